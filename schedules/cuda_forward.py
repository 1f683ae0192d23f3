"""Flash-attention forward for CUDA tensor cores (sm_80 .. sm_90a), as a TIRx native kernel.

The s_tir route cannot carry the online softmax between two tensor-core GEMMs on register
fragments (see the GPU cookbook), so the CUDA mapping is written by hand, like CUDA, and
generated from the spec plus the knobs below. What is computed is the same as
`tvmflash/kernels/forward.py`: the score modifiers (causal, masks, later variants) are the
shared target-independent functions of `tvmflash/kernels/score_mods.py`.

Mapping: one CTA per (q-block of BM rows, batch * head); one warp per 16 query rows.
K/V tiles of BN rows are double-buffered in shared memory through `cp.async` (rows padded by
8 elements so `ldmatrix` is conflict-free); S = Q K^T and O += P V run on
`mma.sync.m16n8k16` with fp32 accumulators; the online softmax runs in registers in the exp2
domain; P is reused as the A fragment of the PV product straight from registers.

Knobs (`DEFAULTS`, tuned values in tuning_logs/cuda/knobs.json):
    block_m        query rows per CTA (16 per warp)
    block_n        key rows per K/V tile
    q_in_registers keep Q's mma fragments in registers for the whole CTA (large head dims
                   reload them from shared memory instead, to stay clear of spills)
"""
from __future__ import annotations

import math

from tvm import tirx
from tvm.script import tirx as T

from tvmflash.kernels.common import F32, NEG_INF, Shape
from tvmflash.kernels.forward import declare_forward_args
from tvmflash.kernels.score_mods import ScoreIndex
from tvmflash.spec import AttentionSpec

DEFAULTS = {"block_m": 128, "block_n": 64, "q_in_registers": 1}

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
PAD = 8  # elements of padding per shared-memory row


def default_knobs(spec: AttentionSpec) -> dict:
    knobs = dict(DEFAULTS)
    if spec.head_dim > 128:
        knobs.update(block_m=64, block_n=32, q_in_registers=0)
    return knobs


def forward_kernel_cuda(spec: AttentionSpec, knobs: dict) -> tirx.PrimFunc:
    D, dt = spec.head_dim, spec.dtype
    BM, BN = knobs["block_m"], knobs["block_n"]
    q_regs = bool(knobs["q_in_registers"])
    if D % 16 or dt not in ("float16", "bfloat16"):
        raise ValueError(f"the CUDA forward needs fp16/bf16 and head_dim % 16 == 0, got {spec}")
    NW = BM // 16          # warps: 16 query rows each
    NT = NW * 32
    CH = D // 8            # 16-byte chunks per row
    NS = BN // 8           # n8 tiles of S per warp
    ND = D // 8            # n8 tiles of O per warp
    ROWS = BM + 4 * BN     # shared pool rows: Q | K0 K1 | V0 V1
    smem_bytes = ROWS * (D + PAD) * 2
    SCOPE = "shared" if smem_bytes <= 48 * 1024 else "shared.dyn"
    MMA = ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" if dt == "float16"
           else "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32")
    LDM = "ldmatrix.sync.aligned.m8n8.x4.shared.b16"
    LDM_T = "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16"

    shape = Shape.fresh()
    B, H, HK, LQ, LK = shape.batch, shape.heads, shape.heads_k, shape.seqlen_q, shape.seqlen_k

    @T.prim_func
    def fwd():
        T.func_attr({"tirx.noalias": True})
        Q, K, V, O, LSE, scale, score = T.meta_var(declare_forward_args(spec, shape))
        T.device_entry()
        bx, bh = T.cta_id([T.Cast("int32", (LQ + BM - 1) // BM), T.Cast("int32", B * H)])
        tid = T.thread_id([NT])
        b = T.meta_var(T.Cast("int64", bh) // H)
        h = T.meta_var(T.Cast("int64", bh) % H)
        hk = T.meta_var(h // (H // HK))
        warp = T.meta_var(tid // 32)
        lane = T.meta_var(tid % 32)
        q0 = T.meta_var(T.Cast("int64", bx) * BM)
        pool = T.alloc_buffer((ROWS, D + PAD), dt, scope=SCOPE, align=128)
        qf = T.alloc_local([D // 16 * 4 if q_regs else 4], "uint32")
        kb = T.alloc_local([4], "uint32")
        vb = T.alloc_local([4], "uint32")
        s = T.alloc_local([NS * 4], F32)
        p = T.alloc_local([NS * 4], dt)
        o = T.alloc_local([ND * 4], F32)
        m = T.alloc_local([2], F32)       # running max (log2 units), rows g and g + 8
        l = T.alloc_local([2], F32)       # running partial sum of this lane's columns
        mx = T.alloc_local([1], F32)
        alpha = T.alloc_local([1], F32)
        pw = p.view("uint32")
        scale_log2 = T.meta_var(scale * T.float32(LOG2E))
        kb_lo, kb_hi = T.meta_var(score.kv_blocks(q0, T.min(q0 + BM, LQ), BN))

        @T.inline
        def copy_rows(pool_row0, src, head, row0, nrows, limit):
            # nrows x D from src[b, head, row0:, :] into the pool; rows past `limit` are
            # zero-filled (src-size 0) with the source address clamped in bounds
            for it in T.unroll(nrows * CH // NT):
                c = T.meta_var(tid + it * NT)
                r = T.meta_var(c // CH)
                cc = T.meta_var(c % CH * 8)
                row = T.meta_var(row0 + r)
                T.ptx["cp.async.cg.shared.global"](
                    pool.ptr_to([pool_row0 + r, cc]), src.ptr_to([b, head, T.min(row, limit - 1), cc]),
                    16, T.Select(row < limit, T.uint32(16), T.uint32(0)))

        @T.inline
        def load_q_fragment(kk, dst):
            T.ptx[LDM](qf[dst], qf[dst + 1], qf[dst + 2], qf[dst + 3],
                       pool.ptr_to([warp * 16 + lane % 16, kk * 16 + lane // 16 * 8]))

        @T.inline
        def softmax_step(k0, masked):
            # lane holds rows g = lane/4 and g + 8 and columns 2*(lane%4) (+1) of each n8
            # tile; the 4 lanes of a quad share a row. Scores go to the exp2 domain.
            for hh in T.unroll(2):
                mx[0] = m[hh]
                for nt in T.unroll(NS):
                    for e in T.unroll(2):
                        idx = T.meta_var(nt * 4 + hh * 2 + e)
                        ix = T.meta_var(ScoreIndex(b, h, q0 + warp * 16 + lane // 4 + hh * 8,
                                                   k0 + nt * 8 + lane % 4 * 2 + e))
                        if masked or score.changes_values:
                            s[idx] = score(s[idx] * scale, ix, masked) * T.float32(LOG2E)
                        else:
                            s[idx] = s[idx] * scale_log2
                        mx[0] = T.max(mx[0], s[idx])
                mx[0] = T.cuda.warp_max(mx[0], width=4)
                alpha[0] = T.exp2(m[hh] - mx[0])
                m[hh] = mx[0]
                l[hh] = l[hh] * alpha[0]
                for nt in T.unroll(NS):
                    for e in T.unroll(2):
                        idx = T.meta_var(nt * 4 + hh * 2 + e)
                        s[idx] = T.exp2(s[idx] - mx[0])
                        l[hh] = l[hh] + s[idx]
                        p[idx] = T.Cast(dt, s[idx])
                for dd in T.unroll(ND):
                    for e in T.unroll(2):
                        o[dd * 4 + hh * 2 + e] = o[dd * 4 + hh * 2 + e] * alpha[0]

        copy_rows(0, Q, h, q0, BM, LQ)
        copy_rows(BM, K, hk, kb_lo * BN, BN, LK)
        copy_rows(BM + 2 * BN, V, hk, kb_lo * BN, BN, LK)
        T.ptx["cp.async.commit_group"]()
        for i in T.unroll(ND * 4):
            o[i] = T.float32(0)
        for i in T.unroll(2):
            m[i] = T.min_value(F32)
            l[i] = T.float32(0)

        for j in T.serial(kb_hi - kb_lo):
            buf = T.meta_var(j % 2)
            k0 = T.meta_var((kb_lo + j) * BN)
            if kb_lo + j + 1 < kb_hi:  # prefetch the next K/V tile into the other buffer
                copy_rows(BM + (1 - buf) * BN, K, hk, k0 + BN, BN, LK)
                copy_rows(BM + 2 * BN + (1 - buf) * BN, V, hk, k0 + BN, BN, LK)
            T.ptx["cp.async.commit_group"]()
            T.ptx["cp.async.wait_group"](1)
            T.cuda.cta_sync()
            if q_regs:
                if j == 0:
                    for kk in T.unroll(D // 16):
                        load_q_fragment(kk, kk * 4)
            # S = Q K^T
            for i in T.unroll(NS * 4):
                s[i] = T.float32(0)
            for kk in T.unroll(D // 16):
                if not q_regs:
                    load_q_fragment(kk, 0)
                for nn in T.unroll(BN // 16):
                    T.ptx[LDM](kb[0], kb[1], kb[2], kb[3], pool.ptr_to(
                        [BM + buf * BN + nn * 16 + lane % 8 + lane // 16 * 8, kk * 16 + lane // 8 % 2 * 8]))
                    for half in T.unroll(2):
                        t = T.meta_var((nn * 2 + half) * 4)
                        a = T.meta_var(kk * 4 if q_regs else 0)
                        T.ptx[MMA](s[t], s[t + 1], s[t + 2], s[t + 3],
                                   qf[a], qf[a + 1], qf[a + 2], qf[a + 3], kb[half * 2], kb[half * 2 + 1],
                                   s[t], s[t + 1], s[t + 2], s[t + 3])
            # online softmax; masks and bounds only on tiles that need them
            if score.tile_unmasked(q0, T.min(q0 + BM, LQ), k0, k0 + BN):
                softmax_step(k0, False)
            else:
                softmax_step(k0, True)
            # O += P V: the f32 S fragments of two n8 tiles, as f16/bf16, are the A fragment
            # of one k16 step; V arrives transposed through ldmatrix.trans
            for kk in T.unroll(BN // 16):
                for dd in T.unroll(D // 16):
                    T.ptx[LDM_T](vb[0], vb[1], vb[2], vb[3], pool.ptr_to(
                        [BM + 2 * BN + buf * BN + kk * 16 + lane % 8 + lane // 8 % 2 * 8, dd * 16 + lane // 16 * 8]))
                    for half in T.unroll(2):
                        t = T.meta_var((dd * 2 + half) * 4)
                        T.ptx[MMA](o[t], o[t + 1], o[t + 2], o[t + 3],
                                   pw[kk * 4], pw[kk * 4 + 1], pw[kk * 4 + 2], pw[kk * 4 + 3],
                                   vb[half * 2], vb[half * 2 + 1], o[t], o[t + 1], o[t + 2], o[t + 3])
            T.cuda.cta_sync()  # this buffer is refilled by the next iteration's prefetch
        for hh in T.unroll(2):
            l[hh] = T.cuda.warp_sum(l[hh], width=4)
            row = T.meta_var(q0 + warp * 16 + lane // 4 + hh * 8)
            if row < LQ:
                for dd in T.unroll(ND):
                    for e in T.unroll(2):
                        O[b, h, row, dd * 8 + lane % 4 * 2 + e] = T.Cast(dt, T.Select(
                            l[hh] > T.float32(0), o[dd * 4 + hh * 2 + e] / l[hh], T.float32(0)))
                if lane % 4 == 0:
                    LSE[b, h, row] = T.Select(l[hh] > T.float32(0),
                                              m[hh] * T.float32(LN2) + T.log(l[hh]), NEG_INF)

    return fwd.with_attr("global_symbol", "forward")
