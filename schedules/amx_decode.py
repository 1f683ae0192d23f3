"""bf16 split-KV forward on Intel AMX tiles (`tdpbf16ps`) for kv-heads with more query rows
than the FMA kernel's task holds (speculative decode, chunked prefill against a cache, GQA
groups above 4): `kernels/decode.py`'s split forward (same arguments, tasks over (batch,
split, kv-head, row block), outputs and merge), with both products on tiles and the softmax
down the columns of S^T. `ops._split_kernel` chooses it (module functions `decode_tiles`,
`forward_split_tiles`).

A task's rows are a kv-head's query rows (G x Lq), up to ROWS, an AMX tile's rows; a short
block repeats its last row (its results are not stored). Per kv-block of BLOCK_K keys:

- S^T = K . Q^T, 16 keys at a time (C: 16 keys x 16 rows fp32). A = 16 key rows where they lie
  (a tile load takes the cache's row stride; 16 aligned keys lie in one page), copied into a
  stage only where they would leave their page or the keys; B = Q^T in VNNI pairs, gathered
  once per task. Q is not pre-scaled: its products are exact, the scale goes to fp32 scores.
- The softmax walks S^T's rows: each vector is one key's scores of all the task's rows, so
  block maxima and row sums are vertical and the score modifiers run 16 rows a vector.
  P = 2^(t - m) with the running max moving only past GROW (as in the AMX forward).
- O (16 rows x D, fp32 in L1) += P . V: A = P's rows (bf16, 32 keys a tile, gathered from
  S^T's columns for the real rows only); B = V in key pairs, two V rows interleaved by a
  permute per 32 dims.

A task costs about what an FMA task of 4 rows costs: a kv-head of 16 rows takes one task
here where the FMA kernel takes four, each reading the keys again (Xeon, bf16 D = 128, same
process: Lq = 4 with 4 heads a kv-head 2.6-3.2x faster, Lq = 16 2.8-3.2x). With 4 rows or
fewer the FMA kernel is faster (1.09-1.20x at Lq = 1): the tile work per block is short and
latency-bound (P and V's pairs are stored by vector stores and read back by tile loads), and
the tile loads of K from L2 hide less of the memory latency than the FMA kernel's row loads.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ..kernels.common import F32, LOG2E, NEG_INF, Shape, fast_exp
from ..kernels.decode import (declare_split_args, key_element, key_positions, prefetch_keys, sequence, split_blocks,
                              store_row, task_regions, value_pairs)
from ..kernels.score_mods import ScoreIndex
from ..spec import AttentionSpec
from .amx import PAIR, TILE, amx, bf16_row, column_16, configure_tiles, exp2_16, gather_16, release_tiles, row_bytes, tmm
from .amx_forward import GROW, LN2, amx_supported
from .host import SPLIT_AMX_ROWS, SPLIT_BLOCK_K

ROWS = SPLIT_AMX_ROWS  # query rows a task: an A / C tile's
BLOCK_K = SPLIT_BLOCK_K  # keys a kv-block (the unit of the splits): four 16-key S^T tiles
assert ROWS == TILE and BLOCK_K == 64
LINE = 32  # bf16 elements of a 64-byte cache line

_LANES = tirx.Ramp(tirx.const(0, "int32"), tirx.const(1, "int32"), ROWS)


def decode_amx_kernel(spec: AttentionSpec, name: str = "forward_split") -> tirx.PrimFunc:
    """The split-KV forward of `spec` (kv_cache: the cache in place, else K and V (B, Hk, L, D))
    on AMX tiles, as module function `name`."""
    assert amx_supported(spec)
    D, RB, BK = spec.head_dim, ROWS, BLOCK_K
    shape = Shape.fresh()
    B, H, HK, LQ, LK = shape.batch, shape.heads, shape.heads_k, shape.seqlen_q, shape.seqlen_k
    S = tirx.Var("splits", "int64")
    cached = spec.kv_cache
    KC = D // 32  # 32-dim chunks of a key row: S^T's k-steps
    QT_RESIDENT = KC <= 4  # Q^T's tiles (tmm4-7) loaded once a block, else once a product
    OT = 4 if D % 64 == 0 else 2  # O's C tiles a P.V pass keeps (tmm0-3 or tmm0-1)
    cols = _LANES

    def key_group(K, cache, where, slot, b, hk, k0):
        """(whether 16 aligned keys from k0 lie whole in their page (cached) or the keys (dense),
        the address of their first row, as a function of the dim)"""
        if cached:
            pos = tirx.Cast("int32", k0)
            inside = cache.row(pos) + 16 <= tirx.Cast("int32", cache.page_size)
            return inside, lambda d: T.address_of(K[tirx.Cast("int64", cache.page(b, pos)),
                                                     tirx.Cast("int64", cache.row(pos)), hk, d])
        return k0 + 16 <= LK, lambda d: T.address_of(K[b, hk, k0, d])

    @T.prim_func(s_tir=True)
    def dec():
        T.func_attr({"tirx.noalias": True})
        Q, K, V, (O, O_FINAL), (LSE, LSE_FINAL), scale, score_all, cache, _ = T.meta_var(
            declare_split_args(spec, shape, S))  # (a task is one kv-head: kv_heads is not read)
        G = T.meta_var(H // HK)
        NRB = T.meta_var((G * LQ + RB - 1) // RB)  # row blocks per kv-head
        k_row = T.meta_var(K.strides[1 if cached else 2] * 2)  # bytes between key rows
        for t in T.parallel(B * S * HK * NRB):
            with T.sblock("dec_task"):
                vb = T.axis.spatial(B, t // (S * HK * NRB))
                vs = T.axis.spatial(S, t // (HK * NRB) % S)
                vhk = T.axis.spatial(HK, t // NRB % HK)
                vrb = T.axis.spatial(NRB, t % NRB)
                reads, writes = T.meta_var(task_regions(Q, K, V, (O, O_FINAL, LSE, LSE_FINAL), cache, shape,
                                                        vb, vs, vhk, D))
                T.reads(reads)
                T.writes(writes)
                cfg = T.sblock_alloc_buffer((64,), "uint8")
                qp = T.sblock_alloc_buffer((D // 2, RB), PAIR)  # Q^T pairs (B of S^T)
                rix = T.sblock_alloc_buffer((2, RB), "int64")  # per row: query head, query index
                qoff = T.sblock_alloc_buffer((RB,), "int32")  # per row: q's byte offset from the first
                st = T.sblock_alloc_buffer((4, RB), F32)  # per row: m (log2 units), l, block max, alpha
                grow = T.sblock_alloc_buffer((1,), "int32")
                sT = T.sblock_alloc_buffer((BK, RB), F32)  # a block's S^T, then its exponents, then P
                pa = T.sblock_alloc_buffer((RB, BK // 2), PAIR)  # P's rows in bf16 (A of P.V)
                vp = T.sblock_alloc_buffer((BK // 2, D), PAIR)  # V in key pairs (B of P.V)
                kst = T.sblock_alloc_buffer((BK, D), "uint16")  # key rows that leave their page
                acc = T.sblock_alloc_buffer((RB, D), F32)  # O's rows
                # cached: each key's (page, row) in this block (slot kb % 2) and the next, clamped
                where = T.sblock_alloc_buffer((2, BK if cached else 1, 2), "int64")
                score, first_key = T.meta_var(sequence(score_all, cache, vb, LQ))
                real_rows = T.meta_var(T.min(G * LQ - vrb * RB, RB))
                kb_lo, kb_hi, clamp = T.meta_var(split_blocks(score, first_key, LQ, S, vs, BK))
                for r in T.serial(RB):
                    rix[0, r] = vhk * G + T.min(vrb * RB + r, G * LQ - 1) // LQ
                    rix[1, r] = T.min(vrb * RB + r, G * LQ - 1) % LQ
                    qoff[r] = T.Cast("int32", (rix[0, r] - vhk * G) * Q.strides[1] * 2 + rix[1, r] * Q.strides[2] * 2)
                    st[0, r] = T.min_value(F32)
                    st[1, r] = T.float32(0)
                for r, d in T.grid(RB, D):
                    acc[r, d] = T.float32(0)
                for r, c in T.grid(RB, BK // 2):  # rows past the real ones stay 0
                    pa[r, c] = T.uint32(0)
                for p in T.serial(D // 2):  # Q^T pairs: word p of every row, one gather
                    qp[p, cols] = T.reinterpret("uint32x16", gather_16(
                        "int32x16", T.address_of(Q[vb, vhk * G, 0, p * 2]), qoff[cols]))
                configure_tiles(cfg)
                for kb in T.serial(kb_lo, kb_hi + 1):  # block kb_hi: only its page lookup (prefetch)
                    k0 = T.meta_var(kb * BK)
                    if cached:
                        key_positions(where, kb % 2, cache, vb, k0, clamp, BK)
                    if kb > kb_lo:
                        pk0 = T.meta_var(k0 - BK)  # block kb - 1 is computed here
                        slot = T.meta_var((kb - 1) % 2)
                        for j in T.serial(BK):  # the next block's K, this one's V, into L2
                            prefetch_keys(K, V, cache, where, kb % 2, slot, vb, vhk, k0, pk0, j, D, LK, LINE)
                        # S^T = K . Q^T, 16 keys a C tile (tmm0 / tmm1), K in tmm2 / tmm3
                        if QT_RESIDENT:
                            for c in T.unroll(KC):
                                T.evaluate(amx("tileloadd64", tmm(4 + c), T.address_of(qp[c * 16, 0]), row_bytes(RB * 4)))
                        for g in T.unroll(BK // 16):
                            inside, row_at = T.meta_var(key_group(K, cache, where, slot, vb, vhk, pk0 + g * 16))
                            if not inside:  # the group leaves its page or the keys: clamped rows, staged
                                for j in T.serial(16):
                                    for d in T.vectorized(D):
                                        kst[g * 16 + j, d] = T.reinterpret("uint16", key_element(
                                            K, cache, where, slot, vb, vhk, pk0, g * 16 + j, d, LK))
                            T.evaluate(amx("tilezero", tmm(g % 2)))
                            for c in T.unroll(KC):
                                if not QT_RESIDENT:
                                    T.evaluate(amx("tileloadd64", tmm(4 + c % 4), T.address_of(qp[c * 16, 0]),
                                                   row_bytes(RB * 4)))
                                if inside:
                                    T.evaluate(amx("tileloadd64", tmm(2 + g % 2), row_at(c * 32), row_bytes(k_row)))
                                else:
                                    T.evaluate(amx("tileloadd64", tmm(2 + g % 2), T.address_of(kst[g * 16, c * 32]),
                                                   row_bytes(D * 2)))
                                T.evaluate(amx("tdpbf16ps", tmm(g % 2), tmm(2 + g % 2), tmm(4 + c % 4)))
                            T.evaluate(amx("tilestored64", tmm(g % 2), T.address_of(sT[g * 16, 0]), row_bytes(RB * 4)))
                        # exponents in log2 units, 16 rows a vector; the modifiers only where the
                        # block is not whole or they change values
                        whole = T.meta_var(score.tile_unmasked(T.int64(0), LQ, pk0 - first_key, pk0 - first_key + BK))
                        st[2, cols] = tirx.Broadcast(NEG_INF, RB)
                        if score.changes_values or not whole:
                            for j in T.serial(BK):
                                for r in T.vectorized(RB):
                                    sT[j, r] = score(sT[j, r] * scale, ScoreIndex(
                                        vb, rix[0, r], rix[1, r], pk0 + j - first_key)) * T.float32(LOG2E)
                                    st[2, r] = T.max(st[2, r], sT[j, r])
                        else:
                            for j in T.serial(BK):
                                sT[j, cols] = sT[j, cols] * tirx.Broadcast(scale * T.float32(LOG2E), RB)
                                st[2, cols] = T.max(st[2, cols], sT[j, cols])
                        grow[0] = 0
                        for r in T.serial(RB):
                            grow[0] = T.max(grow[0], T.Select(st[2, r] > st[0, r] + T.float32(GROW), 1, 0))
                        if grow[0] > 0:  # m to the block's max, l and O rescaled
                            for r in T.serial(RB):
                                st[3, r] = fast_exp((st[0, r] - T.max(st[0, r], st[2, r])) * T.float32(LN2))
                                st[0, r] = T.max(st[0, r], st[2, r])
                                st[1, r] = st[1, r] * st[3, r]
                            for r in T.serial(real_rows):
                                for d in T.vectorized(D):
                                    acc[r, d] = acc[r, d] * st[3, r]
                        for j in T.serial(BK):  # P = 2^(t - m), summed into l
                            sT[j, cols] = exp2_16(sT[j, cols] - st[0, cols])
                            st[1, cols] = st[1, cols] + sT[j, cols]
                        for r, c in T.grid(real_rows, BK // 32):  # P's rows from S^T's columns
                            pa[r, T.Ramp(c * 16, 1, 16)] = bf16_row(column_16(sT, [c * 32, r], RB * 4),
                                                                    column_16(sT, [c * 32 + 16, r], RB * 4))
                        for p, c in T.grid(BK // 2, D // 32):  # V's key pairs (clamped rows)
                            lo, hi = T.meta_var(value_pairs(V, cache, where, slot, vb, vhk, pk0, p, c, LK))
                            vp[p, T.Ramp(c * 32, 1, 16)] = lo
                            vp[p, T.Ramp(c * 32 + 16, 1, 16)] = hi
                        # O += P . V, OT C tiles of 16 dims at a time; P in tmm4, V in tmm6 / tmm7
                        for n in T.unroll(D // (16 * OT)):
                            for c in T.unroll(OT):
                                T.evaluate(amx("tileloadd64", tmm(c), T.address_of(acc[0, (n * OT + c) * 16]),
                                               row_bytes(D * 4)))
                            for kc in T.unroll(BK // 32):
                                T.evaluate(amx("tileloadd64", tmm(4), T.address_of(pa[0, kc * 16]), row_bytes(BK * 2)))
                                for c in T.unroll(OT):
                                    T.evaluate(amx("tileloadd64", tmm(6 + c % 2), T.address_of(vp[kc * 16, (n * OT + c) * 16]),
                                                   row_bytes(D * 4)))
                                    T.evaluate(amx("tdpbf16ps", tmm(c), tmm(4), tmm(6 + c % 2)))
                            for c in T.unroll(OT):
                                T.evaluate(amx("tilestored64", tmm(c), T.address_of(acc[0, (n * OT + c) * 16]),
                                               row_bytes(D * 4)))
                release_tiles()
                for r in T.serial(real_rows):
                    lse_r = T.meta_var(T.Select(st[1, r] == T.float32(0), NEG_INF,
                                                (st[0, r] + T.log2(st[1, r])) * T.float32(LN2)))
                    o_r = T.meta_var(lambda d: T.Select(st[1, r] == T.float32(0), T.float32(0), acc[r, d] / st[1, r]))
                    store_row(O, O_FINAL, LSE, LSE_FINAL, S, vb, vs, rix[0, r], rix[1, r], lse_r, o_r, D, spec.dtype)

    return dec.with_attr("global_symbol", name)
