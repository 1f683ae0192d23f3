"""Flash-attention dK / dV (and atomic dQ) for Hopper (sm_90a) on warpgroup GEMMs (`wgmma`).

Computes what `cuda_backward.dkdv_kernel` computes; the prep, dQ-convert and deterministic dQ
kernels stay those of `cuda_backward.py`. Head dims 64 and 128 take this kernel on sm_90a.

Mapping: one CTA per (kv-block of 64 * warpgroups keys, batch * kv-head); each warpgroup owns
64 keys. K and V stay in shared memory while the q-blocks (64 or 128 queries) of every query
head of the GQA group stream past (Q, dO and the row stats in a ring of three slots filled by
`cp.async`, in wgmma's swizzled layout, see `cuda_wgmma`: step j + 2 loads while step j runs,
so one CTA barrier a step suffices). Per q-block, with keys as the M dimension:
    S^T = K Q^T, dP^T = V dO^T     two smem x smem wgmma, in flight together (with 128-query
                                   blocks dP^T follows P^T in S^T's registers, and dS^T uses
                                   P^T in 16 bits: the registers would not hold both)
    P^T = exp2(S^T scale log2e - lse2)              registers (as the A operand of:)
    dV += P^T dO                   register-A wgmma, overlapping the dS^T computation
    dS^T = P^T (dP^T - delta)      registers, then dK += dS^T Q (register-A wgmma)
    dQ += dS K                     dS^T goes to shared memory; each warpgroup computes
                                   D / warpgroups columns of dQ over all the CTA's keys and adds
                                   them to the fp32 accumulator, staged in shared memory, with
                                   one bulk reduction (`cp.reduce.async.bulk .add.f32`) a step:
                                   the accumulator keeps a warpgroup's columns apart (row-major
                                   per column block, `dq_acc_layout`), so its rows are one run.
                                   (Bulk operations issued by many threads of a warp run one
                                   thread at a time: a reduction per row cost ~10% of the time.)
                                   A warpgroup writes the next dS^T once the other's dQ product
                                   has read this one (a named barrier, not a CTA barrier).
A flex block mask's empty tiles are skipped without a step of their own: each warp tests the
next 32 steps' tiles in the block map at once (a ballot) to find the next live step, and the
mask_mod is evaluated only on its partial tiles.

Knobs (`default_knobs`; tuned values in tuning_logs/cuda/ (tvmflash.tuning)):
    bwd_wgmma             1: this kernel where `supports` says so; 0: the mma.sync kernel
    bwd_wgmma_warpgroups  warpgroups per CTA (keys per CTA = 64 * warpgroups)
    bwd_wgmma_block_m     queries per streamed q-block (64 or 128; 128 halves the per-step
                          overhead at small head dims, S^T and dP^T take twice the registers)
    bwd_cta_order_l2_mb   MiB of Q / dO the CTAs in flight may share (`grid_position`)
"""
from __future__ import annotations

import math

from tvm import tirx
from tvm.script import tirx as T

from tvmflash.kernels.common import F32, LOG2E, Shape
from tvmflash.kernels.dropout import check_dropout_blocks
from tvmflash.kernels.score_mods import TileAt, grad_from_output, unit_grad
from tvmflash.spec import AttentionSpec

from .cuda_backward import DqAccLayout, _check, _declare
from .cuda_mma import (SHARED_LIMIT, QStepWalk, SequenceTiles, advance, batch_and_head, copy_row_stats, cta_position,
                       dropout_cols_t, dropped_ds, locate_tile, thread_row_stats, transposed_probabilities)
from .cuda_wgmma import (ATOM_BYTES, copy_rows_sw128, encode_desc, fence_registers, gemm_rs_mnmajor,
                         gemm_ss_kmajor, gemm_ss_mnmajor, wgmma_op)

DEFAULTS = {"bwd_wgmma": 1, "bwd_wgmma_warpgroups": 2, "bwd_wgmma_block_m": 64, "bwd_cta_order_l2_mb": 8}


def supports(spec: AttentionSpec, arch: str) -> bool:
    """sm_90a, head dims 64 and 128, modifiers whose gradient is 1 or follows from the modified
    score (softcap alone; a factor per score would not fit this kernel's registers, so it is
    recomputed from P and lse)."""
    return arch == "sm_90a" and spec.head_dim in (64, 128) and grad_from_output(spec.modifiers())


def default_knobs(spec: AttentionSpec) -> dict:
    # 128-query blocks fit the registers (without spills) only at D = 64, where they pay most;
    # dropout keeps P and P Z apart, which 128-query blocks' shared registers cannot
    wide = spec.head_dim <= 64 and "dropout" not in spec.variants
    return {**DEFAULTS, "bwd_wgmma_block_m": 128 if wide else 64}


def dq_acc_layout(spec: AttentionSpec, knobs: dict) -> DqAccLayout:
    """The dQ accumulator's layout: a column block per warpgroup, swizzled (see DqAccLayout)."""
    return DqAccLayout(spec.head_dim, knobs["bwd_wgmma_warpgroups"], swizzle=True)


def _fast_log2(x):
    """log2 as one MUFU instruction (__log2f; absolute error ~2^-22)."""
    return tirx.call_pure_extern(F32, "__log2f", x)


def dkdv_kernel_wgmma(spec: AttentionSpec, knobs: dict, with_dq: bool) -> tirx.PrimFunc:
    _check(spec)
    check_dropout_blocks(spec, knobs["bwd_wgmma_block_m"], 64 * knobs["bwd_wgmma_warpgroups"])
    assert grad_from_output(spec.modifiers()), "this gradient needs the mma backward (supports())"
    D, dt = spec.head_dim, spec.dtype
    NWG, BM = knobs["bwd_wgmma_warpgroups"], knobs["bwd_wgmma_block_m"]
    if D % 64 or NWG not in (1, 2) or D % (8 * NWG) or BM not in (64, 128):
        raise ValueError(f"the wgmma backward needs head_dim % 64 == 0, 1 or 2 warpgroups and block_m 64 or 128, "
                         f"got {spec}, {knobs}")
    MT = BM // 64          # 64-query m-tiles of the dQ product
    sparse = spec.block_sparse
    # 128 queries: registers are short, so dP^T reuses S^T's (computed after P^T, not alongside
    # S^T) and dS^T P^T's (after dV += P^T dO), from P^T in 16 bits
    LOW_REG = BM > 64
    # softcap's factor 1 - tanh^2 (not 1: the other modifiers) folded into the fp32 P^T that dS
    # reads, where P^T keeps its own registers (not LOW_REG) and no dropout sign: with LOW_REG
    # dS recomputes it from P^T in 16 bits, a log2 a score (a third MUFU op besides tanh, exp2)
    FACTORED = not LOW_REG and "dropout" not in spec.variants and not unit_grad(spec.modifiers())
    if LOW_REG and "dropout" in spec.variants:
        raise ValueError(f"dropout needs bwd_wgmma_block_m 64 (P and P Z in separate registers), got {knobs}")
    BN = 64 * NWG
    NT = 128 * NWG
    NQ8 = BM // 8          # n8 tiles of a warpgroup's S^T (64 keys x BM queries)
    ND = D // 8            # n8 tiles of dK / dV
    DQN = D // NWG         # dQ columns of one warpgroup
    dq_layout = dq_acc_layout(spec, knobs)
    OP_S, OP_KV, OP_DQ = wgmma_op(dt, BM), wgmma_op(dt, D), wgmma_op(dt, DQN)
    # pool (elements): K | V | Q slots | dO slots | dS^T; a ring of SLOTS q-blocks: step j + 2
    # loads while j runs and j + 1's S^T is in flight
    SLOTS = 3
    K_OFF, V_OFF = 0, BN * D
    Q_OFF = 2 * BN * D
    DO_OFF = Q_OFF + SLOTS * BM * D
    DS_OFF = DO_OFF + SLOTS * BM * D
    POOL = DS_OFF + BN * BM  # dS^T: MT column blocks of BN keys x 64 queries
    STATS = (SLOTS, 2, BM)  # fp32 row stats a slot: [lse2 | delta][q]
    STAGE = (NWG, BM * DQN)  # fp32 dQ staging a warpgroup
    # the pool, the row stats and the dQ staging: refused here, where the launch would fail to
    # reserve them ("Failed to set the allowed dynamic shared memory size")
    need = POOL * 2 + (math.prod(STATS) + math.prod(STAGE)) * 4
    if need > SHARED_LIMIT:
        raise ValueError(f"the wgmma backward's tiles need {need} bytes of shared memory at head dim {D} with "
                         f"bwd_wgmma_block_m {BM} and {NWG} warpgroups, more than the {SHARED_LIMIT} an SM "
                         f"gives a CTA")

    shape = Shape.fresh()
    B, H, HK, LQ, LK = shape.batch, shape.heads, shape.heads_k, shape.seqlen_q, shape.seqlen_k

    def declare():
        outs = [("dk", HK, LK, dt), ("dv", HK, LK, dt)] + ([("dq_acc", H, LQ, F32)] if with_dq else [])
        q, k, v, do, lse2, delta, (dk, dv, *dq_acc), scale, score = _declare(spec, shape, outs)
        return q, k, v, do, lse2, delta, dk, dv, (dq_acc or [None])[0], scale, score

    @T.prim_func
    def dkdv():
        T.func_attr({"tirx.noalias": True})
        Q, K, V, DO, LSE2, DELTA, DK, DV, DQ_ACC, scale, score = T.meta_var(declare())
        T.device_entry()
        tiles = T.meta_var(SequenceTiles(score, LQ, LK, BN, keys=True))  # packed sequences' own key tiles
        drop = T.meta_var(score.dropout)
        ntiles = T.meta_var(T.Cast("int64", tiles.count))
        cta = T.cta_id([T.Cast("int32", ntiles * B * HK)])
        tid = T.thread_id([NT])
        # this CTA's (key tile, batch x kv-head): under a causal mask the first key tiles see
        # the most queries, and rank r is tile r; a kv-head's CTAs share the Q and dO of its group
        place = T.alloc_local([2], "int64")
        cta_position(place, cta, ntiles, B * HK, 1, tirx.truncdiv(H, HK) * LQ * (4 * D),
                     knobs["bwd_cta_order_l2_mb"] << 20)
        bx = T.meta_var(place[0])
        # batch, kv-head and group size in registers: the loop would redo their divisions
        bhg = T.alloc_local([3], "int64")
        bhg[0] = batch_and_head(place[1], HK)[0]
        bhg[1] = batch_and_head(place[1], HK)[1]
        bhg[2] = tirx.truncdiv(H, HK)
        b, hk, G = T.meta_var((bhg[0], bhg[1], bhg[2]))
        lane = T.meta_var(tid % 32)
        wg = T.meta_var(tid // 128)
        seq = T.alloc_local([tiles.registers()], "int64")
        locate_tile(tiles, seq, bx)
        # where the tile lies: scores see (bs, queries and keys from 0 (q0, k0), the sequence's
        # lengths lq, lk, tscore); the tensors' rows start at q_start + q0 and k_start + k0
        bs, q_start, k_start, k0, lq, lk, tscore = T.meta_var(tiles.where(seq, bx, b))
        kr = T.meta_var(tid // 32 * 16)            # this warp's key rows in the tile
        pool = T.alloc_buffer((POOL,), dt, scope="shared.dyn", align=ATOM_BYTES)
        stats = T.alloc_buffer(STATS, F32, scope="shared", align=16)  # [slot][lse2|delta][q]
        # dQ staging per warpgroup, in the accumulator's (swizzled) order: one bulk reduction a step
        stage = T.alloc_buffer(STAGE, F32, scope="shared", align=128)
        desc_kmaj = T.alloc_local([1], "uint64")   # K-major operands (K, V as A; Q, dO as B)
        desc_q_mn = T.alloc_local([1], "uint64")   # MN-major BM-row tiles (Q, dO as B; dS^T as A)
        desc_k_mn = T.alloc_local([1], "uint64")   # MN-major BN-row tiles (K as B of dQ)
        s = T.alloc_local([NQ8 * 4], F32)
        dp_own = T.alloc_local([1 if LOW_REG else max(NQ8 * 4, MT * DQN // 2)], F32)
        dp = T.meta_var(s if LOW_REG else dp_own)  # dP^T, then (not LOW_REG) the dQ accumulator
        # (LOW_REG: the dQ tile in S^T's registers made ptxas serialize every wgmma)
        dq_own = T.alloc_local([MT * DQN // 2 if LOW_REG else 1], F32)
        dq = T.meta_var(dq_own if LOW_REG else dp)
        p = T.alloc_local([NQ8 * 4], dt)
        ds_own = T.alloc_local([1 if LOW_REG else NQ8 * 4], dt)
        ds = T.meta_var(p if LOW_REG else ds_own)
        dk = T.alloc_local([ND * 4], F32)
        # lse2, then delta, of this thread's query columns, read ahead of the wgmma waits (LOW_REG:
        # no registers to spare, read where used)
        row_stat = T.alloc_local([1 if LOW_REG else NQ8 * 2], F32)
        dv = T.alloc_local([ND * 4], F32)
        pw = p.view("uint32")
        dsw = ds.view("uint32")
        pool_w = pool.view("uint32")
        walk = T.meta_var(QStepWalk(tscore, k0, T.min(k0 + BN, lk), BM, hk, G))
        steps = T.alloc_local([1], "int64")
        steps[0] = T.Select(k0 < lk, walk.count, T.int64(0))  # a packed tile may have no rows
        NJ = T.meta_var(steps[0])
        cur = T.alloc_local([2], "int64")  # this step and the next two
        nxt = T.alloc_local([2], "int64")
        nxt2 = T.alloc_local([2], "int64")
        at = T.meta_var(lambda st: TileAt(bs, walk.head(st), (BM, BN)))
        seek_pos = T.alloc_local([1], "int32")
        seek_hits = T.alloc_local([1], "uint32")
        live_steps = T.alloc_local([1], "int64")  # steps run (which slot is whose)

        @T.inline
        def seek(st):
            # st -> the first step at or after it whose tile the block mask keeps (st[0] >= G:
            # none). The step itself first (usually kept); past it, 32 steps a round, one per
            # lane (ballot), the same in every warp
            steps = T.meta_var(T.Cast("int32", NJ))
            per_head = T.meta_var(T.Cast("int32", walk.per_head))
            seek_pos[0] = T.Cast("int32", st[0]) * per_head + T.Cast("int32", st[1])
            clamped = T.meta_var((T.min(st[0], G - 1), st[1]))
            if T.And(seek_pos[0] < steps, tirx.Not(tscore.tile_live(walk.q0(clamped), k0, at(clamped)))):
                seek_pos[0] = seek_pos[0] + 1
                seek_hits[0] = T.uint32(0)
                while T.And(seek_hits[0] == T.uint32(0), seek_pos[0] < steps):
                    cand = T.meta_var(T.min(seek_pos[0] + lane, steps - 1))
                    cand_step = T.meta_var((T.Cast("int64", cand // per_head), T.Cast("int64", cand % per_head)))
                    live = T.meta_var(tscore.tile_live(walk.q0(cand_step), k0, at(cand_step)))
                    seek_hits[0] = tirx.call_extern("uint32", "__ballot_sync", T.uint32(0xFFFFFFFF),
                                                    T.And(seek_pos[0] + lane < steps, live))
                    if seek_hits[0] == T.uint32(0):
                        seek_pos[0] = seek_pos[0] + 32
                    else:
                        seek_pos[0] = seek_pos[0] + tirx.call_pure_extern(
                            "int32", "__ffs", T.Cast("int32", seek_hits[0])) - 1
                st[0] = T.Cast("int64", seek_pos[0] // T.max(per_head, 1))
                st[1] = T.Cast("int64", seek_pos[0] % T.max(per_head, 1))
            if seek_pos[0] >= steps:  # past the walk (also where a band leaves the key tile no query)
                st[0] = T.int64(G)

        @T.inline
        def load_step(st, slot):
            h = T.meta_var(walk.head(st))
            q0 = T.meta_var(walk.q0(st))
            copy_rows_sw128(pool, Q_OFF + slot * BM * D, Q, b, h, q_start + q0, BM, q_start + lq, D, tid, NT)
            copy_rows_sw128(pool, DO_OFF + slot * BM * D, DO, b, h, q_start + q0, BM, q_start + lq, D, tid, NT)
            copy_row_stats(stats, slot, LSE2, DELTA, b, h, q_start + q0, BM, q_start + lq, tid, NT)

        @T.inline
        def find_after(st, after):
            # after -> the step after st (the next one the block mask keeps)
            advance(walk, st, after)
            if sparse:
                seek(after)

        @T.inline
        def issue_s(slot):  # S^T = K Q^T
            T.ptx.wgmma.fence.sync.aligned()
            gemm_ss_kmajor(OP_S, s, NQ8 * 4, desc_kmaj, K_OFF + wg * 64 * 64, BN, Q_OFF + slot * BM * D, BM, D)
            T.ptx.wgmma.commit_group.sync.aligned()

        @T.inline
        def issue_dp(slot):  # dP^T = V dO^T
            T.ptx.wgmma.fence.sync.aligned()
            gemm_ss_kmajor(OP_S, dp, NQ8 * 4, desc_kmaj, V_OFF + wg * 64 * 64, BN, DO_OFF + slot * BM * D, BM, D)
            T.ptx.wgmma.commit_group.sync.aligned()

        @T.inline
        def dst_read():
            # this warpgroup is done reading dS^T (named barrier 3 + wg; the other warpgroup
            # waits on it before writing the next dS^T; one arrival per step with a next step)
            T.ptx["bar.arrive"](T.Cast("uint32", 3 + wg), T.uint32(NT))

        # whether step `st` (the j-th) exists: a block mask's walk ends past the last head
        exists = T.meta_var(lambda st, j: (st[0] < G) if sparse else (j < NJ))
        cur[0] = T.int64(0)
        cur[1] = T.int64(0)
        if sparse:
            seek(cur)
        if exists(cur, 0):
            copy_rows_sw128(pool, K_OFF, K, b, hk, k_start + k0, BN, k_start + lk, D, tid, NT)
            copy_rows_sw128(pool, V_OFF, V, b, hk, k_start + k0, BN, k_start + lk, D, tid, NT)
            load_step(cur, 0)
        T.ptx["cp.async.commit_group"]()
        find_after(cur, nxt)
        if exists(nxt, 1):
            load_step(nxt, 1)
        T.ptx["cp.async.commit_group"]()
        encode_desc(desc_kmaj, pool, 16, ATOM_BYTES)
        encode_desc(desc_q_mn, pool, BM * 128, ATOM_BYTES)
        encode_desc(desc_k_mn, pool, BN * 128, ATOM_BYTES)
        for i in T.unroll(ND * 4):
            dk[i] = T.float32(0)
            dv[i] = T.float32(0)
        T.ptx["cp.async.wait_group"](1)
        # cp.async wrote through the generic proxy; wgmma reads through the async one
        T.ptx.fence.proxy.async_.shared__cta()
        T.cuda.cta_sync()
        if with_dq and NWG > 1:
            if exists(cur, 0):
                dst_read()  # dS^T is free for step 0

        @T.inline
        def step(j):
            # step j's q-block is in its slot; step j + 1's has been loading since step j - 1
            # (wgmma products are issued and waited for within a step: ptxas serializes every
            # wgmma of a kernel where one is in flight across the loop's back edge)
            slot = T.meta_var(j % SLOTS)
            h = T.meta_var(walk.head(cur))
            q0 = T.meta_var(walk.q0(cur))
            q_tile = T.meta_var(Q_OFF + slot * BM * D)
            do_tile = T.meta_var(DO_OFF + slot * BM * D)
            issue_s(slot)
            if not LOW_REG:
                issue_dp(slot)
                thread_row_stats(row_stat, stats, slot, 0, NQ8, lane)
            T.ptx.wgmma.wait_group.sync.aligned(0 if LOW_REG else 1)
            fence_registers(s, NQ8 * 4)
            if tscore.tile_unmasked(q0, q0 + BM, k0, k0 + BN, at(cur)):
                transposed_probabilities(s, p, stats, slot, NQ8, tscore, scale, bs, h, q0, k0 + kr, lane, False,
                                         lse2=None if LOW_REG else row_stat, factored=FACTORED)
            else:
                transposed_probabilities(s, p, stats, slot, NQ8, tscore, scale, bs, h, q0, k0 + kr, lane, True,
                                         lse2=None if LOW_REG else row_stat, factored=FACTORED)
            if drop is not None:  # dV takes P Z; s keeps P with Z in its sign
                dropout_cols_t(s, p, drop, NQ8, b, h, q0, k0 + kr, lane)
            # dV += P^T dO
            fence_registers(pw, NQ8 * 2)
            T.ptx.wgmma.fence.sync.aligned()
            gemm_rs_mnmajor(OP_KV, dv, ND * 4, pw, 0, desc_q_mn, do_tile, BM)
            T.ptx.wgmma.commit_group.sync.aligned()
            if LOW_REG:
                issue_dp(slot)
            else:
                thread_row_stats(row_stat, stats, slot, 1, NQ8, lane)
            T.ptx.wgmma.wait_group.sync.aligned(0 if LOW_REG else 1)
            fence_registers(dp, NQ8 * 4)
            # dS^T = P^T (dP^T - delta); dK += dS^T Q (x scale at the end)
            for nt in T.unroll(NQ8):
                for i in T.unroll(4):
                    idx = T.meta_var(nt * 4 + i)
                    prob = T.meta_var(T.Cast(F32, p[idx]) if LOW_REG else s[idx])
                    qc = T.meta_var(nt * 8 + lane % 4 * 2 + i % 2)
                    delta = T.meta_var(stats[slot, 1, qc] if LOW_REG else row_stat[nt * 2 + i % 2])
                    grad = T.meta_var(dropped_ds(drop, prob, dp[idx], delta))
                    if score.unit_grad or FACTORED:
                        ds[idx] = T.Cast(dt, grad)
                    else:  # softcap: its factor from the capped score, log2(P) + lse2 (in log2 units)
                        capped = T.meta_var((_fast_log2(T.abs(prob)) + stats[slot, 0, qc]) * T.float32(1 / LOG2E))
                        ds[idx] = T.Cast(dt, T.Select(prob != T.float32(0), grad * score.grad_of_output(capped),
                                                      T.float32(0)))
            if with_dq:
                # dS^T to shared memory (one swizzled column block, keys as rows) for dQ, once
                # the other warpgroup's dQ product of the step before has read it; before the
                # dK product reads the same registers asynchronously
                if NWG > 1:
                    T.ptx["bar.sync"](T.Cast("uint32", 4 - wg), T.uint32(NT))  # the other's dst_read
                for nt in T.unroll(NQ8):
                    for hh in T.unroll(2):
                        key = T.meta_var(kr + lane // 4 + hh * 8)
                        pool_w[(DS_OFF + nt // 8 * (BN * 64) + key * 64 + T.bitwise_xor(nt % 8, key % 8) * 8
                                + lane % 4 * 2) // 2] = dsw[nt * 2 + hh]
            fence_registers(dsw, NQ8 * 2)
            T.ptx.wgmma.fence.sync.aligned()
            gemm_rs_mnmajor(OP_KV, dk, ND * 4, dsw, 0, desc_q_mn, q_tile, BM)
            T.ptx.wgmma.commit_group.sync.aligned()
            # one CTA barrier a step: step j + 1's q-block has landed (and is visible to wgmma),
            # dS^T is written, and every warpgroup is done with step j - 1's slot
            T.ptx["cp.async.wait_group"](0)
            if with_dq:
                if tid % 128 == 0:  # the previous step's reduction has read the staging tile
                    T.ptx["cp.async.bulk.wait_group.read"](0)
            T.ptx.fence.proxy.async_.shared__cta()
            T.cuda.cta_sync()
            find_after(nxt, nxt2)
            if exists(nxt2, j + 2):
                load_step(nxt2, (j + 2) % SLOTS)
            T.ptx["cp.async.commit_group"]()
            if with_dq:
                # dQ = dS K over the CTA's keys, this warpgroup's DQN columns
                T.ptx.wgmma.fence.sync.aligned()
                for mt in T.unroll(MT):
                    gemm_ss_mnmajor(OP_DQ, dq, mt * DQN // 2, DQN // 2, desc_q_mn, DS_OFF + mt * BN * 64, desc_k_mn,
                                    K_OFF + wg * DQN // 64 * (BN * 64) + wg * DQN % 64, BN)
                T.ptx.wgmma.commit_group.sync.aligned()
            T.ptx.wgmma.wait_group.sync.aligned(0)
            if with_dq:
                fence_registers(dq, MT * DQN // 2)
                if NWG > 1:
                    if exists(nxt, j + 1):
                        dst_read()
                # the dQ tile goes through shared memory and is added to the accumulator by one
                # bulk reduction (far fewer L2 operations than per-thread atomics); the rows of
                # this warpgroup's column block are one run there
                for mt in T.unroll(MT):
                    for nt in T.unroll(DQN // 8):
                        for hh in T.unroll(2):
                            for e in T.unroll(2):
                                r = T.meta_var(mt * 64 + (tid % 128) // 32 * 16 + lane // 4 + hh * 8)
                                # row q_start + q0 + r is q_start + lane // 4 mod 4 (q0, r - lane // 4: multiples of 8)
                                unit = T.meta_var(dq_layout.unit(q_start + lane // 4, nt))
                                stage[wg, r * DQN + unit * 8 + lane % 4 * 2 + e] = dq[(mt * DQN // 8 + nt) * 4 + hh * 2 + e]
                T.ptx.fence.proxy.async_.shared__cta()
                T.ptx["bar.sync"](T.Cast("uint32", 1 + wg), T.uint32(128))  # this warpgroup only
                if tid % 128 == 0:
                    T.ptx["cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32"](
                        DQ_ACC.ptr_to([b, h] + dq_layout.row_start(LQ, wg, q_start + q0)), stage.ptr_to([wg, 0]),
                        T.Cast("uint32", T.min(lq - q0, BM) * (DQN * 4)))
                    T.ptx["cp.async.bulk.commit_group"]()
            fence_registers(dk, ND * 4)
            fence_registers(dv, ND * 4)
            cur[0] = nxt[0]
            cur[1] = nxt[1]
            nxt[0] = nxt2[0]
            nxt[1] = nxt2[1]

        if sparse:
            live_steps[0] = T.int64(0)
            while cur[0] < G:
                step(live_steps[0])
                live_steps[0] = live_steps[0] + T.int64(1)
        else:
            for j in T.serial(NJ):
                step(j)
        if with_dq:
            if tid % 128 == 0:
                T.ptx["cp.async.bulk.wait_group"](0)
        for dd in T.unroll(ND):
            for hh in T.unroll(2):
                key = T.meta_var(k0 + kr + lane // 4 + hh * 8)
                if key < lk:
                    for e in T.vectorized(2):
                        DK[b, hk, k_start + key, dd * 8 + lane % 4 * 2 + e] = T.Cast(
                            dt, dk[dd * 4 + hh * 2 + e] * scale)
                        DV[b, hk, k_start + key, dd * 8 + lane % 4 * 2 + e] = T.Cast(dt, dv[dd * 4 + hh * 2 + e])

    return dkdv.with_attr("global_symbol", "backward_dkdv_dq" if with_dq else "backward_dkdv")
