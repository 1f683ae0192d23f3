"""Flash-attention forward for Hopper (sm_90a) on warpgroup tensor-core GEMMs (`wgmma`).

Computes what `cuda_forward.py` computes (same spec, score modifiers, online softmax and
epilogue macros); only the GEMMs differ. Head dims that are multiples of 64 (the swizzled tile
layout's column block) take this kernel on sm_90a; the others stay on `mma.sync`.

Mapping: a CTA works on items (q-block of 64 * warpgroups rows, batch * head), one or,
persistent, several; each warpgroup (128 threads) owns 64 query rows. Q and rings of K and V tiles sit in shared memory in wgmma's
128B-swizzled layout, filled with `cp.async`. Per K/V tile:
    S = Q K^T       wgmma m64n{BN}k16, both operands from shared memory (K-major)
    online softmax  on the accumulator registers (the mma.sync layout per warp)
    O += P V        wgmma m64n{D}k16, P from registers, V from shared memory (MN-major)
wgmma is asynchronous: the softmax of tile j + 1 runs while the tensor cores do P_j V_j.

Work items are (query tile, batch x head) pairs. Two forms of the loop (knob `wgmma_producer`):
- warp-specialized (FlashAttention-3's structure; two consumer warpgroups): a third warpgroup
  only copies tiles into rings of `wgmma_stages` slots (mbarriers: a slot full, a slot read by
  both consumers) and gives its registers to the consumers (`setmaxnreg`); the consumers take
  turns at the tensor cores (named barriers, `wgmma_pingpong`), so one's softmax runs while the
  other's GEMMs do. H100, bf16 D=128: 4-13% faster than lockstep (A/B in one process).
  Persistent (`wgmma_persistent`): a CTA an SM loops over items; the rings' slots and phases
  run on across them, the consumers free Q after an item's last S = Q K^T, and the producer
  copies the next item's Q and first tiles during the item's last softmax, PV and epilogue,
  where a CTA an item paid its start, loads and epilogue in series (H100, bf16 D=128, 128
  query rows: ~6 us a CTA against ~1.9 us a 128-key tile).
- lockstep: every thread copies, a CTA barrier per tile, rings of two (one warpgroup, and
  the head dims whose rings do not fit three stages).

Knobs (`DEFAULTS`; tuned values in tuning_logs/cuda/ (tvmflash.tuning)):
    forward_wgmma     1: this kernel where `supports` says so; 0: the mma.sync kernel
    wgmma_block_n     key rows per K/V tile (a multiple of 16)
    wgmma_warpgroups  warpgroups per CTA (block_m = 64 * warpgroups)
    cta_order_l2_mb   MiB of K/V the CTAs in flight may share (`grid_position`: the L2 that
                      the tile ranks of several heads, taken in turn, may fill)
    wgmma_producer    1: the warp-specialized loop (with two warpgroups), 0: lockstep
    wgmma_stages      K/V ring slots of the warp-specialized loop (2-4; smem permitting)
    wgmma_pingpong    1: its consumers take turns at the tensor cores, 0: they issue freely
    wgmma_poly_exp2   eighths of a softcap tile's exponents computed by a polynomial on the
                      FMA pipe (`cuda_mma.poly_exp2_into`), not MUFU.EX2 (which tanh shares)
    wgmma_persistent  1: the warp-specialized loop runs persistent CTAs (at most one an SM, the
                      `cta_slots` argument), each taking every grid-th item; 2: each draws its
                      next item from the `item_counter` argument (FlashAttention-3's dynamic
                      scheduler: items go out in grid order, the longest first under a causal
                      mask, to whichever CTA is free); 0 (default): a CTA an item. H100, bf16
                      D=128, 16 heads, 1 against 0 in one process (2026-12-06): 1.13x at 1k
                      queries x 256 keys and 1.11x on a flex sliding window (1024, 16k), but
                      0.98 / 0.96 / 0.93x dense at 1k / 4k / 16k (the item loop's code runs 5-8%
                      slower even at one item a CTA: ncu, +4.3% instructions) and 0.83 / 0.66 /
                      0.63x causal, 0.82x a flex document mask (static striding: CTAs get
                      unequal work and their K/V window in L2 drifts apart)
    wgmma_stage_lists 1: a block mask's tile lists are staged in shared memory per CTA (one item
                      a CTA); 0: read in place, the next tile's first key ahead of its wait
                      (H100, flex window / document / causal masks: 0.93-0.99x of staged)
    wgmma_uniform_warpgroup  1: the warpgroup index is broadcast from lane 0 (a warp shuffle),
                      which lets ptxas keep Q's wgmma descriptors in uniform registers: bf16
                      D=128 tile loop 1045 -> 1033 instructions, no R2UR (16 before); persistent
                      1064 -> 1021. 0 (default) until measured on a GPU; then it should be
                      unconditional and the knob go
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from tvmflash.kernels.common import F32, Shape
from tvmflash.kernels.dropout import check_dropout_blocks
from tvmflash.kernels.forward import declare_forward_args
from tvmflash.kernels.score_mods import TileAt
from tvmflash.spec import AttentionSpec

from .cuda_mma import (SequenceTiles, batch_and_head, cta_position, declare_scheduling_args, dropout_rows, key_terms_size,
                       load_key_terms, load_row_values, locate_tile, query_rows, rescale_rows, row_values_size,
                       softmax_tile, store_output, to_a_fragments, unmasked_softmax_tile)
from .cuda_wgmma import (ATOM_BYTES, copy_rows_sw128, encode_desc, fence_registers, gemm_rs_mnmajor,
                         gemm_ss_kmajor, wgmma_op)

DEFAULTS = {"forward_wgmma": 1, "wgmma_block_n": 128, "wgmma_warpgroups": 2, "cta_order_l2_mb": 8,
            "wgmma_producer": 1, "wgmma_stages": 3, "wgmma_pingpong": 1, "wgmma_poly_exp2": 1,
            "wgmma_persistent": 0, "wgmma_stage_lists": 1, "wgmma_uniform_warpgroup": 0}
# the warp-specialized loop's producer warpgroup's registers a thread (setmaxnreg); its two
# consumers share the rest of the 512 a thread slot has over three warpgroups
PRODUCER_REGS = 40
# the fewest registers a thread that lockstep CTAs sharing an SM are held to (the D=64 loop's
# allocation before ptxas grew it)
MIN_SHARED_SM_REGS = 168
ALL, PRODUCER, CONSUMER = "all", "producer", "consumer"  # whose part of an item `run_item` emits
SMEM_BYTES = 232448  # a CTA's shared memory on sm_90a
# a block mask's kv tiles whose first keys a CTA stages in shared memory (the lists' loads
# and index arithmetic leave the loop; up to this many, as the tile rings leave room for);
# tiles past those read the lists in place
LISTED_TILES = 1024
# drawn items (wgmma_persistent 2): the next items the producer has published ahead (an even count)
ITEM_RING = 2


def supports(spec: AttentionSpec, arch: str, knobs: dict | None = None) -> bool:
    """sm_90a, head dims of multiples of 64; with a flex block mask, tiles that divide its
    blocks (this kernel walks the mask's block lists; the mma forward takes the others)."""
    if not (arch == "sm_90a" and spec.head_dim % 64 == 0):
        return False
    knobs = {**default_knobs(spec), **(knobs or {})}
    tile = (64 * knobs["wgmma_warpgroups"], knobs["wgmma_block_n"])
    return all(b % t == 0 for _, _, block in spec.flex if block for b, t in zip(block, tile))


def default_knobs(spec: AttentionSpec) -> dict:
    knobs = dict(DEFAULTS)
    if spec.head_dim > 128:  # the O accumulator takes D/2 registers a thread
        knobs.update(wgmma_block_n=64)
    if spec.head_dim != 128:  # measured at 128 (at 64 lockstep on one warpgroup was faster)
        knobs.update(wgmma_producer=0)
    return knobs


def warp_specialized(knobs: dict) -> bool:
    """Whether `knobs` make the warp-specialized loop (it needs two consumer warpgroups)."""
    return knobs["wgmma_producer"] == 1 and knobs["wgmma_warpgroups"] == 2


def forward_kernel_wgmma(spec: AttentionSpec, knobs: dict) -> tirx.PrimFunc:
    D, dt = spec.head_dim, spec.dtype
    BN, NWG = knobs["wgmma_block_n"], knobs["wgmma_warpgroups"]
    if D % 64:
        raise ValueError(f"the wgmma forward needs head_dim % 64 == 0, got {spec}")
    if BN % 16 or not 16 <= BN <= 256 or NWG not in (1, 2, 3):
        raise ValueError(f"bad wgmma forward knobs {knobs}")
    if knobs["wgmma_producer"] not in (0, 1) or knobs["wgmma_stages"] not in (2, 3, 4) \
            or not 0 <= knobs["wgmma_poly_exp2"] <= 8 or knobs["wgmma_persistent"] not in (0, 1, 2) \
            or knobs["wgmma_uniform_warpgroup"] not in (0, 1):
        raise ValueError(f"bad wgmma forward knobs {knobs}")
    WS = warp_specialized(knobs)  # else lockstep
    STAGES = knobs["wgmma_stages"] if WS else 2
    PINGPONG = WS and knobs["wgmma_pingpong"] == 1
    PERSISTENT = WS and knobs["wgmma_persistent"] >= 1
    DRAWN = PERSISTENT and knobs["wgmma_persistent"] == 2  # items drawn from item_counter
    UNIFORM_WG = knobs["wgmma_uniform_warpgroup"] == 1
    # a block mask's tile lists staged in shared memory: with one item a CTA (persistent, the
    # producer and the consumers work on different items; the lists are read in place)
    STAGED = spec.block_sparse and not PERSISTENT and knobs["wgmma_stage_lists"] == 1
    # a tile's first key read before the wait for its tile (a list load, when read in place)
    READ_AHEAD = PERSISTENT or (spec.block_sparse and not STAGED)
    BM = 64 * NWG
    check_dropout_blocks(spec, BM, BN)
    NC = 128 * NWG              # consumer threads (all threads without a producer)
    NT = NC + 128 * WS
    CONSUMER_REGS = (512 - PRODUCER_REGS) // NWG // 8 * 8
    NS, ND = BN // 8, D // 8    # n8 accumulator tiles of S and of O
    OP_S, OP_O = wgmma_op(dt, BN), wgmma_op(dt, D)
    K_OFF = BM * D              # element offsets in the pool: Q | STAGES K tiles | STAGES V tiles
    V_OFF = K_OFF + STAGES * BN * D
    POOL = V_OFF + STAGES * BN * D
    # mbarriers: a slot's K and V in, each read; the Q tile read; drawn items: an item slot
    # written, read (a ring of ITEM_RING), then the slots (int32, one word)
    FULL, EMPTY_K, EMPTY_V, EMPTY_Q = (i * STAGES for i in range(4))
    ITEM_FULL = EMPTY_Q + 1
    ITEM_EMPTY = ITEM_FULL + ITEM_RING
    ITEM_SLOTS = 2 * (ITEM_EMPTY + ITEM_RING)  # int32 index of the first slot
    # Static shared memory: the mbarriers, then the staged block-mask tile list, in one buffer
    # of whole KiB (the tiles' pool after it stays 1024-byte aligned, as the 128B swizzle needs:
    # a static part of 2944 bytes put it off and wgmma read garbage)
    bar_words = (3 * STAGES + PERSISTENT + (2 * ITEM_RING + ITEM_RING // 2) * DRAWN) if WS else 0
    spare = (SMEM_BYTES - 2 * POOL) // 1024 * 1024 - 8 * bar_words  # bytes the tiles leave
    if spare < 4:
        raise ValueError(f"the wgmma forward's tiles do not fit shared memory: {knobs} for {spec.name}")
    listed = min(LISTED_TILES, spare // 4) if STAGED else 1  # block-mask tile lists staged
    meta_words = -(-(8 * bar_words + 4 * listed) // 1024) * 128
    LIST0 = 2 * bar_words  # the tile list's first int32 in the buffer

    # Lockstep CTAs of one warpgroup can share an SM (D=64: three by shared memory, at <= 170
    # registers a thread). Say so to ptxas: left to itself it took 193 registers for the dense
    # D=64 loop once batch / head divided in 32 bits (was 168), and lost a CTA an SM (0.90-0.95x).
    ctas_an_sm = SMEM_BYTES // (2 * POOL + 8 * meta_words + 1024)
    SHARE_SM = not WS and ctas_an_sm > 1 and 65536 // (NT * ctas_an_sm) >= MIN_SHARED_SM_REGS

    shape = Shape.fresh()
    B, H, HK, LQ, LK = shape.batch, shape.heads, shape.heads_k, shape.seqlen_q, shape.seqlen_k

    @T.prim_func
    def fwd():
        T.func_attr({"tirx.noalias": True})
        Q, K, V, O, LSE, scale, score = T.meta_var(declare_forward_args(spec, shape))
        cta_slots, item_counter = T.meta_var(declare_scheduling_args())
        T.device_entry()
        if SHARE_SM:
            T.attr({"tirx.launch_bounds_min_blocks_per_sm": ctas_an_sm})
        tiles = T.meta_var(SequenceTiles(score, LQ, LK, BM))  # packed sequences' own query tiles
        ntiles = T.meta_var(T.Cast("int64", tiles.count))
        total = T.meta_var(ntiles * B * H)  # work items: (query tile, batch x head)
        # persistent: a CTA an SM at most, each starting on the item of its index (so the first
        # wave's items are those a grid of one CTA an item would start first), then taking every
        # grid-th item or (drawn) the next one the counter gives out
        grid = T.meta_var(T.min(total, T.Cast("int64", cta_slots)) if PERSISTENT else total)
        cta = T.cta_id([T.Cast("int32", grid)])
        tid = T.thread_id([NT])
        lane = T.meta_var(tid % 32)
        if UNIFORM_WG:  # from lane 0: ptxas then knows a warp agrees on it (see the knob)
            warpgroup = T.alloc_local([1], "int32")
            warpgroup[0] = T.tvm_warp_shuffle(T.uint32(0xFFFFFFFF), tid // 128, 0, 32, 32)
        wg = T.meta_var(warpgroup[0] if UNIFORM_WG else tid // 128)
        pool = T.alloc_buffer((POOL,), dt, scope="shared.dyn", align=ATOM_BYTES)
        desc_k = T.alloc_local([1], "uint64")  # K-major layout (Q, K)
        desc_v = T.alloc_local([1], "uint64")  # MN-major layout (V)
        s = T.alloc_local([NS * 4], F32)
        p = T.alloc_local([NS * 4], dt)
        o = T.alloc_local([ND * 4], F32)
        m = T.alloc_local([2], F32)  # running max (log2 units) of rows g and g + 8
        l = T.alloc_local([2], F32)  # running partial sum of this lane's columns
        mx = T.alloc_local([2], F32)
        alpha = T.alloc_local([2], F32)
        meta = T.alloc_buffer((meta_words,), "uint64", scope="shared", align=1024)
        bars, listed_k0 = T.meta_var((meta, meta.view("int32")))  # mbarriers | staged tile list
        # the K/V tiles and the Q tiles this CTA's earlier items loaded: where the rings stand
        # (a tile's slot and phase count from the CTA's first item, not from its item's first tile)
        done = T.alloc_local([2], "int32")
        done[0] = 0
        done[1] = 0
        place = T.alloc_local([2], "int64")  # the item's (tile rank, batch x head)
        batch_head = T.alloc_local([2], "int64")  # its batch and head: divided once an item
        seq = T.alloc_local([tiles.registers()], "int64")
        kv0 = T.alloc_local([1], "int64")
        kv_next = T.alloc_local([1], "int64")  # the next tile's first key, read ahead of its wait
        next_k0 = T.alloc_local([1], "int64")  # the first key of the tile being fetched
        encode_desc(desc_k, pool, 16, ATOM_BYTES)
        encode_desc(desc_v, pool, BN * 128, ATOM_BYTES)

        @T.inline
        def init_barriers():
            # count: a slot full = the producer's 128 copying threads; read, or Q read = one
            # arrival a consumer warp
            if tid == 0:
                for i in T.unroll(STAGES):
                    T.ptx.mbarrier.init.shared.b64(bars.ptr_to([FULL + i]), T.uint32(128))
                    T.ptx.mbarrier.init.shared.b64(bars.ptr_to([EMPTY_K + i]), T.uint32(4 * NWG))
                    T.ptx.mbarrier.init.shared.b64(bars.ptr_to([EMPTY_V + i]), T.uint32(4 * NWG))
                if PERSISTENT:
                    T.ptx.mbarrier.init.shared.b64(bars.ptr_to([EMPTY_Q]), T.uint32(4 * NWG))
                if DRAWN:  # an item slot is written by one thread and read by every thread
                    for i in T.unroll(ITEM_RING):
                        T.ptx.mbarrier.init.shared.b64(bars.ptr_to([ITEM_FULL + i]), T.uint32(1))
                        T.ptx.mbarrier.init.shared.b64(bars.ptr_to([ITEM_EMPTY + i]), T.uint32(NT))
            T.cuda.cta_sync()  # the barriers' init (and the listed tiles)

        @T.inline
        def producer_registers():
            T.ptx["setmaxnreg.dec.sync.aligned.u32"](PRODUCER_REGS)

        @T.inline
        def consumer_registers():
            T.ptx["setmaxnreg.inc.sync.aligned.u32"](CONSUMER_REGS)
            if PINGPONG and wg == 1:  # warpgroup 0 goes first
                T.ptx["bar.arrive"](T.uint32(1), T.uint32(NC))

        @T.inline
        def run_item(item, role):
            # work item `item`, by `role`'s threads (ALL: every thread, the warp-specialized loop's
            # roles split below; persistent, each role loops over the items by itself: ptxas
            # gives the producer's registers to the consumers only where no code after the
            # hand-over is shared)
            # K and V: 2 x D 16-bit elements a key
            cta_position(place, item, ntiles, B * H, tirx.truncdiv(H, HK), LK * (4 * D), knobs["cta_order_l2_mb"] << 20)
            item_b, item_h = T.meta_var(batch_and_head(place[1], H))
            batch_head[0] = item_b
            batch_head[1] = item_h
            b, h = T.meta_var((batch_head[0], batch_head[1]))
            hk = T.meta_var(tirx.truncdiv(h, tirx.truncdiv(H, HK)))
            # tiles in reverse: under a causal mask the last ones have the most keys, and the
            # longest items should start first
            tile = T.meta_var(ntiles - 1 - place[0])
            locate_tile(tiles, seq, tile)
            # where the tile lies: scores see (bs, the sequence's q0.., its lengths lq, lk, tscore);
            # the tensors' rows start at q_start + q0 and k_start + key
            bs, q_start, k_start, q0, lq, lk, tscore = T.meta_var(tiles.where(seq, tile, b))
            row0 = T.meta_var(tid // 32 * 16)   # this warp's first row in the tile
            rowv = T.alloc_local([row_values_size(tscore, 1)], "int32")  # row values (varlen, flex loads)
            kt = T.alloc_local([key_terms_size(tscore)], F32)  # a splitting bias's key terms (ALiBi)
            if q0 < lq:  # a packed tile between two sequences' tiles has no rows
                if tscore.row_values > 0:
                    load_row_values(rowv, tscore, 1, bs, h, q0 + row0, lane)
                index = T.meta_var(query_rows(tscore, bs, h, q0 + row0, rowv, lane))
                load_key_terms(kt, tscore, bs, h, lane)
                pw = p.view("uint32")
                # the K/V tiles to visit: a block mask's listed ones (supports() requires tiles that
                # divide its blocks), else the ones the modifiers' ranges leave
                walk = T.meta_var(tscore.kv_walk(q0, T.min(q0 + BM, lq), BN, TileAt(bs, h, (BM, BN))))
                # the tile count and a block mask's first full tile in registers, and each tile's first
                # key (kv0, below): from a block mask's lists they are loads, which would otherwise sit
                # in every tile's (or score's) path
                walk_regs = T.alloc_local([1 if walk.first_full is None else 2], "int64")
                walk_regs[0] = walk.count
                if walk.first_full is not None:
                    walk_regs[1] = walk.first_full
                n = T.meta_var(walk_regs[0])
                if STAGED:  # one item a CTA: read after the first tile's barrier
                    for i in T.unroll((listed + NT - 1) // NT):
                        jj = T.meta_var(T.Cast("int64", tid + i * NT))
                        if jj < n and jj < listed:
                            listed_k0[LIST0 + jj] = T.Cast("int32", walk.k0(jj))
                tile_k0 = T.meta_var((lambda j: tirx.if_then_else(
                    j < listed, T.Cast("int64", listed_k0[LIST0 + T.min(j, listed - 1)]), walk.k0(j)))
                    if STAGED else walk.k0)
                # tile j's slot in the rings and the parity of its slot's fill, counted from the
                # CTA's first tile (persistent: int32, non-negative, so C's division)
                ring = T.meta_var((lambda j: done[0] + T.Cast("int32", j)) if PERSISTENT else (lambda j: j))
                slot_of = T.meta_var(lambda j: tirx.truncmod(ring(j), STAGES))
                parity_of = T.meta_var(lambda j: T.Cast("int32", tirx.truncmod(tirx.truncdiv(ring(j), STAGES), 2)))

                @T.inline
                def scores_to_p(k0, j):
                    # online softmax of the finished S tile (masks and bounds only where needed)
                    full = T.meta_var(None if walk.first_full is None else j >= walk_regs[1])
                    if tscore.tile_unmasked(q0, T.min(q0 + BM, lq), k0, k0 + BN, TileAt(bs, h, (BM, BN)), full):
                        unmasked_softmax_tile(s, m, l, mx, alpha, 1, NS, tscore, scale, index, k0, k0 + BN, q0,
                                              T.min(q0 + BM, lq), kt, lane, fold_scale=True, interleave=WS,
                                              poly=knobs["wgmma_poly_exp2"])
                    else:
                        softmax_tile(s, m, l, mx, alpha, 1, NS, tscore, scale, index, k0, lane, True)
                    if score.dropout is not None:  # l has the undropped P; O takes P Z
                        dropout_rows(s, score.dropout, 1, NS, b, h, q0 + row0, k0, lane, False)

                @T.inline
                def issue_s(kv_block):
                    T.ptx.wgmma.fence.sync.aligned()
                    gemm_ss_kmajor(OP_S, s, NS * 4, desc_k, wg * 64 * 64, BM,
                                   K_OFF + slot_of(kv_block) * BN * D, BN, D)
                    T.ptx.wgmma.commit_group.sync.aligned()

                @T.inline
                def prepare_pv():
                    rescale_rows(o, alpha, 1, ND)
                    fence_registers(pw, NS * 2)

                @T.inline
                def issue_pv(j):
                    T.ptx.wgmma.fence.sync.aligned()
                    gemm_rs_mnmajor(OP_O, o, ND * 4, pw, 0, desc_v, V_OFF + slot_of(j) * BN * D, BN)
                    T.ptx.wgmma.commit_group.sync.aligned()

                @T.inline
                def copy_k(slot, k0, t, nt):
                    copy_rows_sw128(pool, K_OFF + slot * BN * D, K, b, hk, k_start + k0, BN, k_start + lk, D, t, nt)

                @T.inline
                def copy_v(slot, k0, t, nt):
                    copy_rows_sw128(pool, V_OFF + slot * BN * D, V, b, hk, k_start + k0, BN, k_start + lk, D, t, nt)

                @T.inline
                def arrive(bar):  # warp-specialized: this warp is done with what `bar` guards
                    if WS:
                        if lane == 0:
                            T.ptx.mbarrier.arrive.shared.b64(bars.ptr_to([bar]), T.uint32(1))

                @T.inline
                def softmax_next(pending, j, k0):
                    # S_j's GEMM done (PV_{j-1}'s may be in flight: pending), then its softmax
                    T.ptx.wgmma.wait_group.sync.aligned(pending)
                    fence_registers(s, NS * 4)
                    arrive(EMPTY_K + slot_of(j))
                    if PERSISTENT:
                        if j == n - 1:  # the item's last S: its Q tile may take the next item's
                            arrive(EMPTY_Q)
                    kv0[0] = k0
                    scores_to_p(kv0[0], j)

                @T.inline
                def wait_pv(j):
                    T.ptx.wgmma.wait_group.sync.aligned(0)
                    fence_registers(o, ND * 4)
                    arrive(EMPTY_V + slot_of(j))
                for i in T.unroll(ND * 4):
                    o[i] = T.float32(0)
                for i in T.unroll(2):
                    m[i] = T.min_value(F32)
                    l[i] = T.float32(0)
                if WS:
                    # Warp-specialized (FlashAttention-3's structure): the last warpgroup only copies
                    # Q and K/V tiles into a ring of STAGES slots (cp.async; mbarriers say when a slot
                    # is full and when both consumers are done with it, and when they are done with
                    # Q), the consumer warpgroups only compute. Two consumers take turns at the tensor
                    # cores (named barriers 1 and 2, one a consumer): one's GEMMs run while the other's
                    # softmax does, where in lockstep both softmaxes ran at once with the tensor cores
                    # idle. Persistent, the producer copies the next item's tiles while the consumers
                    # finish this one's.
                    if not PERSISTENT:
                        init_barriers()
                    if (wg == NWG) if role == ALL else role == PRODUCER:
                        if not PERSISTENT:
                            producer_registers()
                        if n > 0:
                            if PERSISTENT:
                                if done[1] > 0:  # the consumers' last S of the previous item read Q
                                    T.cuda.mbarrier_wait(bars.ptr_to([EMPTY_Q]), tirx.truncmod(done[1] - 1, 2))
                            copy_rows_sw128(pool, 0, Q, b, h, q_start + q0, BM, q_start + lq, D, tid - NC, 128)
                        for t in T.serial(n):
                            slot = T.meta_var(slot_of(t))
                            refill = T.meta_var(parity_of(t) ^ 1)
                            next_k0[0] = tile_k0(t)
                            if ring(t) >= STAGES:
                                T.cuda.mbarrier_wait(bars.ptr_to([EMPTY_K + slot]), refill)
                            copy_k(slot, next_k0[0], tid - NC, 128)
                            if ring(t) >= STAGES:
                                T.cuda.mbarrier_wait(bars.ptr_to([EMPTY_V + slot]), refill)
                            copy_v(slot, next_k0[0], tid - NC, 128)
                            # one barrier for both (a consumer's wait costs ~100 cycles of its critical
                            # path); it also covers the item's Q, copied before its first tile
                            T.ptx["cp.async.mbarrier.arrive.noinc.shared.b64"](bars.ptr_to([FULL + slot]))
                    else:
                        if not PERSISTENT:
                            consumer_registers()

                        @T.inline
                        def wait_full(j):  # tile j's K and V in shared memory
                            T.cuda.mbarrier_wait(bars.ptr_to([FULL + slot_of(j)]), parity_of(j))
                            # cp.async wrote through the generic proxy; wgmma reads through the async one
                            T.ptx.fence.proxy.async_.shared__cta()

                        @T.inline
                        def take_turn():
                            if PINGPONG:
                                T.ptx["bar.sync"](T.Cast("uint32", 1 + wg), T.uint32(NC))

                        @T.inline
                        def pass_turn():
                            if PINGPONG:
                                T.ptx["bar.arrive"](T.Cast("uint32", 2 - wg), T.uint32(NC))

                        if n > 0:
                            wait_full(0)
                            take_turn()
                            issue_s(0)
                            pass_turn()
                            softmax_next(0, 0, walk.k0(0))
                            to_a_fragments(s, p, NS * 4)
                        for j in T.serial(n - 1):
                            if READ_AHEAD:
                                kv_next[0] = tile_k0(j + 1)
                            prepare_pv()
                            wait_full(j + 1)
                            take_turn()
                            issue_s(j + 1)
                            issue_pv(j)
                            pass_turn()
                            softmax_next(1, j + 1, kv_next[0] if READ_AHEAD else tile_k0(j + 1))
                            wait_pv(j)
                            to_a_fragments(s, p, NS * 4)
                        if n > 0:
                            prepare_pv()
                            take_turn()
                            issue_pv(n - 1)
                            pass_turn()
                            if PERSISTENT:  # the last V slot goes back to the ring
                                wait_pv(n - 1)
                            else:
                                T.ptx.wgmma.wait_group.sync.aligned(0)
                                fence_registers(o, ND * 4)
                        store_output(O, LSE, o, m, l, 1, ND, b, h, q_start + q0 + row0, q_start + lq, lane)
                else:
                    @T.inline
                    def sync_tiles():
                        T.ptx["cp.async.wait_group"](0)
                        # cp.async wrote through the generic proxy; wgmma reads through the async one
                        T.ptx.fence.proxy.async_.shared__cta()
                        T.cuda.cta_sync()

                    @T.inline
                    def fetch_tiles(j):
                        if j + 2 < n:
                            next_k0[0] = tile_k0(j + 2)  # once, not per copied row (loads from a block mask's lists)
                            copy_k(j % 2, next_k0[0], tid, NT)
                        if j + 1 < n:
                            next_k0[0] = tile_k0(j + 1)
                            copy_v((j + 1) % 2, next_k0[0], tid, NT)
                        T.ptx["cp.async.commit_group"]()

                    copy_rows_sw128(pool, 0, Q, b, h, q_start + q0, BM, q_start + lq, D, tid, NT)
                    next_k0[0] = walk.k0(0)
                    copy_k(0, next_k0[0], tid, NT)
                    copy_v(0, next_k0[0], tid, NT)
                    if n > 1:
                        next_k0[0] = walk.k0(1)
                        copy_k(1, next_k0[0], tid, NT)
                    T.ptx["cp.async.commit_group"]()
                    if n > 0:
                        T.ptx["cp.async.wait_group"](0)
                        T.ptx.fence.proxy.async_.shared__cta()
                        T.cuda.cta_sync()
                        issue_s(0)
                        softmax_next(0, 0, walk.k0(0))
                        to_a_fragments(s, p, NS * 4)

                    # Iteration j: S_{j+1} = Q K_{j+1}^T and O += P_j V_j go to the tensor cores back to back;
                    # the softmax of S_{j+1} then runs while the PV product is still in flight. K and V
                    # rings of two: K_{j+2} and V_{j+1} are loaded into the slots of K_j and V_{j-1}, whose
                    # readers every warpgroup finished before the barrier. S_{j+1} goes first and the copies
                    # are issued while the tensor cores compute it: issued before the barrier or after
                    # PV_j (whose issue waits for the tensor cores), they delayed the next GEMM or the
                    # softmax (H100, bf16 D=128 16k: 10% of the forward's time).
                    for j in T.serial(n - 1):
                        sync_tiles()
                        issue_s(j + 1)
                        fetch_tiles(j)
                        prepare_pv()
                        issue_pv(j)
                        softmax_next(1, j + 1, tile_k0(j + 1))
                        wait_pv(j)
                        to_a_fragments(s, p, NS * 4)
                    if n > 0:
                        sync_tiles()
                        prepare_pv()
                        issue_pv(n - 1)
                        T.ptx.wgmma.wait_group.sync.aligned(0)
                        fence_registers(o, ND * 4)
                    store_output(O, LSE, o, m, l, 1, ND, b, h, q_start + q0 + row0, q_start + lq, lane)
                if PERSISTENT:
                    done[0] = done[0] + T.Cast("int32", n)
                    done[1] = done[1] + T.Cast("int32", n > 0)

        if PERSISTENT:
            current = T.alloc_local([1], "int64")  # the CTA's item
            current[0] = T.Cast("int64", cta)
            taken = T.alloc_local([1], "int32")  # items after the first the CTA has taken
            taken[0] = 0
            drawn = T.alloc_local([1], "int32")  # the counter's value the CTA drew last
            item_slots = T.meta_var(meta.view("int32"))

            @T.inline
            def draw():
                # the producer's first thread draws the next item at the start of an item and
                # publishes it at the end (next_item), so the atomic's latency hides under the
                # item's copies
                if DRAWN:
                    if tid == NC:
                        T.ptx["atom.relaxed.gpu.global.add.s32"](drawn[0], item_counter.ptr_to([0]), T.int32(1))

            @T.inline
            def next_item(publisher):
                if DRAWN:
                    # the counter gives out 0, 1, ...: the CTAs' draws past the first grid items,
                    # one each that comes back past the last item (total draws in all, so the one
                    # that drew total - 1 was the launch's last and zeroes the counter for the next)
                    slot = T.meta_var(taken[0] % ITEM_RING)
                    if publisher:
                        if tid == NC:
                            if taken[0] >= ITEM_RING:  # every thread read what the slot held before
                                T.cuda.mbarrier_wait(bars.ptr_to([ITEM_EMPTY + slot]),
                                                     (taken[0] // ITEM_RING - 1) % 2)
                            if drawn[0] == T.Cast("int32", total) - 1:
                                item_counter[0] = T.int32(0)
                            item_slots[ITEM_SLOTS + slot] = T.Cast("int32", grid) + drawn[0]
                            T.ptx.mbarrier.arrive.shared.b64(bars.ptr_to([ITEM_FULL + slot]), T.uint32(1))
                    T.cuda.mbarrier_wait(bars.ptr_to([ITEM_FULL + slot]), (taken[0] // ITEM_RING) % 2)
                    current[0] = T.Cast("int64", item_slots[ITEM_SLOTS + slot])
                    T.ptx.mbarrier.arrive.shared.b64(bars.ptr_to([ITEM_EMPTY + slot]), T.uint32(1))
                    taken[0] = taken[0] + 1
                else:
                    current[0] = current[0] + grid

            init_barriers()
            if wg == NWG:
                producer_registers()
                while current[0] < total:
                    draw()
                    run_item(current[0], PRODUCER)
                    next_item(True)
            else:
                consumer_registers()
                while current[0] < total:
                    run_item(current[0], CONSUMER)
                    next_item(False)
        else:
            run_item(T.Cast("int64", cta), ALL)

    return fwd.with_attr("global_symbol", "forward")
