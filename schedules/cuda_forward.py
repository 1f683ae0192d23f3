"""Flash-attention forward for CUDA tensor cores (sm_80 .. sm_90a), as a TIRx native kernel.

The s_tir route cannot carry the online softmax between two tensor-core GEMMs on register
fragments (see the GPU cookbook), so the CUDA mapping is written by hand, like CUDA, and
generated from the spec plus the knobs below. What is computed is the same as
`tvmflash/kernels/forward.py`: the score modifiers (causal, masks, later variants) are the
shared target-independent functions of `tvmflash/kernels/score_mods.py`.

Mapping: one CTA per (q-block of BM rows, batch * head); one warp per 16 * warp_m_tiles query
rows (with two m-tiles a warp reuses every K/V fragment it loads for two mma's).
K/V tiles of BN rows go through a ring of 2 or 3 shared-memory buffers filled by `cp.async`
(rows padded by 8 elements so `ldmatrix` is conflict-free; 3 buffers drop a CTA barrier); S = Q K^T and O += P V run on
`mma.sync.m16n8k16` with fp32 accumulators; the online softmax runs in registers in the exp2
domain; P is reused as the A fragment of the PV product straight from registers. Tiles that
a flex block mask calls empty are skipped (their K/V still stream through the ring).

Knobs (`DEFAULTS`, tuned values in tuning_logs/cuda/ (tvmflash.tuning)):
    block_m        query rows per CTA (16 per warp)
    block_n        key rows per K/V tile
    q_in_registers keep Q's mma fragments in registers for the whole CTA (large head dims
                   reload them from shared memory instead, to stay clear of spills)
    warp_m_tiles   16-row m-tiles per warp (1 or 2)
    stages         K/V buffers (2 or 3)
    cta_order_l2_mb MiB of K/V the CTAs in flight may share (`grid_position`)
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from tvmflash.kernels.common import F32, Shape
from tvmflash.kernels.dropout import check_dropout_blocks
from tvmflash.kernels.forward import declare_forward_args
from tvmflash.kernels.score_mods import TileAt
from tvmflash.spec import AttentionSpec

from .cuda_mma import (PAD, SequenceTiles, batch_and_head, copy_rows, cta_position, declare_scheduling_args,
                       dropout_rows, key_terms_size, load_a, load_b, load_b_trans, load_key_terms, load_row_values,
                       locate_tile, mma_16x16, mma_op, query_rows, rescale_rows, row_values_size, smem_scope,
                       softmax_tile, store_output, to_a_fragments, unmasked_softmax_tile)

DEFAULTS = {"block_m": 128, "block_n": 64, "q_in_registers": 1, "warp_m_tiles": 1, "stages": 2, "cta_order_l2_mb": 8}


def default_knobs(spec: AttentionSpec) -> dict:
    """Knobs of specs without a tuning record: the tuned winners of the nearest head dim."""
    knobs = dict(DEFAULTS)
    if spec.head_dim <= 64:
        knobs.update(q_in_registers=0, warp_m_tiles=2)
    elif spec.head_dim <= 128:
        knobs.update(block_n=32, q_in_registers=0, warp_m_tiles=2, stages=3)
    else:
        knobs.update(block_m=64, block_n=32, q_in_registers=0)
    return knobs


def forward_kernel_cuda(spec: AttentionSpec, knobs: dict) -> tirx.PrimFunc:
    D, dt = spec.head_dim, spec.dtype
    BM, BN = knobs["block_m"], knobs["block_n"]
    MT = knobs["warp_m_tiles"]
    q_regs = bool(knobs["q_in_registers"])
    if D % 16:
        raise ValueError(f"the CUDA forward needs head_dim % 16 == 0, got {spec}")
    MMA = mma_op(dt)
    WM = 16 * MT           # query rows per warp
    if BM % WM or BN % 16:
        raise ValueError(f"block_m {BM} must be a multiple of 16 * warp_m_tiles, block_n {BN} of 16")
    NW = BM // WM
    check_dropout_blocks(spec, BM, BN)
    NT = NW * 32
    NS = BN // 8           # n8 tiles of S per m-tile
    ND = D // 8            # n8 tiles of O per m-tile
    ST = knobs["stages"]   # K/V buffers in the ring; with 3 the end-of-tile barrier goes
    if ST not in (2, 3):
        raise ValueError(f"stages must be 2 or 3, got {ST}")
    K_ROW, V_ROW = BM, BM + ST * BN
    ROWS = BM + 2 * ST * BN  # shared pool rows: Q | K ring | V ring
    SCOPE = smem_scope(ROWS * (D + PAD) * 2)

    shape = Shape.fresh()
    B, H, HK, LQ, LK = shape.batch, shape.heads, shape.heads_k, shape.seqlen_q, shape.seqlen_k

    @T.prim_func
    def fwd():
        T.func_attr({"tirx.noalias": True})
        Q, K, V, O, LSE, scale, score = T.meta_var(declare_forward_args(spec, shape))
        _slots, _counter = T.meta_var(declare_scheduling_args())  # (unused: one CTA a tile here)
        T.device_entry()
        tiles = T.meta_var(SequenceTiles(score, LQ, LK, BM))  # packed sequences' own query tiles
        ntiles = T.meta_var(T.Cast("int64", tiles.count))
        cta = T.cta_id([T.Cast("int32", ntiles * B * H)])
        tid = T.thread_id([NT])
        place = T.alloc_local([2], "int64")  # this CTA's (tile rank, batch x head)
        # K and V: 2 x D 16-bit elements a key
        cta_position(place, cta, ntiles, B * H, tirx.truncdiv(H, HK), LK * (4 * D), knobs["cta_order_l2_mb"] << 20)
        b, h = T.meta_var(batch_and_head(place[1], H))
        # tiles in reverse: under a causal mask the last ones have the most keys, and the
        # longest CTAs should start first
        bx = T.meta_var(ntiles - 1 - place[0])
        hk = T.meta_var(tirx.truncdiv(h, tirx.truncdiv(H, HK)))
        warp = T.meta_var(tid // 32)
        lane = T.meta_var(tid % 32)
        seq = T.alloc_local([tiles.registers()], "int64")
        locate_tile(tiles, seq, bx)
        # scores see (bs, the sequence's q0.., its lengths lq, lk, tscore); the tensors' rows
        # start at q_start + q0 and k_start + key
        bs, q_start, k_start, q0, lq, lk, tscore = T.meta_var(tiles.where(seq, bx, b))
        row0 = T.meta_var(warp * WM)   # this warp's first row in the tile
        pool = T.alloc_buffer((ROWS, D + PAD), dt, scope=SCOPE, align=128)
        qf = T.alloc_local([MT * (D // 16 if q_regs else 1) * 4], "uint32")
        kb = T.alloc_local([4], "uint32")
        vb = T.alloc_local([4], "uint32")
        s = T.alloc_local([MT * NS * 4], F32)
        p = T.alloc_local([MT * NS * 4], dt)
        o = T.alloc_local([MT * ND * 4], F32)
        m = T.alloc_local([MT * 2], F32)  # running max (log2 units) of rows g and g + 8 per m-tile
        rowv = T.alloc_local([row_values_size(tscore, MT)], "int32")  # row values (varlen, flex loads)
        kt = T.alloc_local([key_terms_size(tscore)], F32)  # a splitting bias's key terms (ALiBi)
        l = T.alloc_local([MT * 2], F32)  # running partial sum of this lane's columns
        mx = T.alloc_local([1], F32)
        alpha = T.alloc_local([MT * 2], F32)
        if tscore.row_values > 0:
            load_row_values(rowv, tscore, MT, bs, h, q0 + row0, lane)
        index = T.meta_var(query_rows(tscore, bs, h, q0 + row0, rowv, lane))
        load_key_terms(kt, tscore, bs, h, lane)
        pw = p.view("uint32")
        q_frag = T.meta_var(lambda mt, kk: (mt * (D // 16) + kk) * 4 if q_regs else mt * 4)

        copy_rows(pool, 0, Q, b, h, q_start + q0, BM, q_start + lq, D, tid, NT)
        at = T.meta_var(TileAt(bs, h, (BM, BN)))
        # the K/V tiles to visit (none for a packed tile between two sequences' tiles)
        walk = T.meta_var(tscore.kv_walk(q0, T.min(q0 + BM, lq), BN, at))
        count = T.meta_var(walk.count if not tiles.packed else T.Select(q0 < lq, walk.count, T.int64(0)))
        # first keys of this and the next tile, in registers: with a block mask they come from
        # its lists, and a load per use would sit in every score's index
        kv0 = T.alloc_local([2], "int64")
        kv0[1] = walk.k0(0)
        if walk.fetch(0):  # tiles to be skipped are not fetched
            copy_rows(pool, K_ROW, K, b, hk, k_start + kv0[1], BN, k_start + lk, D, tid, NT)
            copy_rows(pool, V_ROW, V, b, hk, k_start + kv0[1], BN, k_start + lk, D, tid, NT)
        T.ptx["cp.async.commit_group"]()
        for i in T.unroll(MT * ND * 4):
            o[i] = T.float32(0)
        for i in T.unroll(MT * 2):
            m[i] = T.min_value(F32)
            l[i] = T.float32(0)

        @T.inline
        def tile_step(j):
            # one K/V tile: S, online softmax, O += P V
            buf = T.meta_var(j % ST)
            k0 = T.meta_var(kv0[0])
            # S = Q K^T: every K fragment feeds the warp's MT m-tiles
            for i in T.unroll(MT * NS * 4):
                s[i] = T.float32(0)
            for kk in T.unroll(D // 16):
                if not q_regs:
                    for mt in T.unroll(MT):
                        load_a(qf, q_frag(mt, kk), pool, row0 + mt * 16, kk * 16, lane)
                for nn in T.unroll(BN // 16):
                    load_b(kb, 0, pool, K_ROW + buf * BN + nn * 16, kk * 16, lane)
                    for mt in T.unroll(MT):
                        mma_16x16(MMA, s, (mt * NS + nn * 2) * 4, qf, q_frag(mt, kk), kb, 0)
            # online softmax; masks and bounds only on tiles that need them
            if tscore.tile_unmasked(q0, T.min(q0 + BM, lq), k0, k0 + BN, at):
                unmasked_softmax_tile(s, m, l, mx, alpha, MT, NS, tscore, scale, index, k0, k0 + BN, q0,
                                      T.min(q0 + BM, lq), kt, lane)
            else:
                softmax_tile(s, m, l, mx, alpha, MT, NS, tscore, scale, index, k0, lane, True)
            if score.dropout is not None:  # l has the undropped P; O takes P Z
                dropout_rows(s, score.dropout, MT, NS, b, h, q0 + row0, k0, lane, False)
            to_a_fragments(s, p, MT * NS * 4)
            rescale_rows(o, alpha, MT, ND)
            # O += P V: the f32 S fragments of two n8 tiles, as f16/bf16, are the A fragment
            # of one k16 step; V arrives transposed through ldmatrix.trans
            for kk in T.unroll(BN // 16):
                for dd in T.unroll(D // 16):
                    load_b_trans(vb, 0, pool, V_ROW + buf * BN + kk * 16, dd * 16, lane)
                    for mt in T.unroll(MT):
                        mma_16x16(MMA, o, (mt * ND + dd * 2) * 4, pw, mt * NS * 2 + kk * 4, vb, 0)

        for j in T.serial(count):
            kv0[0] = kv0[1]
            kv0[1] = walk.k0(j + 1)  # (clamped in bounds past the last tile)
            if walk.fetch(j + 1):  # prefetch the next K/V tile into the next buffer
                copy_rows(pool, K_ROW + (j + 1) % ST * BN, K, b, hk, k_start + kv0[1], BN, k_start + lk, D, tid, NT)
                copy_rows(pool, V_ROW + (j + 1) % ST * BN, V, b, hk, k_start + kv0[1], BN, k_start + lk, D, tid, NT)
            T.ptx["cp.async.commit_group"]()
            T.ptx["cp.async.wait_group"](1)
            T.cuda.cta_sync()
            if q_regs:
                if j == 0:
                    for mt in T.unroll(MT):
                        for kk in T.unroll(D // 16):
                            load_a(qf, q_frag(mt, kk), pool, row0 + mt * 16, kk * 16, lane)
            live = T.meta_var(walk.live(j))
            if live is None:
                tile_step(j)
            else:
                if live:  # a block mask's empty tiles are skipped
                    tile_step(j)
            if ST == 2:  # the next iteration refills this buffer (with 3, the one before)
                T.cuda.cta_sync()
        store_output(O, LSE, o, m, l, MT, ND, b, h, q_start + q0 + row0, q_start + lq, lane)

    return fwd.with_attr("global_symbol", "forward")
