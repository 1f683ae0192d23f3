"""Split-KV forward for decode-like calls (a handful of queries against a long cache), in
s_tir TensorIR, and the kernel that merges its partial results.

`forward_split`: one task per (batch, head, q-block of BQ queries, split); the q-block's
kv-blocks are cut into `splits` consecutive ranges so that short query blocks still fill the
cores. With so few queries there is no matmul worth the name: each query row streams K and V
once, vectorised along the head dim (QK^T as per-lane partial dot products summed across the
lanes, PV as a row update of O), reading K and V in place (no tile copies). Each task writes
its O normalised by its own row sums and its lse, in fp32.

`forward_combine`: lse = log sum_s exp(lse_s), O = sum_s exp(lse_s - lse) O_s; a query no
split saw gets O = 0, lse = -inf, as from the one-pass forward.

The loops are written vectorised here (block names `dec_*`, no schedule rules), since every
choice is fixed by the shape: LANES fp32 per vector along the head dim.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ..spec import AttentionSpec
from .common import F32, NEG_INF, KernelArgs, Shape, fast_exp
from .forward import declare_forward_args
from .score_mods import ScoreIndex

LANES = 16


def forward_split_kernel(spec: AttentionSpec, block_q: int = 4, block_k: int = 64) -> tirx.PrimFunc:
    D, BQ, BK = spec.head_dim, block_q, block_k
    VL = LANES if D % LANES == 0 else 1  # head dims that are not multiples of 16: scalar lanes
    shape = Shape.fresh()
    B, H, HK, LQ, LK = shape.batch, shape.heads, shape.heads_k, shape.seqlen_q, shape.seqlen_k
    S = tirx.Var("splits", "int64")

    @T.prim_func(s_tir=True)
    def fwd():
        T.func_attr({"tirx.noalias": True})
        Q, K, V, O, LSE, scale, score = T.meta_var(declare_forward_args(spec, shape, S))
        NQB = T.meta_var((LQ + BQ - 1) // BQ)
        for t in T.parallel(B * H * NQB * S):
            with T.sblock("dec_task"):
                vb = T.axis.spatial(B, t // (H * NQB * S))
                vh = T.axis.spatial(H, t // (NQB * S) % H)
                vqb = T.axis.spatial(NQB, t // S % NQB)
                vs = T.axis.spatial(S, t % S)
                T.reads(Q[vb, vh, 0:LQ, 0:D], K[vb, 0:HK, 0:LK, 0:D], V[vb, 0:HK, 0:LK, 0:D])
                T.writes(O[vb, vh, vs, 0:LQ, 0:D], LSE[vb, vh, vs, 0:LQ])
                qs = T.sblock_alloc_buffer((BQ, D), F32)
                acc = T.sblock_alloc_buffer((BQ, D), F32)
                part = T.sblock_alloc_buffer((VL,), F32)
                s = T.sblock_alloc_buffer((BK,), F32)
                st = T.sblock_alloc_buffer((4,), F32)  # m, l, block max, block sum
                vhk = T.meta_var(vh // (H // HK))
                q0 = T.meta_var(vqb * BQ)
                kb_first, kb_end = T.meta_var(score.kv_blocks(q0, T.min(q0 + BQ, LQ), BK))
                per_split = T.meta_var((kb_end - kb_first + S - 1) // S)
                kb_lo = T.meta_var(T.min(kb_first + vs * per_split, kb_end))
                kb_hi = T.meta_var(T.min(kb_lo + per_split, kb_end))
                for i in T.serial(BQ):
                    if q0 + i < LQ:
                        for d in T.vectorized(D):
                            qs[i, d] = T.Cast(F32, Q[vb, vh, q0 + i, d]) * scale
                            acc[i, d] = T.float32(0)
                        st[0] = T.min_value(F32)
                        st[1] = T.float32(0)
                        for kb in T.serial(kb_lo, kb_hi):
                            k0 = T.meta_var(kb * BK)
                            for j in T.serial(BK):  # scores of the block's keys
                                for c in T.vectorized(VL):
                                    part[c] = T.float32(0)
                                for dc in T.serial(D // VL):
                                    for c in T.vectorized(VL):
                                        part[c] = part[c] + qs[i, dc * VL + c] * T.Cast(
                                            F32, K[vb, vhk, T.min(k0 + j, LK - 1), dc * VL + c])
                                s[j] = T.float32(0)
                                for c in T.serial(VL):
                                    s[j] = s[j] + part[c]
                                s[j] = score(s[j], ScoreIndex(vb, vh, q0 + i, k0 + j))  # -inf if masked
                            st[2] = T.min_value(F32)
                            for j in T.serial(BK):
                                st[2] = T.max(st[2], s[j])
                            # online softmax: rescale O by exp(m_old - m_new)
                            for d in T.vectorized(D):
                                acc[i, d] = acc[i, d] * fast_exp(st[0] - T.max(st[0], st[2]))
                            st[1] = st[1] * fast_exp(st[0] - T.max(st[0], st[2]))
                            st[0] = T.max(st[0], st[2])
                            for j in T.vectorized(BK):
                                s[j] = fast_exp(s[j] - st[0])
                            st[3] = T.float32(0)
                            for j in T.serial(BK):
                                st[3] = st[3] + s[j]
                            st[1] = st[1] + st[3]
                            for j in T.serial(BK):  # O += p_j V_j (padded keys have p = 0)
                                for d in T.vectorized(D):
                                    acc[i, d] = acc[i, d] + s[j] * T.Cast(F32, V[vb, vhk, T.min(k0 + j, LK - 1), d])
                        LSE[vb, vh, vs, q0 + i] = T.Select(st[1] > T.float32(0), st[0] + T.log(st[1]), NEG_INF)
                        for d in T.vectorized(D):
                            O[vb, vh, vs, q0 + i, d] = T.Select(st[1] > T.float32(0), acc[i, d] / st[1], T.float32(0))

    return fwd.with_attr("global_symbol", "forward_split")


def forward_combine_kernel(spec: AttentionSpec) -> tirx.PrimFunc:
    """O and lse of a split-KV forward from its partials: lse = log sum_s exp(lse_s), O = sum_s
    exp(lse_s - lse) O_s; a query no split saw gets O = 0, lse = -inf."""
    D, dt = spec.head_dim, spec.dtype
    shape = Shape.fresh()
    B, H, LQ = shape.batch, shape.heads, shape.seqlen_q
    S = tirx.Var("splits", "int64")
    args = KernelArgs()

    def declare():
        o_part = args.tensor("o_part", (B, H, S, LQ, D), F32)
        lse_part = args.tensor("lse_part", (B, H, S, LQ), F32)
        o = args.tensor("o", (B, H, LQ, D), dt)
        lse = args.tensor("lse", (B, H, LQ), F32)
        return o_part, lse_part, o, lse

    @T.prim_func(s_tir=True)
    def combine():
        T.func_attr({"tirx.noalias": True})
        O_PART, LSE_PART, O, LSE = T.meta_var(declare())
        for t in T.parallel(B * H * LQ):
            with T.sblock("row"):
                vb = T.axis.spatial(B, t // (H * LQ))
                vh = T.axis.spatial(H, t // LQ % H)
                vi = T.axis.spatial(LQ, t % LQ)
                m = T.sblock_alloc_buffer((1,), F32)
                l = T.sblock_alloc_buffer((1,), F32)
                acc = T.sblock_alloc_buffer((D,), F32)
                for s in T.serial(S):
                    with T.sblock("combine_max"):
                        vs = T.axis.remap("R", [s])
                        with T.init():
                            m[0] = T.min_value(F32)
                        m[0] = T.max(m[0], LSE_PART[vb, vh, vs, vi])
                for d, s in T.grid(D, S):
                    with T.sblock("combine_sum"):
                        vd, vs = T.axis.remap("SR", [d, s])
                        with T.init():
                            acc[vd] = T.float32(0)
                        # partials that saw no key have lse -inf: weight exactly 0
                        acc[vd] = acc[vd] + fast_exp(LSE_PART[vb, vh, vs, vi] - m[0]) * O_PART[vb, vh, vs, vi, vd]
                for s in T.serial(S):
                    with T.sblock("combine_l"):
                        vs = T.axis.remap("R", [s])
                        with T.init():
                            l[0] = T.float32(0)
                        l[0] = l[0] + fast_exp(LSE_PART[vb, vh, vs, vi] - m[0])
                with T.sblock("combine_lse"):
                    LSE[vb, vh, vi] = T.Select(l[0] > T.float32(0), m[0] + T.log(l[0]), NEG_INF)
                for d in T.serial(D):
                    with T.sblock("combine_out"):
                        vd = T.axis.remap("S", [d])
                        O[vb, vh, vi, vd] = T.Cast(dt, T.Select(l[0] > T.float32(0), acc[vd] / l[0], T.float32(0)))

    return combine.with_attr("global_symbol", "forward_combine")
