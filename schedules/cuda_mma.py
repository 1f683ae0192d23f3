"""Building blocks of the CUDA tensor-core kernels (forward and backward): `cp.async` tile
copies, `ldmatrix` fragment loads and `mma.sync.m16n8k16`, as TVMScript macros.

Fragment conventions (PTX ISA, mma.m16n8k16 with 16-bit inputs and fp32 accumulators): lane
`l` holds rows g = l/4 and g + 8 and columns 2*(l%4) (+1) of an accumulator n8 tile, four
floats per tile at `acc[t .. t+3]` = (g, c), (g, c+1), (g+8, c), (g+8, c+1). An A fragment
(m16 x k16) is four uint32 registers, a B fragment (k16 x n8) two; `ldmatrix.x4` loads one A
fragment or the B fragments of two n8 tiles at once. Shared-memory tiles are row-major with
rows padded by PAD elements, which keeps `ldmatrix` free of bank conflicts, or unpadded with
their 16-byte chunks swizzled (`SwizzledRows`), which also keeps `cp.async` from splitting.
"""
from __future__ import annotations

import math

from tvm import tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import tirx as irb

from tvmflash.kernels.common import LOG2E, NEG_INF, KernelArgs
from tvmflash.kernels.score_mods import BEYOND_BAND, ScoreIndex, unrolled_choice, with_kv_parts

LN2 = math.log(2.0)
PAD = 8  # elements of padding per shared-memory row
LDM = "ldmatrix.sync.aligned.m8n8.x4.shared.b16"
CP_ASYNC = "cp.async.cg.shared.global"
LDM_T = "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16"


class SwizzledRows:
    """A row-major shared-memory tile of 16-bit elements whose rows are a multiple of 64
    elements (128 bytes) long and whose 16-byte chunks are stored XOR (row % 8): `ptr_to` maps
    [row, col] as the buffer's own does, so the copy and fragment helpers here take either.
    Why not padding: a padded row starts off a 128-byte boundary, so a `cp.async` warp's
    128-byte runs of global memory land across two shared-memory lines; the copy then takes
    more shared wavefronts and the L1 splits its global requests with them (measured on the
    H200 decode kernel: 24 L2 sectors a copy instruction where 16 hold the data, L2-bound at
    84% of DRAM bandwidth). Swizzled, each run fills one line, and `ldmatrix`'s eight rows of
    one chunk still fall in eight different bank groups."""

    def __init__(self, buf):
        self.buf = buf

    @staticmethod
    def fits(width: int) -> bool:
        return width % 64 == 0

    @staticmethod
    def column(row, col):
        """Where in row `row` element `col` is stored (integers or TIR expressions)."""
        if isinstance(row, int) and isinstance(col, int):
            return (col // 8 ^ row % 8) * 8 + col % 8
        col = tirx.const(col, "int32") if isinstance(col, int) else col
        return tirx.bitwise_xor(col // 8, tirx.Cast(str(col.ty), row % 8)) * 8 + col % 8

    def ptr_to(self, index):
        row, col = index
        return self.buf.ptr_to([row, self.column(row, col)])


def mma_op(dtype: str) -> str:
    if dtype not in ("float16", "bfloat16"):
        raise ValueError(f"CUDA kernels take float16 or bfloat16, got {dtype}")
    ab = "f16" if dtype == "float16" else "bf16"
    return f"mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32"


SHARED_LIMIT = 227 * 1024  # shared memory a CTA may take on sm_90 (the tuner's grids keep within it)


def smem_scope(nbytes: int) -> str:
    """Static shared memory up to 48 KB, else the (single) dynamic allocation."""
    return "shared" if nbytes <= 48 * 1024 else "shared.dyn"


def batch_and_head(bh, heads):
    """(batch, head), as int64, of a CTA whose grid index `bh` runs over batch x heads
    (truncating division: both are positive, and floor division's sign fix-ups would be
    repeated in every expression that indexes by them, e.g. each score's ALiBi slope). The
    division is 32-bit (batch x heads < 2^31): a 64-bit one is a call in SASS, and a call in a
    persistent kernel's item loop made ptxas keep the wgmma descriptors out of uniform registers
    (four R2UR and six integer ops more a wgmma)."""
    bh, heads = tirx.Cast("int32", bh), tirx.Cast("int32", heads)
    return tirx.Cast("int64", tirx.truncdiv(bh, heads)), tirx.Cast("int64", tirx.truncmod(bh, heads))


def grid_position(cta, tiles, pairs, group, kv_bytes, l2_bytes):
    """(tile rank, batch x head pair) of CTA `cta` of a one-dimensional grid over tiles x
    pairs. CTAs start in grid order, so ranks go major: every pair's rank-0 tile (a kernel's
    longest, under a causal mask) starts before any rank-1 tile, and the short tiles of all
    pairs fill the tail, where pair-major order left each pair's short tiles between the next
    pair's long ones and ended on one pair's (a tail of up to a quarter of a 4k causal call).
    Ranks go major within sections of consecutive pairs whose K and V (`kv_bytes` a kv-head,
    `group` query heads to one) fit in `l2_bytes`: the CTAs in flight then read K/V that stays
    in L2, as with pair-major order. All arguments are non-negative (truncating division)."""
    # 32-bit per CTA (or persistent item): CTAs and tiles x pairs < 2^31 (see batch_and_head)
    per_section = tirx.Cast("int32", tirx.min(tirx.max(tirx.truncdiv(tirx.const(l2_bytes, "int64"), kv_bytes), 1)
                                              * group, pairs))
    cta, tiles, pairs = (tirx.Cast("int32", x) for x in (cta, tiles, pairs))
    first = tirx.truncdiv(cta, per_section * tiles) * per_section
    within = cta - first * tiles
    width = tirx.min(per_section, pairs - first)
    return tirx.Cast("int64", tirx.truncdiv(within, width)), tirx.Cast("int64", first + tirx.truncmod(within, width))


def declare_scheduling_args() -> tuple:
    """The CUDA forward kernels' last arguments (declare them after the forward's others, while
    the kernel is parsed), which tvmflash.ops passes: `cta_slots`, how many CTAs of the kernel
    the GPU runs at once (its SM count), and `item_counter`, a zeroed int32 from which CTAs
    draw work items (the last CTA to draw leaves it zero again). Persistent kernels launch at
    most `cta_slots` CTAs, the dynamic ones draw their items from the counter; the others take
    both so that every CUDA forward has one signature."""
    args = KernelArgs()
    return args.scalar("cta_slots", "int32"), args.tensor("item_counter", [1], "int32")


@T.inline
def cta_position(place, cta, tiles, pairs, group, kv_bytes, l2_bytes):
    """place[0], place[1] = grid_position(...) (int64 registers: the kernel reads them often)."""
    rank, pair = T.meta_var(grid_position(cta, tiles, pairs, group, kv_bytes, l2_bytes))
    place[0] = rank
    place[1] = pair


class QStepWalk:
    """The steps of a kv-block's CTA in the backward: every (head of the GQA group, q-block
    that sees the keys k0..k1) in order. A step is a 2-element int64 buffer (head in the group,
    q-block index), advanced by `advance` without divisions."""

    def __init__(self, score, k0, k1, block_m: int, head_k, group):
        self.qb_lo, qb_hi = score.q_blocks(k0, k1, block_m)
        self.per_head = qb_hi - self.qb_lo
        self.count = group * self.per_head
        self.block_m, self.first_head = block_m, head_k * group

    def head(self, step):
        return self.first_head + step[0]

    def q0(self, step):
        return (self.qb_lo + step[1]) * self.block_m


@T.inline
def advance(walk, cur, nxt):
    nxt[0] = T.Select(cur[1] + 1 < walk.per_head, cur[0], cur[0] + 1)
    nxt[1] = T.Select(cur[1] + 1 < walk.per_head, cur[1] + 1, T.int64(0))


@T.inline
def copy_tile(pool, pool_row0, address, valid, nrows, width, tid, nthreads, op=CP_ASYNC):
    """nrows x width elements into pool rows pool_row0.. with `cp.async` (16 bytes a thread):
    row r's from the pointer address(r, col), which must stay in bounds; rows where valid(r)
    fails are zero-filled (source size 0). `op`: CP_ASYNC, or it with an L2 prefetch size
    (CP_ASYNC + ".L2::256B")."""
    for it in T.unroll((nrows * width // 8 + nthreads - 1) // nthreads):
        c = T.meta_var(tid + it * nthreads)
        r = T.meta_var(c // (width // 8))
        cc = T.meta_var(c % (width // 8) * 8)
        if nrows * width // 8 % nthreads == 0 or c < nrows * width // 8:
            T.ptx[op](pool.ptr_to([pool_row0 + r, cc]), address(r, cc), 16,
                      T.Select(valid(r), T.uint32(16), T.uint32(0)))


@T.inline
def copy_rows(pool, pool_row0, src, b, head, row0, nrows, limit, width, tid, nthreads):
    """nrows x width elements of src[b, head, row0:, :] into pool rows pool_row0.. (copy_tile);
    rows at or past `limit` are zero-filled with the source address clamped in bounds."""
    address = T.meta_var(lambda r, cc: src.ptr_to([b, head, T.min(row0 + r, limit - 1), cc]))
    valid = T.meta_var(lambda r: row0 + r < limit)
    copy_tile(pool, pool_row0, address, valid, nrows, width, tid, nthreads)


@T.inline
def load_a(frag, f0, pool, row, col, lane):
    """A fragment (m16 x k16) from a row-major [m][k] tile at (row, col) into frag[f0 .. f0+3]."""
    T.ptx[LDM](frag[f0], frag[f0 + 1], frag[f0 + 2], frag[f0 + 3],
               pool.ptr_to([row + lane % 16, col + lane // 16 * 8]))


@T.inline
def load_a_trans(frag, f0, pool, row, col, lane):
    """A fragment (m16 x k16) from a [k][m] tile at (row = k, col = m)."""
    T.ptx[LDM_T](frag[f0], frag[f0 + 1], frag[f0 + 2], frag[f0 + 3],
                 pool.ptr_to([row + lane // 16 * 8 + lane % 8, col + lane // 8 % 2 * 8]))


@T.inline
def load_b(frag, f0, pool, row, col, lane):
    """B fragments of two n8 tiles (k16 x n16) from an [n][k] tile at (row = n, col = k):
    frag[f0 : f0+2] is n-tile 0, frag[f0+2 : f0+4] n-tile 1."""
    T.ptx[LDM](frag[f0], frag[f0 + 1], frag[f0 + 2], frag[f0 + 3],
               pool.ptr_to([row + lane % 8 + lane // 16 * 8, col + lane // 8 % 2 * 8]))


@T.inline
def load_b_trans(frag, f0, pool, row, col, lane):
    """B fragments of two n8 tiles from a [k][n] tile at (row = k, col = n)."""
    T.ptx[LDM_T](frag[f0], frag[f0 + 1], frag[f0 + 2], frag[f0 + 3],
                 pool.ptr_to([row + lane % 8 + lane // 8 % 2 * 8, col + lane // 16 * 8]))


@T.inline
def mma_16x16(op, acc, t, a, a0, b, b0):
    """acc n8 tiles at t and t + 4 += A (a[a0 .. a0+3]) x the two B tiles in b[b0 .. b0+3]."""
    for half in T.unroll(2):
        T.ptx[op](acc[t + half * 4], acc[t + half * 4 + 1], acc[t + half * 4 + 2], acc[t + half * 4 + 3],
                  a[a0], a[a0 + 1], a[a0 + 2], a[a0 + 3], b[b0 + half * 2], b[b0 + half * 2 + 1],
                  acc[t + half * 4], acc[t + half * 4 + 1], acc[t + half * 4 + 2], acc[t + half * 4 + 3])


@T.inline
def warp_gemm_nt(op, acc, af, bf, pool, a_row, b_row, n16, k16, lane):
    """acc (16 x 16*n16, n8 tiles) += pool[a_row: +16, :16*k16] . pool[b_row: +16*n16, :16*k16]^T.
    Fragments are double-buffered (af, bf hold 8 registers): the loads of step i + 1 are
    issued before the mma of step i, so tensor cores do not wait on each ldmatrix."""
    load_a(af, 0, pool, a_row, 0, lane)
    load_b(bf, 0, pool, b_row, 0, lane)
    for i in T.unroll(n16 * k16):
        if i + 1 < n16 * k16:
            if (i + 1) % n16 == 0:
                load_a(af, (i + 1) // n16 % 2 * 4, pool, a_row, (i + 1) // n16 * 16, lane)
            load_b(bf, (i + 1) % 2 * 4, pool, b_row + (i + 1) % n16 * 16, (i + 1) // n16 * 16, lane)
        mma_16x16(op, acc, i % n16 * 8, af, i // n16 % 2 * 4, bf, i % 2 * 4)


@T.inline
def warp_gemm_rn(op, acc, a, bf, pool, b_row, b_col, n16, k16, lane):
    """acc (16 x 16*n16) += A (register fragments a[kk*4 ..], k16 steps) . pool[b_row: +16*k16,
    b_col: +16*n16] (row-major [k][n], read transposed by ldmatrix), B double-buffered."""
    load_b_trans(bf, 0, pool, b_row, b_col, lane)
    for i in T.unroll(n16 * k16):
        if i + 1 < n16 * k16:
            load_b_trans(bf, (i + 1) % 2 * 4, pool, b_row + (i + 1) // n16 * 16, b_col + (i + 1) % n16 * 16, lane)
        mma_16x16(op, acc, i % n16 * 8, a, i // n16 * 4, bf, i % 2 * 4)


class SequenceTiles:
    """The tiles of a kernel's grid (x dimension) along queries or keys (`keys`), and where each
    lies.

    Dense: tile t covers rows [t BM, t BM + BM) of batch entry b. Packed sequences (`packed`)
    without dropout: each sequence gets its own tiles, as if called alone (flash-attn's varlen
    grid), so no tile spans two sequences and the other axis's tiles start at the sequence's
    first row: in the sequence table, sequence s owns tiles [start[s] // BM + s,
    + ceil(count[s] / BM)), which are disjoint and in order, all below rows // BM + sequences
    + 1; a tile between two ranges has no rows. `locate_tile` finds a tile's sequence with a
    binary search over the table (once per CTA). With dropout, packed sequences keep the
    shared tiles of the packed rows: its random numbers come in groups aligned to those rows,
    and every kernel must tile alike to draw the same mask."""

    def __init__(self, score, seqlen_q, seqlen_k, block: int, keys: bool = False):
        self.score, self.block = score, block
        self.packed = score.seqs is not None and score.dropout is None
        self.seqlen_q, self.seqlen_k = seqlen_q, seqlen_k
        self.column = 2 if keys else 0  # the tiled axis's start in the table's rows
        self.table = score.seqs.seqs if self.packed else None
        rows = seqlen_k if keys else seqlen_q
        self.count = rows // block + self.table.shape[0] + 1 if self.packed else (rows + block - 1) // block

    def registers(self) -> int:
        """int64 registers `locate_tile` fills: sequence, q start, q count, k start, k count."""
        return 5 if self.packed else 1

    def where(self, info, tile, b):
        """(batch index of the scores, the sequence's first query row and first key row in the
        tensors, the tile's first row in its sequence, the sequence's lengths Lq and Lk, the
        score pipeline in its coordinates) of grid tile `tile` of batch entry b, after
        `locate_tile`."""
        if not self.packed:
            return b, 0, 0, tile * self.block, self.seqlen_q, self.seqlen_k, self.score
        first = (tile - info[1 + self.column] // self.block - info[0]) * self.block
        return info[0], info[1], info[3], first, info[2], info[4], self.score.in_packed_sequence(info[2], info[4])


@T.inline
def locate_tile(tiles, info, tile):
    """info = [sequence, q start, q count, k start, k count] of the packed sequence owning
    grid tile `tile` (SequenceTiles): the last s whose first tile, start[s] // BM + s, is at or
    before it."""
    if tiles.packed:
        info[0] = T.int64(0)  # the answer lies in [info[0], info[1])
        info[1] = tiles.table.shape[0]
        for _ in T.serial(32):
            if info[1] - info[0] > 1:
                if T.Cast("int64", tiles.table[(info[0] + info[1]) // 2, tiles.column]) // tiles.block \
                        + (info[0] + info[1]) // 2 <= tile:
                    info[0] = (info[0] + info[1]) // 2
                else:
                    info[1] = (info[0] + info[1]) // 2
        for c in T.unroll(4):
            info[1 + c] = T.Cast("int64", tiles.table[info[0], c])


def query_rows(score, b, h, q_row0, rowv, lane):
    """softmax_tile's index for query rows q_row0 + 16 mt + lane / 4 + 8 hh of head h, with
    the rows' values (load_row_values) from the registers rowv."""
    n = score.row_values

    def index(mt, hh, col):
        slot = (mt * 2 + hh) * n
        row = tuple(rowv[slot + c] for c in range(n)) if n else None
        return ScoreIndex(b, h, q_row0 + mt * 16 + lane // 4 + hh * 8, col, row)
    return index


def row_values_size(score, n_mt: int) -> int:
    """Registers for the row values (score.row_values) of a lane's 2 * n_mt rows (>= 1)."""
    return max(score.row_values * n_mt * 2, 1)


@T.inline
def load_row_values(rowv, score, n_mt, b, h, q_row0, lane):
    """The row values of this lane's rows (g and g + 8 of each m-tile), once per query tile:
    inside the kv loop they would be reloaded per tile (loads do not move across its asm
    barriers), or per score."""
    for mt in T.unroll(n_mt):
        for hh in T.unroll(2):
            for c in T.unroll(score.row_values):
                rowv[(mt * 2 + hh) * score.row_values + c] = score.row_value(
                    b, h, q_row0 + mt * 16 + lane // 4 + hh * 8, c)


@T.inline
def exp2_into(dst, x):
    """dst = 2^x as one MUFU.EX2 (`ex2.approx.ftz`: results below 2^-126 flush to 0, -inf gives
    0); exp2f wraps it in a range test and two predicated scalings (H100 forward: 5% faster)."""
    T.ptx["ex2.approx.ftz.f32"](dst, x)


# 2^f on [-1/2, 1/2] as a cubic (relative error 7.5e-5: below the 16-bit P's rounding)
POLY_EXP2 = (0.9999280571937561, 0.6932609677314758, 0.2426111400127411, 0.0551716685295105)
ROUNDER = 12582912.0  # 1.5 x 2^23: x + ROUNDER holds round(x) in its low mantissa bits


@T.inline
def poly_exp2_into(buf, i, x):
    """buf[i] = 2^x on the FMA and integer pipes (FlashAttention-4's offload): x = n + f with
    n = round(x) (one add of ROUNDER, kept opaque so that no simplifier folds it away), 2^f
    by POLY_EXP2, 2^n added to its exponent bits. x is clamped at -125 (2^-125, not 0: for
    scores of unmasked tiles only). 7 instructions where MUFU.EX2 is one, but off the MUFU
    unit, which a softcap's tanh shares with the exponent."""
    rounded = T.alloc_local((1,), "float32")
    buf[i] = T.max(x, T.float32(-125))
    T.ptx["add.rn.f32"](rounded[0], buf[i], T.float32(ROUNDER))
    f = T.meta_var(buf[i] - (rounded[0] - T.float32(ROUNDER)))
    buf[i] = ((T.float32(POLY_EXP2[3]) * f + T.float32(POLY_EXP2[2])) * f + T.float32(POLY_EXP2[1])) * f \
        + T.float32(POLY_EXP2[0])
    buf[i] = T.reinterpret("float32", T.reinterpret("int32", buf[i])
                           + T.shift_left(T.reinterpret("int32", rounded[0]), 23))


def bound_values(score, axis: str, b, h, at, used: bool):
    """The values of query row `at` (axis "row": score.row_values) or key `at` ("col":
    col_values) that the scores of that row / key share, each bound once (TVM shares no loads
    between expressions), for ScoreIndex.row / .col; None if there are none or they are not
    `used` (the tile's scores take no modifiers)."""
    n = score.row_values if axis == "row" else score.col_values
    if not used or n == 0:
        return None
    value = score.row_value if axis == "row" else score.col_value
    return tuple(irb.bind(value(b, h, at, c)) for c in range(n))


def pick_values(per_half: list, hh):
    """per_half[hh] (bound_values of a thread's rows g and g + 8) for an unrolled loop's hh."""
    if per_half[0] is None:
        return None
    return tuple(unrolled_choice(list(pair), hh) for pair in zip(*per_half))


@T.inline
def modified_score(s, idx, score, scale, masked, ix):
    """s[idx]: a raw score -> its modified, scaled score in the exp2 domain (masked: True, False
    or BEYOND_BAND, `ScorePipeline.__call__`'s modes)."""
    if masked and not score.changes_values:  # masks pick the score or -inf: scale it in one multiply
        s[idx] = score(s[idx] * (scale * T.float32(LOG2E)), ix, masked)
    elif masked is not False or (score.changes_values and not score.additive):
        s[idx] = score(s[idx] * scale, ix, masked) * T.float32(LOG2E)
    elif score.changes_values:  # a bias: one multiply-add per score on top
        s[idx] = s[idx] * (scale * T.float32(LOG2E)) + score.bias(ix, T.float32(LOG2E))
    else:
        s[idx] = s[idx] * (scale * T.float32(LOG2E))


def offsets_in(band, first, width: int):
    """A band [lo, hi) of absolute indices as int32 offsets from `first`, clamped to [0, width]
    (bound once: the compares with a tile's constant offsets are then one instruction each)."""
    return tuple(irb.bind(tirx.Cast("int32", tirx.max(tirx.min(x - first, width), 0))) for x in band)


def band_offsets(score, index, mt, hh, first, width: int, wanted: bool):
    """(banded, lo, hi): where `wanted` and the pipeline's masks form a band
    (`ScorePipeline.row_band`: causal, window and the bounds), the offsets o in [0, width)
    from key `first` that row hh of m-tile mt keeps are lo <= o < hi (int32, bound once a
    row). Masking a score then takes two compares with constants: the masks' own index
    arithmetic, in int64 a score, made a causal diagonal tile cost ~3.4 unmasked ones (H200:
    22 instructions a score more; with the band, bf16 D=128 causal forwards 1.08x (16k) to
    1.20x (1k) faster, window (1024, 0) 1.73x). (False, None, None) where there is no band or
    the index moves keys (a sequence's coordinates)."""
    ix = index(mt, hh, first)
    band = score.row_band(ix.q_idx) if wanted and ix.kv_idx is first else None
    return (False, None, None) if band is None else (True, *offsets_in(band, first, width))


def offsets_of_rows(score, index, mt, first, width: int, wanted: bool) -> list:
    """band_offsets' (lo, hi) of a lane's rows g and g + 8 of m-tile mt, [None, None] where
    there is no band (for pick_values)."""
    bands = [band_offsets(score, index, mt, hh, first, width, wanted) for hh in range(2)]
    return [band[1:] if band[0] else None for band in bands]


@T.inline
def banded_score(s, idx, score, scale, lo, hi, offset, ix):
    """modified_score of a masked tile's score whose masks form a band (`band_offsets`): the
    value modifiers as on an unmasked tile (and the masks' work beyond the band, where a flex
    mask has more conjuncts: `ScorePipeline.band_rest`), -inf outside lo <= offset < hi."""
    modified_score(s, idx, score, scale, BEYOND_BAND if score.band_rest else False, ix)
    s[idx] = T.Select(tirx.all(lo <= offset, offset < hi), s[idx], NEG_INF)


def row_scores(s, mt, hh, ns):
    """The 2 * ns scores of a lane's row g (hh = 0) or g + 8 (hh = 1) of m-tile mt."""
    return [s[(mt * ns + nt) * 4 + hh * 2 + e] for nt in range(ns) for e in range(2)]


def pairwise(combine, values):
    """values reduced by `combine` as a balanced tree (log2(n) dependent steps, not n)."""
    while len(values) > 1:
        values = [combine(*values[i:i + 2]) if i + 1 < len(values) else values[i] for i in range(0, len(values), 2)]
    return values[0]


@T.inline
def raw_row_max(dst, i, m_row, s, mt, hh, ns, scale, log2_scale):
    """dst[i] = max(m_row, the row's max of raw scores, scaled): the min's under a negative scale."""
    if scale >= T.float32(0):
        dst[i] = T.max(m_row, pairwise(tirx.Max, row_scores(s, mt, hh, ns)) * log2_scale)
    else:
        dst[i] = T.max(m_row, pairwise(tirx.Min, row_scores(s, mt, hh, ns)) * log2_scale)


@T.inline
def row_exponents(s, m, l, alpha, mt, hh, ns, mx, raw, log2_scale, row_term=None, poly=0):
    """Row hh of m-tile mt with its new max mx (log2 units, in a register): the rescale factor
    into alpha, m and l moved to it, then P = exp2(S - mx) and its sum; `raw` scores take the
    scale in the same multiply-add. `row_term`: S holds scores without this row's share of a
    split bias (`split_bias_tile`), so P = exp2(S - (mx - row_term)). `poly` (raw scores): of
    each 8 n8 tiles, the first `poly` take `poly_exp2_into`, not MUFU.EX2."""
    exp2_into(alpha[mt * 2 + hh], m[mt * 2 + hh] - mx)
    m[mt * 2 + hh] = mx
    l[mt * 2 + hh] = l[mt * 2 + hh] * alpha[mt * 2 + hh]
    for nt in T.unroll(ns):
        for e in T.unroll(2):
            idx = T.meta_var((mt * ns + nt) * 4 + hh * 2 + e)
            if raw and nt % 8 < poly:
                poly_exp2_into(s, idx, s[idx] * log2_scale - mx)
            elif raw:
                exp2_into(s[idx], s[idx] * log2_scale - mx)  # one multiply-add
            elif row_term is not None:
                exp2_into(s[idx], s[idx] - (mx - row_term))
            else:
                exp2_into(s[idx], s[idx] - mx)
            l[mt * 2 + hh] = l[mt * 2 + hh] + s[idx]


def raw_values(score, scale, unmasked: bool):
    """(squashed, a, factor) for softmax_tile: on an unmasked tile of a pipeline whose only value
    modifier is a softcap (`ScorePipeline.squashed_values`), squashed with tanh's factor a and
    the cap as the factor of the kept values; else (False, None, scale)."""
    values = score.squashed_values(scale) if unmasked else None
    return (False, None, scale) if values is None else (True, *values)


@T.inline
def softmax_tile(s, m, l, mx, alpha, n_mt, ns, score, scale, index, k0, lane, masked, fold_scale=False, interleave=False,
                 poly=0):
    """One K/V tile of the forward's online softmax on accumulator fragments: n_mt m-tiles of
    16 rows, ns n8 tiles of scores S (k0: the tile's first key). Scores go to the exp2 domain;
    m is the running max and l this lane's partial row sum (two rows per m-tile: g and g + 8,
    shared by the 4 lanes of a quad). Leaves P = exp2(S - m) in s and the factor the output
    rows must be rescaled by in alpha. index(mt, hh, key): the ScoreIndex of the lane's row g
    (hh = 0) or g + 8 (hh = 1) of m-tile mt (`query_rows`). `fold_scale`: see `raw` below.
    `interleave` (with fold_scale): a lane's two rows' maxima, shuffles and exponents side by
    side (mx: 2 registers), for a warp that runs its softmax alone on its scheduler (the
    warp-specialized forward: 4-5% faster there; 1-5% slower in lockstep, where the other
    warpgroup's softmax hides the latency). `poly`: eighths of a squashed (softcap) tile's
    exponents that take `poly_exp2_into` (tanh and exp2 both on MUFU bound it)."""
    by_key = T.meta_var(score.col_values > 0 and (masked or score.changes_values))
    # With `fold_scale`, scores a tile leaves unmodified stay raw: their row max is taken first
    # and scaled once, then each exponent is one multiply-add (s * scale log2 e - max). Scaling
    # every score before the max cost a multiply per score: the wgmma forward issues ~10
    # instructions a score, and one fewer was 10-20% of its time. (The mma.sync forward, at two
    # m-tiles a warp, ran 4-20% slower with it on the H100: it keeps the scaled scores.)
    # A softcap alone (`squashed_values`: modified = c tanh(a s)) keeps tanh(a s) and goes the
    # raw way with c in place of the scale: 6 instructions a score, not 9.
    squashed, inner, factor = T.meta_var(raw_values(score, scale, fold_scale and not masked))
    raw = T.meta_var(fold_scale and not masked and (not score.changes_values or squashed))
    log2_scale = T.meta_var(factor * T.float32(LOG2E))  # factor: what the kept values are scaled by
    poly_tiles = T.meta_var(poly if squashed else 0)
    for mt in T.unroll(n_mt):
        if squashed:
            for i in T.unroll(ns * 4):
                s[mt * ns * 4 + i] = score.squash(s[mt * ns * 4 + i] * inner)
        if by_key:  # a key's two rows together: its column values (score.col_values) load once
            row_bands = T.meta_var(offsets_of_rows(score, index, mt, k0 + lane % 4 * 2, ns * 8, masked))
            for nt in T.unroll(ns):
                for e in T.unroll(2):
                    first = T.meta_var(index(mt, 0, k0 + lane % 4 * 2 + nt * 8 + e))
                    col = T.meta_var(bound_values(score, "col", first.b, first.h, first.kv_idx, True))
                    for hh in T.unroll(2):
                        idx = T.meta_var((mt * ns + nt) * 4 + hh * 2 + e)
                        ix = T.meta_var(with_kv_parts(index, mt, hh, base=k0 + lane % 4 * 2, offset=nt * 8 + e,
                                                      col=col))
                        band = T.meta_var(pick_values(row_bands, hh))
                        if band is not None:
                            banded_score(s, idx, score, scale, band[0], band[1], nt * 8 + e, ix)
                        else:
                            modified_score(s, idx, score, scale, masked, ix)
        if raw and interleave:  # both rows' maxima and shuffles side by side, then their exponents
            for hh in T.unroll(2):
                raw_row_max(mx, hh, m[mt * 2 + hh], s, mt, hh, ns, factor, log2_scale)
            for hh in T.unroll(2):
                mx[hh] = T.cuda.warp_max(mx[hh], width=4)
            for hh in T.unroll(2):
                row_exponents(s, m, l, alpha, mt, hh, ns, mx[hh], raw, log2_scale, poly=poly_tiles)
        else:
            for hh in T.unroll(2):
                if raw:
                    raw_row_max(mx, 0, m[mt * 2 + hh], s, mt, hh, ns, factor, log2_scale)
                else:
                    mx[0] = m[mt * 2 + hh]
                    banded, lo, hi = T.meta_var(band_offsets(score, index, mt, hh, k0 + lane % 4 * 2, ns * 8,
                                                             masked and not by_key))
                    for nt in T.unroll(ns):
                        for e in T.unroll(2):
                            idx = T.meta_var((mt * ns + nt) * 4 + hh * 2 + e)
                            ix = T.meta_var(with_kv_parts(index, mt, hh, base=k0 + lane % 4 * 2, offset=nt * 8 + e))
                            if banded:
                                banded_score(s, idx, score, scale, lo, hi, nt * 8 + e, ix)
                            elif not by_key:
                                modified_score(s, idx, score, scale, masked, ix)
                            mx[0] = T.max(mx[0], s[idx])
                mx[0] = T.cuda.warp_max(mx[0], width=4)
                row_exponents(s, m, l, alpha, mt, hh, ns, mx[0], raw, log2_scale, poly=poly_tiles)


def key_terms_size(score) -> int:
    """Registers for `load_key_terms` (>= 1)."""
    return 2 if score.splits_bias else 1


@T.inline
def load_key_terms(kt, score, b, h, lane):
    """A splitting bias's (`ScorePipeline.splits_bias`) slope x log2 e and that times a lane's
    first column offset (lane % 4 x 2), once a query tile: `split_bias_tile` forms its key terms
    from them (a column's is one multiply-add a tile; held for every column, 32 more registers
    spilled in the wgmma forward)."""
    if score.splits_bias:
        kt[0] = score.split_slope(b, h, T.float32(LOG2E))
        kt[1] = kt[0] * T.Cast("float32", lane % 4 * 2)


def split_key_term(scaled, kt, column, sign: int):
    """scaled +- the split bias's key term of a lane's column `column` (from `load_key_terms`'s
    kt): one multiply-add past the key term, which a lane's two rows share."""
    term = kt[1] + kt[0] * T.float32(column)
    return scaled + term if sign > 0 else scaled - term


def split_row_term(score, index, mt, hh, k0, kt, sign: int):
    """The split bias's term -sign x slope x log2 e x d of a lane's row hh of m-tile mt."""
    return kt[0] * T.float32(-sign) * score.split_offset(index(mt, hh, k0), k0)


@T.inline
def split_bias_tile(s, m, l, mx, alpha, n_mt, ns, score, scale, index, k0, kt, sign, interleave=False):
    """softmax_tile on an unmasked tile where the bias splits (`ScorePipeline.bias_side` gave
    `sign`, 1 or -1: ALiBi off its diagonal) into sign x (key term - row term): scores take the
    key term alone, S = s x scale + sign x slope x (key - k0) (one multiply-add; the key term is
    one more a column, from `load_key_terms`'s kt, shared by a lane's two rows), and a row's
    term r enters its max, max(m, max(S) + r), and its exponents, exp2(S - (max - r)), once a
    row. The full |distance| cost a subtraction, a multiply and a multiply-add a score (ALiBi's
    forward ran 35% over the plain one at 16k on the H200)."""
    log2_scale = T.meta_var(scale * T.float32(LOG2E))
    for mt in T.unroll(n_mt):
        for nt in T.unroll(ns):
            for e in T.unroll(2):
                for hh in T.unroll(2):
                    s[(mt * ns + nt) * 4 + hh * 2 + e] = split_key_term(
                        s[(mt * ns + nt) * 4 + hh * 2 + e] * log2_scale, kt, nt * 8 + e, sign)
        if interleave:
            for hh in T.unroll(2):
                mx[hh] = T.max(m[mt * 2 + hh], pairwise(tirx.Max, row_scores(s, mt, hh, ns))
                               + split_row_term(score, index, mt, hh, k0, kt, sign))
            for hh in T.unroll(2):
                mx[hh] = T.cuda.warp_max(mx[hh], width=4)
            for hh in T.unroll(2):
                row_exponents(s, m, l, alpha, mt, hh, ns, mx[hh], False, log2_scale,
                              split_row_term(score, index, mt, hh, k0, kt, sign))
        else:
            for hh in T.unroll(2):
                mx[0] = T.max(m[mt * 2 + hh], pairwise(tirx.Max, row_scores(s, mt, hh, ns))
                              + split_row_term(score, index, mt, hh, k0, kt, sign))
                mx[0] = T.cuda.warp_max(mx[0], width=4)
                row_exponents(s, m, l, alpha, mt, hh, ns, mx[0], False, log2_scale,
                              split_row_term(score, index, mt, hh, k0, kt, sign))


@T.inline
def unmasked_softmax_tile(s, m, l, mx, alpha, n_mt, ns, score, scale, index, k0, kv_hi, q_lo, q_hi, kt, lane,
                          fold_scale=False, interleave=False, poly=0):
    """softmax_tile for a tile [q_lo, q_hi) x [k0, kv_hi) that `tile_unmasked` proved whole:
    `split_bias_tile` where the bias splits there (kt: `load_key_terms`'s registers)."""
    side = T.meta_var(score.bias_side(q_lo, q_hi, k0, kv_hi))
    if side == 1:
        split_bias_tile(s, m, l, mx, alpha, n_mt, ns, score, scale, index, k0, kt, 1, interleave)
    elif side == -1:
        split_bias_tile(s, m, l, mx, alpha, n_mt, ns, score, scale, index, k0, kt, -1, interleave)
    else:
        softmax_tile(s, m, l, mx, alpha, n_mt, ns, score, scale, index, k0, lane, False, fold_scale, interleave, poly)


@T.inline
def to_a_fragments(s, p, n):
    """P (f32 accumulator fragments s) as p's 16-bit type: two n8 tiles are one A fragment."""
    for i in T.unroll(n):
        p[i] = T.Cast(p.dtype, s[i])


@T.inline
def rescale_rows(o, alpha, n_mt, nd):
    """Output accumulator rows times the factors `softmax_tile` left in alpha."""
    for mt in T.unroll(n_mt):
        for dd in T.unroll(nd):
            for i in T.unroll(4):
                o[(mt * nd + dd) * 4 + i] = o[(mt * nd + dd) * 4 + i] * alpha[mt * 2 + i // 2]


def row_reciprocal(l):
    """1 / l, or 0 for a row that saw no key (l = 0): the epilogues multiply by it, once a row
    (o / l per element compiles to IEEE divisions with their slow-path checks, a fifth of a
    1k-key forward's time)."""
    return T.Select(l == T.float32(0), T.float32(0), T.float32(1) / l)


@T.inline
def store_output(O, LSE, o, m, l, n_mt, nd, b, h, q_row0, seqlen_q, lane):
    """O = o / l and LSE = m ln2 + ln l of the rows of `online_softmax`; rows that saw no key
    (l = 0) get O = 0 and LSE = -inf. A row's 1 / l goes to a register first: as an expression
    each store repeated its division (32 IEEE divisions with slow-path calls a thread, at D=128)."""
    inv_l = T.alloc_local([2], "float32")
    for mt in T.unroll(n_mt):
        for hh in T.unroll(2):
            l[mt * 2 + hh] = T.cuda.warp_sum(l[mt * 2 + hh], width=4)
            row = T.meta_var(q_row0 + mt * 16 + lane // 4 + hh * 8)
            inv_l[hh] = row_reciprocal(l[mt * 2 + hh])
            if row < seqlen_q:
                for dd in T.unroll(nd):
                    for e in T.vectorized(2):
                        O[b, h, row, dd * 8 + lane % 4 * 2 + e] = T.Cast(
                            O.dtype, o[(mt * nd + dd) * 4 + hh * 2 + e] * inv_l[hh])
                if lane % 4 == 0:
                    LSE[b, h, row] = T.Select(l[mt * 2 + hh] == T.float32(0), NEG_INF,
                                              m[mt * 2 + hh] * T.float32(LN2) + T.log(l[mt * 2 + hh]))


@T.inline
def copy_row_stats(stats, slot, lse2, delta, b, h, q0, nrows, limit, tid, nthreads):
    """lse2 and delta of query rows q0.. into stats[slot, 0 | 1, :nrows] with 4-byte
    `cp.async` (rows at or past `limit` zero-filled)."""
    for it in T.unroll((2 * nrows + nthreads - 1) // nthreads):
        c = T.meta_var(tid + it * nthreads)
        row = T.meta_var(q0 + c % nrows)
        if 2 * nrows % nthreads == 0 or c < 2 * nrows:
            if c < nrows:
                T.ptx["cp.async.ca.shared.global"](
                    stats.ptr_to([slot, 0, c % nrows]), lse2.ptr_to([b, h, T.min(row, limit - 1)]),
                    4, T.Select(row < limit, T.uint32(4), T.uint32(0)))
            else:
                T.ptx["cp.async.ca.shared.global"](
                    stats.ptr_to([slot, 1, c % nrows]), delta.ptr_to([b, h, T.min(row, limit - 1)]),
                    4, T.Select(row < limit, T.uint32(4), T.uint32(0)))


def unmasked_exponent(raw, score, scale, ix, beyond_band=False):
    """A raw score's exp2-domain value where no mask applies: its value modifiers (if any) on
    the scaled score, times log2 e. `beyond_band`: a score masked by its band (`key_bands`),
    which also takes the masks' work beyond it where they have some (`ScorePipeline.band_rest`)."""
    if beyond_band and score.band_rest:
        return score(raw * scale, ix, BEYOND_BAND) * T.float32(LOG2E)
    if score.changes_values:
        return score(raw * scale, ix, False) * T.float32(LOG2E)
    return raw * (scale * T.float32(LOG2E))


def key_bands(score, key, first, width: int, wanted: bool) -> list:
    """[band of key, band of key + 8] (`offsets_in` of `ScorePipeline.key_band` from query
    `first`), or [None, None] where not `wanted` or the masks form no band."""
    bands = [score.key_band(key + kh * 8) if wanted else None for kh in range(2)]
    return [None, None] if bands[0] is None else [offsets_in(band, first, width) for band in bands]


@T.inline
def transposed_probability(s, p, stats, slot, score, scale, b, h, q0, key0, lane, masked, gs, lse2, nt, hh, e,
                           row, col, factored, band=None):
    """One score of `transposed_probabilities` (row, col: its ScoreIndex.row / .col; band:
    the key's queries as offsets (lo, hi) from q0 + lane % 4 * 2, where its masks form one,
    `ScorePipeline.key_band`)."""
    idx = T.meta_var(nt * 4 + hh * 2 + e)
    qc = T.meta_var(nt * 8 + lane % 4 * 2 + e)
    ix = T.meta_var(ScoreIndex(b, h, q0 + qc, key0 + lane // 4 + hh * 8, row, col=col))
    row_lse2 = T.meta_var(stats[slot, 0, qc] if lse2 is None else lse2[nt * 2 + e])
    if gs is not None:
        gs[idx] = score.grad(s[idx] * scale, ix)
    if factored:  # p = P, s = P x d modified / d score (the score's tanh is at hand here)
        prob = T.alloc_local([1], "float32")
        exp2_into(prob[0], score(s[idx] * scale, ix, masked) * T.float32(LOG2E) - row_lse2)
        p[idx] = T.Cast(p.dtype, prob[0])
        s[idx] = prob[0] * score.grad(s[idx] * scale, ix)
    elif masked and band is not None:
        keep = T.meta_var(tirx.all(band[0] <= nt * 8 + e, nt * 8 + e < band[1]))
        exp2_into(s[idx], T.Select(keep, unmasked_exponent(s[idx], score, scale, ix, True), NEG_INF) - row_lse2)
    elif masked:
        exp2_into(s[idx], score(s[idx] * scale, ix, True) * T.float32(LOG2E) - row_lse2)
    else:
        exp2_into(s[idx], unmasked_exponent(s[idx], score, scale, ix) - row_lse2)
    if not factored:
        p[idx] = T.Cast(p.dtype, s[idx])


@T.inline
def transposed_probabilities(s, p, stats, slot, nq8, score, scale, b, h, q0, key0, lane, masked, gs=None,
                             lse2=None, factored=False):
    """Scores S^T in s (rows keys from key0, nq8 n8 tiles of queries from q0) -> P^T =
    exp2(S^T scale log2e - lse2[query]) in s (fp32) and p (its 16-bit type); `gs` (modifiers
    whose gradient is not 1) takes d modified score / d score of each; `factored`: s takes P
    times it instead (p stays P). lse2[query] from stats[slot, 0], or from `lse2` (registers
    filled by `thread_row_stats`)."""
    modified = T.meta_var(masked or score.changes_values)
    # masks that form a band (causal, window): each key's queries as two offsets, up front
    bands = T.meta_var(key_bands(score, key0 + lane // 4, q0 + lane % 4 * 2, nq8 * 8,
                                 masked and gs is None and not factored))
    if modified and score.row_values + score.col_values > 0:
        # values loaded once: a thread's two keys' up front, each query's for its two keys
        keys = T.meta_var([bound_values(score, "col", b, h, key0 + lane // 4 + kh * 8, True) for kh in range(2)])
        for nt in T.unroll(nq8):
            for e in T.unroll(2):
                query = T.meta_var(bound_values(score, "row", b, h, q0 + nt * 8 + lane % 4 * 2 + e, True))
                for hh in T.unroll(2):
                    transposed_probability(s, p, stats, slot, score, scale, b, h, q0, key0, lane, masked, gs, lse2,
                                           nt, hh, e, query, pick_values(keys, hh), factored, pick_values(bands, hh))
    else:
        for nt in T.unroll(nq8):
            for hh in T.unroll(2):
                for e in T.unroll(2):
                    transposed_probability(s, p, stats, slot, score, scale, b, h, q0, key0, lane, masked, gs, lse2,
                                           nt, hh, e, None, None, factored, pick_values(bands, hh))


@T.inline
def thread_row_stats(dst, stats, slot, which, nq8, lane):
    """stats[slot, which] (0: lse2, 1: delta) of this thread's query columns in S^T fragments
    into dst[nt * 2 + e]: read ahead of a wgmma wait, the shared-memory latency hides under it."""
    for nt in T.unroll(nq8):
        for e in T.unroll(2):
            dst[nt * 2 + e] = stats[slot, which, nt * 8 + lane % 4 * 2 + e]


@T.inline
def dropout_rows(s, drop, n_mt, ns, b, h, q_row0, k0, lane, signed):
    """Dropout on P in S-layout fragments (n_mt m-tiles of 16 queries from q_row0, a multiple
    of 16; ns n8 tiles of keys from k0, a multiple of 32): s *= Z, or with `signed` s keeps
    P and is negated where dropped (the backward's dS reads Z back from the sign). One Philox
    call serves a thread's rows g, g + 8 and columns +8, +16, +24 (tvmflash/rng.py)."""
    for mt in T.unroll(n_mt):
        for nq in T.unroll(ns // 4):
            for e in T.unroll(2):
                w = T.meta_var(drop.words(b, h, q_row0 + mt * 16 + lane // 4, k0 + nq * 32 + lane % 4 * 2 + e))
                for hh in T.unroll(2):
                    for t in T.unroll(4):
                        idx = T.meta_var((mt * ns + nq * 4 + t) * 4 + hh * 2 + e)
                        z = T.meta_var(drop.factor(w, hh * 4 + t))
                        if signed:
                            s[idx] = T.Select(z > T.float32(0), s[idx], -s[idx])
                        else:
                            s[idx] = s[idx] * z


@T.inline
def dropout_cols_t(s, p, drop, nq8, b, h, q0, key0, lane):
    """Dropout on P^T in S^T-layout fragments (16 keys from key0, a multiple of 16; nq8 n8
    tiles of queries from q0, a multiple of 16) holding P: p = P Z (the dV operand), s keeps P,
    negated where dropped. A thread holds two of the four key rows of each call."""
    for nq in T.unroll(nq8 // 2):
        for e in T.unroll(2):
            w = T.meta_var(drop.words(b, h, q0 + nq * 16 + lane % 4 * 2 + e, key0 + lane // 4))
            for a in T.unroll(2):
                for hh in T.unroll(2):
                    idx = T.meta_var((nq * 2 + a) * 4 + hh * 2 + e)
                    z = T.meta_var(drop.factor(w, a * 4 + key0 // 8 % 4 + hh))
                    p[idx] = T.Cast(p.dtype, s[idx] * z)
                    s[idx] = T.Select(z > T.float32(0), s[idx], -s[idx])


def dropped_ds(drop, p_signed, dp, delta):
    """dS = P (dP Z - delta) from a sign-encoded P (dropout_rows / dropout_cols_t); without
    dropout P (dP - delta)."""
    if drop is None:
        return p_signed * (dp - delta)
    return T.abs(p_signed) * (T.Select(p_signed >= T.float32(0), dp * drop.scale, T.float32(0)) - delta)
