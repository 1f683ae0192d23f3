"""bf16 flash-attention backward on Intel AMX tiles (or avx512_bf16's `vdpbf16ps` where there
are none: `amx.MatrixUnit`), fp32 element-wise work on AVX512.

Same plans, names and outputs as `kernels/backward.py` (fused: one task per (batch, kv-head)
that also owns dQ; split: kv-block tasks for dK/dV plus q-block tasks for dQ), but all five
matmuls of a (kv-block, q-block) step run on AMX tiles, on S^T-shaped (keys x queries) tiles:

    S^T  = K . Q^T           A: K rows                      B: Q pairs over d      (packed)
    dP^T = V . dO^T          A: V rows                      B: dO pairs over d     (packed)
    dV  += P^T . dO          A: P^T rows (bf16, per step)   B: dO pairs over queries (packed)
    dK  += dS^T . Q          A: dS^T rows (bf16, per step)  B: Q pairs over queries  (packed)
    dQ^T += K^T . dS^T       A: K^T rows                    B: dS^T pairs over keys (per step)

With dropout, dV takes (P Z)^T and dS = P (dP Z - delta), Z^T the step's factors
(`amx.dropout_tile_16`, S^T-shaped).

An fp32 spec gives the bf16x3 backward (precision "high", as `amx_forward.py`): every GEMM's
contraction in three segments, [hi | hi | lo] . [hi; lo; hi], the packs from
`backward_amx_pack_kernel` (`Packs`), P^T / dS^T split per step.

`backward_amx_pack_kernel` writes the seven packed operands once per call, zero-padded to a
multiple of `pad` rows, so tile loads stay in bounds and padded rows contribute exactly 0. The
fused plan accumulates dQ^T in an fp32 (B, H, D, Lq_padded) scratch owned by its task. Q is not
pre-scaled: scale enters the fp32 scores and the dK / dQ stores, so bf16 rounding of q*scale
does not enter.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import tirx as irb

from ..kernels.backward import declare_backward_inputs, load_row_stats
from ..kernels.common import F32, LOG2E, KernelArgs, Shape, fast_exp
from ..kernels.score_mods import ScoreIndex, ScorePipeline
from .amx import (BF16, PAIR, TILES, MatrixUnit, amx_dropout_buffers, bf16_row, dropout_tile_16, exp2_16, fp32_column,
                  key_row, pair_bits, stage_rows, store_pair_rows, store_split_pairs, store_split_row,
                  store_word_halves, store_words, word_column)
from .amx_forward import (amx_supported, bf16x3_supported, dropped, modified, odd_tanh, segments_of, small_limit,
                          small_scores, tanh_16, tanh_coefficients, z_rows)

__all__ = ["amx_supported", "backward_amx_pack_kernel", "backward_amx_kernel"]


class Packs:
    """The packed operands (kernel arguments, declared in this order after the others). An fp32
    spec's (bf16x3, `segments_of`: S = 3) take S segments along each GEMM's contraction: rows
    of K and V [hi | hi | lo] over the head dim, K^T's rows each kv block's keys [hi | hi | lo]
    (`block_k`), Q and dO pairs [hi; lo; hi] over the head dim, and over each q-block's queries
    (`block_q`)."""

    def __init__(self, spec, shape: Shape, args: KernelArgs, lqp: tirx.Var):
        D, S = spec.head_dim, segments_of(spec)
        B, H, HK = shape.batch, shape.heads, shape.heads_k
        self.lqp = lqp
        self.lkp = tirx.Var("seqlen_k_padded", "int64")
        LQP, LKP = self.lqp, self.lkp
        self.kp = args.tensor("kp", (B, HK, LKP, S * D), BF16)  # K rows
        self.vp = args.tensor("vp", (B, HK, LKP, S * D), BF16)  # V rows
        self.kt = args.tensor("kt", (B, HK, D, S * LKP), BF16)  # K^T rows
        self.qd = args.tensor("qd", (B, H, S * D // 2, LQP), PAIR)  # [p, i] = (q[i, 2p], q[i, 2p+1])
        self.dod = args.tensor("dod", (B, H, S * D // 2, LQP), PAIR)
        self.qq = args.tensor("qq", (B, H, S * LQP // 2, D), PAIR)  # [r, d] = (q[2r, d], q[2r+1, d])
        self.doq = args.tensor("doq", (B, H, S * LQP // 2, D), PAIR)


def backward_amx_pack_kernel(spec, pad: int, block_q: int = 0, block_k: int = 0) -> tirx.PrimFunc:
    """The seven packed operands of one backward call (`Packs`; zero past Lq / Lk), from q, k,
    v, dO: `backward_pack`. For an fp32 spec (the bf16x3 backward, `backward_pack_bf16x3`)
    their bf16x3 segments; K^T's and the pairs over queries' follow the backward's `block_k` and
    `block_q`."""
    D, S = spec.head_dim, segments_of(spec)
    shape = Shape.fresh()
    B, H, HK, LQ, LK = shape.batch, shape.heads, shape.heads_k, shape.seqlen_q, shape.seqlen_k
    args = KernelArgs()
    CH = 32  # rows per task
    assert pad % CH == 0 and (S == 1 or (block_q % CH == 0 and block_k % CH == 0 and D % 32 == 0))

    def declare():
        q, k, v, do = (args.tensor(name, (B, heads, length, D), spec.dtype)
                       for name, heads, length in (("q", H, LQ), ("k", HK, LK), ("v", HK, LK), ("do", H, LQ)))
        return q, k, v, do, Packs(spec, shape, args, tirx.Var("seqlen_q_padded", "int64"))

    @T.prim_func(s_tir=True)
    def pack():
        T.func_attr({"tirx.noalias": True})
        Q, K, V, DO, P = T.meta_var(declare())
        NKC, NQC = T.meta_var((P.lkp // CH, P.lqp // CH))
        for t in T.parallel(B * HK * NKC):
            with T.sblock("kv_rows"):
                vb = T.axis.spatial(B, t // (HK * NKC))
                vh = T.axis.spatial(HK, t // NKC % HK)
                vc = T.axis.spatial(NKC, t % NKC)
                j0 = T.meta_var(vc * CH)
                if S == 1:
                    key = T.meta_var(lambda j: T.min(j0 + j, LK - 1))
                    for j, d in T.grid(CH, D):
                        with T.sblock("pack_kv"):
                            vj, vd = T.axis.remap("SS", [j, d])
                            P.kp[vb, vh, j0 + vj, vd] = T.Select(j0 + vj < LK, K[vb, vh, key(vj), vd], T.bfloat16(0))
                            P.vp[vb, vh, j0 + vj, vd] = T.Select(j0 + vj < LK, V[vb, vh, key(vj), vd], T.bfloat16(0))
                    for p in T.serial(D // 2):
                        with T.sblock("pack_kT"):
                            vp = T.axis.remap("S", [p])
                            T.reads(K[vb, vh, 0:LK, vp * 2:vp * 2 + 2])
                            T.writes(P.kt[vb, vh, vp * 2:vp * 2 + 2, j0:j0 + CH])
                            store_word_halves(P.kt, vb, vh, vp, j0, word_column(K, vb, vh, j0, vp, LK))
                else:
                    for j, c in T.grid(CH, D // 32):
                        with T.sblock("pack_kv_split"):
                            vj, vcc = T.axis.remap("SS", [j, c])
                            T.reads(K[vb, vh, T.min(j0 + vj, LK - 1), vcc * 32:vcc * 32 + 32],
                                    V[vb, vh, T.min(j0 + vj, LK - 1), vcc * 32:vcc * 32 + 32])
                            T.writes(P.kp[vb, vh, j0 + vj, 0:S * D], P.vp[vb, vh, j0 + vj, 0:S * D])
                            split_rows(((K, P.kp), (V, P.vp)), vb, vh, j0 + vj, vcc * 32, LK, D)
                    col = T.meta_var(j0 // block_k * (S * block_k) + j0 % block_k)  # the chunk in its block's segments
                    for d in T.serial(D):
                        with T.sblock("pack_kT_split"):
                            vd = T.axis.remap("S", [d])
                            T.reads(K[vb, vh, 0:LK, vd])
                            T.writes(P.kt[vb, vh, vd, 0:S * P.lkp])
                            store_split_row(P.kt, lambda s: [vb, vh, vd, col + s * block_k],
                                            fp32_column(K, vb, vh, j0, vd, LK))
        for t in T.parallel(B * H * NQC):
            with T.sblock("q_rows"):
                vb = T.axis.spatial(B, t // (H * NQC))
                vh = T.axis.spatial(H, t // NQC % H)
                vc = T.axis.spatial(NQC, t % NQC)
                i0 = T.meta_var(vc * CH)
                if S == 1:
                    row = T.meta_var(lambda i: T.min(i0 + i, LQ - 1))
                    q_rows = T.sblock_alloc_buffer((1, 1, CH, D), "uint16")
                    do_rows = T.sblock_alloc_buffer((1, 1, CH, D), "uint16")
                    stage_rows(q_rows, Q, vb, vh, i0, LQ, CH, D)
                    stage_rows(do_rows, DO, vb, vh, i0, LQ, CH, D)
                    for p in T.serial(D // 2):
                        with T.sblock("pack_qd"):
                            vp = T.axis.remap("S", [p])
                            T.reads(q_rows[0, 0, 0:CH, vp * 2:vp * 2 + 2], do_rows[0, 0, 0:CH, vp * 2:vp * 2 + 2])
                            T.writes(P.qd[vb, vh, vp, i0:i0 + CH], P.dod[vb, vh, vp, i0:i0 + CH])
                            store_words(P.qd, [vb, vh, vp], i0, word_column(q_rows, 0, 0, 0, vp, CH))
                            store_words(P.dod, [vb, vh, vp], i0, word_column(do_rows, 0, 0, 0, vp, CH))
                    for r, d in T.grid(CH // 2, D):
                        with T.sblock("pack_qq"):
                            vr, vd = T.axis.remap("SS", [r, d])
                            P.qq[vb, vh, i0 // 2 + vr, vd] = T.Select(
                                i0 + 2 * vr < LQ, pair_bits(Q[vb, vh, row(2 * vr), vd], Q[vb, vh, row(2 * vr + 1), vd]) &
                                T.Select(i0 + 2 * vr + 1 < LQ, T.uint32(0xFFFFFFFF), T.uint32(0xFFFF)), T.uint32(0))
                            P.doq[vb, vh, i0 // 2 + vr, vd] = T.Select(
                                i0 + 2 * vr < LQ, pair_bits(DO[vb, vh, row(2 * vr), vd], DO[vb, vh, row(2 * vr + 1), vd]) &
                                T.Select(i0 + 2 * vr + 1 < LQ, T.uint32(0xFFFFFFFF), T.uint32(0xFFFF)), T.uint32(0))
                else:
                    for p in T.serial(D // 2):
                        with T.sblock("pack_qd_split"):
                            vp = T.axis.remap("S", [p])
                            T.reads(Q[vb, vh, 0:LQ, vp * 2:vp * 2 + 2], DO[vb, vh, 0:LQ, vp * 2:vp * 2 + 2])
                            T.writes(P.qd[vb, vh, 0:S * D // 2, i0:i0 + CH], P.dod[vb, vh, 0:S * D // 2, i0:i0 + CH])
                            split_pairs_over_d(((Q, P.qd), (DO, P.dod)), vb, vh, vp, i0, LQ, D)
                    # the chunk's pair rows in its q-block's segments
                    row = T.meta_var(i0 // block_q * (S * block_q // 2) + i0 % block_q // 2)
                    for r, c in T.grid(CH // 2, D // 16):
                        with T.sblock("pack_qq_split"):
                            vr, vcc = T.axis.remap("SS", [r, c])
                            T.reads(Q[vb, vh, 0:LQ, vcc * 16:vcc * 16 + 16], DO[vb, vh, 0:LQ, vcc * 16:vcc * 16 + 16])
                            T.writes(P.qq[vb, vh, 0:S * P.lqp // 2, vcc * 16:vcc * 16 + 16],
                                     P.doq[vb, vh, 0:S * P.lqp // 2, vcc * 16:vcc * 16 + 16])
                            split_pairs_over_queries(((Q, P.qq), (DO, P.doq)), vb, vh, row + vr, i0 + 2 * vr,
                                                     vcc * 16, LQ, block_q)

    return pack.with_attr("global_symbol", "backward_pack_bf16x3" if S > 1 else "backward_pack")


def split_rows(pairs, b, h, j, c0, rows, D: int) -> None:
    """For each (src, dst) of `pairs`: src's row j, columns [c0, c0 + 32), as dst's bf16x3 A
    operand row segments (0 past `rows`)."""
    for src, dst in pairs:
        store_split_row(dst, lambda s: [b, h, j, s * D + c0], key_row(src, b, h, j, rows, c0))


def split_pairs_over_d(pairs, b, h, p, i0, rows, D: int) -> None:
    """For each (src, dst): src's columns 2p, 2p + 1 of rows [i0, i0 + 32) as dst's bf16x3
    VNNI pairs over the head dim (segments D / 2 pair rows apart)."""
    for src, dst in pairs:
        store_split_pairs(dst, lambda s, half: [b, h, p + s * (D // 2), i0 + half * 16],
                          fp32_column(src, b, h, i0, p * 2, rows), fp32_column(src, b, h, i0, p * 2 + 1, rows))


def split_pairs_over_queries(pairs, b, h, row, i, c0, rows, block_q: int) -> None:
    """For each (src, dst): src's rows i, i + 1, columns [c0, c0 + 16), as dst's bf16x3 VNNI
    pair row `row` of its q-block's first segment (the others block_q / 2 pair rows apart)."""
    for src, dst in pairs:
        store_split_pairs(dst, lambda s, _: [b, h, row + s * (block_q // 2), c0],
                          key_row(src, b, h, i, rows, c0, 16), key_row(src, b, h, i + 1, rows, c0, 16))


def step_index(b, h, q0, k0, i, j, LQ, LK, masked: bool) -> ScoreIndex:
    """Score (q0 + i, k0 + j)'s index, clamped into bounds on tiles that may pass them."""
    if masked:
        return ScoreIndex(b, h, T.min(q0 + i, LQ - 1), T.min(k0 + j, LK - 1))
    return ScoreIndex(b, h, q0 + i, k0 + j)


def key_kept(value, inside, masked: bool):
    """value, or 0 for a padded key on tiles that may pass Lk."""
    return T.Select(inside, value, T.float32(0)) if masked else value


@T.inline
def step_gradients(score, scale, sT, dpT, pT, dsT, zT, lse_t, delta_t, b, h, q0, k0, BQ, BK, LQ, LK, masked):
    """P^T and dS^T of a step's tile, 16 queries a vector; `masked`: the tile is not whole.
    With dropout dS = P (dP Z - delta), Z its factors (`zT`)."""
    for j in T.serial(BK):
        for i in T.vectorized(BQ):
            with T.sblock("p" if masked else "p_whole"):
                vj, vi = T.axis.remap("SS", [j, i])
                pT[vj, vi] = key_kept(fast_exp(modified(score, sT[vj, vi] * scale,
                                                        step_index(b, h, q0, k0, vi, vj, LQ, LK, masked), masked)
                                               - lse_t[vi]), k0 + vj < LK, masked)
    for j in T.serial(BK):
        for i in T.vectorized(BQ):
            with T.sblock("ds" if masked else "ds_whole"):
                vj, vi = T.axis.remap("SS", [j, i])
                dsT[vj, vi] = pT[vj, vi] * (dropped(dpT[vj, vi], zT, vj, vi, score.dropout is not None)
                                            - delta_t[vi]) * score.grad(
                    sT[vj, vi] * scale, step_index(b, h, q0, k0, vi, vj, LQ, LK, masked))


def whole_tile_form(score: ScorePipeline, scale):
    """How `whole_gradients` takes a whole tile's P and dS: ("plain", scale) without value modifiers,
    ("softcap", a, c) for a lone softcap (modified score c tanh(a s)), None for other pipelines
    (the generic `step_gradients`)."""
    if not score.changes_values:
        return ("plain", scale)
    squashed = score.squashed_values(scale)
    return None if squashed is None else ("softcap", *squashed)


def tile_gradient(form, s, dp, lse2, delta, squash: str, coefficients):
    """(P, dS) of 16 queries of a whole tile's key row, from raw scores s, dP (times dropout's
    Z) and the row's lse in log2 units: P = 2^(s scale log2 e - lse2) (`exp2_16`), dS = P (dP -
    delta), and for a softcap P = 2^(c tanh(a s) log2 e - lse2) with dS times 1 - tanh^2, tanh
    from `odd_tanh` (`squash` "small": every |s| of the tile within `small_limit`) or `tanh_16`.
    (`coefficients`: odd_tanh's for tanh(a s) itself.)"""
    if form[0] == "plain":
        p = exp2_16(s * tirx.Broadcast(form[1] * T.float32(LOG2E), 16) - lse2)
        return p, p * (dp - delta)
    _, inner, cap = form
    if squash == "small":
        t = odd_tanh(s, coefficients)
    else:
        t = tanh_16(s * tirx.Broadcast(inner * T.float32(2 * LOG2E), 16))
    p = exp2_16(t * tirx.Broadcast(cap * T.float32(LOG2E), 16) - lse2)
    return p, p * (dp - delta) * (tirx.Broadcast(T.float32(1), 16) - t * t)


@T.inline
def gradient_rows(name, form, sT, dpT, pT, dsT, zT, lse2, delta_t, BQ, BK, squash, coefficients, dropout):
    """P^T and dS^T of a whole tile, 16 queries a vector (`tile_gradient`)."""
    for j in T.serial(BK):
        with T.sblock(name):
            vj = T.axis.remap("S", [j])
            T.reads(sT[vj, 0:BQ], dpT[vj, 0:BQ], lse2[0:BQ], delta_t[0:BQ], z_rows(zT, vj, 1, BQ, dropout))
            T.writes(pT[vj, 0:BQ], dsT[vj, 0:BQ])
            for ic in T.serial(BQ // 16):
                cols = T.meta_var(T.Ramp(ic * 16, 1, 16))
                p, ds = T.meta_var(tile_gradient(form, sT[vj, cols], dropped(dpT[vj, cols], zT, vj, cols, dropout),
                                                 lse2[cols], delta_t[cols], squash, coefficients))
                pT[vj, cols] = p
                dsT[vj, cols] = ds


@T.inline
def whole_gradients(form, sT, dpT, pT, dsT, zT, lse_t, delta_t, BQ, BK, dropout):
    """`step_gradients` of a whole tile in explicit 16-lane code on `exp2_16` (Xeon-class
    AMX dev box, bf16 L=4096 D=128, same process: softcap's backward ~0.6x -> see benchmarks/HISTORY.md of
    the plain one, one tanh a score where the generic pass took three exps and two divisions);
    a softcap's tile takes `odd_tanh` where all its scores are small."""
    with T.sblock("whole_gradients"):
        T.reads(sT[0:BK, 0:BQ], dpT[0:BK, 0:BQ], lse_t[0:BQ], delta_t[0:BQ], z_rows(zT, 0, BK, BQ, dropout))
        T.writes(pT[0:BK, 0:BQ], dsT[0:BK, 0:BQ])
        lse2 = T.sblock_alloc_buffer((BQ,), F32)
        bound = T.sblock_alloc_buffer((BQ,), F32)
        small = T.sblock_alloc_buffer((1,), "int32")
        for i in T.serial(BQ):
            lse2[i] = lse_t[i] * T.float32(LOG2E)
        if form[0] == "plain":
            gradient_rows("pds_whole", form, sT, dpT, pT, dsT, zT, lse2, delta_t, BQ, BK, "", None, dropout)
        else:
            small_scores(sT, bound, small, 0, BK, BQ, small_limit(form[1]))
            if small[0] > 0:
                gradient_rows("pds_small", form, sT, dpT, pT, dsT, zT, lse2, delta_t, BQ, BK, "small",
                              tanh_coefficients(form[1], T.float32(1)), dropout)
            else:
                gradient_rows("pds_exact", form, sT, dpT, pT, dsT, zT, lse2, delta_t, BQ, BK, "exact", None, dropout)


@T.inline
def score_gradients(unit, P, score, scale, cfg, sT, dpT, pT, dsT, zT, words, lse_t, delta_t, b, h, hk, q0, k0, BQ, BK, DC,
                    LQ, LK):
    """P^T and dS^T (fp32, keys x queries) of one (kv-block, q-block) step, and with dropout
    its factors Z^T (`zT`; `words`: scratch)."""
    # (contractions over the head dim: D, or S D for an fp32 spec's bf16x3 packs)
    with T.sblock("qk_amx"):  # S^T = K . Q^T
        T.reads(P.kp[b, hk, k0:k0 + BK, 0:DC], P.qd[b, h, 0:DC // 2, q0:q0 + BQ], cfg[0:64])
        T.writes(sT[0:BK, 0:BQ])
        unit.gemm(lambda r, c: sT[r, c], BQ * 4, lambda r, c: P.kp[b, hk, k0 + r, c], P.kp.strides[2] * 2,
                  lambda r, c: P.qd[b, h, r, q0 + c], P.qd.strides[2] * 4, BK, BQ, DC, False)
    with T.sblock("dp_amx"):  # dP^T = V . dO^T
        T.reads(P.vp[b, hk, k0:k0 + BK, 0:DC], P.dod[b, h, 0:DC // 2, q0:q0 + BQ], cfg[0:64])
        T.writes(dpT[0:BK, 0:BQ])
        unit.gemm(lambda r, c: dpT[r, c], BQ * 4, lambda r, c: P.vp[b, hk, k0 + r, c], P.vp.strides[2] * 2,
                  lambda r, c: P.dod[b, h, r, q0 + c], P.dod.strides[2] * 4, BK, BQ, DC, False)
    if score.dropout is not None:
        dropout_tile_16(score.dropout, zT, words, b, h, q0, k0, BQ, BK)
    # P^T and dS^T in 16-lane vectors written here: left to LLVM's loop vectorizer, the
    # loops ran scalar wherever a modifier indexed scores (ALiBi, windows: 8-10x and 4x the
    # plain backward on the Xeon). Whole tiles (`tile_unmasked`) take only the value
    # modifiers, without the per-score clamps and masks.
    form = T.meta_var(whole_tile_form(score, scale))
    if score.tile_unmasked(q0, q0 + BQ, k0, k0 + BK):
        if form is None:
            step_gradients(score, scale, sT, dpT, pT, dsT, zT, lse_t, delta_t, b, h, q0, k0, BQ, BK, LQ, LK, False)
        else:
            whole_gradients(form, sT, dpT, pT, dsT, zT, lse_t, delta_t, BQ, BK, score.dropout is not None)
    else:
        step_gradients(score, scale, sT, dpT, pT, dsT, zT, lse_t, delta_t, b, h, q0, k0, BQ, BK, LQ, LK, True)


@T.inline
def accumulate_rows(unit, name, acc, a_rows, pairs, cfg, b, h, q0, BK, BQ, D, S):
    """acc (BK x D fp32) += a_rows (BK x BQ bf16: P^T or dS^T; S segments of them, bf16x3) .
    the step's queries of `pairs` (dO or Q as VNNI pairs over queries, the q-block's S
    segments)."""
    with T.sblock(name):
        T.reads(a_rows[0:BK, 0:S * BQ // 2], pairs[b, h, S * q0 // 2:S * (q0 + BQ) // 2, 0:D], acc[0:BK, 0:D], cfg[0:64])
        T.writes(acc[0:BK, 0:D])
        unit.gemm(lambda r, c: acc[r, c], D * 4, lambda r, c: a_rows[r, c // 2], S * BQ * 2,
                  lambda r, c: pairs[b, h, S * q0 // 2 + r, c], pairs.strides[2] * 4, BK, D, S * BQ, True)


def store_step_rows(pT, dsT, pa, dsa, zT, j, c, BQ: int, S: int, dropout: bool) -> None:
    """Key row j's queries [32 c, 32 c + 32) of (P Z)^T (Z: dropout's factors) and dS^T as bf16
    A operand rows of dV and dK (S segments, `amx.store_split_row`, for bf16x3)."""
    cols = [tirx.Ramp(c * 32 + h * 16, 1, 16) for h in range(2)]
    for dst, rows in ((pa, [dropped(pT[j, x], zT, j, x, dropout) for x in cols]), (dsa, [dsT[j, x] for x in cols])):
        if S == 1:
            irb.buffer_store(dst, bf16_row(*rows), [j, tirx.Ramp(c * 16, 1, 16)])
        else:
            store_split_row(dst, lambda s: [j, s * (BQ // 2) + c * 16], rows)


@T.inline
def pack_step_rows(pT, dsT, pa, dsa, zT, BK, BQ, S, dropout):
    """The step's A operands of dV and dK (`store_step_rows`)."""
    for j, c in T.grid(BK, BQ // 32):
        with T.sblock("pack_pa"):
            vj, vc = T.axis.remap("SS", [j, c])
            T.reads(pT[vj, vc * 32:vc * 32 + 32], dsT[vj, vc * 32:vc * 32 + 32], z_rows(zT, vj, 1, BQ, dropout))
            T.writes(pa[vj, 0:S * BQ // 2], dsa[vj, 0:S * BQ // 2])
            store_step_rows(pT, dsT, pa, dsa, zT, vj, vc, BQ, S, dropout)


@T.inline
def accumulate_dq(unit, P, cfg, acc_at, acc_ld, acc_region, dsT, dsb, hk, b, k0, BQ, BK, D, S):
    """dQ^T (D x BQ, at acc_at) += K^T . dS^T (S segments over the kv block's keys: bf16x3)."""
    for p, ic in T.grid(BK // 2, BQ // 16):
        with T.sblock("pack_dsb"):
            vp, vic = T.axis.remap("SS", [p, ic])
            T.reads(dsT[vp * 2:vp * 2 + 2, vic * 16:vic * 16 + 16])
            T.writes(dsb[0:S * BK // 2, vic * 16:vic * 16 + 16])
            cols = T.meta_var(T.Ramp(vic * 16, 1, 16))
            store_pair_rows(dsb, vp, cols, dsT[vp * 2, cols], dsT[vp * 2 + 1, cols], S)
    with T.sblock("dq_amx"):
        T.reads(P.kt[b, hk, 0:D, S * k0:S * (k0 + BK)], dsb[0:S * BK // 2, 0:BQ], acc_region, cfg[0:64])
        T.writes(acc_region)
        unit.gemm(acc_at, acc_ld, lambda r, c: P.kt[b, hk, r, S * k0 + c], P.kt.strides[2] * 2,
                  lambda r, c: dsb[r, c], BQ * 4, D, BQ, S * BK, True)


def backward_amx_kernel(spec, block_q: int, block_k: int, plan: str, unit: MatrixUnit = TILES,
                        family: str = "backward") -> tirx.PrimFunc:
    """plan "fused": one task per (batch, kv-head), dK, dV and dQ (symbol <family>_fused);
    "dkdv": one task per (batch, kv-head, kv-block), dK and dV (<family>_dkdv); "dq": one task
    per (batch, head, q-block), dQ (<family>_dq). Arguments as the generic kernels' (the fused
    plan's fp32 scratch is dQ^T: (B, H, D, Lq_padded)), then the packs. An fp32 spec gives the
    bf16x3 backward (`backward_amx_pack_kernel`'s packs, every GEMM's contraction in S
    segments, the step's P^T / dS^T operands split likewise)."""
    assert amx_supported(spec) or bf16x3_supported(spec)
    assert block_q % 32 == 0 and block_k % 32 == 0 and plan in ("fused", "dkdv", "dq")
    D, BQ, BK, dt = spec.head_dim, block_q, block_k, spec.dtype
    S = segments_of(spec)
    shape = Shape.fresh()
    B, H, HK, LQ, LK = shape.batch, shape.heads, shape.heads_k, shape.seqlen_q, shape.seqlen_k
    args = KernelArgs()
    fused = plan == "fused"
    dropout = "dropout" in spec.variants
    WORDS_SHAPE, Z_SHAPE = amx_dropout_buffers(spec, BQ, BK)

    def declare():
        q, k, v, do, lse, delta = declare_backward_inputs(spec, shape, args)
        dk = args.tensor("dk", (B, HK, LK, D), dt) if plan != "dq" else None
        dv = args.tensor("dv", (B, HK, LK, D), dt) if plan != "dq" else None
        dq = args.tensor("dq", (B, H, LQ, D), dt) if plan != "dkdv" else None
        lqp = tirx.Var("seqlen_q_padded", "int64")
        dq_accT = args.tensor("dq_accT", (B, H, D, lqp), F32) if fused else None
        scale = args.scalar("scale")
        score = ScorePipeline(spec.modifiers(), args, shape)
        packs = Packs(spec, shape, args, lqp)
        return lse, delta, dk, dv, dq, dq_accT, scale, score, packs

    if plan == "dq":
        return _dq_kernel(declare, shape, D, BQ, BK, dt, WORDS_SHAPE, Z_SHAPE, unit, S, family)

    @T.prim_func(s_tir=True)
    def dkdv_fn():
        T.func_attr({"tirx.noalias": True})
        LSE, DELTA, DK, DV, DQ, DQ_ACC, scale, score, P = T.meta_var(declare())
        NKB = T.meta_var((LK + BK - 1) // BK)
        SPLIT, TASK_KB = T.meta_var((1, NKB) if fused else (NKB, 1))
        G = T.meta_var(H // HK)
        for t in T.parallel(B * HK * SPLIT):
            with T.sblock("task"):
                vt = T.axis.spatial(B * HK * SPLIT, t)
                cfg = T.sblock_alloc_buffer((64,), "uint8")
                unit.configure(cfg)
                if fused:
                    for g, d, ic, i in T.grid(G, D, P.lqp // 16, 16):  # Lq_padded % 16 == 0
                        with T.sblock("zero_dq"):
                            vg, vd, vic, vi = T.axis.remap("SSSS", [g, d, ic, i])
                            DQ_ACC[vt // HK, vt % HK * G + vg, vd, vic * 16 + vi] = T.float32(0)
                for kbt in T.serial(TASK_KB):
                    with T.sblock("tile"):
                        vb = T.axis.spatial(B, vt // (HK * SPLIT))
                        vhk = T.axis.spatial(HK, vt // SPLIT % HK)
                        vkb = T.axis.opaque(NKB, vt % SPLIT * TASK_KB + kbt)
                        dk_acc = T.sblock_alloc_buffer((BK, D), F32)
                        dv_acc = T.sblock_alloc_buffer((BK, D), F32)
                        k0 = T.meta_var(vkb * BK)
                        qb_lo, qb_hi = T.meta_var(score.q_blocks(k0, T.min(k0 + BK, LK), BQ))
                        for j, d in T.grid(BK, D):
                            with T.sblock("init_acc"):
                                vj, vd = T.axis.remap("SS", [j, d])
                                dk_acc[vj, vd] = T.float32(0)
                                dv_acc[vj, vd] = T.float32(0)
                        for g, qb in T.grid(G, qb_hi - qb_lo):
                            with T.sblock("q_step"):
                                vg = T.axis.opaque(G, g)
                                vqb = T.axis.opaque((LQ + BQ - 1) // BQ, qb_lo + qb)
                                lse_t = T.sblock_alloc_buffer((BQ,), F32)
                                delta_t = T.sblock_alloc_buffer((BQ,), F32)
                                sT = T.sblock_alloc_buffer((BK, BQ), F32)
                                dpT = T.sblock_alloc_buffer((BK, BQ), F32)
                                pT = T.sblock_alloc_buffer((BK, BQ), F32)
                                dsT = T.sblock_alloc_buffer((BK, BQ), F32)
                                pa = T.sblock_alloc_buffer((BK, S * BQ // 2), PAIR)  # bf16 rows
                                dsa = T.sblock_alloc_buffer((BK, S * BQ // 2), PAIR)
                                zT = T.sblock_alloc_buffer(Z_SHAPE, F32)  # dropout's factors Z^T
                                words = T.sblock_alloc_buffer(WORDS_SHAPE, "uint32")  # and Philox words
                                vh = T.meta_var(vhk * G + vg)
                                q0 = T.meta_var(vqb * BQ)
                                load_row_stats(LSE, DELTA, lse_t, delta_t, vb, vh, q0, BQ, LQ)
                                score_gradients(unit, P, score, scale, cfg, sT, dpT, pT, dsT, zT, words, lse_t, delta_t,
                                                vb, vh, vhk, q0, k0, BQ, BK, S * D, LQ, LK)
                                pack_step_rows(pT, dsT, pa, dsa, zT, BK, BQ, S, dropout)  # dV takes (P Z)^T with dropout
                                accumulate_rows(unit, "dv_amx", dv_acc, pa, P.doq, cfg, vb, vh, q0, BK, BQ, D, S)  # dV += P^T dO
                                accumulate_rows(unit, "dk_amx", dk_acc, dsa, P.qq, cfg, vb, vh, q0, BK, BQ, D, S)  # dK += dS^T Q
                                if fused:
                                    dsb = T.sblock_alloc_buffer((S * BK // 2, BQ), PAIR)
                                    accumulate_dq(unit, P, cfg, lambda r, c: DQ_ACC[vb, vh, r, q0 + c],
                                                  DQ_ACC.strides[2] * 4, DQ_ACC[vb, vh, 0:D, q0:q0 + BQ],
                                                  dsT, dsb, vhk, vb, k0, BQ, BK, D, S)
                        for j, d in T.grid(BK, D):
                            with T.sblock("store_dkdv"):
                                vj, vd = T.axis.remap("SS", [j, d])
                                T.where(k0 + j < LK)
                                DK[vb, vhk, k0 + vj, vd] = T.Cast(dt, dk_acc[vj, vd] * scale)
                                DV[vb, vhk, k0 + vj, vd] = T.Cast(dt, dv_acc[vj, vd])
                unit.release()
                if fused:
                    for g, i, d in T.grid(G, LQ, D):
                        with T.sblock("store_dq"):
                            vg, vi, vd = T.axis.remap("SSS", [g, i, d])
                            DQ[vt // HK, vt % HK * G + vg, vi, vd] = T.Cast(
                                dt, DQ_ACC[vt // HK, vt % HK * G + vg, vd, vi] * scale)

    return dkdv_fn.with_attr("global_symbol", f"{family}_fused" if fused else f"{family}_dkdv")


def _dq_kernel(declare, shape: Shape, D: int, BQ: int, BK: int, dt: str, WORDS_SHAPE, Z_SHAPE,
               unit: MatrixUnit, S: int, family: str) -> tirx.PrimFunc:
    B, H, HK, LQ, LK = shape.batch, shape.heads, shape.heads_k, shape.seqlen_q, shape.seqlen_k

    @T.prim_func(s_tir=True)
    def dq_fn():
        T.func_attr({"tirx.noalias": True})
        LSE, DELTA, _dk, _dv, DQ, _acc, scale, score, P = T.meta_var(declare())
        NQB = T.meta_var((LQ + BQ - 1) // BQ)
        for t in T.parallel(B * H * NQB):
            with T.sblock("tile"):
                vb = T.axis.spatial(B, t // (H * NQB))
                vh = T.axis.spatial(H, t // NQB % H)
                vqb = T.axis.spatial(NQB, t % NQB)
                cfg = T.sblock_alloc_buffer((64,), "uint8")
                lse_t = T.sblock_alloc_buffer((BQ,), F32)
                delta_t = T.sblock_alloc_buffer((BQ,), F32)
                dq_accT = T.sblock_alloc_buffer((D, BQ), F32)
                vhk = T.meta_var(vh // (H // HK))
                q0 = T.meta_var(vqb * BQ)
                kb_lo, kb_hi = T.meta_var(score.kv_blocks(q0, T.min(q0 + BQ, LQ), BK))
                unit.configure(cfg)
                load_row_stats(LSE, DELTA, lse_t, delta_t, vb, vh, q0, BQ, LQ)
                for d, i in T.grid(D, BQ):
                    with T.sblock("init_acc"):
                        vd, vi = T.axis.remap("SS", [d, i])
                        dq_accT[vd, vi] = T.float32(0)
                for kb in T.serial(kb_lo, kb_hi):
                    with T.sblock("kv_step"):
                        vkb = T.axis.opaque((LK + BK - 1) // BK, kb)
                        sT = T.sblock_alloc_buffer((BK, BQ), F32)
                        dpT = T.sblock_alloc_buffer((BK, BQ), F32)
                        pT = T.sblock_alloc_buffer((BK, BQ), F32)
                        dsT = T.sblock_alloc_buffer((BK, BQ), F32)
                        dsb = T.sblock_alloc_buffer((S * BK // 2, BQ), PAIR)
                        zT = T.sblock_alloc_buffer(Z_SHAPE, F32)
                        words = T.sblock_alloc_buffer(WORDS_SHAPE, "uint32")
                        k0 = T.meta_var(vkb * BK)
                        score_gradients(unit, P, score, scale, cfg, sT, dpT, pT, dsT, zT, words, lse_t, delta_t,
                                        vb, vh, vhk, q0, k0, BQ, BK, S * D, LQ, LK)
                        accumulate_dq(unit, P, cfg, lambda r, c: dq_accT[r, c], BQ * 4, dq_accT[0:D, 0:BQ],
                                      dsT, dsb, vhk, vb, k0, BQ, BK, D, S)
                unit.release()
                for i, d in T.grid(BQ, D):
                    with T.sblock("store_dq"):
                        vi, vd = T.axis.remap("SS", [i, d])
                        T.where(q0 + i < LQ)
                        DQ[vb, vh, q0 + vi, vd] = T.Cast(dt, dq_accT[vd, vi] * scale)

    return dq_fn.with_attr("global_symbol", f"{family}_dq")
