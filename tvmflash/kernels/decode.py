"""Split-KV forward for decode-like calls (a handful of queries against a long cache), in
s_tir TensorIR, and the kernel that merges its partial results.

`forward_split`: one task per (batch, kv-head, block of query rows, split); a kv-head's rows
are the queries of its query heads (GQA packs the group), and its kv-blocks are cut into
`splits` consecutive ranges so that few queries still fill the cores. With so few queries there
is no matmul worth the name: per kv-block, each row takes its scores and its O update
vectorised along the head dim (QK^T as per-lane partial dot products summed across the lanes,
PV as a row update of O), reading K and V in place (no tile copies; a block is read from
memory once and reused from L1 by the task's rows). Each task writes its rows' O normalised by
their own row sums and their lse, in fp32.

`forward_combine`: lse = log sum_s exp(lse_s), O = sum_s exp(lse_s - lse) O_s; a query no
split saw gets O = 0, lse = -inf, as from the one-pass forward.

For a kv_cache spec (flash_attn_with_kvcache) the same kernel reads a KV cache in place:
`declare_decode_args`' paged layout (a contiguous cache is one page per batch entry), each
batch entry's keys at cache positions [leftpad, seqlen + new) (`CacheArgs`), the score
modifiers in that sequence's coordinates. Its kv-blocks are aligned to cache positions, so
each 16 keys lie in one page: the block's pages are looked up once per block. The CUDA decode
kernel (schedules/cuda_decode.py) takes the same arguments.

The loops are written vectorised here (block names `dec_*`, no schedule rules), since every
choice is fixed by the shape: LANES fp32 per vector along the head dim.
"""
from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from ..spec import AttentionSpec
from .common import F32, NEG_INF, KernelArgs, Shape, fast_exp
from .forward import declare_forward_args
from .score_mods import ScoreIndex, ScorePipeline

LANES = 16
PAGE_ALIGN = 16  # page sizes are multiples of this: 16 aligned keys lie in one page


@dataclass(frozen=True)
class CacheArgs:
    """A KV cache's kernel arguments besides K and V: `table` (B, max_pages) int32 page
    numbers, `seqlens` and `leftpad` (B,) int32 and the scalar `new_keys`; batch entry b's keys
    are cache positions [leftpad[b], seqlens[b] + new_keys)."""

    table: tirx.Buffer
    seqlens: tirx.Buffer
    leftpad: tirx.Buffer
    new_keys: tirx.Var
    num_pages: tirx.Var
    page_size: tirx.Var

    def start(self, b):
        return tirx.Cast("int64", self.leftpad[b])

    def count(self, b):
        return tirx.max(tirx.Cast("int64", self.seqlens[b]) + self.new_keys - self.start(b), tirx.const(0, "int64"))

    def page(self, b, pos):
        """The page of cache position `pos` (int32 arithmetic), clamped into the table and the
        cache: bad tables cannot make reads leave the cache."""
        pos, pages = tirx.Cast("int32", pos), tirx.Cast("int32", self.table.shape[1])
        entry = self.table[b, tirx.min(pos // tirx.Cast("int32", self.page_size), pages - 1)]
        return tirx.min(tirx.max(entry, 0), tirx.Cast("int32", self.num_pages) - 1)

    def row(self, pos):
        """The row of cache position `pos` in its page."""
        return tirx.Cast("int32", pos) % tirx.Cast("int32", self.page_size)


def declare_decode_args(spec: AttentionSpec, shape: Shape, splits: tirx.Var):
    """A kv_cache spec's decode arguments, in call order: q (B, H, Lq, D); k_cache, v_cache
    (num_pages, page_size, Hk, D); block_table (B, max_pages); cache_seqlens, cache_leftpad
    (B,) int32; new_keys (int64); o_part (B, H, splits, Lq, D) and lse_part (B, H, splits, Lq)
    fp32; scale; then the score modifiers' arguments. Returns (q, k, v, CacheArgs, o_part,
    lse_part, scale, the bound ScorePipeline)."""
    B, H, HK, LQ = shape.batch, shape.heads, shape.heads_k, shape.seqlen_q
    NP, PG, MP = (tirx.Var(n, "int64") for n in ("num_pages", "page_size", "max_pages"))
    D, dt = spec.head_dim, spec.dtype
    args = KernelArgs()
    q = args.tensor("q", (B, H, LQ, D), dt)
    k = args.tensor("k_cache", (NP, PG, HK, D), dt)
    v = args.tensor("v_cache", (NP, PG, HK, D), dt)
    table = args.tensor("block_table", (B, MP), "int32", unit_last_stride=False)
    seqlens = args.tensor("cache_seqlens", (B,), "int32", unit_last_stride=False)
    leftpad = args.tensor("cache_leftpad", (B,), "int32", unit_last_stride=False)
    cache = CacheArgs(table, seqlens, leftpad, args.scalar("new_keys", "int64"), NP, PG)
    o = args.tensor("o_part", (B, H, splits, LQ, D), F32)
    lse = args.tensor("lse_part", (B, H, splits, LQ), F32)
    scale = args.scalar("scale")
    return q, k, v, cache, o, lse, scale, ScorePipeline(spec.modifiers(), args, shape)


def forward_split_kernel(spec: AttentionSpec, block_rows: int = 8, block_k: int = 64) -> tirx.PrimFunc:
    """Tasks over (batch, kv-head, block of `block_rows` query rows, split). The rows of a
    kv-head are its query heads' queries (G x Lq for GQA): each kv-block of K and V is read
    from memory once per task and reused from L1 by every row. A kv_cache spec reads its
    cache in place (declare_decode_args)."""
    D, RB, BK = spec.head_dim, block_rows, block_k
    VL = LANES if D % LANES == 0 else 1  # head dims that are not multiples of 16: scalar lanes
    shape = Shape.fresh()
    B, H, HK, LQ, LK = shape.batch, shape.heads, shape.heads_k, shape.seqlen_q, shape.seqlen_k
    S = tirx.Var("splits", "int64")
    cached = spec.kv_cache

    def declare():
        """(Q, K, V, O, LSE, scale, pipeline, CacheArgs or None)"""
        if cached:
            q, k, v, cache, o, lse, scale, score = declare_decode_args(spec, shape, S)
            return q, k, v, o, lse, scale, score, cache
        return (*declare_forward_args(spec, shape, S), None)

    def keys_of(buf, cache, b, hk):
        """The region of K or V the task of (b, hk) may read."""
        if cache is None:
            return buf[b, hk, 0:LK, 0:D]
        return buf[0:cache.num_pages, 0:cache.page_size, hk, 0:D]

    def sequence(score, cache, b):
        """(the pipeline in batch entry b's coordinates, the first key's position)"""
        if cache is None:
            return score, tirx.const(0, "int64")
        return score.in_sequence(LQ, cache.count(b)), cache.start(b)

    def key(buf, cache, where, b, hk, k0, j, d):
        """Key k0 + j (dense: clamped into the keys; cached: through the block's `where`)."""
        if cache is None:
            return buf[b, hk, tirx.min(k0 + j, LK - 1), d]
        return buf[tirx.Cast("int64", where[j, 0]), tirx.Cast("int64", where[j, 1]), hk, d]

    @T.prim_func(s_tir=True)
    def fwd():
        T.func_attr({"tirx.noalias": True})
        Q, K, V, O, LSE, scale, score_all, cache = T.meta_var(declare())
        G = T.meta_var(H // HK)
        NRB = T.meta_var((G * LQ + RB - 1) // RB)  # row blocks per kv-head
        for t in T.parallel(B * HK * NRB * S):
            with T.sblock("dec_task"):
                vb = T.axis.spatial(B, t // (HK * NRB * S))
                vhk = T.axis.spatial(HK, t // (NRB * S) % HK)
                vrb = T.axis.spatial(NRB, t // S % NRB)
                vs = T.axis.spatial(S, t % S)
                T.reads(Q[vb, vhk * G:vhk * G + G, 0:LQ, 0:D], keys_of(K, cache, vb, vhk), keys_of(V, cache, vb, vhk))
                T.writes(O[vb, vhk * G:vhk * G + G, vs, 0:LQ, 0:D], LSE[vb, vhk * G:vhk * G + G, vs, 0:LQ])
                qs = T.sblock_alloc_buffer((RB, D), F32)
                acc = T.sblock_alloc_buffer((RB, D), F32)
                part = T.sblock_alloc_buffer((VL,), F32)
                s = T.sblock_alloc_buffer((BK,), F32)
                st = T.sblock_alloc_buffer((RB, 4), F32)  # per row: m, l, block max, block sum
                # cached: each key's (page, row) in this block, clamped into the sequence (keys
                # outside it get p = 0, but 0 * a NaN from unwritten cache memory is NaN)
                where = T.sblock_alloc_buffer((BK if cached else 1, 2), "int32")
                score, first_key = T.meta_var(sequence(score_all, cache, vb))
                row = T.meta_var(lambda r: vrb * RB + r)  # of the kv-head's G * Lq rows
                head, qi = T.meta_var((lambda r: vhk * G + row(r) // LQ, lambda r: row(r) % LQ))
                lo, hi = T.meta_var(score.kv_range(T.int64(0), LQ))  # every row's keys
                kb_first = T.meta_var((first_key + lo) // BK)  # blocks aligned to cache positions
                kb_end = T.meta_var(T.max((first_key + hi + BK - 1) // BK, kb_first))
                per_split = T.meta_var((kb_end - kb_first + S - 1) // S)
                kb_lo = T.meta_var(T.min(kb_first + vs * per_split, kb_end))
                kb_hi = T.meta_var(T.min(kb_lo + per_split, kb_end))
                for r in T.serial(RB):
                    if row(r) < G * LQ:
                        for d in T.vectorized(D):
                            qs[r, d] = T.Cast(F32, Q[vb, head(r), qi(r), d]) * scale
                            acc[r, d] = T.float32(0)
                        st[r, 0] = T.min_value(F32)
                        st[r, 1] = T.float32(0)
                for kb in T.serial(kb_lo, kb_hi):
                    k0 = T.meta_var(kb * BK)
                    if cached:
                        for j in T.serial(BK):
                            pos = T.meta_var(T.min(T.max(k0 + j, first_key), first_key + T.max(hi, 1) - 1))
                            where[j, 0] = cache.page(vb, pos)
                            where[j, 1] = cache.row(pos)
                    for r in T.serial(RB):
                        if row(r) < G * LQ:
                            for j in T.serial(BK):  # scores of the block's keys
                                for c in T.vectorized(VL):
                                    part[c] = T.float32(0)
                                for dc in T.serial(D // VL):
                                    for c in T.vectorized(VL):
                                        part[c] = part[c] + qs[r, dc * VL + c] * T.Cast(
                                            F32, key(K, cache, where, vb, vhk, k0, j, dc * VL + c))
                                s[j] = T.float32(0)
                                for c in T.serial(VL):
                                    s[j] = s[j] + part[c]
                                s[j] = score(s[j], ScoreIndex(vb, head(r), qi(r), k0 + j - first_key))  # -inf if masked
                            st[r, 2] = T.min_value(F32)
                            for j in T.serial(BK):
                                st[r, 2] = T.max(st[r, 2], s[j])
                            # online softmax: rescale O by exp(m_old - m_new)
                            for d in T.vectorized(D):
                                acc[r, d] = acc[r, d] * fast_exp(st[r, 0] - T.max(st[r, 0], st[r, 2]))
                            st[r, 1] = st[r, 1] * fast_exp(st[r, 0] - T.max(st[r, 0], st[r, 2]))
                            st[r, 0] = T.max(st[r, 0], st[r, 2])
                            for j in T.vectorized(BK):
                                s[j] = fast_exp(s[j] - st[r, 0])
                            st[r, 3] = T.float32(0)
                            for j in T.serial(BK):
                                st[r, 3] = st[r, 3] + s[j]
                            st[r, 1] = st[r, 1] + st[r, 3]
                            for j in T.serial(BK):  # O += p_j V_j (padded keys have p = 0)
                                for d in T.vectorized(D):
                                    acc[r, d] = acc[r, d] + s[j] * T.Cast(F32, key(V, cache, where, vb, vhk, k0, j, d))
                for r in T.serial(RB):
                    if row(r) < G * LQ:
                        LSE[vb, head(r), vs, qi(r)] = T.Select(st[r, 1] == T.float32(0), NEG_INF,
                                                               st[r, 0] + T.log(st[r, 1]))
                        for d in T.vectorized(D):
                            O[vb, head(r), vs, qi(r), d] = T.Select(st[r, 1] == T.float32(0), T.float32(0),
                                                                    acc[r, d] / st[r, 1])

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
                    LSE[vb, vh, vi] = T.Select(l[0] == T.float32(0), NEG_INF, m[0] + T.log(l[0]))
                for d in T.serial(D):
                    with T.sblock("combine_out"):
                        vd = T.axis.remap("S", [d])
                        O[vb, vh, vi, vd] = T.Cast(dt, T.Select(l[0] == T.float32(0), T.float32(0), acc[vd] / l[0]))

    return combine.with_attr("global_symbol", "forward_combine")
