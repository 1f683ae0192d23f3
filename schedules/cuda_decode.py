"""Split-KV decode for CUDA: a few queries (decode, speculative decode) against a KV cache
read in place, paged or not, as a TIRx native kernel; and the kernel that merges the splits.

What is computed is the forward of `tvmflash/kernels/forward.py` for one sequence of the
cache per batch entry: its keys are cache positions [cache_leftpad[b], cache_seqlens[b] +
new_keys), found through `block_table` pages (a contiguous cache is one page per
batch entry). The score modifiers (causal, window, ALiBi, softcap) see each score in the
sequence's own coordinates, as in flash_attn_with_kvcache.

Mapping: one CTA of `warps` warps per (batch, kv-head, block of 16 query rows,
split). A block's rows are the kv-head's query heads x queries (GQA packs the group: a K/V
tile is read once for all of them); with Lq = 1 and 4 heads per kv-head that is 4 of an m16
tile's rows, which costs tensor-core cycles the memory-bound kernel has to spare. A split
owns a range of K/V tiles of `block_n` keys, aligned to cache positions so that each
16 keys lie in one page (pages are multiples of 16): one table lookup per 16 rows. Tiles
stream through a ring of `stages` shared-memory buffers, filled by all the CTA's
threads (`cp.async`, rows past the sequence zero-filled, page numbers clamped to the cache;
rows swizzled where the head dim allows, `SwizzledRows`: with padded rows the copies' L2
traffic was 1.5x the bytes read and the kernel L2-bound at 0.92-0.95x cuDNN's speed on the
H200, swizzled it reads the cache at cuDNN's 4.4 TB/s);
each warp takes an equal slice of a tile's keys, with its own online softmax (S and O on
`mma.sync` as in cuda_forward.py), and the warps' rows are combined through shared memory (the
spent K/V ring) at the end (`combine_warps`). Why several warps (measured on the H100, B=16
Hk=8 D=128 bf16, 64k keys): one-warp CTAs, 3-4 an SM each on its own range of keys, read the
cache at 2.90-2.92 TB/s; one CTA of four warps per (batch, kv-head), 128 keys a tile, at 2.98
(cuDNN's kernel, the same shape of CTA on a dense cache: 3.14). Each split writes its rows' O
/ l and lse (fp32); the last split of a row block to finish (an atomic count per row block in
`split_counters`, which it resets) merges them by lse (`merge_splits`), and a single split
writes the outputs itself: one launch a call. The epilogue is loops, not unrolled copies:
unrolled, its stores and index arithmetic made the kernel 12.5k instructions, and at 256 keys
a quarter of the stall samples were instruction-cache misses (4.6-5.4k now; 3-4 us less a call
on the H200).

Two plans, one kernel each in a kv_cache module, by the cache's page size (tuning.DECODE_PHASES,
each a tuning phase with its own knobs): `decode` for pages of fewer than DECODE_LONG_PAGE
keys, `decode_long` for longer pages and contiguous caches. Measured on the H200 (B=16, H=32,
Hk=8, D=128 bf16, 8k-64k keys, against cuDNN's kernel on a dense cache): in shuffled pages of 16
keys, one CTA an SM read at 0.69-0.87x cuDNN's speed whatever its tile and ring depth, two
(64-key tiles, 3 buffers, 2 splits) at 0.96-0.99x; in pages of 256, one CTA an SM on 128-key
tiles with 2 buffers and no splits at 1.01-1.02x, where the two-CTA plan reached 0.98-0.99x.

Knobs (`DEFAULTS`, fitted to a spec's head dim by `default_knobs`; `<phase>_` names them:
decode_block_n, decode_long_block_n, ...):
    block_n     keys per K/V tile (a multiple of 16 x warps)
    warps       warps per CTA (1, 2, 4, 8), each on block_n / warps keys of a tile
    stages      ring buffers (2 .. 6; the pool must fit an SM's 227 KB: 6 x 64 keys at head dim
                128 is the two-CTA plan's ring in one CTA, untuned)
    l2_prefetch L2 prefetch size of the K/V copies in bytes (0: none, 64, 128, 256; on the
                H200 256 added 19% to the L2 traffic of swizzled copies)
(and `<phase>_ctas_per_sm`, read by ops.decode_kv_cache: the automatic num_splits aims at about
that many CTAs per SM)
"""
from __future__ import annotations

import functools

from tvm import tirx
from tvm.script import tirx as T

from tvmflash.kernels.common import F32, NEG_INF, Shape
from tvmflash.kernels.decode import PAGE_ALIGN, append_name, declare_append_args, declare_decode_args, rotated_pair
from tvmflash.kernels.score_mods import ScoreIndex
from tvmflash.spec import DECODE_ROWS as ROWS
from tvmflash.spec import ROTARY_INTERLEAVED, ROTARY_NONE, AttentionSpec
from tvmflash.tuning import DECODE_PHASES

from .cuda_mma import (CP_ASYNC, LN2, PAD, SHARED_LIMIT, SwizzledRows, copy_tile, load_a, load_b, load_b_trans,
                       mma_16x16, mma_op, rescale_rows, row_reciprocal, smem_scope, softmax_tile, to_a_fragments)

DEFAULTS = {"decode_block_n": 32, "decode_warps": 1, "decode_stages": 3, "decode_l2_prefetch": 0,
            "decode_long_block_n": 128, "decode_long_warps": 4, "decode_long_stages": 2, "decode_long_l2_prefetch": 0}


def default_knobs(spec: AttentionSpec) -> dict:
    """DEFAULTS, each phase's tile halved (down to 16 keys a warp) until its pool fits an SM's
    shared memory: decode_long's 128 keys x 2 buffers take 265 KB at head dim 256."""
    knobs = dict(DEFAULTS)
    for phase in DECODE_PHASES:
        bn, w, st = (f"{phase}_{k}" for k in ("block_n", "warps", "stages"))
        while shared_bytes(spec.head_dim, knobs[bn], knobs[w], knobs[st]) > SHARED_LIMIT and knobs[bn] > PAGE_ALIGN * knobs[w]:
            knobs[bn] //= 2
    return knobs


def row_width(head_dim: int) -> int:
    """Elements a shared-memory row of the kernel's tiles takes: swizzled rows (`SwizzledRows`)
    where the head dim allows, else padded ones."""
    return head_dim if SwizzledRows.fits(head_dim) else head_dim + PAD


def pool_bytes(head_dim: int, block_n: int, stages: int) -> int:
    """A decode CTA's tile pool: the query rows, then rings of `stages` K and V tiles."""
    return (ROWS + 2 * stages * block_n) * row_width(head_dim) * 2


def shared_bytes(head_dim: int, block_n: int, warps: int, stages: int) -> int:
    """A decode CTA's shared memory: its pool and the warps' row stats (max and sum a row)."""
    return pool_bytes(head_dim, block_n, stages) + warps * ROWS * 2 * 4


def supports(spec: AttentionSpec) -> bool:
    """Specs the decode kernel computes: 16-bit, head dims that are multiples of 16, the
    modifiers of flash_attn_with_kvcache (no masks, dropout, flex or packed sequences)."""
    return (spec.dtype in ("float16", "bfloat16") and spec.head_dim % 16 == 0 and spec.mask == "none"
            and not spec.flex and set(spec.variants) <= {"softcap", "alibi", "window"})


def sum_over(n, term):
    """term(0) + ... + term(n - 1), as one expression."""
    return functools.reduce(lambda x, y: x + y, (term(i) for i in range(n)))


@T.inline
def combine_warps(part, stats, top, ids, O_PART, LSE_PART, O, LSE, b, head, qi, split, r0, rows, S, tid, NT, W, D,
                  dt):
    """The CTA's rows from its W warps' online-softmax rows (unnormalised O in `part`, a flat
    (W, ROWS, D) fp32 view, each warp's row max (log2 units) and sum in `stats`): the rows'
    maximum over the warps, each warp's O scaled to it and summed, divided by the row sum,
    written as this split's O / lse (a single split: the outputs). A row at a time, the
    threads over its columns: coalesced stores, and no copy of the code per row (the
    epilogue's cost was its code: at 256 keys a quarter of the stall samples were
    instruction-cache misses in 5k instructions of unrolled stores and index arithmetic)."""
    for r in T.serial(ROWS):
        if r0 + r < rows:
            ids[0] = head(r)
            ids[1] = qi(r)
            top[0] = stats[0, r, 0]
            for w in T.unroll(1, W):
                top[0] = T.max(top[0], stats[w, r, 0])
            top[1] = sum_over(W, lambda w: stats[w, r, 1] * T.exp2(stats[w, r, 0] - top[0]))
            for k in T.unroll((D + NT - 1) // NT):
                c = T.meta_var(tid + k * NT)
                if D % NT == 0 or c < D:
                    scaled = T.meta_var(lambda w: part[(w * ROWS + r) * D + c] * T.exp2(stats[w, r, 0] - top[0]))
                    value = T.meta_var(sum_over(W, scaled) * row_reciprocal(top[1]))
                    if S == 1:
                        O[b, ids[0], ids[1], c] = T.Cast(dt, value)
                    else:
                        O_PART[b, ids[0], split, ids[1], c] = value
            if tid == 0:
                lse = T.meta_var(T.Select(top[1] == T.float32(0), NEG_INF, top[0] * T.float32(LN2) + T.log(top[1])))
                if S == 1:
                    LSE[b, ids[0], ids[1]] = lse
                else:
                    LSE_PART[b, ids[0], split, ids[1]] = lse


@T.inline
def merge_splits(O_PART, LSE_PART, O, LSE, top, ids, b, head, qi, r0, rows, S, warp, lane, W, D, dt):
    """O and lse of a row block's rows from its splits' partials: lse = log sum_s exp(lse_s),
    O = sum_s exp(lse_s - lse) O_s; a row no split saw gets O = 0, lse = -inf (the running max
    starts finite, so such splits weigh exp(-inf) = 0). A warp per row: its lanes reduce the
    splits' lse, then add the splits' O rows along the head dim, four splits a step (their
    loads in flight together: one split at a time waited on a load per split)."""
    NC = T.meta_var((D + 31) // 32)  # head-dim columns a lane adds
    weight = T.alloc_local([4], F32)
    acc = T.alloc_local([NC], F32)
    for rr in T.serial((ROWS + W - 1) // W):
        r = T.meta_var(rr * W + warp)
        if r < ROWS and r0 + r < rows:
            ids[0] = head(r)
            ids[1] = qi(r)
            lse_of = T.meta_var(lambda s: LSE_PART[b, ids[0], s, ids[1]])
            top[0] = T.min_value(F32)
            for kk in T.serial((S + 31) // 32):
                if kk * 32 + lane < S:
                    top[0] = T.max(top[0], lse_of(kk * 32 + lane))
            top[0] = T.cuda.warp_max(top[0])
            top[1] = T.float32(0)
            for kk in T.serial((S + 31) // 32):
                if kk * 32 + lane < S:
                    top[1] = top[1] + T.exp(lse_of(kk * 32 + lane) - top[0])
            top[1] = T.cuda.warp_sum(top[1])
            for c in T.unroll(NC):
                acc[c] = T.float32(0)
            for k4 in T.serial((S + 3) // 4):
                for u in T.unroll(4):
                    weight[u] = T.Select(k4 * 4 + u < S, T.exp(lse_of(T.min(k4 * 4 + u, S - 1)) - top[0]),
                                         T.float32(0))
                for u in T.unroll(4):
                    for c in T.unroll(NC):
                        if D % 32 == 0 or lane + c * 32 < D:
                            acc[c] = acc[c] + weight[u] * O_PART[b, ids[0], T.min(k4 * 4 + u, S - 1), ids[1],
                                                                 lane + c * 32]
            for c in T.unroll(NC):
                if D % 32 == 0 or lane + c * 32 < D:
                    O[b, ids[0], ids[1], lane + c * 32] = T.Cast(dt, acc[c] * row_reciprocal(top[1]))
            if lane == 0:
                LSE[b, ids[0], ids[1]] = T.Select(top[1] == T.float32(0), NEG_INF, top[0] + T.log(top[1]))


def decode_kernel_cuda(spec: AttentionSpec, knobs: dict, phase: str = "decode") -> tirx.PrimFunc:
    """The decode kernel of `phase` (tuning.DECODE_PHASES; its function's name), from that
    phase's knobs."""
    D, dt = spec.head_dim, spec.dtype
    BN, W, ST, L2 = (knobs[f"{phase}_{k}"] for k in ("block_n", "warps", "stages", "l2_prefetch"))
    COPY = CP_ASYNC + (f".L2::{L2}B" if L2 else "")
    if not supports(spec):
        raise ValueError(f"the CUDA decode kernel does not compute {spec}")
    if W not in (1, 2, 4, 8) or BN % (PAGE_ALIGN * W) or not 16 <= BN <= 256 or not 2 <= ST <= 6:
        raise ValueError(f"bad decode knobs: block_n {BN} (a multiple of 16 x warps up to 256), warps {W} (1, 2, "
                         f"4, 8), stages {ST} (2 .. 6)")
    need = shared_bytes(D, BN, W, ST)
    if need > SHARED_LIMIT:
        raise ValueError(f"decode knobs block_n {BN}, warps {W}, stages {ST} need {need} bytes of shared memory at "
                         f"head dim {D}, more than the {SHARED_LIMIT} an SM gives a CTA")
    MMA = mma_op(dt)
    BW = BN // W  # keys of a tile each warp takes
    NS, ND = BW // 8, D // 8
    K_ROW, V_ROW = ROWS, ROWS + ST * BN
    WIDTH = row_width(D)
    SCOPE = smem_scope(pool_bytes(D, BN, ST))
    assert W * ROWS * D * 4 <= pool_bytes(D, BN, ST)  # the warps' O rows fit in the pool

    shape = Shape.fresh()
    B, H, HK, LQ = shape.batch, shape.heads, shape.heads_k, shape.seqlen_q
    S = tirx.Var("splits", "int64")

    @T.prim_func
    def decode():
        T.func_attr({"tirx.noalias": True})
        Q, K, V, cache, O, LSE, O_FINAL, LSE_FINAL, COUNTERS, scale, score_all = T.meta_var(
            declare_decode_args(spec, shape, S, counters=True))
        T.device_entry()
        G = T.meta_var(tirx.truncdiv(H, HK))
        NRB = T.meta_var((G * LQ + ROWS - 1) // ROWS)
        bx, by = T.cta_id([T.Cast("int32", NRB * S), T.Cast("int32", B * HK)])
        tid = T.thread_id([W * 32])
        lane = T.meta_var(tid % 32)
        warp = T.meta_var(tid // 32)
        b = T.meta_var(T.Cast("int64", by) // HK)
        hk = T.meta_var(T.Cast("int64", by) % HK)
        split = T.meta_var(T.Cast("int64", bx) % S)
        r0 = T.meta_var(T.Cast("int64", bx) // S * ROWS)  # the block's first row of the kv-head's G * Lq
        pool_rows = T.alloc_buffer((ROWS + 2 * ST * BN, WIDTH), dt, scope=SCOPE, align=128)
        pool = T.meta_var(SwizzledRows(pool_rows) if WIDTH == D else pool_rows)
        qf = T.alloc_local([D // 16 * 4], "uint32")
        kb = T.alloc_local([4], "uint32")
        vb = T.alloc_local([4], "uint32")
        s = T.alloc_local([NS * 4], F32)
        p = T.alloc_local([NS * 4], dt)
        o = T.alloc_local([ND * 4], F32)
        m = T.alloc_local([2], F32)
        l = T.alloc_local([2], F32)
        mx = T.alloc_local([1], F32)
        alpha = T.alloc_local([2], F32)
        key = T.alloc_local([2], "int64")  # the sequence's first cache position, its key count
        where = T.alloc_local([BN // PAGE_ALIGN * 2], "int32")  # the next tile to fetch: (page, row) per page run
        tiles = T.alloc_local([2], "int64")  # this split's first tile and tile count
        # the warps' rows combined at the end: each warp's row max and sum, its O rows in the
        # pool (fp32)
        stats = T.alloc_buffer((W, ROWS, 2), F32, scope="shared")
        part = pool_rows.view(F32).view(-1)
        top = T.alloc_local([2], F32)  # a row's max and sum
        ids = T.alloc_local([2], "int64")  # a row's query head and query
        ticket = T.alloc_buffer((1,), "int32", scope="shared")  # splits of this row block done before
        pw = p.view("uint32")
        key[0] = cache.start(b)
        key[1] = cache.count(b)
        # the pipeline in the sequence's coordinates: key j is cache position key[0] + j
        score = T.meta_var(score_all.in_sequence(LQ, key[1]))
        row = T.meta_var(lambda r: T.min(r0 + r, G * LQ - 1))  # padding rows repeat the last row
        head = T.meta_var(lambda r: hk * G + row(r) // LQ)
        qi = T.meta_var(lambda r: row(r) % LQ)

        # the splits share the tiles of the keys any query sees, in cache-aligned tiles
        lo, hi = T.meta_var(score.kv_range(T.int64(0), LQ))
        first = T.meta_var((key[0] + lo) // BN)
        count = T.meta_var(T.max((key[0] + hi + BN - 1) // BN - first, T.int64(0)))
        per_split = T.meta_var((count + S - 1) // S)
        tiles[0] = first + T.min(split * per_split, count)
        tiles[1] = T.min(per_split, count - T.min(split * per_split, count))

        copy_tile(pool, 0, lambda r, c: Q.ptr_to([b, head(r), qi(r), c]), lambda r: r0 + r < G * LQ, ROWS, D, tid,
                  W * 32)

        @T.inline
        def look_up(j):
            # tile j's pages and rows in them into `where`: a load whose latency the next tile's
            # compute hides (fetched at once, the table load stalled every tile's copies)
            for u in T.unroll(BN // PAGE_ALIGN):
                pos = T.meta_var((tiles[0] + j) * BN + u * PAGE_ALIGN)
                where[u * 2] = cache.page(b, pos)
                where[u * 2 + 1] = cache.row(pos)

        @T.inline
        def fetch(j):  # tile j (looked up) into ring buffer j % ST, PAGE_ALIGN keys (one page) at a time
            for u in T.unroll(BN // PAGE_ALIGN):
                pos = T.meta_var((tiles[0] + j) * BN + u * PAGE_ALIGN)
                page, prow = T.meta_var((T.Cast("int64", where[u * 2]), T.Cast("int64", where[u * 2 + 1])))
                inside = T.meta_var(lambda r: tirx.all(pos + r >= key[0], pos + r < key[0] + key[1]))
                copy_tile(pool, K_ROW + j % ST * BN + u * PAGE_ALIGN, lambda r, c: K.ptr_to([page, prow + r, hk, c]),
                          inside, PAGE_ALIGN, D, tid, W * 32, COPY)
                copy_tile(pool, V_ROW + j % ST * BN + u * PAGE_ALIGN, lambda r, c: V.ptr_to([page, prow + r, hk, c]),
                          inside, PAGE_ALIGN, D, tid, W * 32, COPY)

        for j in T.unroll(T.int64(ST - 1)):
            look_up(j)
            if j < tiles[1]:
                fetch(j)
            T.ptx["cp.async.commit_group"]()
        look_up(T.int64(ST - 1))
        for i in T.unroll(ND * 4):
            o[i] = T.float32(0)
        for i in T.unroll(2):
            m[i] = T.min_value(F32)
            l[i] = T.float32(0)
        index = T.meta_var(lambda mt, hh, col: ScoreIndex(b, head(lane // 4 + hh * 8), qi(lane // 4 + hh * 8),
                                                          col - key[0]))
        for j in T.serial(tiles[1]):
            if j + ST - 1 < tiles[1]:
                fetch(j + ST - 1)
            T.ptx["cp.async.commit_group"]()
            look_up(j + ST)  # for the next iteration's fetch
            T.ptx["cp.async.wait_group"](ST - 1)
            T.cuda.cta_sync()
            if j == 0:
                for kk in T.unroll(D // 16):
                    load_a(qf, kk * 4, pool, 0, kk * 16, lane)
            row0 = T.meta_var(j % ST * BN + warp * BW)  # this warp's keys in the ring buffer
            k0 = T.meta_var((tiles[0] + j) * BN + warp * BW)  # cache position of its first key
            for i in T.unroll(NS * 4):
                s[i] = T.float32(0)
            for kk in T.unroll(D // 16):
                for nn in T.unroll(BW // 16):
                    load_b(kb, 0, pool, K_ROW + row0 + nn * 16, kk * 16, lane)
                    mma_16x16(MMA, s, nn * 8, qf, kk * 4, kb, 0)
            if score.tile_unmasked(T.int64(0), LQ, k0 - key[0], k0 + BW - key[0]):
                softmax_tile(s, m, l, mx, alpha, 1, NS, score, scale, index, k0, lane, False)
            else:
                softmax_tile(s, m, l, mx, alpha, 1, NS, score, scale, index, k0, lane, True)
            to_a_fragments(s, p, NS * 4)
            rescale_rows(o, alpha, 1, ND)
            for kk in T.unroll(BW // 16):
                for dd in T.unroll(D // 16):
                    load_b_trans(vb, 0, pool, V_ROW + row0 + kk * 16, dd * 16, lane)
                    mma_16x16(MMA, o, dd * 8, pw, kk * 4, vb, 0)
            T.cuda.cta_sync()  # the next iteration refills a buffer read here
        # the warps' rows through shared memory: the pool's tiles are spent (and no copy may
        # still land there when a split had no tiles)
        T.ptx["cp.async.wait_group"](0)
        T.cuda.cta_sync()
        for hh in T.unroll(2):
            l[hh] = T.cuda.warp_sum(l[hh], width=4)
            if lane % 4 == 0:
                stats[warp, lane // 4 + hh * 8, 0] = m[hh]
                stats[warp, lane // 4 + hh * 8, 1] = l[hh]
        for dd in T.unroll(ND):
            for i in T.unroll(4):
                part[(warp * ROWS + lane // 4 + i // 2 * 8) * D + dd * 8 + lane % 4 * 2 + i % 2] = o[dd * 4 + i]
        T.cuda.cta_sync()
        combine_warps(part, stats, top, ids, O, LSE, O_FINAL, LSE_FINAL, b, head, qi, split, r0, G * LQ, S, tid, W * 32,
                      W, D, dt)
        if S > 1:
            # the row block's last split to finish merges the partials (no combine launch): the
            # CTA's writes ordered before its count by the barrier and thread 0's release, the
            # count's acquire before the reads (one fence a CTA: a fence in every thread waited
            # for each thread's stores)
            slot = T.meta_var(T.Cast("int64", by) * NRB + T.Cast("int64", bx) // S)
            T.cuda.cta_sync()
            if tid == 0:
                T.ptx["atom.acq_rel.gpu.global.add.s32"](ticket[0], COUNTERS.ptr_to([slot]), T.int32(1))
            T.cuda.cta_sync()
            if ticket[0] == T.Cast("int32", S) - 1:
                merge_splits(O, LSE, O_FINAL, LSE_FINAL, top, ids, b, head, qi, r0, G * LQ, S, warp, lane, W, D, dt)
                if tid == 0:
                    COUNTERS[slot] = T.int32(0)  # ready for the next launch

    return decode.with_attr("global_symbol", phase)


APPEND_THREADS = 128


def append_kernel_cuda(spec: AttentionSpec, table_dtype: str) -> tirx.PrimFunc:
    """A decode step's writes on CUDA, `decode_append` / `decode_append_f32`: the arguments and
    results of kernels/decode.py's CPU kernel (`declare_append_args`) without its checks, which
    would make the host wait for the GPU: a CTA per new token (its kv-heads' K rotated, and V,
    written at its cache position) and, with rotary, per query (q rotated into q_rotated).
    Tokens whose position lies outside the cache or whose page (block_table entry, or
    cache_batch_idx row) outside its pages are not written; rotary rows are clamped into the
    tables (as the decode kernel clamps its reads); `result` is not written. One launch: in
    torch ops the same step took about twenty."""
    D, dt = spec.head_dim, spec.dtype

    @T.prim_func
    def append():
        T.func_attr({"tirx.noalias": True})
        (TABLE, SEQLENS, LEFTPAD, offset, capacity, num_pages, RESULT, K, V, K_CACHE, V_CACHE, Q, Q_ROTATED, COS, SIN,
         rotary, q_steps) = T.meta_var(declare_append_args(spec, table_dtype))
        B, MP = T.meta_var(TABLE.shape)
        N, HK, PAGE, LQ, H, LRO, HALF = T.meta_var((*K.shape[1:3], K_CACHE.shape[1], *Q.shape[1:3], *COS.shape))
        T.device_entry()
        row = T.cta_id([T.Cast("int32", B * (N + LQ))])
        tid = T.thread_id([APPEND_THREADS])
        r = T.meta_var(T.Cast("int64", row))
        keys = T.meta_var(r < B * N)  # a new token's row, else a query's
        b = T.meta_var(T.Select(keys, r // T.max(N, 1), (r - B * N) // T.max(LQ, 1)))
        i = T.meta_var(T.Select(keys, r % T.max(N, 1), (r - B * N) % T.max(LQ, 1)))
        base = T.meta_var(T.Cast("int64", SEQLENS[b]) + offset)
        pos = T.meta_var(base + T.Select(keys or q_steps != 0, i, T.int64(0)))
        heads = T.meta_var(T.Select(keys, HK, H))
        at = T.meta_var(T.min(T.max(pos, T.int64(0)), LRO - 1))  # the rotary row (clamped)
        page = T.meta_var(T.Cast("int64", TABLE[b, T.min(T.max(pos, T.int64(0)) // PAGE, MP - 1)]))
        if (keys and pos >= 0 and pos < capacity and page >= 0 and page < num_pages) or (
                not keys and rotary != ROTARY_NONE):
            for j in T.serial((heads * D + APPEND_THREADS - 1) // APPEND_THREADS):
                e = T.meta_var(j * APPEND_THREADS + tid)
                h, d = T.meta_var((e // D, e % D))
                pairs = T.meta_var(rotary == ROTARY_INTERLEAVED)
                p = T.meta_var(T.min(T.Select(pairs, d // 2, d % HALF), HALF - 1))
                first = T.meta_var(T.Select(pairs, 2 * p, p))
                second = T.meta_var(T.Select(pairs, 2 * p + 1, T.min(p + HALF, T.int64(D - 1))))
                c = T.meta_var(T.Cast(F32, COS[at, p]))
                sn = T.meta_var(T.Cast(F32, SIN[at, p]))
                upper = T.meta_var(T.Select(pairs, d % 2 == 1, d >= HALF))
                if e < heads * D:
                    if keys:
                        lo, hi = T.meta_var(rotated_pair(T.Cast(F32, K[b, i, h, first]), T.Cast(F32, K[b, i, h, second]),
                                                         c, sn))
                        V_CACHE[page, pos % PAGE, h, d] = V[b, i, h, d]
                        K_CACHE[page, pos % PAGE, h, d] = T.Select(
                            rotary == ROTARY_NONE or d >= 2 * HALF, K[b, i, h, d], T.Cast(dt, T.Select(upper, hi, lo)))
                    else:
                        lo, hi = T.meta_var(rotated_pair(T.Cast(F32, Q[b, i, h, first]), T.Cast(F32, Q[b, i, h, second]),
                                                         c, sn))
                        Q_ROTATED[b, i, h, d] = T.Select(d >= 2 * HALF, Q[b, i, h, d], T.Cast(dt, T.Select(upper, hi, lo)))

    return append.with_attr("global_symbol", append_name(spec, table_dtype))
