"""Flash-attention forward in s_tir TensorIR: blocked online softmax, fp32 accumulation.

One task per (batch, head, q-block) loops over the kv-blocks its queries can see. Scores are
kept transposed, S^T (block_k x block_q): K rows are broadcast (never transposed), the per-query
max/sum reductions run along the outer axis and vectorise over queries, and only the Q tile is
transposed, once per task. Q is pre-scaled, so `qk` yields scale * q.k directly.

Outputs: O (any strides, head dim unit-stride) and lse = m + log(l) (natural log, fp32);
a query that sees no key gets O = 0 and lse = -inf. Dropout multiplies P by its factors
after the row sums (kernels/dropout.py).
The split-KV forward for decode (few queries) is in decode.py.
How these blocks map to a CPU is in schedules/ (block names are that interface).
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ..spec import AttentionSpec
from .common import F32, NEG_INF, KernelArgs, Shape, fast_exp
from .dropout import check_dropout_blocks, dropout_buffers, dropout_tile
from .score_mods import ScoreIndex, ScorePipeline, TileAt


def declare_forward_args(spec: AttentionSpec, shape: Shape, splits: tirx.Var | None = None):
    """The forward's arguments, in call order, for every target's forward kernel (call while
    the kernel is parsed): q, k, v, o (B, H|Hk, L, D), lse (B, H, Lq) fp32, scale, then the
    score modifiers' own arguments; returns them and the bound ScorePipeline. With `splits`
    (split-KV) o and lse are the fp32 partials, (B, H, splits, Lq, D) and (B, H, splits, Lq),
    followed by the final o and lse, which a single split writes itself (no merge): the
    returned o and lse are then pairs (partial, final)."""
    B, H, HK, LQ, LK = shape.batch, shape.heads, shape.heads_k, shape.seqlen_q, shape.seqlen_k
    D, dt = spec.head_dim, spec.dtype
    args = KernelArgs()
    q = args.tensor("q", (B, H, LQ, D), dt)
    k = args.tensor("k", (B, HK, LK, D), dt)
    v = args.tensor("v", (B, HK, LK, D), dt)
    if splits is None:
        o = args.tensor("o", (B, H, LQ, D), dt)
        lse = args.tensor("lse", (B, H, LQ), F32)
    else:
        o_part = args.tensor("o_part", (B, H, splits, LQ, D), F32)
        lse_part = args.tensor("lse_part", (B, H, splits, LQ), F32)
        o = (o_part, args.tensor("o", (B, H, LQ, D), dt))
        lse = (lse_part, args.tensor("lse", (B, H, LQ), F32))
    scale = args.scalar("scale")
    return q, k, v, o, lse, scale, ScorePipeline(spec.modifiers(), args, shape)


def forward_kernel(spec: AttentionSpec, block_q: int = 64, block_k: int = 64) -> tirx.PrimFunc:
    D, BQ, BK, dt = spec.head_dim, block_q, block_k, spec.dtype
    check_dropout_blocks(spec, BQ, BK)
    WORDS_SHAPE, Z_SHAPE = dropout_buffers(spec, BQ, BK, transposed=True)
    shape = Shape.fresh()
    B, H, HK, LQ, LK = shape.batch, shape.heads, shape.heads_k, shape.seqlen_q, shape.seqlen_k

    @T.prim_func(s_tir=True)
    def fwd():
        T.func_attr({"tirx.noalias": True})
        Q, K, V, O, LSE, scale, score = T.meta_var(declare_forward_args(spec, shape))
        NQB = T.meta_var((LQ + BQ - 1) // BQ)
        for t in T.parallel(B * H * NQB):
            with T.sblock("tile"):
                vb = T.axis.spatial(B, t // (H * NQB))
                vh = T.axis.spatial(H, t // NQB % H)
                vqb = T.axis.spatial(NQB, t % NQB)
                qT = T.sblock_alloc_buffer((D, BQ), F32)
                m = T.sblock_alloc_buffer((BQ,), F32)
                l = T.sblock_alloc_buffer((BQ,), F32)
                acc = T.sblock_alloc_buffer((BQ, D), F32)
                vhk = T.meta_var(vh // (H // HK))
                q0 = T.meta_var(vqb * BQ)
                kb_lo, kb_hi = T.meta_var(score.kv_blocks(q0, T.min(q0 + BQ, LQ), BK))
                for i, d in T.grid(BQ, D):
                    with T.sblock("load_qT"):
                        vi, vd = T.axis.remap("SS", [i, d])
                        qT[vd, vi] = T.Select(
                            q0 + vi < LQ,
                            T.Cast(F32, Q[vb, vh, T.min(q0 + vi, LQ - 1), vd]) * scale,
                            T.float32(0))
                for i in T.serial(BQ):
                    with T.sblock("init_ml"):
                        vi = T.axis.remap("S", [i])
                        m[vi] = T.min_value(F32)
                        l[vi] = T.float32(0)
                for i, d in T.grid(BQ, D):
                    with T.sblock("init_acc"):
                        vi, vd = T.axis.remap("SS", [i, d])
                        acc[vi, vd] = T.float32(0)
                for kb in T.serial(kb_lo, kb_hi):
                    with T.sblock("kv_step"):
                        vkb = T.axis.opaque((LK + BK - 1) // BK, kb)
                        live = T.meta_var(score.tile_live(q0, kb * BK, TileAt(vb, vh, (BQ, BK))))
                        if live is not None:  # a block mask's empty tiles are skipped
                            T.where(live)
                        kf = T.sblock_alloc_buffer((BK, D), F32)
                        vf = T.sblock_alloc_buffer((BK, D), F32)
                        sT = T.sblock_alloc_buffer((BK, BQ), F32)
                        sc = T.sblock_alloc_buffer((BK, BQ), F32)
                        pT = T.sblock_alloc_buffer((BK, BQ), F32)
                        mn = T.sblock_alloc_buffer((BQ,), F32)
                        alpha = T.sblock_alloc_buffer((BQ,), F32)
                        ls = T.sblock_alloc_buffer((BQ,), F32)
                        pv = T.sblock_alloc_buffer((BQ, D), F32)
                        pzT = T.sblock_alloc_buffer(Z_SHAPE, F32)  # P Z (dropout)
                        words = T.sblock_alloc_buffer(WORDS_SHAPE, "uint32")  # dropout's Philox words
                        p_v = T.meta_var(pT if score.dropout is None else pzT)  # the P that O takes
                        k0 = T.meta_var(vkb * BK)
                        for j, d in T.grid(BK, D):
                            with T.sblock("load_k"):
                                vj, vd = T.axis.remap("SS", [j, d])
                                kf[vj, vd] = T.Cast(F32, K[vb, vhk, T.min(k0 + vj, LK - 1), vd])
                        for j, d in T.grid(BK, D):
                            with T.sblock("load_v"):
                                vj, vd = T.axis.remap("SS", [j, d])
                                vf[vj, vd] = T.Select(
                                    k0 + vj < LK,
                                    T.Cast(F32, V[vb, vhk, T.min(k0 + vj, LK - 1), vd]),
                                    T.float32(0))
                        for j, i, d in T.grid(BK, BQ, D):
                            with T.sblock("qk"):
                                vj, vi, vd = T.axis.remap("SSR", [j, i, d])
                                with T.init():
                                    sT[vj, vi] = T.float32(0)
                                sT[vj, vi] = sT[vj, vi] + kf[vj, vd] * qT[vd, vi]
                        for j, i in T.grid(BK, BQ):
                            with T.sblock("score"):
                                vj, vi = T.axis.remap("SS", [j, i])
                                sc[vj, vi] = score(sT[vj, vi], ScoreIndex(vb, vh, q0 + vi, k0 + vj))
                        for i, j in T.grid(BQ, BK):
                            with T.sblock("rowmax"):
                                vi, vj = T.axis.remap("SR", [i, j])
                                with T.init():
                                    mn[vi] = T.min_value(F32)
                                mn[vi] = T.max(mn[vi], sc[vj, vi])
                        for i in T.serial(BQ):
                            with T.sblock("alpha"):
                                vi = T.axis.remap("S", [i])
                                alpha[vi] = fast_exp(m[vi] - T.max(m[vi], mn[vi]))
                                m[vi] = T.max(m[vi], mn[vi])
                        for j, i in T.grid(BK, BQ):
                            with T.sblock("p"):
                                vj, vi = T.axis.remap("SS", [j, i])
                                pT[vj, vi] = fast_exp(sc[vj, vi] - m[vi])
                        for i, j in T.grid(BQ, BK):
                            with T.sblock("rowsum"):
                                vi, vj = T.axis.remap("SR", [i, j])
                                with T.init():
                                    ls[vi] = T.float32(0)
                                ls[vi] = ls[vi] + pT[vj, vi]
                        for i in T.serial(BQ):
                            with T.sblock("l_update"):
                                vi = T.axis.remap("S", [i])
                                l[vi] = l[vi] * alpha[vi] + ls[vi]
                        if score.dropout is not None:  # l sums the undropped P; O takes P Z
                            dropout_tile(score.dropout, words, pzT, pT, vb, vh, q0, k0, BQ, BK, True)
                        for i, d, j in T.grid(BQ, D, BK):
                            with T.sblock("pv"):
                                vi, vd, vj = T.axis.remap("SSR", [i, d, j])
                                with T.init():
                                    pv[vi, vd] = T.float32(0)
                                pv[vi, vd] = pv[vi, vd] + p_v[vj, vi] * vf[vj, vd]
                        for i in T.serial(BQ):
                            for d in T.vectorized(D):
                                with T.sblock("acc_update"):
                                    vi, vd = T.axis.remap("SS", [i, d])
                                    acc[vi, vd] = acc[vi, vd] * alpha[vi] + pv[vi, vd]
                for i in T.serial(BQ):
                    with T.sblock("store_lse"):
                        vi = T.axis.remap("S", [i])
                        T.where(q0 + i < LQ)
                        LSE[vb, vh, q0 + vi] = T.Select(l[vi] == T.float32(0), NEG_INF, m[vi] + T.log(l[vi]))
                for i, d in T.grid(BQ, D):
                    with T.sblock("store_o"):
                        vi, vd = T.axis.remap("SS", [i, d])
                        T.where(q0 + i < LQ)
                        O[vb, vh, q0 + vi, vd] = T.Cast(
                            dt, T.Select(l[vi] == T.float32(0), T.float32(0), acc[vi, vd] / l[vi]))

    return fwd.with_attr("global_symbol", "forward")
