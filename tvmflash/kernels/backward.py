"""Flash-attention backward in s_tir TensorIR:

- `backward_delta`: delta = rowsum(dO * O) (fp32), one task per (batch, head, q-block);
- `backward_dkdv`: one task per (batch, kv-head, kv-block); for every query head of the group
  and every q-block that can see the kv-block: recompute P = exp(S - lse), then
  dV += P^T dO, dP = dO V^T, dS = P * (dP - delta), dK += dS^T Q;
- `backward_dq`: one task per (batch, head, q-block) over its kv-blocks: dQ = scale * dS K;
- `backward_fused`: `backward_dkdv` with one task per (batch, kv-head) walking all its
  kv-blocks, which then also owns dQ of its query heads and accumulates dQ += dS K (fp32,
  unscaled) in the same pass: 5 matmuls instead of 7, for shapes with enough (batch, head)
  pairs to fill the cores.

Neither path uses atomics: dQ is accumulated per q-block by its own task (recomputing S and dP
once more), or by the single task that owns the head. Every gradient is bitwise reproducible.
Same transposed (kv x q) tiles and block names as the forward, so the schedules reuse their
rules. Q is pre-scaled, which makes dK = dS^T (scale Q) come out scaled. With dropout
(kernels/dropout.py) the regenerated factors Z enter as dV += (P Z)^T dO, dS = P (dP Z - delta).
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ..spec import AttentionSpec
from .common import F32, POS_INF, NEG_INF, KernelArgs, Shape, fast_exp
from .dropout import check_dropout_blocks, dropout_buffers, dropout_tile
from .score_mods import ScoreIndex, ScorePipeline, TileAt


def declare_backward_inputs(spec: AttentionSpec, shape: Shape, args: KernelArgs, lse_name: str = "lse"):
    """q, k, v, do, the row log-sum-exp (`lse_name`: the CUDA kernels take it in log2 units)
    and delta, in call order: the inputs every backward kernel of every target shares."""
    D, dt = spec.head_dim, spec.dtype
    B, H, HK, LQ, LK = shape.batch, shape.heads, shape.heads_k, shape.seqlen_q, shape.seqlen_k
    q = args.tensor("q", (B, H, LQ, D), dt)
    k = args.tensor("k", (B, HK, LK, D), dt)
    v = args.tensor("v", (B, HK, LK, D), dt)
    do = args.tensor("do", (B, H, LQ, D), dt)
    lse = args.tensor(lse_name, (B, H, LQ), F32)
    delta = args.tensor("delta", (B, H, LQ), F32)
    return q, k, v, do, lse, delta


@T.inline
def load_row_stats(LSE, DELTA, lse_t, delta_t, b, h, q0, BQ, LQ):
    """lse and delta of a step's BQ queries from q0; lse = +inf past Lq or where a query sees
    no key (lse = -inf), which makes its p exactly 0."""
    for i in T.serial(BQ):
        with T.sblock("load_stats"):
            vi = T.axis.remap("S", [i])
            lse_t[vi] = T.Select(q0 + vi < LQ, T.Select(LSE[b, h, T.min(q0 + vi, LQ - 1)] == NEG_INF, POS_INF,
                                                           LSE[b, h, T.min(q0 + vi, LQ - 1)]), POS_INF)
            delta_t[vi] = T.Select(q0 + vi < LQ, DELTA[b, h, T.min(q0 + vi, LQ - 1)], T.float32(0))


def backward_delta_kernel(spec: AttentionSpec, block_q: int = 64) -> tirx.PrimFunc:
    D, BQ, dt = spec.head_dim, block_q, spec.dtype
    shape = Shape.fresh()
    B, H, LQ = shape.batch, shape.heads, shape.seqlen_q
    args = KernelArgs()

    def declare():
        o = args.tensor("o", (B, H, LQ, D), dt)
        do = args.tensor("do", (B, H, LQ, D), dt)
        delta = args.tensor("delta", (B, H, LQ), F32)
        return o, do, delta

    @T.prim_func(s_tir=True)
    def delta_fn():
        T.func_attr({"tirx.noalias": True})
        O, DO, DELTA = T.meta_var(declare())
        NQB = T.meta_var((LQ + BQ - 1) // BQ)
        for t in T.parallel(B * H * NQB):
            with T.sblock("tile"):
                vb = T.axis.spatial(B, t // (H * NQB))
                vh = T.axis.spatial(H, t // NQB % H)
                vqb = T.axis.spatial(NQB, t % NQB)
                q0 = T.meta_var(vqb * BQ)
                for i, d in T.grid(BQ, D):
                    with T.sblock("rowdot"):
                        vi, vd = T.axis.remap("SR", [i, d])
                        T.where(q0 + i < LQ)
                        with T.init():
                            DELTA[vb, vh, q0 + vi] = T.float32(0)
                        DELTA[vb, vh, q0 + vi] = DELTA[vb, vh, q0 + vi] + (
                            T.Cast(F32, O[vb, vh, q0 + vi, vd]) * T.Cast(F32, DO[vb, vh, q0 + vi, vd]))

    return delta_fn.with_attr("global_symbol", "backward_delta")


def backward_dkdv_kernel(spec: AttentionSpec, block_q: int = 64, block_k: int = 64,
                         fuse_dq: bool = False) -> tirx.PrimFunc:
    """K and V stay in the task while Q and dO stream past, so scores are kept un-transposed
    here, S (block_q x block_k): the streamed tiles are read row-major and only the task's own
    K and V are transposed, once."""
    D, BQ, BK, dt = spec.head_dim, block_q, block_k, spec.dtype
    check_dropout_blocks(spec, BQ, BK)
    WORDS_SHAPE, Z_SHAPE = dropout_buffers(spec, BQ, BK, transposed=False)
    shape = Shape.fresh()
    B, H, HK, LQ, LK = shape.batch, shape.heads, shape.heads_k, shape.seqlen_q, shape.seqlen_k
    args = KernelArgs()

    def declare():
        q, k, v, do, lse, delta = declare_backward_inputs(spec, shape, args)
        dk = args.tensor("dk", (B, HK, LK, D), dt)
        dv = args.tensor("dv", (B, HK, LK, D), dt)
        # fused: dQ and its fp32 accumulator (scratch: the kernel zeroes it)
        dq = args.tensor("dq", (B, H, LQ, D), dt) if fuse_dq else None
        dq_acc = args.tensor("dq_acc", (B, H, LQ, D), F32) if fuse_dq else None
        scale = args.scalar("scale")
        return q, k, v, do, lse, delta, dk, dv, dq, dq_acc, scale, ScorePipeline(spec.modifiers(), args, shape)

    @T.prim_func(s_tir=True)
    def dkdv_fn():
        T.func_attr({"tirx.noalias": True})
        Q, K, V, DO, LSE, DELTA, DK, DV, DQ, DQ_ACC, scale, score = T.meta_var(declare())
        drop = T.meta_var(score.dropout)
        NKB = T.meta_var((LK + BK - 1) // BK)
        # tasks per (batch, kv-head) and kv-blocks per task
        SPLIT, TASK_KB = T.meta_var((1, NKB) if fuse_dq else (NKB, 1))
        G = T.meta_var(H // HK)
        for t in T.parallel(B * HK * SPLIT):
            if fuse_dq:
                for g, i, d in T.grid(G, LQ, D):
                    with T.sblock("zero_dq"):
                        vt, vg, vi, vd = T.axis.remap("SSSS", [t, g, i, d])
                        DQ_ACC[vt // HK, vt % HK * G + vg, vi, vd] = T.float32(0)
            for kbt in T.serial(TASK_KB):
                with T.sblock("tile"):
                    vb = T.axis.spatial(B, t // (HK * SPLIT))
                    vhk = T.axis.spatial(HK, t // SPLIT % HK)
                    vkb = T.axis.opaque(NKB, t % SPLIT * TASK_KB + kbt)
                    kT = T.sblock_alloc_buffer((D, BK), F32)
                    vT = T.sblock_alloc_buffer((D, BK), F32)
                    dk_acc = T.sblock_alloc_buffer((BK, D), F32)
                    dv_acc = T.sblock_alloc_buffer((BK, D), F32)
                    k0 = T.meta_var(vkb * BK)
                    key = T.meta_var(lambda j: T.min(k0 + j, LK - 1))
                    qb_lo, qb_hi = T.meta_var(score.q_blocks(k0, T.min(k0 + BK, LK), BQ))
                    for j, d in T.grid(BK, D):
                        with T.sblock("load_kT"):
                            vj, vd = T.axis.remap("SS", [j, d])
                            kT[vd, vj] = T.Cast(F32, K[vb, vhk, key(vj), vd])
                    for j, d in T.grid(BK, D):
                        with T.sblock("load_vT"):
                            vj, vd = T.axis.remap("SS", [j, d])
                            vT[vd, vj] = T.Cast(F32, V[vb, vhk, key(vj), vd])
                    if fuse_dq:
                        kf = T.sblock_alloc_buffer((BK, D), F32)
                        for j, d in T.grid(BK, D):
                            with T.sblock("load_k"):
                                vj, vd = T.axis.remap("SS", [j, d])
                                kf[vj, vd] = T.Cast(F32, K[vb, vhk, key(vj), vd])
                    for j, d in T.grid(BK, D):
                        with T.sblock("init_acc"):
                            vj, vd = T.axis.remap("SS", [j, d])
                            dk_acc[vj, vd] = T.float32(0)
                            dv_acc[vj, vd] = T.float32(0)
                    for g, qb in T.grid(G, qb_hi - qb_lo):
                        with T.sblock("q_step"):
                            vg = T.axis.opaque(G, g)
                            vqb = T.axis.opaque((LQ + BQ - 1) // BQ, qb_lo + qb)
                            live = T.meta_var(score.tile_live((qb_lo + qb) * BQ, k0, TileAt(vb, vhk * G + g, (BQ, BK))))
                            if live is not None:  # a block mask's empty tiles are skipped
                                T.where(live)
                            qs = T.sblock_alloc_buffer((BQ, D), F32)
                            dos = T.sblock_alloc_buffer((BQ, D), F32)
                            lse_t = T.sblock_alloc_buffer((BQ,), F32)
                            delta_t = T.sblock_alloc_buffer((BQ,), F32)
                            s = T.sblock_alloc_buffer((BQ, BK), F32)
                            p = T.sblock_alloc_buffer((BQ, BK), F32)
                            dp = T.sblock_alloc_buffer((BQ, BK), F32)
                            ds = T.sblock_alloc_buffer((BQ, BK), F32)
                            dk_part = T.sblock_alloc_buffer((BK, D), F32)
                            dv_part = T.sblock_alloc_buffer((BK, D), F32)
                            z = T.sblock_alloc_buffer(Z_SHAPE, F32)  # dropout factors
                            words = T.sblock_alloc_buffer(WORDS_SHAPE, "uint32")  # their Philox words
                            pz = T.sblock_alloc_buffer(Z_SHAPE, F32)
                            p_v = T.meta_var(p if drop is None else pz)  # the P that dV takes
                            dp_z = T.meta_var(lambda i, j: dp[i, j] if drop is None else dp[i, j] * z[i, j])
                            vh = T.meta_var(vhk * G + vg)
                            q0 = T.meta_var(vqb * BQ)
                            row = T.meta_var(lambda i: T.min(q0 + i, LQ - 1))
                            inside = T.meta_var(lambda i: q0 + i < LQ)
                            for i, d in T.grid(BQ, D):
                                with T.sblock("load_q"):
                                    vi, vd = T.axis.remap("SS", [i, d])
                                    qs[vi, vd] = T.Cast(F32, Q[vb, vh, row(vi), vd]) * scale
                            for i, d in T.grid(BQ, D):
                                with T.sblock("load_do"):
                                    vi, vd = T.axis.remap("SS", [i, d])
                                    dos[vi, vd] = T.Select(inside(vi), T.Cast(F32, DO[vb, vh, row(vi), vd]),
                                                           T.float32(0))
                            load_row_stats(LSE, DELTA, lse_t, delta_t, vb, vh, q0, BQ, LQ)
                            for i, j, d in T.grid(BQ, BK, D):
                                with T.sblock("qk"):
                                    vi, vj, vd = T.axis.remap("SSR", [i, j, d])
                                    with T.init():
                                        s[vi, vj] = T.float32(0)
                                    s[vi, vj] = s[vi, vj] + qs[vi, vd] * kT[vd, vj]
                            for i, j in T.grid(BQ, BK):
                                with T.sblock("p"):
                                    vi, vj = T.axis.remap("SS", [i, j])
                                    p[vi, vj] = fast_exp(
                                        score(s[vi, vj], ScoreIndex(vb, vh, q0 + vi, k0 + vj)) - lse_t[vi])
                            if drop is not None:  # z = dropout factors; dV takes P z
                                dropout_tile(drop, words, z, None, vb, vh, q0, k0, BQ, BK, False)
                                for i, j in T.grid(BQ, BK):
                                    with T.sblock("p_drop"):
                                        vi, vj = T.axis.remap("SS", [i, j])
                                        pz[vi, vj] = p[vi, vj] * z[vi, vj]
                            for j, d, i in T.grid(BK, D, BQ):
                                with T.sblock("dv"):
                                    vj, vd, vi = T.axis.remap("SSR", [j, d, i])
                                    with T.init():
                                        dv_part[vj, vd] = T.float32(0)
                                    dv_part[vj, vd] = dv_part[vj, vd] + p_v[vi, vj] * dos[vi, vd]
                            for i, j, d in T.grid(BQ, BK, D):
                                with T.sblock("dp"):
                                    vi, vj, vd = T.axis.remap("SSR", [i, j, d])
                                    with T.init():
                                        dp[vi, vj] = T.float32(0)
                                    dp[vi, vj] = dp[vi, vj] + dos[vi, vd] * vT[vd, vj]
                            for i, j in T.grid(BQ, BK):
                                with T.sblock("ds"):
                                    vi, vj = T.axis.remap("SS", [i, j])
                                    ds[vi, vj] = p[vi, vj] * (dp_z(vi, vj) - delta_t[vi]) * score.grad(
                                        s[vi, vj], ScoreIndex(vb, vh, q0 + vi, k0 + vj))
                            for j, d, i in T.grid(BK, D, BQ):
                                with T.sblock("dk"):
                                    vj, vd, vi = T.axis.remap("SSR", [j, d, i])
                                    with T.init():
                                        dk_part[vj, vd] = T.float32(0)
                                    dk_part[vj, vd] = dk_part[vj, vd] + ds[vi, vj] * qs[vi, vd]
                            for j in T.serial(BK):
                                for d in T.vectorized(D):
                                    with T.sblock("acc_update"):
                                        vj, vd = T.axis.remap("SS", [j, d])
                                        dv_acc[vj, vd] = dv_acc[vj, vd] + dv_part[vj, vd]
                                        dk_acc[vj, vd] = dk_acc[vj, vd] + dk_part[vj, vd]
                            if fuse_dq:
                                dq_part = T.sblock_alloc_buffer((BQ, D), F32)
                                for i, d, j in T.grid(BQ, D, BK):
                                    with T.sblock("dq"):
                                        vi, vd, vj = T.axis.remap("SSR", [i, d, j])
                                        with T.init():
                                            dq_part[vi, vd] = T.float32(0)
                                        dq_part[vi, vd] = dq_part[vi, vd] + ds[vi, vj] * kf[vj, vd]
                                for i in T.serial(BQ):
                                    for d in T.vectorized(D):
                                        with T.sblock("dq_update"):
                                            vi, vd = T.axis.remap("SS", [i, d])
                                            T.where(q0 + i < LQ)
                                            DQ_ACC[vb, vh, q0 + vi, vd] = DQ_ACC[vb, vh, q0 + vi, vd] + dq_part[vi, vd]
                    for j, d in T.grid(BK, D):
                        with T.sblock("store_dkdv"):
                            vj, vd = T.axis.remap("SS", [j, d])
                            T.where(k0 + j < LK)
                            DK[vb, vhk, k0 + vj, vd] = T.Cast(dt, dk_acc[vj, vd])
                            DV[vb, vhk, k0 + vj, vd] = T.Cast(dt, dv_acc[vj, vd])

            if fuse_dq:
                for g, i, d in T.grid(G, LQ, D):
                    with T.sblock("store_dq"):
                        vt, vg, vi, vd = T.axis.remap("SSSS", [t, g, i, d])
                        DQ[vt // HK, vt % HK * G + vg, vi, vd] = T.Cast(
                            dt, DQ_ACC[vt // HK, vt % HK * G + vg, vi, vd] * scale)

    return dkdv_fn.with_attr("global_symbol", "backward_fused" if fuse_dq else "backward_dkdv")


def backward_dq_kernel(spec: AttentionSpec, block_q: int = 64, block_k: int = 64) -> tirx.PrimFunc:
    D, BQ, BK, dt = spec.head_dim, block_q, block_k, spec.dtype
    check_dropout_blocks(spec, BQ, BK)
    WORDS_SHAPE, Z_SHAPE = dropout_buffers(spec, BQ, BK, transposed=True)
    shape = Shape.fresh()
    B, H, HK, LQ, LK = shape.batch, shape.heads, shape.heads_k, shape.seqlen_q, shape.seqlen_k
    args = KernelArgs()

    def declare():
        q, k, v, do, lse, delta = declare_backward_inputs(spec, shape, args)
        dq = args.tensor("dq", (B, H, LQ, D), dt)
        scale = args.scalar("scale")
        return q, k, v, do, lse, delta, dq, scale, ScorePipeline(spec.modifiers(), args, shape)

    @T.prim_func(s_tir=True)
    def dq_fn():
        T.func_attr({"tirx.noalias": True})
        Q, K, V, DO, LSE, DELTA, DQ, scale, score = T.meta_var(declare())
        drop = T.meta_var(score.dropout)
        NQB = T.meta_var((LQ + BQ - 1) // BQ)
        for t in T.parallel(B * H * NQB):
            with T.sblock("tile"):
                vb = T.axis.spatial(B, t // (H * NQB))
                vh = T.axis.spatial(H, t // NQB % H)
                vqb = T.axis.spatial(NQB, t % NQB)
                qT = T.sblock_alloc_buffer((D, BQ), F32)
                doT = T.sblock_alloc_buffer((D, BQ), F32)
                lse_t = T.sblock_alloc_buffer((BQ,), F32)
                delta_t = T.sblock_alloc_buffer((BQ,), F32)
                dq_acc = T.sblock_alloc_buffer((BQ, D), F32)
                vhk = T.meta_var(vh // (H // HK))
                q0 = T.meta_var(vqb * BQ)
                row = T.meta_var(lambda i: T.min(q0 + i, LQ - 1))
                inside = T.meta_var(lambda i: q0 + i < LQ)
                kb_lo, kb_hi = T.meta_var(score.kv_blocks(q0, T.min(q0 + BQ, LQ), BK))
                for i, d in T.grid(BQ, D):
                    with T.sblock("load_qT"):
                        vi, vd = T.axis.remap("SS", [i, d])
                        qT[vd, vi] = T.Cast(F32, Q[vb, vh, row(vi), vd]) * scale
                for i, d in T.grid(BQ, D):
                    with T.sblock("load_doT"):
                        vi, vd = T.axis.remap("SS", [i, d])
                        doT[vd, vi] = T.Select(inside(vi), T.Cast(F32, DO[vb, vh, row(vi), vd]), T.float32(0))
                load_row_stats(LSE, DELTA, lse_t, delta_t, vb, vh, q0, BQ, LQ)
                for i, d in T.grid(BQ, D):
                    with T.sblock("init_acc"):
                        vi, vd = T.axis.remap("SS", [i, d])
                        dq_acc[vi, vd] = T.float32(0)
                for kb in T.serial(kb_lo, kb_hi):
                    with T.sblock("kv_step"):
                        vkb = T.axis.opaque((LK + BK - 1) // BK, kb)
                        live = T.meta_var(score.tile_live(q0, kb * BK, TileAt(vb, vh, (BQ, BK))))
                        if live is not None:
                            T.where(live)
                        kf = T.sblock_alloc_buffer((BK, D), F32)
                        vf = T.sblock_alloc_buffer((BK, D), F32)
                        sT = T.sblock_alloc_buffer((BK, BQ), F32)
                        pT = T.sblock_alloc_buffer((BK, BQ), F32)
                        dpT = T.sblock_alloc_buffer((BK, BQ), F32)
                        dsT = T.sblock_alloc_buffer((BK, BQ), F32)
                        dq_part = T.sblock_alloc_buffer((BQ, D), F32)
                        zT = T.sblock_alloc_buffer(Z_SHAPE, F32)  # dropout factors
                        words = T.sblock_alloc_buffer(WORDS_SHAPE, "uint32")  # their Philox words
                        dp_z = T.meta_var(lambda j, i: dpT[j, i] if drop is None else dpT[j, i] * zT[j, i])
                        k0 = T.meta_var(vkb * BK)
                        for j, d in T.grid(BK, D):
                            with T.sblock("load_k"):
                                vj, vd = T.axis.remap("SS", [j, d])
                                kf[vj, vd] = T.Cast(F32, K[vb, vhk, T.min(k0 + vj, LK - 1), vd])
                        for j, d in T.grid(BK, D):
                            with T.sblock("load_v"):
                                vj, vd = T.axis.remap("SS", [j, d])
                                vf[vj, vd] = T.Cast(F32, V[vb, vhk, T.min(k0 + vj, LK - 1), vd])
                        for j, i, d in T.grid(BK, BQ, D):
                            with T.sblock("qk"):
                                vj, vi, vd = T.axis.remap("SSR", [j, i, d])
                                with T.init():
                                    sT[vj, vi] = T.float32(0)
                                sT[vj, vi] = sT[vj, vi] + kf[vj, vd] * qT[vd, vi]
                        for j, i in T.grid(BK, BQ):
                            with T.sblock("p"):
                                vj, vi = T.axis.remap("SS", [j, i])
                                pT[vj, vi] = fast_exp(score(sT[vj, vi], ScoreIndex(vb, vh, q0 + vi, k0 + vj)) - lse_t[vi])
                        for j, i, d in T.grid(BK, BQ, D):
                            with T.sblock("dp"):
                                vj, vi, vd = T.axis.remap("SSR", [j, i, d])
                                with T.init():
                                    dpT[vj, vi] = T.float32(0)
                                dpT[vj, vi] = dpT[vj, vi] + vf[vj, vd] * doT[vd, vi]
                        if drop is not None:
                            dropout_tile(drop, words, zT, None, vb, vh, q0, k0, BQ, BK, True)
                        for j, i in T.grid(BK, BQ):
                            with T.sblock("ds"):
                                vj, vi = T.axis.remap("SS", [j, i])
                                dsT[vj, vi] = pT[vj, vi] * (dp_z(vj, vi) - delta_t[vi]) * score.grad(
                                    sT[vj, vi], ScoreIndex(vb, vh, q0 + vi, k0 + vj))
                        for i, d, j in T.grid(BQ, D, BK):
                            with T.sblock("dq"):
                                vi, vd, vj = T.axis.remap("SSR", [i, d, j])
                                with T.init():
                                    dq_part[vi, vd] = T.float32(0)
                                dq_part[vi, vd] = dq_part[vi, vd] + dsT[vj, vi] * kf[vj, vd]
                        for i in T.serial(BQ):
                            for d in T.vectorized(D):
                                with T.sblock("acc_update"):
                                    vi, vd = T.axis.remap("SS", [i, d])
                                    dq_acc[vi, vd] = dq_acc[vi, vd] + dq_part[vi, vd]
                for i, d in T.grid(BQ, D):
                    with T.sblock("store_dq"):
                        vi, vd = T.axis.remap("SS", [i, d])
                        T.where(q0 + i < LQ)
                        DQ[vb, vh, q0 + vi, vd] = T.Cast(dt, dq_acc[vi, vd] * scale)

    return dq_fn.with_attr("global_symbol", "backward_dq")
