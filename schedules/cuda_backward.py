"""Flash-attention backward for CUDA tensor cores (sm_80 .. sm_90a), as TIRx native kernels.

What is computed is `tvmflash/kernels/backward.py` (same score modifiers); how it maps to the
GPU is here. Four kernels:

- `backward_prep`: per query row, delta = rowsum(dO * O) and lse2 = lse * log2(e) (+inf where
  lse = -inf, so a query that sees no key gets P = 0); `ROW_THREADS` threads a row, vector loads.
- `backward_dkdv_dq`: one CTA per (kv-block of BN keys, batch * kv-head), one warp per 16 keys.
  K and V stay in shared memory while the q-blocks of every query head of the GQA group stream
  past (Q, dO and the row stats in a ring of buffers filled by `cp.async`). Per q-block each warp
  computes its transposed tiles in registers: S^T = K Q^T, P^T, dV += P^T dO (P^T reused as
  the A fragment), dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += dS^T Q; dS^T then goes
  through shared memory (two buffers) so the warps share out dQ += dS K one step later, after
  the next step's barrier, added to an fp32 accumulator with `red.global.add.v2.f32` (atomics:
  the order of additions varies between runs). With a 3-stage Q/dO ring that leaves one CTA
  barrier per q-block.
- `backward_dq_convert`: dQ = scale * accumulator, cast.
- Tiles a flex block mask calls empty are skipped in both (a skipped q-block leaves no dS^T,
  so its dQ update is skipped too).
- `backward_dkdv` + `backward_dq` (deterministic=True): the same dK/dV kernel without dQ, and
  a dQ kernel with one CTA per q-block that walks its kv-blocks like the forward (recomputing
  S and dP): no atomics, bitwise reproducible, two more GEMMs.

Knobs (`DEFAULTS`; tuned values in tuning_logs/cuda/ (tvmflash.tuning)):
    bwd_block_n   keys per dK/dV CTA (16 per warp)
    bwd_block_m   queries per streamed q-block in the dK/dV kernel
    bwd_stages    Q/dO/stats buffers in the ring (3 saves one CTA barrier per q-block)
    bwd_dq_chunk  dQ columns a warp accumulates at once (independent mma chains vs registers)
    bwd_d_split   CTAs per kv-block, each owning D / bwd_d_split gradient columns (large D)
    dq_block_m    queries per dQ CTA (16 per warp), deterministic path
    dq_block_n    keys per K/V tile of the dQ kernel
    bwd_cta_order_l2_mb  MiB of Q / dO the dK/dV CTAs in flight may share (`grid_position`)
"""
from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from tvmflash.kernels.backward import declare_backward_inputs
from tvmflash.kernels.common import F32, LOG2E, NEG_INF, KernelArgs, Shape
from tvmflash.kernels.dropout import check_dropout_blocks
from tvmflash.kernels.score_mods import ScoreIndex, ScorePipeline, TileAt
from tvmflash.spec import AttentionSpec

from .cuda_mma import (PAD, QStepWalk, advance, batch_and_head, bound_values, copy_row_stats, copy_rows, cta_position,
                       dropout_cols_t, dropout_rows, dropped_ds, exp2_into, load_a_trans, mma_op, pick_values,
                       smem_scope, transposed_probabilities, warp_gemm_nt, warp_gemm_rn)

DEFAULTS = {"bwd_block_n": 128, "bwd_block_m": 64, "bwd_stages": 3, "bwd_dq_chunk": 32, "bwd_d_split": 1,
            "dq_block_m": 64, "dq_block_n": 64, "bwd_cta_order_l2_mb": 8}
# prep / convert kernels: ROW_THREADS threads a row, each on VEC consecutive columns at a time
# (vector loads: the CUDA inputs' rows are 16-byte aligned, see tvmflash.ops._loads_in_16_byte_rows;
# VEC 4, as TVM's CUDA codegen has no 8-float local vectors). A warp a row, 2 bytes a lane, had
# read O and dO at 1.9 TB/s on the H200 (40% of its DRAM's); H100, B=1 H=16 L=16k D=128, same
# process: fwd+bwd 1.019x (causal) and 1.031x (flex window 1024) with these
VEC, ROW_THREADS, ROWS_PER_CTA = 4, 16, 16


def default_knobs(spec: AttentionSpec) -> dict:
    knobs = dict(DEFAULTS)
    if spec.head_dim > 128:
        # dK and dV of all D columns would not fit the registers: two CTAs per kv-block, each
        # recomputing S and dP and owning half of the gradient columns
        knobs.update(bwd_block_n=128, bwd_block_m=32, bwd_stages=2, bwd_d_split=2, dq_block_n=32)
    return knobs


def _declare(spec: AttentionSpec, shape: Shape, outputs):
    """Declares q, k, v, do, lse2, delta, then `outputs` ((name, heads, length, dtype) of
    (B, heads, length, D) tensors), scale and the score modifiers' arguments, in call order."""
    args = KernelArgs()
    q, k, v, do, lse2, delta = declare_backward_inputs(spec, shape, args, lse_name="lse2")
    outs = [args.tensor(name, (shape.batch, heads, length, spec.head_dim), odt) for name, heads, length, odt in outputs]
    scale = args.scalar("scale")
    return (q, k, v, do, lse2, delta, outs, scale, ScorePipeline(spec.modifiers(), args, shape))


def _check(spec: AttentionSpec) -> None:
    if spec.head_dim % 16:
        raise ValueError(f"the CUDA kernels need head_dim % 16 == 0, got {spec.head_dim}")
    mma_op(spec.dtype)


def row_start(buf, b, h, row):
    """The flat element offset of buf[b, h, row, 0], written as a multiple of VEC: the rows of
    the CUDA kernels' tensors start on 16-byte boundaries (tvmflash.ops._loads_in_16_byte_rows),
    and TVM's CUDA codegen loads VEC elements at once only where it can prove that (else
    element by element)."""
    flat = b * buf.strides[0] + h * buf.strides[1] + row * buf.strides[2]
    return tirx.floordiv(flat, VEC) * VEC


def backward_prep_kernel(spec: AttentionSpec) -> tirx.PrimFunc:
    D, dt = spec.head_dim, spec.dtype
    shape = Shape.fresh()
    B, H, LQ = shape.batch, shape.heads, shape.seqlen_q

    def declare():
        args = KernelArgs()
        o = args.tensor("o", (B, H, LQ, D), dt)
        do = args.tensor("do", (B, H, LQ, D), dt)
        lse = args.tensor("lse", (B, H, LQ), F32)
        delta = args.tensor("delta", (B, H, LQ), F32)
        lse2 = args.tensor("lse2", (B, H, LQ), F32)
        return o, do, lse, delta, lse2

    @T.prim_func
    def prep():
        T.func_attr({"tirx.noalias": True})
        O, DO, LSE, DELTA, LSE2 = T.meta_var(declare())
        T.device_entry()
        bx, bh = T.cta_id([T.Cast("int32", (LQ + ROWS_PER_CTA - 1) // ROWS_PER_CTA), T.Cast("int32", B * H)])
        tid = T.thread_id([ROWS_PER_CTA * ROW_THREADS])
        b, h = T.meta_var(batch_and_head(bh, H))
        row = T.meta_var(T.Cast("int64", bx) * ROWS_PER_CTA + tid // ROW_THREADS)
        o_v = T.alloc_local([VEC], F32)
        do_v = T.alloc_local([VEC], F32)
        acc = T.alloc_local([1], F32)
        acc[0] = T.float32(0)
        if row < LQ:
            for c in T.unroll((D + VEC * ROW_THREADS - 1) // (VEC * ROW_THREADS)):
                col = T.meta_var(tid % ROW_THREADS * VEC + c * VEC * ROW_THREADS)
                if D % (VEC * ROW_THREADS) == 0 or col < D:
                    for e in T.vectorized(VEC):
                        o_v[e] = T.Cast(F32, O[0, 0, 0, row_start(O, b, h, row) + col + e])
                    for e in T.vectorized(VEC):
                        do_v[e] = T.Cast(F32, DO[0, 0, 0, row_start(DO, b, h, row) + col + e])
                    for e in T.unroll(VEC):
                        acc[0] = acc[0] + o_v[e] * do_v[e]
        acc[0] = T.cuda.warp_sum(acc[0], width=ROW_THREADS)
        if row < LQ and tid % ROW_THREADS == 0:
            DELTA[b, h, row] = acc[0]
            LSE2[b, h, row] = T.Select(LSE[b, h, row] == NEG_INF, T.float32(float("inf")),
                                       LSE[b, h, row] * T.float32(LOG2E))

    return prep.with_attr("global_symbol", "backward_prep")


@dataclass(frozen=True)
class DqAccLayout:
    """Where the fp32 dQ accumulator (a (B, H, LQ, D) tensor) keeps dQ[b, h, row, col]. Plain
    (`parts` 1, no swizzle): there. The wgmma backward's: D / `parts`-column blocks, each a
    (LQ, D / parts) row-major array of its own, so a warpgroup's rows x columns are one
    contiguous run (one bulk reduction a step); with `swizzle`, a row's 8-float units XOR
    (row % 4), the order that makes the staging of a wgmma fragment in shared memory free of
    bank conflicts."""

    head_dim: int
    parts: int = 1
    swizzle: bool = False

    @property
    def cols(self) -> int:
        """Columns of one block."""
        return self.head_dim // self.parts

    def unit(self, row, unit):
        """The position of 8-float unit `unit` in row `row` of a block."""
        return tirx.bitwise_xor(unit, row % 4) if self.swizzle else unit

    def _view(self, flat) -> list:
        return [flat // self.head_dim, flat % self.head_dim]

    def row_start(self, lq, part, row) -> list:
        """[row, col] of the (LQ, D) view where row `row` of block `part` starts."""
        return self._view((part * lq + row) * self.cols)

    def index(self, lq, row, col) -> list:
        """[row, col] of the (LQ, D) view that holds dQ (row, col)."""
        if self.parts == 1 and not self.swizzle:
            return [row, col]
        c = col % self.cols
        return self._view((col // self.cols * lq + row) * self.cols + self.unit(row, c // 8) * 8 + c % 8)


def dq_convert_kernel(spec: AttentionSpec, layout: DqAccLayout | None = None) -> tirx.PrimFunc:
    """dQ = scale * the accumulator in `layout` (default: plain), cast."""
    D, dt = spec.head_dim, spec.dtype
    layout = layout or DqAccLayout(D)
    shape = Shape.fresh()
    B, H, LQ = shape.batch, shape.heads, shape.seqlen_q

    def declare():
        args = KernelArgs()
        return (args.tensor("dq_acc", (B, H, LQ, D), F32), args.tensor("dq", (B, H, LQ, D), dt),
                args.scalar("scale"))

    @T.prim_func
    def convert():
        T.func_attr({"tirx.noalias": True})
        ACC, DQ, scale = T.meta_var(declare())
        T.device_entry()
        bx, bh = T.cta_id([T.Cast("int32", (LQ + ROWS_PER_CTA - 1) // ROWS_PER_CTA), T.Cast("int32", B * H)])
        tid = T.thread_id([ROWS_PER_CTA * ROW_THREADS])
        b, h = T.meta_var(batch_and_head(bh, H))
        row = T.meta_var(T.Cast("int64", bx) * ROWS_PER_CTA + tid // ROW_THREADS)
        if row < LQ:
            for c in T.unroll((D + VEC * ROW_THREADS - 1) // (VEC * ROW_THREADS)):
                col = T.meta_var(tid % ROW_THREADS * VEC + c * VEC * ROW_THREADS)
                # an 8-column unit lies in one run of the accumulator whatever its layout
                acc_row, acc_col = T.meta_var(layout.index(LQ, row, col))
                if D % (VEC * ROW_THREADS) == 0 or col < D:
                    for e in T.vectorized(VEC):
                        DQ[b, h, row, col + e] = T.Cast(dt, ACC[0, 0, 0, row_start(ACC, b, h, acc_row) + acc_col + e] * scale)

    return convert.with_attr("global_symbol", "backward_dq_convert")


def dkdv_kernel(spec: AttentionSpec, knobs: dict, with_dq: bool, vector_atomics: bool = True) -> tirx.PrimFunc:
    """dK, dV (and, `with_dq`, the fp32 dQ accumulator by atomics); see the module docstring.
    `vector_atomics`: two-float `red` (sm_90+), else two scalar ones."""
    _check(spec)
    D, dt = spec.head_dim, spec.dtype
    BN, BM = knobs["bwd_block_n"], knobs["bwd_block_m"]
    if BN % 16 or BM % 16:
        raise ValueError(f"bwd_block_n and bwd_block_m must be multiples of 16, got {BN}, {BM}")
    MMA = mma_op(dt)
    NW = BN // 16
    NT = NW * 32
    NQ8 = BM // 8           # n8 tiles of a warp's S^T (16 keys x BM queries)
    check_dropout_blocks(spec, BM, BN)
    DS = knobs["bwd_d_split"]
    if D % (16 * DS):
        raise ValueError(f"bwd_d_split {DS} does not divide head_dim {D} into 16-column tiles")
    DH = D // DS            # dK / dV / dQ columns of one CTA (S and dP always use all of D)
    ND = DH // 8            # n8 tiles of dK / dV
    STAGES = knobs["bwd_stages"]
    if STAGES not in (2, 3):
        raise ValueError(f"bwd_stages must be 2 or 3, got {STAGES}")
    # pool rows (D + PAD wide): K | V | Q ring | dO ring
    K_ROW, V_ROW, Q_ROW, DO_ROW = 0, BN, 2 * BN, 2 * BN + STAGES * BM
    ROWS = 2 * BN + 2 * STAGES * BM
    POOL = smem_scope(ROWS * (D + PAD) * 2)
    DS_W = BM + PAD         # dS^T rows in shared memory (for dQ)
    # dQ work split: row tiles of 16 queries x column groups; each warp takes one (row tile,
    # column group), or several row tiles when there are more tiles than warps
    RT = BM // 16
    if with_dq and (RT % NW if RT >= NW else NW % RT):
        raise ValueError(f"bwd_block_m {BM} does not divide dQ work over {NW} warps")
    CG = 1 if RT >= NW else max(c for c in range(1, NW // RT + 1) if NW // RT % c == 0 and DH % (16 * c) == 0)
    DQ_WARPS = NW if RT >= NW else RT * CG   # the others idle through dQ (odd head dims)
    DQ_COLS = DH // CG
    DQ_CHUNK = max(c for c in range(16, min(knobs["bwd_dq_chunk"], DQ_COLS) + 1, 16) if DQ_COLS % c == 0)

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
        ntiles = T.meta_var((LK + BN - 1) // BN * DS)
        cta = T.cta_id([T.Cast("int32", ntiles * B * HK)])
        tid = T.thread_id([NT])
        # this CTA's (key tile x column split, batch x kv-head), ranks major (grid_position):
        # under a causal mask the first key tiles see the most queries
        place = T.alloc_local([2], "int64")
        G = T.meta_var(tirx.truncdiv(H, HK))
        cta_position(place, cta, ntiles, B * HK, 1, G * LQ * (4 * D), knobs["bwd_cta_order_l2_mb"] << 20)
        bx = T.meta_var(place[0])
        b, hk = T.meta_var(batch_and_head(place[1], HK))
        warp = T.meta_var(tid // 32)
        lane = T.meta_var(tid % 32)
        k0 = T.meta_var(T.Cast("int64", bx // DS) * BN)
        d0 = T.meta_var(bx % DS * DH)              # this CTA's gradient columns
        kr = T.meta_var(warp * 16)                 # this warp's key rows in the tile
        pool = T.alloc_buffer((ROWS, D + PAD), dt, scope=POOL, align=128)
        stats = T.alloc_buffer((STAGES, 2, BM), F32, scope="shared", align=16)  # [buf][lse2|delta][q]
        ds_t = T.alloc_buffer((2 * BN, DS_W), dt, scope="shared", align=128)  # dS^T, two buffers
        # head and q0 of the step whose dQ is pending, and whether it ran (block masks skip steps)
        prev = T.alloc_local([3], "int64")
        af = T.alloc_local([8], "uint32")
        bf = T.alloc_local([8], "uint32")
        s = T.alloc_local([NQ8 * 4], F32)
        dp = T.alloc_local([NQ8 * 4], F32)
        p = T.alloc_local([NQ8 * 4], dt)
        gs_own = T.alloc_local([1 if score.unit_grad else NQ8 * 4], F32)
        gs = T.meta_var(None if score.unit_grad else gs_own)  # d modified score / d score (softcap)
        drop = T.meta_var(score.dropout)
        dk = T.alloc_local([ND * 4], F32)
        dv = T.alloc_local([ND * 4], F32)
        dsf = T.alloc_local([BN // 16 * 4], "uint32")
        acc = T.alloc_local([DQ_CHUNK // 2], F32)
        pw = p.view("uint32")
        ds_w = ds_t.view("uint32")
        walk = T.meta_var(QStepWalk(score, k0, T.min(k0 + BN, LK), BM, hk, G))
        NJ = T.meta_var(walk.count)
        cur = T.alloc_local([2], "int64")  # this step and the next one
        nxt = T.alloc_local([2], "int64")

        @T.inline
        def load_step(st, buf):
            h = T.meta_var(walk.head(st))
            q0 = T.meta_var(walk.q0(st))
            copy_rows(pool, Q_ROW + buf * BM, Q, b, h, q0, BM, LQ, D, tid, NT)
            copy_rows(pool, DO_ROW + buf * BM, DO, b, h, q0, BM, LQ, D, tid, NT)
            copy_row_stats(stats, buf, LSE2, DELTA, b, h, q0, BM, LQ, tid, NT)

        @T.inline
        def transposed_scores(acc, a_row, b_row):
            # acc (16 keys x BM queries) = pool[a_row + kr rows] . pool[b_row rows]^T over D
            for i in T.unroll(NQ8 * 4):
                acc[i] = T.float32(0)
            warp_gemm_nt(MMA, acc, af, bf, pool, a_row + kr, b_row, BM // 16, D // 16, lane)

        @T.inline
        def dq_update(dbuf, h, q0):
            # dQ (BM x D) += dS K from the dS^T tile in ds_t buffer dbuf, split over the warps,
            # added to the fp32 accumulator by atomics
            for rt_i in T.unroll(max(RT // NW, 1)):
                if DQ_WARPS == NW or warp < DQ_WARPS:
                    rt = T.meta_var(warp % RT + rt_i * NW if RT >= NW else warp % RT)
                    col0 = T.meta_var(d0 + (0 if RT >= NW else warp // RT * DQ_COLS))
                    for kk in T.unroll(BN // 16):
                        load_a_trans(dsf, kk * 4, ds_t, dbuf * BN + kk * 16, rt * 16, lane)
                    for dd in T.unroll(DQ_COLS // DQ_CHUNK):
                        for i in T.unroll(DQ_CHUNK // 2):
                            acc[i] = T.float32(0)
                        warp_gemm_rn(MMA, acc, dsf, bf, pool, K_ROW, col0 + dd * DQ_CHUNK, DQ_CHUNK // 16,
                                     BN // 16, lane)
                        for nt in T.unroll(DQ_CHUNK // 8):
                            for hh in T.unroll(2):
                                row = T.meta_var(q0 + rt * 16 + lane // 4 + hh * 8)
                                col = T.meta_var(col0 + dd * DQ_CHUNK + nt * 8 + lane % 4 * 2)
                                if row < LQ:
                                    if vector_atomics:
                                        T.ptx["red.global.add.v2.f32"](DQ_ACC.ptr_to([b, h, row, col]),
                                                                       acc[nt * 4 + hh * 2], acc[nt * 4 + hh * 2 + 1])
                                    else:
                                        for e in T.unroll(2):
                                            T.ptx["red.global.add.f32"](DQ_ACC.ptr_to([b, h, row, col + e]),
                                                                        acc[nt * 4 + hh * 2 + e])

        @T.inline
        def q_step(j, buf, h, q0):
            # one q-block against this CTA's keys: P^T, dV, dP^T, dS^T, dK; dS^T to shared memory
            q_tile = T.meta_var(Q_ROW + buf * BM)
            do_tile = T.meta_var(DO_ROW + buf * BM)
            transposed_scores(s, K_ROW, q_tile)
            if score.tile_unmasked(q0, q0 + BM, k0, k0 + BN, TileAt(b, h, (BM, BN))):
                transposed_probabilities(s, p, stats, buf, NQ8, score, scale, b, h, q0, k0 + kr, lane, False, gs)
            else:
                transposed_probabilities(s, p, stats, buf, NQ8, score, scale, b, h, q0, k0 + kr, lane, True, gs)
            if drop is not None:  # dV takes P Z; s keeps P with Z in its sign
                dropout_cols_t(s, p, drop, NQ8, b, h, q0, k0 + kr, lane)
            warp_gemm_rn(MMA, dv, pw, bf, pool, do_tile, d0, DH // 16, BM // 16, lane)  # dV += P^T dO
            transposed_scores(dp, V_ROW, do_tile)              # dP^T = V dO^T
            for nt in T.unroll(NQ8):                           # dS^T = P^T (dP^T [Z] - delta) [x gs]
                for i in T.unroll(4):
                    idx = T.meta_var(nt * 4 + i)
                    s[idx] = dropped_ds(drop, s[idx], dp[idx], stats[buf, 1, nt * 8 + lane % 4 * 2 + i % 2])
                    if gs is not None:
                        s[idx] = s[idx] * gs[idx]
                    p[idx] = T.Cast(dt, s[idx])
            warp_gemm_rn(MMA, dk, pw, bf, pool, q_tile, d0, DH // 16, BM // 16, lane)   # dK += dS^T Q (x scale at the end)
            if with_dq:
                # dS^T to shared memory; its dQ product runs next iteration, after the barrier
                for nt in T.unroll(NQ8):
                    for hh in T.unroll(2):
                        ds_w[j % 2 * BN + kr + lane // 4 + hh * 8, (nt * 8 + lane % 4 * 2) // 2] = pw[nt * 2 + hh]
                prev[0] = h
                prev[1] = q0

        cur[0] = T.int64(0)
        cur[1] = T.int64(0)
        prev[2] = T.int64(1)
        if NJ > 0:
            copy_rows(pool, K_ROW, K, b, hk, k0, BN, LK, D, tid, NT)
            copy_rows(pool, V_ROW, V, b, hk, k0, BN, LK, D, tid, NT)
            if score.and_live(True, walk.q0(cur), k0, TileAt(b, walk.head(cur), (BM, BN))):
                load_step(cur, 0)  # steps to be skipped are not fetched
        T.ptx["cp.async.commit_group"]()
        for i in T.unroll(ND * 4):
            dk[i] = T.float32(0)
            dv[i] = T.float32(0)

        for j in T.serial(NJ):
            buf = T.meta_var(j % STAGES)
            h = T.meta_var(walk.head(cur))
            q0 = T.meta_var(walk.q0(cur))
            advance(walk, cur, nxt)
            if score.and_live(j + 1 < NJ, walk.q0(nxt), k0, TileAt(b, walk.head(nxt), (BM, BN))):
                load_step(nxt, (j + 1) % STAGES)  # prefetch the next q-block into the other buffer
            T.ptx["cp.async.commit_group"]()
            T.ptx["cp.async.wait_group"](1)
            T.cuda.cta_sync()
            if with_dq:
                if j > 0:
                    if prev[2] == 1:
                        dq_update((j - 1) % 2, prev[0], prev[1])
            live = T.meta_var(score.tile_live(q0, k0, TileAt(b, h, (BM, BN))))
            if live is None:
                q_step(j, buf, h, q0)
            else:
                if live:  # a block mask's empty tiles are skipped
                    q_step(j, buf, h, q0)
                if with_dq:
                    prev[2] = T.Select(live, T.int64(1), T.int64(0))
            if STAGES == 2:  # the next iteration refills this buffer (with 3, the one before)
                T.cuda.cta_sync()
            cur[0] = nxt[0]
            cur[1] = nxt[1]
        if with_dq:
            if NJ > 0:
                T.cuda.cta_sync()
                if prev[2] == 1:
                    dq_update((NJ - 1) % 2, prev[0], prev[1])
        for dd in T.unroll(ND):
            for hh in T.unroll(2):
                key = T.meta_var(k0 + kr + lane // 4 + hh * 8)
                if key < LK:
                    for e in T.unroll(2):
                        DK[b, hk, key, d0 + dd * 8 + lane % 4 * 2 + e] = T.Cast(dt, dk[dd * 4 + hh * 2 + e] * scale)
                        DV[b, hk, key, d0 + dd * 8 + lane % 4 * 2 + e] = T.Cast(dt, dv[dd * 4 + hh * 2 + e])

    return dkdv.with_attr("global_symbol", "backward_dkdv_dq" if with_dq else "backward_dkdv")


def dq_kernel(spec: AttentionSpec, knobs: dict) -> tirx.PrimFunc:
    """Deterministic dQ: one CTA per (q-block, batch * head), one warp per 16 queries, over the
    kv-blocks the q-block sees (K/V double-buffered): S, P, dP = dO V^T, dS, dQ += dS K."""
    _check(spec)
    D, dt = spec.head_dim, spec.dtype
    BM, BN = knobs["dq_block_m"], knobs["dq_block_n"]
    check_dropout_blocks(spec, BM, BN)
    if BN % 16 or BM % 16:
        raise ValueError(f"dq_block_m and dq_block_n must be multiples of 16, got {BM}, {BN}")
    MMA = mma_op(dt)
    NW = BM // 16
    NT = NW * 32
    NS = BN // 8
    ND = D // 8
    Q_ROW, DO_ROW, K_ROW, V_ROW = 0, BM, 2 * BM, 2 * BM + 2 * BN   # K0 K1 | V0 V1
    ROWS = 2 * BM + 4 * BN
    POOL = smem_scope(ROWS * (D + PAD) * 2)

    shape = Shape.fresh()
    B, H, HK, LQ, LK = shape.batch, shape.heads, shape.heads_k, shape.seqlen_q, shape.seqlen_k

    def declare():
        q, k, v, do, lse2, delta, (dq,), scale, score = _declare(spec, shape, [("dq", H, LQ, dt)])
        return q, k, v, do, lse2, delta, dq, scale, score

    @T.prim_func
    def dq_fn():
        T.func_attr({"tirx.noalias": True})
        Q, K, V, DO, LSE2, DELTA, DQ, scale, score = T.meta_var(declare())
        T.device_entry()
        bx, bh = T.cta_id([T.Cast("int32", (LQ + BM - 1) // BM), T.Cast("int32", B * H)])
        tid = T.thread_id([NT])
        b, h = T.meta_var(batch_and_head(bh, H))
        hk = T.meta_var(tirx.truncdiv(h, tirx.truncdiv(H, HK)))
        warp = T.meta_var(tid // 32)
        lane = T.meta_var(tid % 32)
        q0 = T.meta_var(T.Cast("int64", bx) * BM)
        qr = T.meta_var(warp * 16)
        pool = T.alloc_buffer((ROWS, D + PAD), dt, scope=POOL, align=128)
        af = T.alloc_local([8], "uint32")
        bf = T.alloc_local([8], "uint32")
        s = T.alloc_local([NS * 4], F32)
        dp = T.alloc_local([NS * 4], F32)
        p = T.alloc_local([NS * 4], dt)
        gs_own = T.alloc_local([1 if score.unit_grad else NS * 4], F32)
        gs = T.meta_var(None if score.unit_grad else gs_own)  # d modified score / d score (softcap)
        drop = T.meta_var(score.dropout)
        dq = T.alloc_local([ND * 4], F32)
        lse2 = T.alloc_local([2], F32)
        delta = T.alloc_local([2], F32)
        pw = p.view("uint32")
        scale_log2 = T.meta_var(scale * T.float32(LOG2E))
        kb_lo, kb_hi = T.meta_var(score.kv_blocks(q0, T.min(q0 + BM, LQ), BN))

        @T.inline
        def row_scores(acc, a_row, b_row):
            # acc (16 queries x BN keys) = pool[a_row + qr rows] . pool[b_row rows]^T over D
            for i in T.unroll(NS * 4):
                acc[i] = T.float32(0)
            warp_gemm_nt(MMA, acc, af, bf, pool, a_row + qr, b_row, BN // 16, D // 16, lane)

        @T.inline
        def probability(k0, masked, nt, hh, e, row, col):
            idx = T.meta_var(nt * 4 + hh * 2 + e)
            key = T.meta_var(k0 + nt * 8 + lane % 4 * 2 + e)
            ix = T.meta_var(ScoreIndex(b, h, q0 + qr + lane // 4 + hh * 8, key, row, col=col))
            if gs is not None:
                gs[idx] = score.grad(s[idx] * scale, ix)
            if masked or score.changes_values:
                exp2_into(s[idx], score(s[idx] * scale, ix, masked) * T.float32(LOG2E) - lse2[hh])
            else:
                exp2_into(s[idx], s[idx] * scale_log2 - lse2[hh])

        @T.inline
        def probabilities(k0, masked):
            if (masked or score.changes_values) and score.row_values + score.col_values > 0:
                # values loaded once: a thread's two query rows' up front, each key's for both rows
                queries = T.meta_var([bound_values(score, "row", b, h, q0 + qr + lane // 4 + rh * 8, True)
                                      for rh in range(2)])
                for nt in T.unroll(NS):
                    for e in T.unroll(2):
                        col = T.meta_var(bound_values(score, "col", b, h, k0 + nt * 8 + lane % 4 * 2 + e, True))
                        for hh in T.unroll(2):
                            probability(k0, masked, nt, hh, e, pick_values(queries, hh), col)
            else:
                for nt in T.unroll(NS):
                    for hh in T.unroll(2):
                        for e in T.unroll(2):
                            probability(k0, masked, nt, hh, e, None, None)

        copy_rows(pool, Q_ROW, Q, b, h, q0, BM, LQ, D, tid, NT)
        copy_rows(pool, DO_ROW, DO, b, h, q0, BM, LQ, D, tid, NT)
        at = T.meta_var(TileAt(b, h, (BM, BN)))
        if score.and_live(kb_lo < kb_hi, q0, kb_lo * BN, at):  # tiles to be skipped are not fetched
            copy_rows(pool, K_ROW, K, b, hk, kb_lo * BN, BN, LK, D, tid, NT)
            copy_rows(pool, V_ROW, V, b, hk, kb_lo * BN, BN, LK, D, tid, NT)
        T.ptx["cp.async.commit_group"]()
        for hh in T.unroll(2):
            row = T.meta_var(T.min(q0 + qr + lane // 4 + hh * 8, LQ - 1))
            lse2[hh] = LSE2[b, h, row]
            delta[hh] = DELTA[b, h, row]
        for i in T.unroll(ND * 4):
            dq[i] = T.float32(0)

        @T.inline
        def kv_step(j, buf, k0):
            # one K/V tile: P, dP, dS, dQ += dS K
            k_tile = T.meta_var(K_ROW + buf * BN)
            row_scores(s, Q_ROW, k_tile)
            if score.tile_unmasked(q0, q0 + BM, k0, k0 + BN, at):
                probabilities(k0, False)
            else:
                probabilities(k0, True)
            if drop is not None:  # s keeps P with Z in its sign
                dropout_rows(s, drop, 1, NS, b, h, q0 + qr, k0, lane, True)
            row_scores(dp, DO_ROW, V_ROW + buf * BN)          # dP = dO V^T
            for nt in T.unroll(NS):                           # dS = P (dP [Z] - delta) [x gs]
                for i in T.unroll(4):
                    idx = T.meta_var(nt * 4 + i)
                    if gs is not None:
                        p[idx] = T.Cast(dt, dropped_ds(drop, s[idx], dp[idx], delta[i // 2]) * gs[idx])
                    else:
                        p[idx] = T.Cast(dt, dropped_ds(drop, s[idx], dp[idx], delta[i // 2]))
            warp_gemm_rn(MMA, dq, pw, bf, pool, k_tile, 0, D // 16, BN // 16, lane)   # dQ += dS K

        for j in T.serial(kb_hi - kb_lo):
            buf = T.meta_var(j % 2)
            k0 = T.meta_var((kb_lo + j) * BN)
            if score.and_live(kb_lo + j + 1 < kb_hi, q0, k0 + BN, at):
                copy_rows(pool, K_ROW + (1 - buf) * BN, K, b, hk, k0 + BN, BN, LK, D, tid, NT)
                copy_rows(pool, V_ROW + (1 - buf) * BN, V, b, hk, k0 + BN, BN, LK, D, tid, NT)
            T.ptx["cp.async.commit_group"]()
            T.ptx["cp.async.wait_group"](1)
            T.cuda.cta_sync()
            live = T.meta_var(score.tile_live(q0, k0, at))
            if live is None:
                kv_step(j, buf, k0)
            else:
                if live:  # a block mask's empty tiles are skipped
                    kv_step(j, buf, k0)
            T.cuda.cta_sync()
        for hh in T.unroll(2):
            row = T.meta_var(q0 + qr + lane // 4 + hh * 8)
            if row < LQ:
                for dd in T.unroll(ND):
                    for e in T.unroll(2):
                        DQ[b, h, row, dd * 8 + lane % 4 * 2 + e] = T.Cast(dt, dq[dd * 4 + hh * 2 + e] * scale)

    return dq_fn.with_attr("global_symbol", "backward_dq")


def backward_kernels_cuda(spec: AttentionSpec, knobs: dict, arch: str = "sm_90a") -> dict:
    """Every backward kernel of `spec`, by its module function name, for CUDA arch `arch`."""
    return {
        "backward_prep": backward_prep_kernel(spec),
        "backward_dkdv_dq": dkdv_kernel(spec, knobs, with_dq=True, vector_atomics=int(arch[3:5]) >= 90),
        "backward_dq_convert": dq_convert_kernel(spec),
        "backward_dkdv": dkdv_kernel(spec, knobs, with_dq=False),
        "backward_dq": dq_kernel(spec, knobs),
    }
