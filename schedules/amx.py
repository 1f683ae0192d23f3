"""Building blocks of the bf16 kernels (`amx_forward.py`, `amx_backward.py`): their matrix units
(`TILES`: AMX's tile GEMM and tile configuration; `PAIR_DOTS`: the same GEMM on avx512_bf16's
`vdpbf16ps`, for CPUs without AMX), bf16 bit packing, a 16-lane exp2 and dropout's factors
(Philox 16 calls a vector); and `vdpbf16ps` as the split-KV decode's pair products (`PAIR_DOT`).

AMX multiplies bf16 tiles into fp32 tiles: C (16 x 16 fp32) += A (16 rows x 32 bf16) . B, where
B holds 16 rows of VNNI pairs, B[p, n] = (b[2p, n], b[2p + 1, n]) as one 32-bit word. A is a
plain row-major bf16 matrix; B is the K-dim-paired layout the kernels build in packs. Tile
numbers are immediates: a 32 x 32 C block is tmm0-3, fed by A tiles tmm4-5 and B tiles tmm6-7.
`vdpbf16ps` takes the same operands a pair at a time: 16 lanes of C's row r += A's pair (r, 2p)
broadcast times B's row p, so the kernels are written once for both units.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tvm import tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import tirx as irb

from .. import rng
from ..kernels.common import F32
from ..kernels.decode import PairDot, lanes
from ..kernels.dropout import philox_ops

BF16 = "bfloat16"
PAIR = "uint32"  # two bf16 (a VNNI pair) of a tile operand built in the kernel; bf16 scratch
# buffers would not do: TVM legalises them to fp32
TILE = 16  # rows of an AMX tile; a row is 64 bytes: 32 bf16 or 16 fp32
BLOCK = 32  # C block edge (2 x 2 tiles); every GEMM dimension is a multiple of it


def _u32(value: int):
    return tirx.const(value, PAIR)


def _to_bf16(lo, hi):
    """vcvtne2ps2bf16 (avx512_bf16): 32 bf16 words, rounded to nearest even, lo's 16 fp32 lanes
    first (TVM would legalise a bf16 cast into integer arithmetic)."""
    return tirx.call_llvm_pure_intrin("int16x32", "llvm.x86.avx512bf16.cvtne2ps2bf16.512", hi, lo)


def bf16_row(lo, hi):
    """32 consecutive fp32 values (two fp32x16 vectors) as 32 bf16 in order: 16 words of a
    row-major bf16 A operand."""
    return tirx.reinterpret("uint32x16", _to_bf16(lo, hi))


# vdpbf16ps (avx512_bf16) takes <32 x bfloat> operands, which TIR cannot spell (its bf16 vectors
# are legalised to fp32 or passed as i16): an IR helper takes the words, LLVM inlines it
_DPBF16_IR = """define <16 x float> @tvmflash_dpbf16(<16 x float> %acc, <16 x i32> %a, <16 x i32> %b) #0 {
  %x = bitcast <16 x i32> %a to <32 x bfloat>
  %y = bitcast <16 x i32> %b to <32 x bfloat>
  %r = call <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float> %acc, <32 x bfloat> %x, <32 x bfloat> %y)
  ret <16 x float> %r
}
declare <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float>, <32 x bfloat>, <32 x bfloat>)
define <16 x i32> @tvmflash_pair_broadcast(ptr %row, i64 %i) #0 {
  %p = getelementptr i32, ptr %row, i64 %i
  %w = load i32, ptr %p, align 2
  %v = insertelement <16 x i32> poison, i32 %w, i64 0
  %b = shufflevector <16 x i32> %v, <16 x i32> poison, <16 x i32> zeroinitializer
  ret <16 x i32> %b
}
attributes #0 = { alwaysinline nounwind "target-features"="+avx512f,+avx512bf16" }
"""


def _pair_broadcast(row, i):
    """Word i (a bf16 pair) of the row at address `row`, in all 16 lanes: one 32-bit load."""
    return tirx.call_extern("uint32x16", "tvmflash_pair_broadcast", row, tirx.Cast("int64", i))


def _dpbf16(acc, a, b):
    return tirx.call_pure_extern("float32x16", "tvmflash_dpbf16", acc, tirx.reinterpret("int32x16", a),
                                 tirx.reinterpret("int32x16", b))


# the split-KV decode's bf16 pair products (kernels/decode.py) on avx512_bf16
PAIR_DOT = PairDot(dot=_dpbf16, pack=bf16_row, llvm_ir=_DPBF16_IR)


_INTERLEAVE = [x for m in range(16) for x in (m, m + 16)]


_ROW_LANES = tirx.Ramp(tirx.const(0, "int32"), tirx.const(1, "int32"), 16)  # row r of a 16-row gather


def gather_16(dtype: str, base, byte_offsets):
    """16 lanes of `dtype` ("int32x16": `vpgatherdd`, "float32x16": `vgatherdps`) from base +
    byte_offsets (int32x16), all lanes on."""
    intrin = {"int32x16": "llvm.x86.avx512.mask.gather.dpi.512", "float32x16": "llvm.x86.avx512.mask.gather.dps.512"}
    zero = tirx.Broadcast(tirx.const(0, dtype.split("x")[0]), 16)
    return tirx.call_llvm_pure_intrin(dtype, intrin[dtype], zero, base, byte_offsets,
                                      tirx.Broadcast(tirx.const(True, "bool"), 16), tirx.const(1, "int32"))


def word_column(src, b, h, r0, p, rows):
    """The 32-bit words src[b, h, r0 + r, 2p : 2p + 2] (a bf16 pair; of an fp32 `src`, element
    p) of rows r < 32, as two int32x16 (rows r0..r0+15, r0+16..r0+31; 0 for rows past `rows`),
    by two `vpgatherdd` (row indices clamped in bounds). A TIR load of a column gathers lane by
    lane (a 16-bit insert an element, which cost the AMX forward's V^T pack about a tenth of
    an L = 1024 call); emits its bindings into the statement being built. The gathers' 32-bit
    byte offsets count from the first row, so they stay within 31 rows whatever the sequence's
    length."""
    first = tirx.min(r0, rows - 1)
    row_elems = src.strides[2] if src.strides else src.shape[3]  # (a compact buffer has no strides)
    fp32 = src.dtype == F32
    row_bytes = tirx.Broadcast(tirx.Cast("int32", row_elems * (4 if fp32 else 2)), 16)
    last = tirx.Broadcast(tirx.Cast("int32", rows - 1 - first), 16)
    zero = tirx.Broadcast(tirx.const(0, "int32"), 16)
    base = tirx.address_of(src[b, h, first, p if fp32 else p * 2])
    words = []
    for half in range(2):
        row = tirx.Broadcast(tirx.Cast("int32", r0 - first + half * 16), 16) + _ROW_LANES  # from `first`
        gathered = gather_16("int32x16", base, tirx.min(row, last) * row_bytes)
        words.append(irb.bind(tirx.Select(row <= last, gathered, zero)))
    return words


def _store_row_bits(stage, r, src, b, h, row, keep, width: int) -> None:
    """stage[0, 0, r, :width] = the bits of src[b, h, row, :width] if `keep`, else 0 (one vector)."""
    lanes = tirx.Ramp(tirx.const(0, "int64"), tirx.const(1, "int64"), width)
    bits = tirx.reinterpret(f"uint16x{width}", tirx.BufferLoad(src, [b, h, row, lanes]))
    irb.buffer_store(stage, tirx.Select(keep, bits, tirx.Broadcast(tirx.const(0, "uint16"), width)),
                     [tirx.const(0, "int64"), tirx.const(0, "int64"), tirx.Cast("int64", r), lanes])


@T.inline
def stage_rows(stage, src, b, h, r0, rows, n, width):
    """stage[0, 0, r, :] = the bf16 bits of src[b, h, r0 + r, :width] (0 past `rows`), r < n, a
    row a vector copy: a tile's rows copied whole before `word_column` gathers their columns
    from the copy (L1). Gathered in place, rows a power of two of KB apart (flash_attn_func's
    (B, L, H, D) layout) share an L1 set, and each gather refetched its lines from L2: dev
    box, one thread, H = 16, D = 128, L = 1024: the forward's V^T pack 1.03 -> 0.67 ms
    (contiguous V 0.54-0.60), the backward's packs (Q and dO staged) 7.1 -> 3.7-4.0 ms
    (contiguous 3.0-4.0). The stage is uint16: TVM's bf16 legalization would keep a bf16
    buffer in fp32."""
    for r in T.serial(n):
        with T.sblock("stage_rows"):
            vr = T.axis.remap("S", [r])
            T.reads(src[b, h, T.min(r0 + vr, rows - 1), 0:width])
            T.writes(stage[0, 0, vr, 0:width])
            _store_row_bits(stage, vr, src, b, h, T.min(r0 + vr, rows - 1), r0 + vr < rows, width)


def column_16(src, rows_at: list, row_bytes):
    """The 16 fp32 src[rows_at + (r, ...)] of rows r < 16 of one column (rows `row_bytes` apart,
    row_bytes a 32-bit value) as one fp32x16, by one `vgatherdps`: TIR loads a column lane by
    lane (an insert an element)."""
    return gather_16("float32x16", tirx.address_of(src[tuple(rows_at)]),
                      _ROW_LANES * tirx.Broadcast(tirx.const(row_bytes, "int32"), 16))


def transpose_16(rows: list) -> list:
    """The 16 columns of a 16 x 16 block of 32-bit lanes given as its 16 rows (vectors), by
    four rounds of two-source shuffles, 64 in all (LLVM picks `vpermt2ps` / unpacks): each round
    swaps the off-diagonal h x h blocks of every 2h x 2h block, h = 8, 4, 2, 1. (A column by
    `vgatherdps` is 16 loads.) Expressions, not bindings: LLVM merges their shared subtrees, and
    a let per shuffle made TVM's codegen take ~7 s a transposing kernel (the forward and its packs
    built in 2x the time, no faster at run time)."""
    for h in (8, 4, 2, 1):
        keep = [tirx.const(c if not c & h else 16 + c - h, "int32") for c in range(16)]
        swap = [tirx.const(c + h if not c & h else 16 + c, "int32") for c in range(16)]
        nxt = list(rows)
        for i in (i for i in range(16) if not i & h):
            nxt[i] = tirx.Shuffle([rows[i], rows[i + h]], keep)
            nxt[i + h] = tirx.Shuffle([rows[i], rows[i + h]], swap)
        rows = nxt
    return rows


def store_fp32_row(dst, index: list, lo, hi) -> None:
    """dst[*index, c0 : c0 + 32] = 32 fp32 (two fp32x16, lo first), index's last entry c0."""
    *prefix, c0 = index
    for half, x in enumerate((lo, hi)):
        irb.buffer_store(dst, x, [*prefix, _ramp(dst, c0 + half * 16, 16)])


def store_bf16_row(dst, index: list, lo, hi) -> None:
    """dst[*index, c0 : c0 + 32] = bf16 of 32 fp32 (two fp32x16, lo first), index's last entry
    c0; rounded to nearest even by one `vcvtne2ps2bf16` (a bf16 cast would become integer
    arithmetic)."""
    *prefix, c0 = index
    c0 = tirx.Cast("int64", c0)  # in the buffer's index type: a mixed int32 Ramp crashes TVM's passes
    irb.buffer_store(dst, tirx.reinterpret("bfloat16x32", _to_bf16(lo, hi)),
                     [*prefix, tirx.Ramp(c0, tirx.const(1, "int64"), 32)])


def store_words(dst, prefix: list, r0, words) -> None:
    """dst[*prefix, r0 : r0 + 32] = `word_column`'s 32 words (as VNNI pairs)."""
    for half, w in enumerate(words):
        irb.buffer_store(dst, tirx.reinterpret(PAIR + "x16", w), [*prefix, tirx.Ramp(r0 + half * 16, 1, 16)])


_LOW_HALVES = [tirx.const(2 * i, "int32") for i in range(32)]
_HIGH_HALVES = [tirx.const(2 * i + 1, "int32") for i in range(32)]


def store_word_halves(dst, b, h, p, r0, words):
    """dst[b, h, 2p + e, r0 : r0 + 32] = half e of each of `word_column`'s 32 words: the
    transpose of a bf16 column pair, one shuffle a row."""
    halves = [tirx.reinterpret("int16x32", w) for w in words]
    for e, picks in enumerate((_LOW_HALVES, _HIGH_HALVES)):
        irb.buffer_store(dst, tirx.reinterpret("bfloat16x32", tirx.Shuffle(halves, picks)),
                         [b, h, p * 2 + e, tirx.Ramp(r0, 1, 32)])


def store_pair_columns(dst, b, h, p0, r0, halves) -> None:
    """dst[b, h, 2 (p0 + w) + e, r0 : r0 + 32] = half e of word w of 32 rows: `halves` holds
    `word_block_columns` of rows r0.. and r0 + 16.. (`store_word_halves` a word column)."""
    for w in range(16):
        store_word_halves(dst, b, h, p0 + w, r0, [columns[w] for columns in halves])


def fp32_column(src, b, h, r0, d, rows):
    """src[b, h, r0 + r, d] of an fp32 `src`, rows r < 32, as two fp32x16 (`word_column`)."""
    return [tirx.reinterpret("float32x16", w) for w in word_column(src, b, h, r0, d, rows)]


# fp32 operands under torch's float32 matmul precision "high" (schedules/amx_forward.py's bf16x3
# forward): x = hi + lo, hi x rounded to bf16 (to nearest even), lo the remainder (|lo| <= 2^-9
# |x|, exact in fp32) rounded to bf16 (error <= 2^-18 |x|), and a product a . b as
# hi.hi + hi.lo + lo.hi (avx512.SPLIT_SEGMENTS of them; the dropped lo.lo <= 2^-18 |a b|): ~16
# mantissa bits, what torch documents for "high" on bf16 hardware. (hi truncated instead: lo up to
# 2^-8 |x|, errors measured 4x larger.)
def split_bf16(x):
    """(hi, lo) of 16 fp32 lanes, both fp32: hi = x rounded to bf16 (its value exactly), lo =
    x - hi (exact; the caller rounds it to bf16)."""
    bits = tirx.reinterpret("uint32x16", x)
    v16 = lambda c: tirx.Broadcast(_u32(c), 16)  # noqa: E731
    rounded = bits + v16(0x7FFF) + ((bits >> v16(16)) & v16(1))
    hi = tirx.reinterpret("float32x16", rounded & v16(0xFFFF0000))
    return hi, x - hi


def word_block_columns(src, b, h, r0, w0, rows):
    """The 32-bit words src[b, h, r0 + r, 2 (w0 + w) : 2 (w0 + w) + 2] (bf16 pairs) of rows
    r < 16 and words w < 16 as 16 vectors, one per word w (its 16 rows' words): 16 row loads
    and `transpose_16`, 0 for rows past `rows` (row indices clamped in bounds). Where the
    same block by `word_column`'s gathers takes 16 loads a vector."""
    zero = tirx.Broadcast(_u32(0), 16)
    lanes = _ramp(src, w0 * 2, 32)
    row_words = []
    for r in range(16):
        bits = tirx.reinterpret("uint16x32", tirx.BufferLoad(src, [b, h, tirx.min(r0 + r, rows - 1), lanes]))
        row_words.append(irb.bind(tirx.Select(r0 + r < rows, tirx.reinterpret("uint32x16", bits), zero)))
    return transpose_16(row_words)


def store_word_columns(dst, r0, c0, columns) -> None:
    """dst[r0 + w, c0 : c0 + 16] = columns[w] (`word_block_columns`' words, as VNNI pairs)."""
    for w, column in enumerate(columns):
        irb.buffer_store(dst, column, [r0 + w, tirx.Ramp(c0, 1, 16)])


def key_row(src, b, h, row, rows, c0, lanes: int = 32):
    """`lanes` fp32 of src[b, h, row, c0 ..] as fp32x16 vectors, 0 for a row past `rows` (the
    row index clamped in bounds)."""
    zero = tirx.Broadcast(tirx.const(0.0, F32), 16)
    at = tirx.min(row, rows - 1)
    return [tirx.Select(row < rows, tirx.BufferLoad(src, [b, h, at, _ramp(src, c0 + 16 * v, 16)]), zero)
            for v in range(lanes // 16)]


# which part (0: hi, 1: lo) each segment of a bf16x3 operand holds along its GEMM's contraction:
# A operands (row-major bf16) [hi | hi | lo], B operands (VNNI pairs) [hi; lo; hi]
A_PARTS = (0, 0, 1)
B_PARTS = (0, 1, 0)


def _ramp(buf, start, lanes: int):
    """`lanes` consecutive indices of `buf`'s last axis from `start`, in the buffer's index type
    (a Ramp of another integer type crashes TVM's passes)."""
    dtype = buf.shape[-1].dtype if hasattr(buf.shape[-1], "dtype") else "int32"
    return tirx.Ramp(tirx.Cast(dtype, start), tirx.const(1, dtype), lanes)


def store_split_row(dst, first, values) -> None:
    """A bf16x3 A operand's 32 values (two fp32x16, `values`) in its segments: dst[first(s) ..
    + 32] <- part A_PARTS[s] as 32 bf16 (`first(s)`: the index list of the segment's first
    element; a PAIR `dst` takes them as 16 words)."""
    halves = [split_bf16(x) for x in values]
    parts = [irb.bind(_to_bf16(halves[0][part], halves[1][part])) for part in range(2)]
    words = dst.dtype == PAIR
    for segment, part in enumerate(A_PARTS):
        *prefix, last = first(segment)
        irb.buffer_store(dst, tirx.reinterpret(PAIR + "x16" if words else "bfloat16x32", parts[part]),
                         [*prefix, _ramp(dst, last, 16 if words else 32)])


def store_pair_rows(dst, p, cols, even, odd, segments: int) -> None:
    """K-dim rows 2p, 2p + 1 (the fp32x16 `even`, `odd`; columns `cols`, a Ramp) as VNNI pairs
    of a B operand built in a kernel (P for P.V, dS^T for dQ^T): dst[p, cols], or with
    `segments` (bf16x3) `store_split_pairs`' [hi; lo; hi], each segment a 1 / segments of
    dst's rows."""
    if segments == 1:
        irb.buffer_store(dst, bf16_pairs(even, odd), [p, cols])
    else:
        rows = dst.shape[0] // segments
        store_split_pairs(dst, lambda segment, _: [p + segment * rows, cols.base], [even], [odd])


def store_split_pairs(dst, first, even, odd) -> None:
    """A bf16x3 B operand's VNNI pairs of the fp32x16 rows `even[h]`, `odd[h]` (K-dim rows 2p,
    2p + 1; h: 16-column halves) in its segments: dst[first(s, h) .. + 16] <- part B_PARTS[s]."""
    for half, (e, o) in enumerate(zip(even, odd)):
        (e_hi, e_lo), (o_hi, o_lo) = split_bf16(e), split_bf16(o)
        parts = [irb.bind(bf16_pairs(e_hi, o_hi)), bf16_pairs(e_lo, o_lo)]
        for segment, part in enumerate(B_PARTS):
            *prefix, last = first(segment, half)
            irb.buffer_store(dst, parts[part], [*prefix, _ramp(dst, last, 16)])


def bf16_pairs(even, odd):
    """Two fp32x16 rows (K-dim rows 2p and 2p + 1) as 16 VNNI pairs of a B operand."""
    return tirx.reinterpret("uint32x16", tirx.Shuffle([_to_bf16(even, odd)], _INTERLEAVE))


# 2^f on [0, 1) by degree, near-minimax relative error: 4 -> 2.6e-6 (fp32 work: the bf16x3
# forward, tanh, the backward), 3 -> 7.5e-5 (bf16 probabilities, rounded to bf16's 3.9e-3 anyway)
EXP2_POLY = {4: (1.0000026226043701, 0.69300377368927, 0.24144287407398224, 0.05201142653822899, 0.013534124940633774),
             3: (0.9999252557754517, 0.695833146572113, 0.2260679006576538, 0.07802411168813705)}
REDUCE_FLOOR = 9  # vreduceps imm8: keep 0 fraction bits, round down (01), no precision exception


def exp2_16(x, degree: int = 4):
    """2^x of 16 fp32 lanes: f = x - floor(x) in one `vreduceps`, a polynomial in f of
    `degree` (EXP2_POLY) and `vscalefps`, which scales by 2^floor(x) from x itself (one
    instruction each where round, subtract and the generic fast_exp's exponent bits take six);
    exp(s) is exp2_16(s * log2(e)) with the factor folded into the caller's scale. Lanes with
    x <= -125 (masked scores are -inf) are zeroed by the scalef's own mask: exactly 0 (a fully
    masked row must keep l = 0), and never a denormal, whose microcode assist per vector made
    masked tiles several times slower than others. NaN stays NaN."""
    v16 = lambda c: tirx.Broadcast(tirx.const(c, F32), 16)  # noqa: E731
    f = tirx.call_llvm_pure_intrin("float32x16", "llvm.x86.avx512.mask.reduce.ps.512", x,
                                   tirx.const(REDUCE_FLOOR, "int32"), x, tirx.const(-1, "int16"),
                                   tirx.const(4, "int32"))
    poly = EXP2_POLY[degree]
    p = v16(poly[-1])
    for c in reversed(poly[:-1]):
        p = p * f + v16(c)
    scaled = tirx.call_llvm_pure_intrin("float32x16", "llvm.x86.avx512.mask.scalef.ps.512", p, x, p,
                                        tirx.const(-1, "int16"), tirx.const(4, "int32"))
    return tirx.Select(x <= v16(-125.0), v16(0.0), scaled)  # LLVM folds it into the scalef's zero-mask


def pair_bits(lo, hi):
    """Two bf16 values (buffer loads) as one VNNI pair: lo in the low half."""
    return tirx.Cast(PAIR, tirx.reinterpret("uint16", lo)) | (tirx.Cast(PAIR, tirx.reinterpret("uint16", hi)) << _u32(16))


def amx(name: str, *args):
    return tirx.call_llvm_intrin("void", f"llvm.x86.{name}", *args)


def tmm(i):
    return tirx.Cast("int8", i) if not isinstance(i, int) else tirx.IntImm("int8", i)


def row_bytes(nbytes):
    return tirx.Cast("int64", nbytes)


@T.inline
def configure_tiles(cfg):
    """Palette 1, eight tiles of 16 rows x 64 bytes (`cfg`: 64 bytes of scratch), once per task
    (tile state is per thread)."""
    with T.sblock("tile_config"):
        T.reads()
        T.writes(cfg[0:64])
        for c in T.serial(64):
            cfg[c] = T.uint8(0)
        cfg[0] = T.uint8(1)
        for n in T.serial(8):
            cfg[16 + 2 * n] = T.uint8(64)
            cfg[48 + n] = T.uint8(TILE)
        T.evaluate(amx("ldtilecfg", T.address_of(cfg[0])))


@T.inline
def release_tiles():
    """Hand the tile state back (end of a task)."""
    with T.sblock("tile_release"):
        T.reads()
        T.writes()
        T.evaluate(amx("tilerelease"))


@T.inline
def tile_gemm(c_at, c_ld, a_at, a_ld, b_at, b_ld, m, n, k, accumulate, rewalk=None):
    """C (m x n fp32) = [C +] A (m x k bf16) . B (k/2 x n pairs), in 32 x 32 blocks.

    x_at(row, col) is element (row, col) of operand x (a buffer element: C fp32, A bf16 or a
    pair holding (row, col) and (row, col + 1), B a pair, so B's rows are k/2); x_ld its row
    stride in bytes. `accumulate` loads C first, else starts from zero.

    The C blocks are visited so that one operand is walked again for every block of the outer
    loop while the other's block stays in L1 for the inner one: `rewalk` "a" or "b" names it;
    by default the smaller one, A (m x k) when m < n, else B (k x n), which then stays in L1
    itself (with 256 queries a block, Q^T and P^T, 64 KB, would otherwise be re-read from L2
    for each 32 keys or head dims). An operand too big for L1 is better walked again when it
    is the larger one: the smaller is then read from L2 once."""
    a_again = (m < n) if rewalk is None else rewalk == "a"
    for outer, inner in T.grid((n if a_again else m) // BLOCK, (m if a_again else n) // BLOCK):
        mb = T.meta_var(inner if a_again else outer)
        nb = T.meta_var(outer if a_again else inner)
        for c in T.unroll(4):
            if accumulate:
                T.evaluate(amx("tileloadd64", tmm(c), T.address_of(c_at(mb * BLOCK + c // 2 * TILE,
                                                                        nb * BLOCK + c % 2 * TILE)), row_bytes(c_ld)))
            else:
                T.evaluate(amx("tilezero", tmm(c)))
        for kc in T.serial(k // BLOCK):
            for x in T.unroll(2):
                T.evaluate(amx("tileloadd64", tmm(4 + x), T.address_of(a_at(mb * BLOCK + x * TILE, kc * BLOCK)),
                               row_bytes(a_ld)))
                T.evaluate(amx("tileloadd64", tmm(6 + x), T.address_of(b_at(kc * TILE, nb * BLOCK + x * TILE)),
                               row_bytes(b_ld)))
            T.evaluate(amx("tdpbf16ps", tmm(0), tmm(4), tmm(6)))
            T.evaluate(amx("tdpbf16ps", tmm(1), tmm(4), tmm(7)))
            T.evaluate(amx("tdpbf16ps", tmm(2), tmm(5), tmm(6)))
            T.evaluate(amx("tdpbf16ps", tmm(3), tmm(5), tmm(7)))
        for c in T.unroll(4):
            T.evaluate(amx("tilestored64", tmm(c), T.address_of(c_at(mb * BLOCK + c // 2 * TILE,
                                                                      nb * BLOCK + c % 2 * TILE)), row_bytes(c_ld)))


def _vector(element, lanes: int):
    """`lanes` consecutive elements of a buffer from `element` (a scalar BufferLoad) on."""
    *prefix, last = element.indices
    return tirx.BufferLoad(element.source, [*prefix, tirx.Ramp(last, 1, lanes)])


def _row_addresses(a_at, r0, rows: int) -> list:
    """Addresses of A's rows r0.. (column 0), bound once per register block: A's pairs loaded
    by TIR loads, whose index expressions hold the task's coordinates, took TVM's LLVM codegen
    ~20 s a kernel (the same kernels on tiles: ~5 s)."""
    return [irb.bind(tirx.address_of(a_at(r0 + r, 0))) for r in range(rows)]


def _pair_dot_step(acc, a_rows, b_at, c0, p, vecs: int) -> None:
    """acc[r][16v : 16v + 16] += A's pair (r, 2p) . B's row p, columns c0 + 16v.., for the
    block's rows r (`a_rows`: their addresses) and v < vecs: one `vdpbf16ps` each."""
    b_rows = [irb.bind(tirx.reinterpret("uint32x16", _vector(b_at(p, c0 + v * 16), 16))) for v in range(vecs)]
    for r, row in enumerate(a_rows):
        a = _pair_broadcast(row, p)
        for v in range(vecs):
            cols = lanes(tirx.const(v * 16, "int32"))
            irb.buffer_store(acc[r], _dpbf16(tirx.BufferLoad(acc[r], [cols]), a, b_rows[v]), [cols])


def _move_block(acc, c_at, r0, c0, rows: int, vecs: int, load: bool) -> None:
    """acc (a buffer a row) <- C's block at (r0, c0) if `load`, else C's block <- acc."""
    for r in range(rows):
        for v in range(vecs):
            cols = lanes(tirx.const(v * 16, "int32"))
            mem = _vector(c_at(r0 + r, c0 + v * 16), 16)
            if load:
                irb.buffer_store(acc[r], mem, [cols])
            else:
                irb.buffer_store(mem.source, tirx.BufferLoad(acc[r], [cols]), mem.indices)


def _zero_block(acc, vecs: int) -> None:
    for row in acc:
        irb.buffer_store(row, tirx.Broadcast(tirx.const(0.0, F32), vecs * 16),
                         [tirx.Ramp(tirx.const(0, "int32"), tirx.const(1, "int32"), vecs * 16)])


PAIR_DOT_ACCUMULATORS = 16  # zmm accumulators of a register block (of 32): rows x vectors


@T.inline
def pair_dot_gemm(c_at, c_ld, a_at, a_ld, b_at, b_ld, m, n, k, accumulate, rewalk=None):
    """`tile_gemm`'s product on `vdpbf16ps`, in register blocks of 16 accumulators (4 rows x 64
    columns where n allows, else 8 x 32) visited in `tile_gemm`'s order; the row strides are
    the buffers' own. The accumulators are a buffer a row (256 bytes: a stack slot, which LLVM
    keeps in registers; one 1 KB buffer would be a heap workspace, kept in memory)."""
    vecs = T.meta_var(4 if n % 64 == 0 else 2)
    rows = T.meta_var(PAIR_DOT_ACCUMULATORS // vecs)
    acc = T.meta_var([T.sblock_alloc_buffer((vecs * 16,), F32) for _ in range(rows)])
    a_again = T.meta_var((m < n) if rewalk is None else rewalk == "a")
    for outer, inner in T.grid((n // (vecs * 16)) if a_again else (m // rows),
                               (m // rows) if a_again else (n // (vecs * 16))):
        r0 = T.meta_var((inner if a_again else outer) * rows)
        c0 = T.meta_var((outer if a_again else inner) * (vecs * 16))
        if accumulate:
            _move_block(acc, c_at, r0, c0, rows, vecs, True)
        else:
            _zero_block(acc, vecs)
        a_rows = T.meta_var(_row_addresses(a_at, r0, rows))
        for p in T.serial(k // 2, annotations={"pragma_import_llvm": _DPBF16_IR}):
            _pair_dot_step(acc, a_rows, b_at, c0, p, vecs)
        _move_block(acc, c_at, r0, c0, rows, vecs, False)


@T.inline
def no_tile_config(cfg):
    """(`cfg` written all the same: the kernels allocate it, and s_tir wants it used)"""
    with T.sblock("tile_config"):
        T.reads()
        T.writes(cfg[0:1])
        cfg[0] = T.uint8(0)


@T.inline
def no_tile_release():
    T.evaluate(0)


@dataclass(frozen=True)
class MatrixUnit:
    """What the bf16 kernels' GEMMs run on: `gemm` (tile_gemm's signature), and what a task
    does before its first and after its last (`configure(cfg)`, `release()`)."""

    name: str
    gemm: Any
    configure: Any
    release: Any


TILES = MatrixUnit("amx", tile_gemm, configure_tiles, release_tiles)  # AMX: tdpbf16ps
PAIR_DOTS = MatrixUnit("avx512_bf16", pair_dot_gemm, no_tile_config, no_tile_release)  # vdpbf16ps


# ----------------------------------------------------------------------------- dropout
_LANE = tirx.Ramp(_u32(0), _u32(1), 16)


def _u32x16(value):
    return tirx.Broadcast(_u32(value) if isinstance(value, int) else value, 16)


# 16 Philox calls at once, their 64-bit products on vpmuludq (reinterpreting the lanes as 8 x
# uint64 instead, which gave the tightest code, made TVM's passes take time exponential in the
# rounds)
PHILOX_16 = philox_ops(16)


def philox_16(drop, words, b, h, q0, k0, kc, ic, v):
    """Philox calls (query call I0 + l % 8, key call J0 + 2 v + l // 8) for lanes l < 16, where
    I0, J0 are the first calls of the 16 queries from q0 + 16 ic and the 32 keys from k0 + 32 kc
    (q0, k0 multiples of 16 and 32; rng.call_of): their four words into words[v, 0:4, 0:16].
    Emits its bindings and stores into the block being built."""
    seed = drop.seed[tirx.const(0, "int64")]
    key = [_u32x16(tirx.Cast(PAIR, seed)), _u32x16(tirx.Cast(PAIR, seed >> tirx.const(32, "int64")))]
    counter = [_u32x16(tirx.Cast(PAIR, (k0 + kc * 32) // 32 * 8 + v * 2)) + (_LANE >> _u32x16(3)),
               _u32x16(tirx.Cast(PAIR, (q0 + ic * 16) // 16 * 8)) + (_LANE & _u32x16(7)),
               _u32x16(tirx.Cast(PAIR, b * drop.shape.heads + h)),
               _u32x16(tirx.Cast(PAIR, drop.seed[tirx.const(1, "int64")]))]
    for w, word in enumerate(rng.philox(counter, key, PHILOX_16)):
        irb.buffer_store(words, word, [v, w, tirx.Ramp(0, 1, 16)])


_CONCAT = [tirx.const(i, "int32") for i in range(16)]


def factor_rows(drop, words, zT, kc, ic):
    """Dropout's factors Z of 32 key rows x 16 queries (as `philox_16`'s) into zT[32 kc + r,
    16 ic + l] (S^T-shaped) from their 64 calls' words: key row r's call is J0 + r % 8 (vector
    r % 8 // 2, lanes 8 (r % 2) ..), and its 16 queries take their uniforms' slots a * 4 + t
    (a = query // 8 % 2, t = r // 8): 8 lanes of word t // 2 (a = 0), 8 of word 2 + t // 2."""
    threshold, scale = _u32x16(drop.threshold()), tirx.Broadcast(drop.scale, 16)
    zero = tirx.Broadcast(tirx.const(0.0, F32), 16)
    for r in range(32):
        t, v, lanes = r // 8, r % 8 // 2, tirx.Ramp(r % 2 * 8, 1, 8)
        word = tirx.Shuffle([words[v, t // 2, lanes], words[v, 2 + t // 2, lanes]], _CONCAT)
        uniform = (word >> _u32x16(t % 2 * rng.UNIFORM_BITS)) & _u32x16((1 << rng.UNIFORM_BITS) - 1)
        irb.buffer_store(zT, tirx.Select(uniform < threshold, scale, zero), [kc * 32 + r, tirx.Ramp(ic * 16, 1, 16)])


@T.inline
def dropout_tile_16(drop, zT, words, b, h, q0, k0, block_q, block_k):
    """Dropout's factors Z of a block_k x block_q S^T tile from (q0, k0) into zT, as
    `kernels/dropout.py`'s `dropout_tile` but with 16 Philox calls a vector (`words`: (4, 4, 16)
    uint32 scratch): the 32 keys x 16 queries of a block are 64 calls, four vectors."""
    for kc, ic in T.grid(block_k // 32, block_q // 16):
        for v in T.serial(4):
            with T.sblock("dropout_words"):
                vk, vi, vv = T.axis.remap("SSS", [kc, ic, v])
                philox_16(drop, words, b, h, q0, k0, vk, vi, vv)
        with T.sblock("dropout_factors"):
            vk, vi = T.axis.remap("SS", [kc, ic])
            factor_rows(drop, words, zT, vk, vi)


def amx_dropout_buffers(spec, block_q: int, block_k: int):
    """Shapes of a tile's dropout scratch (`dropout_tile_16`'s words, the S^T-shaped factors);
    1-element stand-ins without dropout."""
    if "dropout" not in spec.variants:
        return (1, 1, 1), (1, 1)
    return (4, 4, 16), (block_k, block_q)
