"""bf16 flash-attention forward on Intel AMX tiles (`tdpbf16ps`), fp32 softmax on AVX512.

Same algorithm and outputs as `forward.py` (one task per (batch, head, q-block), online softmax
over S^T tiles), but both matmuls run on AMX tiles (or, on avx512_bf16 CPUs without AMX, on
`vdpbf16ps` register blocks that take the same operands: `amx.MatrixUnit`), which need their
operands in particular layouts:

- S^T = K Q^T (block_k x block_q): A = K rows as stored (16 keys x 32 dims per tile), B = Q^T
  in VNNI pairs, qp[d/2, i] = (q[i, d], q[i, d+1]) (packed once per task);
- O^T += V^T P^T (head_dim x block_q): A = V^T (16 dims x 32 keys per tile), B = P^T in VNNI
  pairs, pp[j/2, i] = (p[j, i], p[j+1, i]): two rows of the S^T-shaped P tile, no transpose.

**Softmax** (the vector side costs as much as both matmuls). Scores are in log2 units (the
scale carries log2(e)) and P = 2^(t - m) uses a `vscalefps` exp2. The running max m moves
only when a block's max exceeds it by more than GROW, so P is computed with the old m in a
single pass that also checks that; only then (rare after the first block) is the block's max
taken, O^T and l rescaled and P recomputed. (Interleaving the tile units of the next and
previous blocks with this pass, so the tile and vector units would work at once, measured no
faster: the tile side is bound by its loads and stores, which the vector side shares.)

**Dropout** (flash-attn's semantics, `kernels/dropout.py`): each kv block's factors Z come
from its Philox words, 16 calls a vector, into an S^T-shaped tile (`amx.dropout_tile_16`), and
P is multiplied by them where it is packed for P.V; the row sums take the undropped P.

**fp32 as bf16x3** (torch's float32 matmul precision "high"; `bf16x3_supported`): the same
kernel on an fp32 spec splits each operand into bf16 hi + lo (`amx.split_bf16`) and runs both
GEMMs over a contraction three segments long, A [hi | hi | lo] . B [hi; lo; hi] (`amx.A_PARTS`,
`B_PARTS`): K's rows and each kv block's V^T columns from `forward_amx_pack_kernel`, Q's
pairs per task, P's pairs per block; fp32 outputs. Xeon, 16 threads: 1.47x torch's fp32 SDPA
forward (geomean, L {1k, 4k}, D {64, 128}; benchmarks/results/cpu-xeon-16core-fp32-high.json).

`forward_amx_pack_kernel` writes K (zero-padded rows) and V^T (zero-padded columns) once per
(batch, kv-head), padded to a multiple of `kv_pad` keys (the caller allocates them), so every
tile load is in bounds and padded keys give exactly 0 (their probabilities are set to 0).
Tiles are 16 rows x 64 bytes; a C block is 2x2 tiles (tmm0-3) fed by two A tiles (tmm4-5) and
two B tiles (tmm6-7). Q is not pre-scaled (scale is applied to the fp32 scores), so bf16
rounding of q*scale does not enter. Needs head_dim % 32 == 0 and block sizes that are
multiples of 32.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import tirx as irb

from ..spec import AttentionSpec
from .avx512 import SPLIT_SEGMENTS
from ..kernels.common import F32, LOG2E, NEG_INF, POS_INF, KernelArgs, Shape, fast_exp
from ..kernels.dropout import Dropout
from ..kernels.forward import declare_forward_args
from ..kernels.score_mods import ScoreIndex, ScorePipeline
from .amx import (BF16, PAIR, TILES, MatrixUnit, amx_dropout_buffers, dropout_tile_16, exp2_16, fp32_column,
                  key_row, store_bf16_row, store_fp32_row, store_pair_columns, store_pair_rows, store_split_pairs,
                  store_split_row, store_word_columns, transpose_16, word_block_columns)

LN2 = 0.6931471805599453
NEG_INF16 = tirx.Broadcast(NEG_INF, 16)


def amx_supported(spec: AttentionSpec) -> bool:
    """bf16 with head dims of multiples of 32."""
    return spec.dtype == BF16 and spec.head_dim % 32 == 0


def bf16x3_supported(spec: AttentionSpec) -> bool:
    """fp32 with head dims of multiples of 32: the bf16x3 forward (`forward_amx_kernel` on fp32
    specs) for torch's float32 matmul precision "high"."""
    return spec.dtype == F32 and spec.head_dim % 32 == 0 and not spec.kv_cache


def segments_of(spec: AttentionSpec) -> int:
    """Operand segments along each GEMM's contraction: 1 (bf16), `avx512.SPLIT_SEGMENTS` (fp32 as
    bf16x3: A [hi | hi | lo] . B [hi; lo; hi])."""
    return SPLIT_SEGMENTS if spec.dtype == F32 else 1


def score_modifiers(spec: AttentionSpec) -> bool:
    """Whether `spec` modifies scores (dropout acts on probabilities: `dropped`)."""
    return any(not isinstance(m, Dropout) for m in spec.modifiers())


def dropped(x, zT, j, cols, dropout: bool):
    """x (P for the P.V operand, the backward's dP) of key row j, queries `cols`, times
    dropout's factors Z (S^T-shaped `zT`, `amx.dropout_tile_16`) where `dropout`."""
    return x * zT[j, cols] if dropout else x


def z_rows(zT, j0, rows: int, cols: int, dropout: bool):
    """The region of `zT` a block reads (its 1-element stand-in without dropout)."""
    return zT[j0:j0 + rows, 0:cols] if dropout else zT[0:1, 0:1]


def modified(score: ScorePipeline, s, ix: ScoreIndex, masked: bool = True):
    """`score`'s modifiers without its bounds check (a compare per score): the kernel masks
    padded keys per key row and never stores padded queries (ix must be clamped in bounds).
    `masked=False` (tiles that `tile_unmasked` proves whole) applies only value modifiers."""
    return score.modify(s, ix, masked)


def rewritten_tile(score: ScorePipeline, has_mods: bool, whole, split, terms):
    """Whether the score pass rewrote a tile's S^T (modified, scaled): with value modifiers
    unless `exponent`'s `terms` take them on this tile (a `split` bias; a softcap's on whole
    tiles), for mask-only specs only on tiles not proven `whole` (score.tile_unmasked)."""
    if not has_mods:
        return tirx.const(False, "bool")
    if terms is not None:
        return tirx.Not(split) if terms[0] == "split" else tirx.Not(whole)
    if score.changes_values:
        return tirx.const(True, "bool")
    return tirx.Not(whole)


def split_tile(score: ScorePipeline, whole, q_lo, q_hi, kv_lo, kv_hi):
    """(split, side) of a tile: whether its S^T stays raw and its bias comes as `bias_terms`
    (a whole tile off ALiBi's diagonal, `ScorePipeline.splits_bias`), and the bias's side."""
    if not score.splits_bias:
        return tirx.const(False, "bool"), 0
    side = score.bias_side(q_lo, q_hi, kv_lo, kv_hi)
    side = tirx.const(side, "int32") if isinstance(side, int) else side
    return tirx.all(whole, side != 0), side


@T.inline
def bias_terms(score, split, side, keyterm, rowterm, b, h, q0, k0, block_k, block_q):
    """A split bias in log2 units, side x slope x ((key - k0) - d_row), as keyterm[key - k0] +
    rowterm[query - q0] (0 where the tile does not `split`), added in the exponent instead of
    a rewriting pass over S^T (Xeon, bf16 D=128 L=4096, same-process A/B: ALiBi's forward 0.78x
    -> 0.87x of plain; most of what remains is the running max moving, see benchmarks/HISTORY.md)."""
    per_key = T.meta_var(score.split_slope(b, h, T.float32(LOG2E)) * T.Cast(F32, side))
    for j in T.serial(block_k):
        with T.sblock("bias_key_terms"):
            vj = T.axis.remap("S", [j])
            keyterm[vj] = T.Select(split, per_key * T.Cast(F32, vj), T.float32(0))
    for i in T.serial(block_q):
        with T.sblock("bias_row_terms"):
            vi = T.axis.remap("S", [i])
            rowterm[vi] = T.Select(split, -per_key * score.split_offset(ScoreIndex(b, h, q0 + vi, None), k0),
                                   T.float32(0))


ROW_PAD = 16  # 4-byte words: rows of BQ words (a power of two of bytes) apart would put a tile's 16
# rows into 2-4 of the L1's 64 sets at BQ >= 128; 64 bytes more spread them over 16
GROW = 8.0  # log2 units: the running max moves only when a block's max passes it by more, so
# most steps skip the rescale; probabilities stay below 2^8 (exact in fp32 and in bf16's range)


def probabilities(t, key_inside, segments: int):
    """2^t of 16 queries (vectors), 0 for a padded key. A bf16 P.V operand (one segment) takes
    exp2's cubic: its 7.5e-5 relative error is 50x below P's rounding to bf16 and one multiply-add
    a vector fewer (dev box, one AMX core pair, bf16 D=128 L=1024 forward 1.025x faster); the
    bf16x3 forward's P (hi + lo, ~16 bits) keeps the quartic."""
    return tirx.Select(key_inside, exp2_16(t, 3 if segments == 1 else 4), tirx.Broadcast(tirx.const(0.0, F32), 16))


def exponent(sT, src_scale, j, cols, shift, terms):
    """s * src_scale - shift of key row j, 16 queries `cols`, with `terms` of the value
    modifiers that no pass wrote into S^T: ("split", keyterm, rowterm) a split bias
    (`bias_terms`), ("squash", inner, factor, whole) a lone softcap on `whole` tiles, its
    modified score c tanh(a s) taken here (`ScorePipeline.squashed_values`); ("small",
    coefficients) the same on rows that `small_scores` found within SMALL_SQUASH (`odd_tanh`)."""
    if terms is None:
        return sT[j, cols] * src_scale - shift
    if terms[0] == "split":
        _, keyterm, rowterm = terms
        return sT[j, cols] * src_scale + keyterm[j] - (shift - rowterm[cols])
    if terms[0] == "small":
        return odd_tanh(sT[j, cols], terms[1]) - shift
    _, inner, factor, whole = terms
    raw = sT[j, cols]
    return tirx.Select(whole, tanh_16(raw * (inner * T.float32(2 * LOG2E))) * factor, raw * src_scale) - shift


SMALL_SQUASH = 0.5  # |a s| up to which a softcap's tanh takes `odd_tanh`: scaled scores within half the cap
TANH_ODD = (1.0, -0.33326461911201477, 0.13185861706733704, -0.04422929137945175)  # tanh(x) ~ x sum c_k x^2k
# on |x| <= SMALL_SQUASH (abs error 2.2e-7 in fp32 evaluation, fitted with c_0 = 1 so tiny x stay exact)


def odd_tanh(s, coefficients):
    """c tanh(a s) log2(e) of 16 lanes with |a s| <= SMALL_SQUASH, as s P(s^2): `small_squash`'s
    `coefficients` fold a, c and log2(e) into TANH_ODD's, so three multiply-adds and a multiply
    take the place of `tanh_16`'s exp2, reciprocal and Newton step (fourteen operations)."""
    s2 = s * s
    p = tirx.Broadcast(coefficients[-1], 16)
    for c in reversed(coefficients[:-1]):
        p = p * s2 + tirx.Broadcast(c, 16)
    return s * p


def abs_max_16(a, b):
    """max(|a|, |b|) lane-wise in one `vrangeps` (imm 11: the larger magnitude, sign cleared); a
    NaN operand yields the other one, so an accumulator that starts finite stays a bound of every
    non-NaN lane it saw (NaN scores give NaN on either tanh path)."""
    return tirx.call_llvm_pure_intrin("float32x16", "llvm.x86.avx512.mask.range.ps.512", a, b,
                                      tirx.const(11, "int32"), a, tirx.const(-1, "int16"), tirx.const(4, "int32"))


@T.inline
def small_scores(sT, bound, small, j0, rows, block_q, limit):
    """small[0] = whether every |s| of S^T rows [j0, j0 + rows) is <= limit: one `abs_max_16` a
    vector into `bound` (a column's running bound: block_q / 16 independent chains), folded and
    compared once per call."""
    with T.sblock("small_scores"):
        T.reads(sT[j0:j0 + rows, 0:block_q], bound[0:block_q])
        T.writes(bound[0:block_q], small[0:1])
        for ic in T.serial(block_q // 16):
            bound[T.Ramp(ic * 16, 1, 16)] = sT[j0, T.Ramp(ic * 16, 1, 16)]
        for j, ic in T.grid(rows - 1, block_q // 16):
            bound[T.Ramp(ic * 16, 1, 16)] = abs_max_16(bound[T.Ramp(ic * 16, 1, 16)], sT[j0 + j + 1, T.Ramp(ic * 16, 1, 16)])
        for ic in T.serial(block_q // 16 - 1):
            bound[T.Ramp(0, 1, 16)] = abs_max_16(bound[T.Ramp(0, 1, 16)], bound[T.Ramp(ic * 16 + 16, 1, 16)])
        small[0] = 1
        for i in T.serial(16):  # (an ordered compare: a NaN first row goes the exact way)
            small[0] = T.min(small[0], T.Select(T.abs(bound[i]) <= limit, 1, 0))


def tanh_16(y2):
    """tanh(y) of 16 fp32 lanes from y2 = 2 y log2 e, as 1 - 2 / (2^y2 + 1) on `exp2_16` and a
    reciprocal estimate with one Newton step (relative error ~1e-7) rather than `vdivps`, the
    slowest zmm instruction here (the two measured alike within the Xeon's spread). y2 is
    capped at 64 (tanh is 1 in fp32 well before), so the reciprocal never sees infinity; below
    -125 exp2_16 gives 0 and tanh -1."""
    v16 = lambda c: tirx.Broadcast(tirx.const(c, F32), 16)  # noqa: E731
    d = exp2_16(tirx.min(y2, v16(64.0))) + v16(1.0)
    r = tirx.call_llvm_pure_intrin("float32x16", "llvm.x86.avx512.rcp14.ps.512", d, v16(0.0),
                                   tirx.const(-1, "int16"))
    return v16(1.0) - v16(2.0) * (r * (v16(2.0) - d * r))


def value_terms(score: ScorePipeline, scale, whole, keyterm, rowterm):
    """`exponent`'s terms for `score`'s tiles (None: S^T holds all it needs)."""
    if score.splits_bias:
        return ("split", keyterm, rowterm)
    squashed = score.squashed_values(scale)
    if squashed is not None:
        inner, cap = squashed
        return ("squash", inner, cap * T.float32(LOG2E), whole)
    return None


def small_squash(terms):
    """(terms, limit) for a softcap's chunks whose raw scores are all within `limit`, so that
    `exponent` may take `odd_tanh` (None, None for other terms)."""
    if terms is None or terms[0] != "squash":
        return None, None
    _, inner, factor, _ = terms
    return ("small", tanh_coefficients(inner, factor)), small_limit(inner)


def tanh_coefficients(inner, factor):
    """`odd_tanh`'s coefficients for factor x tanh(inner x s): TANH_ODD's c_k inner^(2k+1) factor."""
    return [T.float32(c) * factor * _power(inner, 2 * k + 1) for k, c in enumerate(TANH_ODD)]


def small_limit(inner):
    """The bound on |s| below which tanh(inner s) may take `odd_tanh`. Its coefficients stay
    normal numbers for |inner| >= 2^-16 (denormals would cost a microcode assist an operation);
    caps further above the scale than that take the exact tanh throughout (limit -1)."""
    return tirx.Select(T.abs(inner) >= T.float32(2.0 ** -16), T.float32(SMALL_SQUASH) / T.abs(inner), T.float32(-1))


def _power(x, n: int):
    return x if n == 1 else x * _power(x, n - 1)


def prefetch_l1(element):
    """Prefetch (read) the cache line of `element` into L1 (prefetcht0)."""
    return T.call_intrin("void", "tirx.prefetch", T.address_of(element), T.int32(0), T.int32(3), T.int32(1))


@T.inline
def softmax_pair(name, sT, src_scale, m, pp, ls, p, k0, seqlen_k, block_q, terms, zT, dropout, segments, prefetch=None):
    """Key rows 2p and 2p + 1 of a kv block's S^T: P = 2^(s * src_scale - m) for 16 queries per
    vector, written (times dropout's Z where `dropout`) as VNNI pairs of the P.V operand (in
    `segments`: `amx.store_pair_rows`) and added to the row sums `ls`."""
    with T.sblock(name):
        T.reads(sT[p * 2:p * 2 + 2, 0:block_q], m[0:block_q], ls[0:block_q], z_rows(zT, p * 2, 2, block_q, dropout))
        T.writes(pp[0:pp.shape[0], 0:block_q], ls[0:block_q])
        for ic in T.serial(block_q // 16):
            cols = T.meta_var(T.Ramp(ic * 16, 1, 16))
            # bound once (lets): LLVM does not merge the copies meta_vars would leave in the
            # branches it makes of the key checks
            e0 = probabilities(exponent(sT, src_scale, p * 2, cols, m[cols], terms), k0 + p * 2 < seqlen_k, segments)
            e1 = probabilities(exponent(sT, src_scale, p * 2 + 1, cols, m[cols], terms), k0 + p * 2 + 1 < seqlen_k,
                               segments)
            store_pair_rows(pp, p, cols, dropped(e0, zT, p * 2, cols, dropout),
                            dropped(e1, zT, p * 2 + 1, cols, dropout), segments)
            ls[cols] = ls[cols] + e0 + e1
        if prefetch is not None:  # (element of row r, line n) of the rows the next GEMM streams
            for r, n in T.grid(2, prefetch[1]):
                T.evaluate(prefetch_l1(prefetch[0](p * 2 + r, n)))


def whole_squash(terms):
    """A softcap's terms on a tile known to be whole (its select folds away)."""
    _, inner, factor, _ = terms
    return ("squash", inner, factor, tirx.const(True, "bool"))


@T.inline
def softmax_rows(name, sT, src_scale, m, pp, ls, p0, pairs, k0, seqlen_k, block_q, terms, small_terms, whole, small,
                 zT, dropout, segments, prefetch=None):
    """`softmax_pair` over key-row pairs [p0, p0 + pairs). A lone softcap's (`small_terms`) whole
    tiles take `odd_tanh` where `small_scores` set small[0] (0 on other tiles), else `tanh_16`;
    its other tiles are rewritten (modified, scaled) and take none of its terms."""
    if small_terms is None:
        for p in T.serial(pairs):
            softmax_pair(name, sT, src_scale, m, pp, ls, p0 + p, k0, seqlen_k, block_q, terms, zT, dropout, segments,
                         prefetch)
    else:
        if small[0] > 0:
            for p in T.serial(pairs):
                softmax_pair(name + "_small", sT, src_scale, m, pp, ls, p0 + p, k0, seqlen_k, block_q, small_terms,
                             zT, dropout, segments)
        elif whole:
            for p in T.serial(pairs):
                softmax_pair(name, sT, src_scale, m, pp, ls, p0 + p, k0, seqlen_k, block_q, whole_squash(terms), zT,
                             dropout, segments)
        else:
            for p in T.serial(pairs):
                softmax_pair(name + "_rewritten", sT, src_scale, m, pp, ls, p0 + p, k0, seqlen_k, block_q, None, zT,
                             dropout, segments)


def first_chunk_sets_max(has_mods: bool, dropout: bool) -> bool:
    """Whether the first kv block is chunked too, m set from its first chunk's max (with the
    usual GROW check: a later chunk well above it takes the block's max and P again): plain
    specs, where it spares the first block's pass over its whole S^T for the max (a quarter of
    an L = 1024 task's blocks)."""
    return not has_mods and not dropout


PREFETCH_ROW_ELEMENTS = 128  # K rows of at least this many bf16 (head dim 128; bf16x3's 3 x 64) are
# prefetched a chunk ahead (`next_chunk_prefetch`); at head dim 64 it measured nothing (dev box,
# 2 threads, same process: 0.99x at L = 1024 and 4096)


def next_chunk_prefetch(kp, b, hk, k0, row_elements: int):
    """What `softmax_pair` prefetches while a chunk's softmax runs: the K rows 32 keys on (the
    next chunk's, or the next block's first) into L1, a row's lines `(element(row, line),
    lines)`; None for short rows. The tile loads of K otherwise wait on L2: dev box, 2 threads,
    same process, bf16 D = 128 forward 1.04-1.06x faster at L = 1024, 1.10x at 4096."""
    if row_elements < PREFETCH_ROW_ELEMENTS:
        return None
    rows = kp.shape[2]
    return (lambda row, line: kp[b, hk, tirx.min(k0 + row + 32, rows - 1), line * 32], row_elements // 32)


def chunked_softmax(score: ScorePipeline, has_mods: bool, dropout: bool, later, whole, split, terms):
    """Whether a kv block takes P chunk by chunk, each 32 keys of S^T as the GEMM leaves them
    (in L1): a block after the first (whose max sets m; any block of a plain spec,
    `first_chunk_sets_max`) whose scores need no pass of their own:
    no dropout, no mask on the tile (all of a plain spec's tiles: its padded keys are 0 in
    `probabilities`), and value modifiers only where `exponent` takes them (`terms`: a lone
    softcap's on whole tiles, a split bias where the tile splits). Xeon, 16 threads, same
    process: bf16 L = 1024 / 4096 forward 1.02-1.06x faster (D = 128 L = 1024 within 1.5%),
    softcap's (D = 128) 1.07-1.10x."""
    if first_chunk_sets_max(has_mods, dropout):  # every block: the first one's first chunk sets m
        return tirx.const(True, "bool")
    if dropout:
        return tirx.const(False, "bool")
    if not score.changes_values or (terms is not None and terms[0] == "squash"):
        return tirx.all(later, whole)
    if terms is not None and terms[0] == "split":
        return tirx.all(later, whole, split)
    return tirx.const(False, "bool")


@T.inline
def qk_rows(unit, name, sT, kp, qp, b, hk, k0, j0, rows, head_dim, block_q, kp_row, row_bytes):
    """S^T rows [j0, j0 + rows) of a kv block from k0: K rows . Q^T pairs."""
    with T.sblock(name):
        T.reads(kp[b, hk, k0 + j0:k0 + j0 + rows, 0:head_dim], qp[0:head_dim // 2, 0:block_q])
        T.writes(sT[j0:j0 + rows, 0:block_q])
        unit.gemm(lambda r, c: sT[j0 + r, c], row_bytes, lambda r, c: kp[b, hk, k0 + j0 + r, c], kp_row,
                  lambda r, c: qp[r, c], row_bytes, rows, block_q, head_dim, False)


@T.inline
def block_max(sT, src_scale, tmax, k0, seqlen_k, block_k, block_q, terms=None, name="block_max"):
    """tmax = each query's max (with tmax's own) of s * src_scale (+ a split bias's `terms`)
    over the real keys of S^T's first `block_k` rows."""
    for j in T.serial(block_k):
        with T.sblock(name):
            T.reads(sT[j, 0:block_q], tmax[0:block_q])
            T.writes(tmax[0:block_q])
            for ic in T.serial(block_q // 16):
                cols = T.meta_var(T.Ramp(ic * 16, 1, 16))
                tmax[cols] = T.max(tmax[cols], T.Select(k0 + j < seqlen_k, exponent(
                    sT, src_scale, j, cols, tirx.Broadcast(T.float32(0), 16), terms), NEG_INF16))


@T.inline
def squashed_block_max(sT, tmax, tmin, block_k, block_q, inner, factor):
    """`block_max` of a lone softcap's whole tile: each query's largest c tanh(a s) log2(e) is
    that of its largest raw score (its smallest where a < 0: a negative scale), so tanh is taken
    once per query rather than once per score."""
    for ic in T.serial(block_q // 16):
        with T.sblock("squash_max_init"):
            vic = T.axis.remap("S", [ic])
            tmin[T.Ramp(vic * 16, 1, 16)] = tirx.Broadcast(POS_INF, 16)
    for j in T.serial(block_k):
        with T.sblock("squash_extremes"):
            vj = T.axis.remap("S", [j])
            T.reads(sT[vj, 0:block_q], tmax[0:block_q], tmin[0:block_q])
            T.writes(tmax[0:block_q], tmin[0:block_q])
            for ic in T.serial(block_q // 16):
                cols = T.meta_var(T.Ramp(ic * 16, 1, 16))
                tmax[cols] = T.max(tmax[cols], sT[vj, cols])
                tmin[cols] = T.min(tmin[cols], sT[vj, cols])
    for ic in T.serial(block_q // 16):
        with T.sblock("squash_max"):
            vic = T.axis.remap("S", [ic])
            cols = T.meta_var(T.Ramp(vic * 16, 1, 16))
            extreme = T.meta_var(T.Select(inner >= T.float32(0), tmax[cols], tmin[cols]))
            tmax[cols] = tanh_16(extreme * tirx.Broadcast(inner * T.float32(2 * LOG2E), 16)) * tirx.Broadcast(factor, 16)


@T.inline
def kv_block_max(sT, src_scale, tmax, tmin, k0, seqlen_k, block_k, block_q, terms, small_terms, whole):
    """`block_max`, a lone softcap's whole tiles by `squashed_block_max` (its rewritten ones
    without its terms)."""
    if small_terms is None:
        block_max(sT, src_scale, tmax, k0, seqlen_k, block_k, block_q, terms)
    else:
        if whole:
            squashed_block_max(sT, tmax, tmin, block_k, block_q, terms[1], terms[2])
        else:
            block_max(sT, src_scale, tmax, k0, seqlen_k, block_k, block_q, None)


def diagonal_walk(step, kb_lo, kb_hi, q0, seqlen_q, seqlen_k, block_q: int, block_k: int):
    """The kv block that step `step` (kb_lo, kb_lo + 1, ...) of a q-block from q0 visits: from
    the block of the q-block's middle row's diagonal down to kb_lo, then up from the block after
    it (ALiBi: each row's largest biases lie at its diagonal and fall away from it, so the
    running max is set early and moves at most once more, for rows whose diagonal lies further
    up; in key order a causal call's max rose with every block, each a rescale of O and a second
    softmax pass). The kernel stores the index in a buffer: one the block bodies could see
    through (a floormod of the step) made TVM's simplifier take minutes on ALiBi modules."""
    t = step - kb_lo
    middle = (q0 + block_q // 2 + seqlen_k - seqlen_q) // block_k
    first = tirx.min(tirx.max(middle, kb_lo), kb_hi - 1)
    return tirx.Select(t <= first - kb_lo, first - t, kb_lo + t)


def stage_output_rows(stage, accT, d0, i0, inv) -> None:
    """stage[r, 0:32] = accT[d0 : d0 + 32, i0 + r] * inv[i0 + r] (= 1 / l), r < 16: 16 rows of
    the output from O^T's columns, by `transpose_16` of its rows (one L = 1024 task's 512
    column gathers cost ~4% of its time)."""
    cols = tirx.Ramp(i0, 1, 16)
    scale = irb.bind(inv[cols])
    for half in range(2):
        rows = [irb.bind(accT[d0 + half * 16 + r, cols] * scale) for r in range(16)]
        for r, row in enumerate(transpose_16(rows)):
            irb.buffer_store(stage, row, [r, tirx.Ramp(half * 16, 1, 16)])


def forward_amx_pack_kernel(spec: AttentionSpec, kv_pad: int, with_k: bool = True, block_k: int = 0) -> tirx.PrimFunc:
    """The forward's K and V^T operands, once per call, 32 keys a task, 0 past Lk up to the
    padded length (a multiple of `kv_pad`). bf16: kp[b, h, j, d] = K, vt[b, h, d, j] = V^T,
    `forward_pack` (k, v, kp, vt); without `with_k` V^T only, `forward_pack_vt` (v, vt), for
    keys that need no padding, whose K the forward's tile loads read in place (any row stride).
    fp32 (the bf16x3 forward, `forward_pack_bf16x3` (k, v, kp, vt)): kp's rows K's [hi | hi |
    lo] (3 head_dim bf16), vt's rows each kv block's `block_k` keys as [hi | hi | lo] (block kb's
    segment s at columns 3 kb block_k + s block_k ..), so both GEMMs take their contraction 3x
    as long in one pass."""
    D, S = spec.head_dim, segments_of(spec)
    shape = Shape.fresh()
    B, HK, LK = shape.batch, shape.heads_k, shape.seqlen_k
    LKP = tirx.Var("seqlen_k_padded", "int64")
    args = KernelArgs()
    CH = 32  # keys per task
    assert kv_pad % CH == 0 and (S == 1 or (with_k and block_k % CH == 0 and kv_pad % block_k == 0))

    def declare():
        k = args.tensor("k", (B, HK, LK, D), spec.dtype) if with_k else None
        v = args.tensor("v", (B, HK, LK, D), spec.dtype)
        kp = args.tensor("kp", (B, HK, LKP, S * D), BF16) if with_k else None
        vt = args.tensor("vt", (B, HK, D, S * LKP), BF16)
        return k, v, kp, vt

    @T.prim_func(s_tir=True)
    def pack():
        T.func_attr({"tirx.noalias": True})
        K, V, KP, VT = T.meta_var(declare())
        NCH = T.meta_var(LKP // CH)
        for t in T.parallel(B * HK * NCH):
            with T.sblock("tile"):
                vb = T.axis.spatial(B, t // (HK * NCH))
                vh = T.axis.spatial(HK, t // NCH % HK)
                vc = T.axis.spatial(NCH, t % NCH)
                j0 = T.meta_var(vc * CH)
                if S == 1:
                    if with_k:
                        for j, d in T.grid(CH, D):
                            with T.sblock("pack_k"):
                                vj, vd = T.axis.remap("SS", [j, d])
                                KP[vb, vh, j0 + vj, vd] = T.Select(
                                    j0 + vj < LK, K[vb, vh, T.min(j0 + vj, LK - 1), vd], T.bfloat16(0))
                    for wb in T.serial(D // 32):  # V^T's rows 32 dims at a time from V's 16 x 16 word blocks
                        with T.sblock("pack_vT"):
                            vwb = T.axis.remap("S", [wb])
                            T.reads(V[vb, vh, 0:LK, vwb * 32:vwb * 32 + 32])
                            T.writes(VT[vb, vh, vwb * 32:vwb * 32 + 32, j0:j0 + CH])
                            store_pair_columns(VT, vb, vh, vwb * 16, j0, [
                                word_block_columns(V, vb, vh, j0 + half * 16, vwb * 16, LK) for half in range(2)])
                else:
                    for j, c in T.grid(CH, D // 32):
                        with T.sblock("pack_k_split"):
                            vj, vcc = T.axis.remap("SS", [j, c])
                            T.reads(K[vb, vh, T.min(j0 + vj, LK - 1), vcc * 32:vcc * 32 + 32])
                            T.writes(KP[vb, vh, j0 + vj, 0:S * D])
                            store_split_row(KP, lambda s: [vb, vh, j0 + vj, s * D + vcc * 32],
                                            key_row(K, vb, vh, j0 + vj, LK, vcc * 32))
                    # the chunk's columns in its kv block's segments
                    col = T.meta_var(j0 // block_k * (S * block_k) + j0 % block_k)
                    for d in T.serial(D):
                        with T.sblock("pack_vt_split"):
                            vd = T.axis.remap("S", [d])
                            T.reads(V[vb, vh, 0:LK, vd])
                            T.writes(VT[vb, vh, vd, 0:S * LKP])
                            store_split_row(VT, lambda s: [vb, vh, vd, col + s * block_k],
                                            fp32_column(V, vb, vh, j0, vd, LK))

    name = "forward_pack_bf16x3" if S > 1 else "forward_pack" if with_k else "forward_pack_vt"
    return pack.with_attr("global_symbol", name)


def forward_amx_kernel(spec: AttentionSpec, block_q: int, block_k: int, kv_pad: int,
                       name: str = "forward", unit: MatrixUnit = TILES) -> tirx.PrimFunc:
    """`kv_pad`: the packed K / V^T length is a multiple of it (block_k must divide it); `name`
    the module function; `unit` what its GEMMs run on (amx.TILES or amx.PAIR_DOTS). An fp32
    spec gives the bf16x3 forward: its packs from `forward_amx_pack_kernel`, Q's pairs and P
    split likewise (`segments_of`), the GEMMs' contractions 3x as long, fp32 outputs."""
    assert (amx_supported(spec) or bf16x3_supported(spec)) and block_q % 32 == 0 and block_k % 32 == 0
    assert kv_pad % block_k == 0
    D, BQ, BK = spec.head_dim, block_q, block_k
    SEG = segments_of(spec)
    ROW = BQ + ROW_PAD  # row length of the tile operands built here (qp, sT, pp, accT)
    shape = Shape.fresh()
    B, H, HK, LQ, LK = shape.batch, shape.heads, shape.heads_k, shape.seqlen_q, shape.seqlen_k
    LKP = tirx.Var("seqlen_k_padded", "int64")
    packed = KernelArgs()
    has_mods = score_modifiers(spec)
    dropout = "dropout" in spec.variants
    WORDS_SHAPE, Z_SHAPE = amx_dropout_buffers(spec, BQ, BK)
    PAIRS = BK // 2

    def declare():
        q, k, v, o, lse, scale, score = declare_forward_args(spec, shape)
        kp = packed.tensor("kp", (B, HK, LKP, SEG * D), BF16)
        vt = packed.tensor("vt", (B, HK, D, SEG * LKP), BF16)
        return q, o, lse, scale, score, kp, vt

    @T.prim_func(s_tir=True)
    def fwd():
        T.func_attr({"tirx.noalias": True})
        Q, O, LSE, scale, score, KP, VT = T.meta_var(declare())
        NQB = T.meta_var((LQ + BQ - 1) // BQ)
        kp_row, vt_row = T.meta_var((KP.strides[2] * 2, VT.strides[2] * 2))  # bytes
        for t in T.parallel(B * H * NQB):
            with T.sblock("tile"):
                vb = T.axis.spatial(B, t // (H * NQB))
                vh = T.axis.spatial(H, t // NQB % H)
                vqb = T.axis.spatial(NQB, t % NQB)
                cfg = T.sblock_alloc_buffer((64,), "uint8")
                qp = T.sblock_alloc_buffer((SEG * D // 2, ROW), PAIR)
                m = T.sblock_alloc_buffer((BQ,), F32)  # running max, log2 units
                l = T.sblock_alloc_buffer((BQ,), F32)
                inv = T.sblock_alloc_buffer((BQ,), F32)  # 1 / l (0 for fully masked rows)
                o_rows = T.sblock_alloc_buffer((16, 32), F32)  # 16 output rows' 32 dims (stage_output_rows)
                accT = T.sblock_alloc_buffer((D, ROW), F32)
                sT = T.sblock_alloc_buffer((BK, ROW), F32)  # a kv block's S^T (modified in place)
                pp = T.sblock_alloc_buffer((SEG * PAIRS, ROW), PAIR)
                walk = T.sblock_alloc_buffer((1,), "int64")  # the kv block a step visits (diagonal_walk)
                vhk = T.meta_var(vh // (H // HK))
                q0 = T.meta_var(vqb * BQ)
                kb_lo, kb_hi = T.meta_var(score.kv_blocks(q0, T.min(q0 + BQ, LQ), BK))
                unit.configure(cfg)
                if SEG == 1:  # Q^T's pairs: Q's 16 x 16 blocks of words, transposed
                    for pb, ib in T.grid(D // 32, BQ // 16):
                        with T.sblock("pack_q"):
                            vpb, vib = T.axis.remap("SS", [pb, ib])
                            T.reads(Q[vb, vh, 0:LQ, vpb * 32:vpb * 32 + 32])
                            T.writes(qp[vpb * 16:vpb * 16 + 16, vib * 16:vib * 16 + 16])
                            store_word_columns(qp, vpb * 16, vib * 16,
                                               word_block_columns(Q, vb, vh, q0 + vib * 16, vpb * 16, LQ))
                else:
                    for p, c in T.grid(D // 2, BQ // 32):
                        with T.sblock("pack_q_split"):
                            vp, vc = T.axis.remap("SS", [p, c])
                            T.reads(Q[vb, vh, 0:LQ, vp * 2:vp * 2 + 2])
                            T.writes(qp[0:SEG * D // 2, vc * 32:vc * 32 + 32])
                            store_split_pairs(qp, lambda s, h: [vp + s * (D // 2), vc * 32 + h * 16],
                                              fp32_column(Q, vb, vh, q0 + vc * 32, vp * 2, LQ),
                                              fp32_column(Q, vb, vh, q0 + vc * 32, vp * 2 + 1, LQ))
                for i in T.serial(BQ):
                    with T.sblock("init_ml"):
                        vi = T.axis.remap("S", [i])
                        m[vi] = T.min_value(F32)
                        l[vi] = T.float32(0)
                for d, i in T.grid(D, BQ):
                    with T.sblock("init_acc"):
                        vd, vi = T.axis.remap("SS", [d, i])
                        accT[vd, vi] = T.float32(0)
                # the row padding, written once so that buffer compaction (which keeps what is
                # accessed; the tile instructions only name each tile's first element) keeps it
                for r, i in T.grid(D, ROW_PAD):
                    with T.sblock("touch_padding"):
                        vr, vi = T.axis.remap("SS", [r, i])
                        accT[vr, BQ + vi] = T.float32(0)
                        sT[vr % BK, BQ + vi] = T.float32(0)
                        qp[vr % (SEG * D // 2), BQ + vi] = T.uint32(0)
                        pp[vr % (SEG * PAIRS), BQ + vi] = T.uint32(0)
                for kb in T.serial(kb_lo, kb_hi):
                    with T.sblock("kv_step"):
                        vkb = T.axis.opaque((LK + BK - 1) // BK, kb)
                        tmax = T.sblock_alloc_buffer((BQ,), F32)
                        alpha = T.sblock_alloc_buffer((BQ,), F32)
                        ls = T.sblock_alloc_buffer((BQ,), F32)
                        grow = T.sblock_alloc_buffer((2,), "int32")  # m may move, m moves
                        keyterm = T.sblock_alloc_buffer((BK,), F32)  # a split bias (bias_terms)
                        rowterm = T.sblock_alloc_buffer((BQ,), F32)
                        zT = T.sblock_alloc_buffer(Z_SHAPE, F32)  # dropout's factors Z (S^T-shaped)
                        words = T.sblock_alloc_buffer(WORDS_SHAPE, "uint32")  # and Philox words
                        if score.splits_bias:
                            with T.sblock("walk_step"):
                                walk[0] = diagonal_walk(vkb, kb_lo, kb_hi, q0, LQ, LK, BQ, BK)
                        # (vkb stays the step's index: `vkb == kb_lo` below means the first step
                        # visited, whichever block the walk gives it)
                        k0 = T.meta_var(walk[0] * BK if score.splits_bias else vkb * BK)
                        for i in T.serial(BQ):
                            with T.sblock("init_stats"):
                                vi = T.axis.remap("S", [i])
                                tmax[vi] = NEG_INF
                                ls[vi] = T.float32(0)
                        whole = T.meta_var(score.tile_unmasked(q0, q0 + BQ, k0, k0 + BK))
                        split, side = T.meta_var(split_tile(score, whole, q0, q0 + BQ, k0, k0 + BK))
                        terms = T.meta_var(value_terms(score, scale, whole, keyterm, rowterm))
                        small_terms, squash_limit = T.meta_var(small_squash(terms))
                        bound = T.sblock_alloc_buffer((BQ,), F32)  # small_scores' per-column bounds
                        # whether a chunk's / the whole tile's scores lie within squash_limit (a
                        # chunked tile's pass again, `softmax_redo`, needs all of its chunks')
                        small = T.sblock_alloc_buffer((1,), "int32")
                        small_tile = T.sblock_alloc_buffer((1,), "int32")
                        tmin = T.sblock_alloc_buffer((BQ,), F32)  # (squashed_block_max)
                        with T.sblock("small_none"):
                            small[0] = 0
                            small_tile[0] = 0
                        if score.splits_bias:
                            bias_terms(score, split, side, keyterm, rowterm, vb, vh, q0, k0, BK, BQ)
                        # exponents in log2 units: raw scores carry the scale, modified ones are scaled
                        # already (a whole tile of a mask-only spec is left raw)
                        rewritten = T.meta_var(rewritten_tile(score, has_mods, whole, split, terms))
                        src_scale = T.meta_var(T.Select(rewritten, T.float32(LOG2E), scale * T.float32(LOG2E)))
                        next_k_rows = T.meta_var(next_chunk_prefetch(KP, vb, vhk, k0, SEG * D))
                        chunked = T.meta_var(chunked_softmax(score, has_mods, dropout, vkb > kb_lo, whole, split, terms))
                        if chunked:  # S^T 32 keys at a time, each chunk's P taken while it is in L1
                            for c in T.serial(BK // 32):
                                qk_rows(unit, "qk_chunk", sT, KP, qp, vb, vhk, k0, c * 32, 32, SEG * D, BQ, kp_row, ROW * 4)
                                if small_terms is not None:  # a softcap's chunk of small scores: odd_tanh
                                    small_scores(sT, bound, small, c * 32, 32, BQ, squash_limit)
                                    with T.sblock("small_tile"):
                                        small_tile[0] = T.Select(c == 0, small[0], T.min(small_tile[0], small[0]))
                                if first_chunk_sets_max(has_mods, dropout):
                                    if tirx.all(vkb == kb_lo, c == 0):
                                        block_max(sT, src_scale, m, k0, LK, 32, BQ, None, "first_chunk_max")
                                softmax_rows("softmax_chunk", sT, src_scale, m, pp, ls, c * 16, 16, k0, LK, BQ, terms,
                                             small_terms, whole, small, zT, False, SEG, next_k_rows)
                        else:
                            qk_rows(unit, "qk_amx", sT, KP, qp, vb, vhk, k0, 0, BK, SEG * D, BQ, kp_row, ROW * 4)  # S^T = K . Q^T
                            if small_terms is not None:
                                if whole:
                                    small_scores(sT, bound, small_tile, 0, BK, BQ, squash_limit)
                        if dropout:
                            dropout_tile_16(score.dropout, zT, words, vb, vh, q0, k0, BQ, BK)
                        if has_mods:  # modified scores in place (vectorised here, not by a rule)
                            if not whole:  # -inf where masked or past Lk
                                for j in T.serial(BK):
                                    for i in T.vectorized(BQ):
                                        with T.sblock("score_in_place"):
                                            vj, vi = T.axis.remap("SS", [j, i])
                                            sT[vj, vi] = T.Select(k0 + vj < LK, modified(
                                                score, sT[vj, vi] * scale,
                                                ScoreIndex(vb, vh, T.min(q0 + vi, LQ - 1), T.min(k0 + vj, LK - 1))),
                                                NEG_INF)
                            elif score.changes_values and (terms is None or terms[0] == "split"):
                                if not split:  # a whole tile: only the value modifiers
                                    for j in T.serial(BK):
                                        for i in T.vectorized(BQ):
                                            with T.sblock("score_values_in_place"):
                                                vj, vi = T.axis.remap("SS", [j, i])
                                                sT[vj, vi] = modified(score, sT[vj, vi] * scale,
                                                                      ScoreIndex(vb, vh, q0 + vi, k0 + vj), False)
                        if vkb > kb_lo and not chunked:  # P with the running max m (the first block sets m)
                            softmax_rows("softmax_pack", sT, src_scale, m, pp, ls, 0, PAIRS, k0, LK, BQ, terms, small_terms,
                                         whole, small_tile, zT, dropout, SEG)
                        # m must move if an exponent passed GROW; then some row sum passed 2^GROW
                        first_grows = T.meta_var(0 if first_chunk_sets_max(has_mods, dropout) else 1)
                        with T.sblock("init_grow"):
                            grow[0] = T.Select(vkb == kb_lo, first_grows, 0)
                            grow[1] = T.Select(vkb == kb_lo, first_grows, 0)
                        for i in T.serial(BQ):
                            with T.sblock("grow_check"):
                                vi = T.axis.remap("R", [i])
                                grow[0] = T.max(grow[0], T.Select(ls[vi] > T.float32(2 ** GROW), 1, 0))
                        if grow[0] > 0:  # rare after the first block: the block's max decides
                            kv_block_max(sT, src_scale, tmax, tmin, k0, LK, BK, BQ, terms, small_terms, whole)
                            for i in T.serial(BQ):
                                with T.sblock("move_check"):
                                    vi = T.axis.remap("R", [i])
                                    grow[1] = T.max(grow[1], T.Select(tmax[vi] > m[vi] + T.float32(GROW), 1, 0))
                        if grow[1] > 0:  # m to the block's max, O and l rescaled, P again
                            for i in T.serial(BQ):
                                with T.sblock("alpha"):
                                    vi = T.axis.remap("S", [i])
                                    alpha[vi] = fast_exp((m[vi] - T.max(m[vi], tmax[vi])) * T.float32(LN2))
                                    m[vi] = T.max(m[vi], tmax[vi])
                                    l[vi] = l[vi] * alpha[vi]
                                    ls[vi] = T.float32(0)
                            if vkb > kb_lo:  # (O^T is still 0 at the first block)
                                for d in T.serial(D):
                                    for i in T.vectorized(BQ):  # in place: vectorised here, not by a rule
                                        with T.sblock("rescale"):
                                            vd, vi = T.axis.remap("SS", [d, i])
                                            accT[vd, vi] = accT[vd, vi] * alpha[vi]
                            softmax_rows("softmax_redo", sT, src_scale, m, pp, ls, 0, PAIRS, k0, LK, BQ, terms, small_terms,
                                         whole, small_tile, zT, dropout, SEG)
                        for i in T.serial(BQ):
                            with T.sblock("l_update"):
                                vi = T.axis.remap("S", [i])
                                l[vi] = l[vi] + ls[vi]
                        # O^T += V^T . P^T, walking V^T again for each 32 queries: P^T (16-32 KB
                        # a block) does not stay in L1 next to the V^T rows, and one 32-query
                        # column of it does (dev box, AMX, same process: L = 1024 / 4096 forward
                        # 1.02-1.08x faster than walking P^T again for each 32 head dims)
                        with T.sblock("pv_amx"):
                            T.reads(VT[vb, vhk, 0:D, SEG * k0:SEG * (k0 + BK)], pp[0:SEG * PAIRS, 0:BQ], accT[0:D, 0:BQ],
                                    cfg[0:64])
                            T.writes(accT[0:D, 0:BQ])
                            unit.gemm(lambda r, c: accT[r, c], ROW * 4, lambda r, c: VT[vb, vhk, r, SEG * k0 + c], vt_row,
                                      lambda r, c: pp[r, c], ROW * 4, D, BQ, SEG * BK, True, "a")
                unit.release()
                for i in T.serial(BQ):
                    with T.sblock("store_lse"):
                        vi = T.axis.remap("S", [i])
                        T.where(q0 + i < LQ)
                        LSE[vb, vh, q0 + vi] = T.Select(l[vi] == T.float32(0), NEG_INF,
                                                        (m[vi] + T.log2(l[vi])) * T.float32(LN2))
                for i in T.serial(BQ):
                    with T.sblock("row_inverse"):  # one division a row, not one an output
                        vi = T.axis.remap("S", [i])
                        inv[vi] = T.Select(l[vi] == T.float32(0), T.float32(0), T.float32(1) / l[vi])
                for ib, c in T.grid(BQ // 16, D // 32):  # O rows from accT's 16 x 32 blocks: 32 dims a store
                    with T.sblock("transpose_o"):
                        vib, vc = T.axis.remap("SS", [ib, c])
                        T.reads(accT[vc * 32:vc * 32 + 32, vib * 16:vib * 16 + 16], inv[vib * 16:vib * 16 + 16])
                        T.writes(o_rows[0:16, 0:32])
                        stage_output_rows(o_rows, accT, vc * 32, vib * 16, inv)
                    for r in T.serial(16):
                        with T.sblock("store_o_rows"):
                            vib, vc, vr = T.axis.remap("SSS", [ib, c, r])
                            T.where(q0 + ib * 16 + r < LQ)
                            T.reads(o_rows[vr, 0:32])
                            T.writes(O[vb, vh, q0 + vib * 16 + vr, vc * 32:vc * 32 + 32])
                            (store_fp32_row if O.dtype == F32 else store_bf16_row)(
                                O, [vb, vh, q0 + vib * 16 + vr, vc * 32], o_rows[vr, T.Ramp(0, 1, 16)],
                                o_rows[vr, T.Ramp(16, 1, 16)])

    return fwd.with_attr("global_symbol", name)
