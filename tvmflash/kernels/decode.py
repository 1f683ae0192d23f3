"""Split-KV forward for decode-like calls (a handful of queries against a long cache), in
s_tir TensorIR, and the kernel that merges its partial results.

`forward_split`: one task per (batch, split, group of `kv_heads` kv-heads, block of query
rows); a kv-head's rows are the queries of its query heads (GQA packs the group), and its
kv-blocks are cut into `splits` consecutive ranges so that few queries still fill the cores. A
task takes each kv-block for each of its kv-heads in turn: its reads run along whole token
rows (Xeon, B=16 Hk=8, paged cache, 8 kv-heads a task: 1.05-1.11x faster than one;
ops._task_kv_heads; dense K/V stream faster one kv-head a task: ops.DENSE_KV_HEAD_GROUPS).
With so few queries there is no matmul worth the name: K and V are read in place (no tile
copies), each key row once per task, converted to fp32 once and used by all the task's rows
from registers (QK^T as per-lane products, whose lane sums 16 keys at a time take a tree of shuffles, `store_lane_sums`; PV
with the rows' O columns held in registers across the block; bf16 rows converted 32 elements
at a time into their even and odd elements, `store_paired_row`), with the next rows
software-prefetched into L2 (rows of one kv-head lie Hk * D apart in flash-attn's cache layout,
a stride the hardware prefetchers do not follow). Each task writes its rows' O normalised by
their own row sums and their lse, in fp32. Measured on the Xeon (bf16 B=16 H=32 Hk=8 D=128, one
query, 16 threads): at 1k keys the compute is most of the time (a table whose pages are all
one page, so nothing comes from memory, ran 0.57 ms against 0.73 ms on real pages); the lane
sum tree and the paired conversion together made it 1.05-1.08x faster at 1k, 1.04-1.18x at
4k-16k. With a target's bf16 pair products (`PairDot`: `vdpbf16ps`, given by schedules/avx512.py
for Zen 5) both products take the bf16 rows as they lie, 32 dims an instruction, with no
conversion (Zen 5, compute only: 1.2-1.8x faster; on the Xeon 16-18% slower at 1k, so it keeps
the FMAs). (bf16 kv-heads of more than 4 rows run on AMX tiles: schedules/amx_decode.py.)

`forward_combine`: lse = log sum_s exp(lse_s), O = sum_s exp(lse_s - lse) O_s; a query no
split saw gets O = 0, lse = -inf, as from the one-pass forward.

For a kv_cache spec (flash_attn_with_kvcache) the same kernel reads a KV cache in place:
`declare_decode_args`' paged layout (a contiguous cache is one page per batch entry), each
batch entry's keys at cache positions [leftpad, seqlen + new) (`CacheArgs`), the score
modifiers in that sequence's coordinates. Its kv-blocks are aligned to cache positions, so
each 16 keys lie in one page: a page is looked up once per 16 keys. The CUDA decode
kernel (schedules/cuda_decode.py) takes the same arguments.

The loops are written vectorised here (block names `dec_*`, no schedule rules), since every
choice is fixed by the shape: LANES fp32 per vector along the head dim.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import tvm
from tvm import tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import tirx as irb

from ..spec import ROTARY_HALVES, ROTARY_INTERLEAVED, ROTARY_NONE, AttentionSpec
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
    k: tirx.Buffer  # the caches (their strides: `row_offset`)
    v: tirx.Buffer

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

    def row_offset(self, buf, page, row):
        """The element offset of (page, row, kv-head 0, dim 0) in the K or V cache `buf`."""
        return tirx.Cast("int64", page) * buf.strides[0] + tirx.Cast("int64", row) * buf.strides[1]

    def offsets_column(self, buf) -> int:
        """Which column of `key_positions`' table holds `buf`'s (K: 0, V: 1) row offsets."""
        for column, cache in enumerate((self.k, self.v)):
            if buf.same_as(cache):
                return column
        raise ValueError(f"{buf.name} is not one of this call's caches")


def declare_decode_args(spec: AttentionSpec, shape: Shape, splits: tirx.Var, counters: bool = False):
    """A kv_cache spec's decode arguments, in call order: q (B, H, Lq, D); k_cache, v_cache
    (num_pages, page_size, Hk, D); block_table (B, max_pages); cache_seqlens, cache_leftpad
    (B,) int32; new_keys (int64); o_part (B, H, splits, Lq, D) and lse_part (B, H, splits, Lq)
    fp32; o (B, H, Lq, D) and lse (B, H, Lq), the final outputs (the CPU kernel writes them
    when it has one split, else its caller merges the partials); with `counters`,
    split_counters (one int32 per (batch, kv-head, row block), zero between launches), with
    which the CUDA kernel merges its splits itself; scale; then the score modifiers'
    arguments. Returns (q, k, v, CacheArgs, o_part, lse_part, o, lse, [split_counters,]
    scale, the bound ScorePipeline)."""
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
    cache = CacheArgs(table, seqlens, leftpad, args.scalar("new_keys", "int64"), NP, PG, k, v)
    o = args.tensor("o_part", (B, H, splits, LQ, D), F32)
    lse = args.tensor("lse_part", (B, H, splits, LQ), F32)
    outputs = (args.tensor("o", (B, H, LQ, D), dt), args.tensor("lse", (B, H, LQ), F32))
    if counters:
        outputs += (args.tensor("split_counters", (tirx.Var("counters", "int64"),), "int32"),)
    scale = args.scalar("scale")
    return (q, k, v, cache, o, lse, *outputs, scale, ScorePipeline(spec.modifiers(), args, shape))


def declare_split_args(spec: AttentionSpec, shape: Shape, splits: tirx.Var):
    """A split-KV kernel's arguments: (q, k, v, (o_part, o), (lse_part, lse), scale, the bound
    ScorePipeline, CacheArgs or None, kv_heads): a kv_cache spec's decode arguments, else the
    forward's, then the int64 `kv_heads`, the kv-heads a task takes (`forward_split_kernel`; the
    AMX decode's tasks take one)."""
    if spec.kv_cache:
        q, k, v, cache, o_part, lse_part, o, lse, scale, score = declare_decode_args(spec, shape, splits)
        split_args = (q, k, v, (o_part, o), (lse_part, lse), scale, score, cache)
    else:
        split_args = (*declare_forward_args(spec, shape, splits), None)
    return (*split_args, KernelArgs().scalar("kv_heads", "int64"))


def task_keys(buf, cache, shape: Shape, b, heads: slice, head_dim: int):
    """The region of K or V the task of batch entry b and kv-heads `heads` may read."""
    if cache is None:
        return buf[b, heads, 0:shape.seqlen_k, 0:head_dim]
    return buf[0:cache.num_pages, 0:cache.page_size, heads, 0:head_dim]


def sequence(score: ScorePipeline, cache, b, seqlen_q):
    """(the pipeline in batch entry b's coordinates, the first key's position)"""
    if cache is None:
        return score, tirx.const(0, "int64")
    return score.in_sequence(seqlen_q, cache.count(b)), cache.start(b)


def key_element(buf, cache, where, slot, b, hk, k0, j, d, seqlen_k):
    """Key k0 + j's element d (dense: clamped into the keys; cached: through `where`, the
    block's row offsets from `key_positions`, as one flat index, so that an access costs an
    add rather than the (page, row) multiplies, which took ~30 instructions a key and kv-head
    in the decode's loops)."""
    if cache is None:
        return buf[b, hk, tirx.min(k0 + j, seqlen_k - 1), d]
    base = where[slot, j, cache.offsets_column(buf)] + tirx.Cast("int64", hk) * buf.strides[2]
    if isinstance(d, tirx.Ramp):
        flat = tirx.Ramp(base + tirx.Cast("int64", d.base), tirx.Cast("int64", d.stride), d.lanes)
    else:
        flat = base + tirx.Cast("int64", d)
    zero = tirx.const(0, "int64")
    return buf[zero, zero, zero, flat]


def prefetch_l2(element):
    """Prefetch (read) the cache line of `element` into L2 (prefetcht1): rows of one kv-head
    lie at a stride that would make L1's few sets thrash."""
    return T.call_intrin("void", "tirx.prefetch", T.address_of(element), T.int32(0), T.int32(2), T.int32(1))


def split_blocks(score: ScorePipeline, first_key, seqlen_q, splits, split, block_k: int):
    """(kb_lo, kb_hi, clamp) of split `split`: its kv-blocks [kb_lo, kb_hi) of `block_k` keys,
    aligned to cache positions (block kb holds positions [kb block_k, (kb + 1) block_k)), and
    `clamp`, which moves a position into the sequence's keys (a key outside them gets p = 0,
    but 0 x a NaN from unwritten cache memory is NaN)."""
    lo, hi = score.kv_range(tirx.const(0, "int64"), seqlen_q)  # every row's keys
    kb_first = (first_key + lo) // block_k
    kb_end = tirx.max((first_key + hi + block_k - 1) // block_k, kb_first)
    per_split = (kb_end - kb_first + splits - 1) // splits
    kb_lo = tirx.min(kb_first + split * per_split, kb_end)
    kb_hi = tirx.min(kb_lo + per_split, kb_end)
    clamp = lambda pos: tirx.min(tirx.max(pos, first_key), first_key + tirx.max(hi, 1) - 1)  # noqa: E731
    return kb_lo, kb_hi, clamp


@T.macro
def key_positions(where, slot, cache, b, k0, clamp, block_k):
    """where[slot, j, 0 | 1] = the element offsets of block k0's key j in the K | V cache (int64;
    its kv-head 0, dim 0), the key clamped into the sequence: one page lookup per 16 keys (the
    clamped positions of 16 aligned keys lie in one page and are consecutive from the first
    one's)."""
    for g in T.serial(block_k // PAGE_ALIGN):
        for j in T.serial(PAGE_ALIGN):
            page = T.meta_var(cache.page(b, clamp(k0 + g * PAGE_ALIGN)))
            row = T.meta_var(cache.row(clamp(k0 + g * PAGE_ALIGN)) + T.Cast(
                "int32", clamp(k0 + g * PAGE_ALIGN + j) - clamp(k0 + g * PAGE_ALIGN)))
            where[slot, g * PAGE_ALIGN + j, 0] = cache.row_offset(cache.k, page, row)
            where[slot, g * PAGE_ALIGN + j, 1] = cache.row_offset(cache.v, page, row)


def task_regions(Q, K, V, outputs, cache, shape: Shape, b, split, hk, head_dim: int, kv_heads=1, max_kv_heads=1):
    """(reads, writes) of the task of (b, split) and kv-heads [hk, hk + kv_heads) (clipped to
    the kv-heads; `max_kv_heads`: the most kv_heads can be): its query heads' q and the keys it
    may read; their partial and final outputs (`outputs`: O, O_FINAL, LSE, LSE_FINAL)."""
    G, LQ, D = shape.heads // shape.heads_k, shape.seqlen_q, head_dim
    hk_end = hk + 1 if max_kv_heads == 1 else tirx.min(hk + kv_heads, shape.heads_k)
    kv = slice(hk, hk_end)
    heads = slice(hk * G, hk_end * G)
    O, O_FINAL, LSE, LSE_FINAL = outputs
    reads = [Q[b, heads, 0:LQ, 0:D], task_keys(K, cache, shape, b, kv, D), task_keys(V, cache, shape, b, kv, D)]
    writes = [O[b, heads, split, 0:LQ, 0:D], LSE[b, heads, split, 0:LQ], O_FINAL[b, heads, 0:LQ, 0:D],
              LSE_FINAL[b, heads, 0:LQ]]
    return reads, writes


@T.macro
def prefetch_keys(K, V, cache, where, next_slot, slot, b, hk, k0, pk0, j, head_dim, seqlen_k, line):
    """Key row j of the next block (from k0, positions in `where[next_slot]`) and value row j of
    the block being computed (from pk0, `where[slot]`) into L2, `line` elements a cache line."""
    for ln in T.serial((head_dim + line - 1) // line):
        T.evaluate(prefetch_l2(key_element(K, cache, where, next_slot, b, hk, k0, j, ln * line, seqlen_k)))
        T.evaluate(prefetch_l2(key_element(V, cache, where, slot, b, hk, pk0, j, ln * line, seqlen_k)))


@T.macro
def store_row(O, O_FINAL, LSE, LSE_FINAL, splits, b, split, head, q_idx, lse_value, o_value, head_dim, dtype):
    """A task's row: the final O (in `dtype`) and lse where there is one split (nothing to merge:
    a launch and ~20 us saved), else the split's fp32 partials; `o_value(d)` is O's dim d. (The
    outputs come one by one: a tuple unpacked in a macro renames the buffers.)"""
    if splits == 1:
        LSE_FINAL[b, head, q_idx] = lse_value
        for d in T.vectorized(head_dim):
            O_FINAL[b, head, q_idx, d] = T.Cast(dtype, o_value(d))
    else:
        LSE[b, head, split, q_idx] = lse_value
        for d in T.vectorized(head_dim):
            O[b, head, split, q_idx, d] = o_value(d)


@dataclass(frozen=True)
class PairDot:
    """A target's bf16 pair products (x86 avx512_bf16: `vdpbf16ps`, schedules/amx.py), which the
    split-KV forward takes for bf16 in place of widening to fp32 and FMAs: `dot(acc, a, b)` =
    acc + a[2i] b[2i] + a[2i + 1] b[2i + 1] in lane i (acc fp32x16; a, b uint32x16 words, each
    two bf16, the even element in the low half); `pack(lo, hi)`: 32 fp32 (two fp32x16) as 16
    such words, rounded to nearest even; `llvm_ir`: what those calls need imported into the
    module (a loop annotation)."""

    dot: Callable
    pack: Callable
    llvm_ir: str


def lanes(start):
    """LANES consecutive elements from `start`, as a load's last index."""
    return tirx.Ramp(start, 1, LANES)


def words(chunk):
    """32 bf16 (a vector load) as 16 uint32 words of element pairs (a bf16 vector would be
    legalised to fp32)."""
    return tirx.reinterpret("uint32x16", tirx.reinterpret("uint16x32", chunk))


_PAIRS_LO = [tirx.const(i // 2 + (i % 2) * 32, "int32") for i in range(32)]  # keys j, j + 1 of dims 0..15
_PAIRS_HI = [tirx.const(16 + i // 2 + (i % 2) * 32, "int32") for i in range(32)]  # of dims 16..31


def key_pairs(first, second):
    """Two keys' 32 bf16 of the same dims (uint16x32 each) as two uint32x16 rows of pairs,
    (k_j[d], k_j+1[d]) for dims 0..15, then 16..31: one permute each."""
    return [tirx.reinterpret("uint32x16", tirx.Shuffle([first, second], picks)) for picks in (_PAIRS_LO, _PAIRS_HI)]


def value_pairs(V, cache, where, slot, b, hk, k0, p, c, seqlen_k):
    """Keys 2p, 2p + 1 of the block from k0 (`key_element`), dims 32c..32c + 31, as `key_pairs`."""
    return key_pairs(*(tirx.reinterpret("uint16x32", key_element(V, cache, where, slot, b, hk, k0, p * 2 + e,
                                                                  chunk_lanes(c), seqlen_k)) for e in range(2)))


def _fold_pairs(a, b, width: int):
    """Two 16-lane vectors holding keys in groups of `width` lanes as one holding their keys in
    groups of width / 2: each key's two halves added (a's keys first)."""
    half = width // 2
    lo = [t * width + i for t in range(LANES // width) for i in range(half)]
    lo += [LANES + x for x in lo]
    picks = [[tirx.const(x + shift, "int32") for x in lo] for shift in (0, half)]
    return tirx.Shuffle([a, b], picks[0]) + tirx.Shuffle([a, b], picks[1])


def store_lane_sums(dst, index: list, vectors: list, factor=None) -> None:
    """dst[*index[:-1], index[-1] + j] = the sum of the 16 lanes of vectors[j], j < 16 (times
    `factor` if given), by a tree of shuffles and adds (30 shuffles and 15 adds for 16 sums,
    where a horizontal sum takes about 8 instructions each). Emits its bindings into the
    statement being built."""
    width = LANES
    while len(vectors) > 1:
        vectors = [irb.bind(_fold_pairs(a, b, width)) for a, b in zip(vectors[0::2], vectors[1::2])]
        width //= 2
    *prefix, c0 = index
    sums = vectors[0] if factor is None else vectors[0] * tirx.Broadcast(factor, LANES)
    irb.buffer_store(dst, sums, [*prefix, lanes(c0)])


PAIR_CHUNK = 32  # bf16 elements converted at once by `store_paired_row`


def paired_dim(d):
    """The head dim at position d of a row converted by `store_paired_row`: each 32 elements
    hold their even elements, then their odd ones."""
    return d // PAIR_CHUNK * PAIR_CHUNK + d % 16 * 2 + d % PAIR_CHUNK // 16


def paired_slot(d):
    """The position of head dim d in such a row (the inverse of `paired_dim`)."""
    return d // PAIR_CHUNK * PAIR_CHUNK + d % 2 * 16 + d % PAIR_CHUNK // 2


def chunk_lanes(c):
    """Elements [32c, 32c + 32) of a row, as a load's last index."""
    return tirx.Ramp(tirx.Cast("int64", c * PAIR_CHUNK), tirx.const(1, "int64"), PAIR_CHUNK)


def store_paired_row(dst, base, c, chunk):
    """dst[base + 32c + i] = the fp32 of element 2i (i < 16), then 2i - 31 (16 <= i < 32), of the 32
    bf16 `chunk`: its 32-bit words shifted left by 16 (even elements) and masked to their high
    halves (odd ones)."""
    pairs = words(chunk)
    even = tirx.reinterpret("float32x16", pairs << tirx.Broadcast(tirx.const(16, "uint32"), 16))
    odd = tirx.reinterpret("float32x16", pairs & tirx.Broadcast(tirx.const(0xFFFF0000, "uint32"), 16))
    start = base + c * PAIR_CHUNK
    irb.buffer_store(dst, even, [tirx.Ramp(start, 1, 16)])
    irb.buffer_store(dst, odd, [tirx.Ramp(start + 16, 1, 16)])


def pair_dot_sum(pair_dot: PairDot, a, row: tuple, b, chunks: int):
    """sum over c < chunks of pair_dot.dot(a[*row, 16c : 16c + 16], b[16c : 16c + 16]): a row's 16-lane
    products of pairs (its lane sums are its dot product with b)."""
    acc = tirx.Broadcast(tirx.const(0, F32), LANES)
    for c in range(chunks):
        chunk = lanes(tirx.const(c * LANES, "int32"))
        acc = pair_dot.dot(acc, tirx.BufferLoad(a, [*row, chunk]), tirx.BufferLoad(b, [chunk]))
    return acc


def forward_split_kernel(spec: AttentionSpec, block_rows: int = 4, block_k: int = 64,
                         value_cols: int = 64, pair_dot: PairDot | None = None, max_kv_heads: int = 1) -> tirx.PrimFunc:
    """Tasks over (batch, split, group of kv-heads, block of `block_rows` query rows of each),
    in that order (a thread runs a contiguous range of tasks: the kv-heads of one split's keys,
    which share pages). A group is the runtime argument `kv_heads` of them (clamped to [1,
    `max_kv_heads`]); a task takes each kv-block's keys for its kv-heads in turn, so that its
    reads run along whole token rows (a key's kv-heads lie together in the cache) and a page
    is looked up once for them all. The rows of a kv-head are its query heads' queries (G x Lq
    for GQA). A task computes all its `block_rows` rows (a short last block repeats its last row, whose results
    are not stored): no branches in the loops over keys, so LLVM keeps the rows' q in registers
    for the scores and their O columns in registers while a pass over the block's values adds
    p_j V_j to `value_cols` of them (block_rows x value_cols fp32). A kv_cache spec reads its
    cache in place (declare_decode_args). With `pair_dot` (bf16, head dims a multiple of 32)
    both products take bf16 pairs as they lie: q . k 32 dims an instruction (q unscaled: the
    scale goes to the scores), P V two keys an instruction (P rounded to bf16 as for a bf16
    matmul, V's rows of two keys interleaved by `key_pairs`)."""
    D, RB, BK, MAX_HT = spec.head_dim, block_rows, block_k, max_kv_heads
    DV = math.gcd(D, value_cols)  # columns of O a value pass keeps in registers
    VL = LANES if D % LANES == 0 else 1  # head dims that are not multiples of 16: scalar lanes
    BF16_CHUNKS = spec.dtype == "bfloat16" and VL == LANES and D % PAIR_CHUNK == 0 and DV % PAIR_CHUNK == 0
    WORDS = BF16_CHUNKS and pair_dot is not None  # products on bf16 pairs (pair_dot)
    # else bf16 rows converted 32 elements at a time into their even and odd elements (a shift and
    # a mask of the 32-bit words, two instructions where widening takes four); q and O's columns
    # then lie in that order (`paired_dim`), O is put back in order when it is stored
    PAIRED = BF16_CHUNKS and not WORDS
    dim_of = paired_dim if PAIRED else (lambda d: d)  # the head dim held at position d
    slot_of = paired_slot if PAIRED else (lambda d: d)  # the position of head dim d
    shape = Shape.fresh()
    B, H, HK, LQ, LK = shape.batch, shape.heads, shape.heads_k, shape.seqlen_q, shape.seqlen_k
    S = tirx.Var("splits", "int64")
    cached = spec.kv_cache
    LINE = 512 // tvm.runtime.DataType(spec.dtype).bits  # elements of a 64-byte cache line
    KEY_LOOP = {"pragma_import_llvm": pair_dot.llvm_ir} if WORDS else None

    def add(a, b):
        return a + b

    @T.macro
    def fold_to_four(part, combine):
        """A reduction over 16 lanes of `part`, down to its first 4 (16 -> 8 -> 4)."""
        for c in T.vectorized(8):
            part[c] = combine(part[c], part[c + 8])
        for c in T.vectorized(4):
            part[c] = combine(part[c], part[c + 4])

    @T.macro
    def fold_scores(part, s, r, combine):
        """Row r's BK scores folded into the first 4 lanes of `part` (BK / 16 vectors, then
        halving)."""
        for c in T.vectorized(LANES):
            part[c] = s[r, c]
        for jc in T.serial(1, BK // LANES):
            for c in T.vectorized(LANES):
                part[c] = combine(part[c], s[r, jc * LANES + c])
        fold_to_four(part, combine)

    def four(part, combine):
        return combine(combine(part[0], part[1]), combine(part[2], part[3]))

    def products_of(prod, r):
        """Row r's 16 vectors of per-lane products (one a key)."""
        return [tirx.BufferLoad(prod, [r, tirx.const(x, "int32"), lanes(0)]) for x in range(LANES)]

    def score_factor(scale):
        """What the lane sums are multiplied by: q's bf16 pairs are not pre-scaled."""
        return scale if WORDS else None

    @T.prim_func(s_tir=True)
    def fwd():
        T.func_attr({"tirx.noalias": True})
        Q, K, V, (O, O_FINAL), (LSE, LSE_FINAL), scale, score_all, cache, kv_heads = T.meta_var(
            declare_split_args(spec, shape, S))
        G = T.meta_var(H // HK)
        NRB = T.meta_var((G * LQ + RB - 1) // RB)  # row blocks per kv-head
        HT = T.meta_var(T.max(T.min(kv_heads, T.int64(MAX_HT)), T.int64(1)))  # kv-heads a group
        NHG = T.meta_var((HK + HT - 1) // HT)  # groups of kv-heads
        for t in T.parallel(B * S * NHG * NRB):
            with T.sblock("dec_task"):
                vb = T.axis.spatial(B, t // (S * NHG * NRB))
                vs = T.axis.spatial(S, t // (NHG * NRB) % S)
                vhg = T.axis.spatial(NHG, t // NRB % NHG)
                vrb = T.axis.spatial(NRB, t % NRB)
                reads, writes = T.meta_var(task_regions(Q, K, V, (O, O_FINAL, LSE, LSE_FINAL), cache, shape,
                                                        vb, vs, vhg * HT, D, HT, MAX_HT))
                T.reads(reads)
                T.writes(writes)
                # the rows' q: fp32, pre-scaled; or (WORDS) their bf16 pairs
                qs = T.sblock_alloc_buffer((MAX_HT, RB, D // 2) if WORDS else (MAX_HT, RB, D), "uint32" if WORDS else F32)
                acc = T.sblock_alloc_buffer((MAX_HT, RB, D), F32)
                row_f32 = T.sblock_alloc_buffer((D,), F32)  # the key (or value) row being used
                # WORDS: a key row's pairs, or two value rows' (key_pairs); P's pairs per row
                row_words = T.sblock_alloc_buffer((D if WORDS else 1,), "uint32")
                p_words = T.sblock_alloc_buffer((RB, BK // 2) if WORDS else (1, 1), "uint32")
                part = T.sblock_alloc_buffer((LANES,), F32)  # lanes of a reduction
                # per row: 16 keys' per-lane products (their lane sums are the scores)
                prod = T.sblock_alloc_buffer((RB, LANES, LANES) if VL == LANES else (1, 1, 1), F32)
                s = T.sblock_alloc_buffer((RB, BK), F32)
                st = T.sblock_alloc_buffer((MAX_HT, RB, 3), F32)  # per row: m, l, block max
                rix = T.sblock_alloc_buffer((MAX_HT, RB, 2), "int64")  # per row: query head, query index
                # cached: each key's K and V row offsets in this block (slot kb % 2) and the next,
                # clamped into the sequence (keys outside it get p = 0, but 0 * a NaN from
                # unwritten cache memory is NaN)
                where = T.sblock_alloc_buffer((2, BK if cached else 1, 2), "int64")
                score, first_key = T.meta_var(sequence(score_all, cache, vb, LQ))
                row = T.meta_var(lambda r: T.min(vrb * RB + r, G * LQ - 1))  # of the kv-head's G * Lq rows
                NH = T.meta_var(T.min(HK - vhg * HT, HT))  # the task's kv-heads
                kv_head = T.meta_var(lambda h: vhg * HT + h)
                kb_lo, kb_hi, clamp = T.meta_var(split_blocks(score, first_key, LQ, S, vs, BK))
                for h in T.serial(NH):
                    for r in T.serial(RB):
                        rix[h, r, 0] = kv_head(h) * G + row(r) // LQ
                        rix[h, r, 1] = row(r) % LQ
                        if WORDS:
                            for c in T.serial(D // PAIR_CHUNK):
                                qs[h, r, lanes(c * LANES)] = words(Q[vb, rix[h, r, 0], rix[h, r, 1], chunk_lanes(c)])
                        for d in T.vectorized(D):
                            if not WORDS:
                                qs[h, r, d] = T.Cast(F32, Q[vb, rix[h, r, 0], rix[h, r, 1], dim_of(d)]) * scale
                            acc[h, r, d] = T.float32(0)
                        st[h, r, 0] = T.min_value(F32)
                        st[h, r, 1] = T.float32(0)
                # block kb_hi: only its page lookup (prefetch)
                for kb in T.serial(kb_lo, kb_hi + 1, annotations=KEY_LOOP):
                    k0 = T.meta_var(kb * BK)
                    if cached:
                        key_positions(where, kb % 2, cache, vb, k0, clamp, BK)
                    if kb > kb_lo:
                        for h in T.serial(NH):  # the kv-heads of the task in turn: whole token rows
                            pk0 = T.meta_var(k0 - BK)  # block kb - 1 is computed here
                            slot = T.meta_var((kb - 1) % 2)
                            for jg in T.serial(BK // LANES):  # scores of 16 keys: q . k as per-lane products
                                for jj in T.serial(LANES):
                                    j = T.meta_var(jg * LANES + jj)
                                    prefetch_keys(K, V, cache, where, kb % 2, slot, vb, kv_head(h), k0, pk0, j, D, LK, LINE)
                                    if WORDS:
                                        for c in T.serial(D // PAIR_CHUNK):
                                            row_words[lanes(c * LANES)] = words(key_element(
                                                K, cache, where, slot, vb, kv_head(h), pk0, j, chunk_lanes(c), LK))
                                    elif PAIRED:
                                        for c in T.serial(D // PAIR_CHUNK):
                                            store_paired_row(row_f32, 0, c, key_element(
                                                K, cache, where, slot, vb, kv_head(h), pk0, j, chunk_lanes(c), LK))
                                    else:
                                        for d in T.vectorized(D):
                                            row_f32[d] = T.Cast(F32, key_element(K, cache, where, slot, vb, kv_head(h), pk0, j, d, LK))
                                    for r in T.unroll(RB):
                                        if WORDS:
                                            prod[r, jj, lanes(0)] = pair_dot_sum(pair_dot, qs, (h, r), row_words, D // PAIR_CHUNK)
                                        elif VL == LANES:  # the 16 keys' lanes are summed together below
                                            for c in T.vectorized(VL):
                                                prod[r, jj, c] = qs[h, r, c] * row_f32[c]
                                            for dc in T.serial(1, D // VL):
                                                for c in T.vectorized(VL):
                                                    prod[r, jj, c] = prod[r, jj, c] + qs[h, r, dc * VL + c] * row_f32[dc * VL + c]
                                        else:
                                            s[r, j] = T.float32(0)
                                            for d in T.serial(D):
                                                s[r, j] = s[r, j] + qs[h, r, d] * row_f32[d]
                                for r in T.serial(RB):
                                    if VL == LANES:
                                        store_lane_sums(s, [r, jg * LANES], products_of(prod, r), score_factor(scale))
                                    for x in T.vectorized(LANES):
                                        s[r, jg * LANES + x] = score(s[r, jg * LANES + x], ScoreIndex(
                                            vb, rix[h, r, 0], rix[h, r, 1], pk0 + jg * LANES + x - first_key))
                            for r in T.serial(RB):  # online softmax: rescale O by exp(m_old - m_new)
                                fold_scores(part, s, r, T.max)
                                st[h, r, 2] = four(part, T.max)  # the block's max
                                for d in T.vectorized(D):
                                    acc[h, r, d] = acc[h, r, d] * fast_exp(st[h, r, 0] - T.max(st[h, r, 0], st[h, r, 2]))
                                st[h, r, 1] = st[h, r, 1] * fast_exp(st[h, r, 0] - T.max(st[h, r, 0], st[h, r, 2]))
                                st[h, r, 0] = T.max(st[h, r, 0], st[h, r, 2])
                                for j in T.vectorized(BK):
                                    s[r, j] = fast_exp(s[r, j] - st[h, r, 0])
                                fold_scores(part, s, r, add)
                                st[h, r, 1] = st[h, r, 1] + four(part, add)  # plus the block's sum
                                if WORDS:  # P's pairs (keys 2i, 2i + 1) for the value pass
                                    for c in T.serial(BK // PAIR_CHUNK):
                                        p_words[r, lanes(c * LANES)] = pair_dot.pack(
                                            s[r, lanes(c * PAIR_CHUNK)], s[r, lanes(c * PAIR_CHUNK + LANES)])
                            for dv in T.serial(D // DV):  # O += p_j V_j (padded keys have p = 0)
                                if WORDS:
                                    for jp in T.serial(BK // 2):  # two keys a pass
                                        for c in T.serial(DV // PAIR_CHUNK):
                                            pair_lo, pair_hi = T.meta_var(value_pairs(
                                                V, cache, where, slot, vb, kv_head(h), pk0, jp, dv * (DV // PAIR_CHUNK) + c, LK))
                                            row_words[lanes(c * PAIR_CHUNK)] = pair_lo
                                            row_words[lanes(c * PAIR_CHUNK + LANES)] = pair_hi
                                        for r in T.unroll(RB):
                                            for m in T.unroll(DV // LANES):
                                                acc[h, r, lanes(dv * DV + m * LANES)] = pair_dot.dot(
                                                    acc[h, r, lanes(dv * DV + m * LANES)],
                                                    T.Broadcast(p_words[r, jp], LANES), row_words[lanes(m * LANES)])
                                else:
                                    for j in T.serial(BK):
                                        if PAIRED:
                                            for c in T.serial(DV // PAIR_CHUNK):
                                                store_paired_row(row_f32, 0, c, key_element(
                                                    V, cache, where, slot, vb, kv_head(h), pk0, j, chunk_lanes(dv * (DV // PAIR_CHUNK) + c), LK))
                                        else:
                                            for d in T.vectorized(DV):
                                                row_f32[d] = T.Cast(F32, key_element(V, cache, where, slot, vb, kv_head(h), pk0, j, dv * DV + d, LK))
                                        for r in T.unroll(RB):
                                            for d in T.vectorized(DV):
                                                acc[h, r, dv * DV + d] = acc[h, r, dv * DV + d] + s[r, j] * row_f32[d]
                for h in T.serial(NH):
                    for r in T.serial(RB):
                        lse_r = T.meta_var(T.Select(st[h, r, 1] == T.float32(0), NEG_INF, st[h, r, 0] + T.log(st[h, r, 1])))
                        o_r = T.meta_var(lambda d: T.Select(st[h, r, 1] == T.float32(0), T.float32(0), acc[h, r, slot_of(d)] / st[h, r, 1]))
                        if vrb * RB + r < G * LQ:  # a short last block's repeated rows are not stored
                            store_row(O, O_FINAL, LSE, LSE_FINAL, S, vb, vs, rix[h, r, 0], rix[h, r, 1], lse_r, o_r, D,
                                      spec.dtype)

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
            with T.sblock("dec_combine"):
                vb = T.axis.spatial(B, t // (H * LQ))
                vh = T.axis.spatial(H, t // LQ % H)
                vi = T.axis.spatial(LQ, t % LQ)
                T.reads(O_PART[vb, vh, 0:S, vi, 0:D], LSE_PART[vb, vh, 0:S, vi])
                T.writes(O[vb, vh, vi, 0:D], LSE[vb, vh, vi])
                st = T.sblock_alloc_buffer((3,), F32)  # max lse, sum of weights, this split's weight
                acc = T.sblock_alloc_buffer((D,), F32)
                st[0] = T.min_value(F32)
                for s in T.serial(S):
                    st[0] = T.max(st[0], LSE_PART[vb, vh, s, vi])
                st[1] = T.float32(0)
                for d in T.vectorized(D):
                    acc[d] = T.float32(0)
                for s in T.serial(S):  # one exp per split; partials that saw no key weigh exactly 0
                    st[2] = fast_exp(LSE_PART[vb, vh, s, vi] - st[0])
                    st[1] = st[1] + st[2]
                    for d in T.vectorized(D):
                        acc[d] = acc[d] + st[2] * O_PART[vb, vh, s, vi, d]
                LSE[vb, vh, vi] = T.Select(st[1] == T.float32(0), NEG_INF, st[0] + T.log(st[1]))
                for d in T.vectorized(D):
                    O[vb, vh, vi, d] = T.Cast(dt, T.Select(st[1] == T.float32(0), T.float32(0), acc[d] / st[1]))

    return combine.with_attr("global_symbol", "forward_combine")


def declare_append_args(spec: AttentionSpec, table_dtype: str) -> tuple:
    """A decode step's append arguments, in call order (`cache_check_kernel`'s decode_append;
    schedules/cuda_decode.py's append kernel takes the same): block_table (B, max_pages) int32,
    cache_seqlens, cache_leftpad (B,) int32; offset, capacity, num_pages int64; result (3,)
    int32; k, v (B, N, Hk, D); k_cache, v_cache (pages, page_size, Hk, D); q, q_rotated (B, Lq,
    H, D); rotary_cos, rotary_sin (Lro, rotary_dim / 2) in `table_dtype`; rotary, q_steps int32."""
    B, MP, N, LQ, H, HK, PAGES, PAGE, LRO, HALF = (tirx.Var(n, "int64") for n in (
        "batch", "max_pages", "seqlen_new", "seqlen_q", "heads", "heads_k", "pages", "page_size", "seqlen_ro",
        "rotary_half"))
    D, dt = spec.head_dim, spec.dtype
    args = KernelArgs()
    table = args.tensor("block_table", (B, MP), "int32")
    seqlens = args.tensor("cache_seqlens", (B,), "int32", unit_last_stride=False)
    leftpad = args.tensor("cache_leftpad", (B,), "int32", unit_last_stride=False)
    scalars = tuple(args.scalar(n, "int64") for n in ("offset", "capacity", "num_pages"))
    result = args.tensor("result", (3,), "int32")
    return (table, seqlens, leftpad, *scalars, result,
            *(args.tensor(n, (B, N, HK, D), dt) for n in ("k", "v")),
            *(args.tensor(n, (PAGES, PAGE, HK, D), dt) for n in ("k_cache", "v_cache")),
            *(args.tensor(n, (B, LQ, H, D), dt) for n in ("q", "q_rotated")),
            *(args.tensor(n, (LRO, HALF), table_dtype) for n in ("rotary_cos", "rotary_sin")),
            args.scalar("rotary", "int32"), args.scalar("q_steps", "int32"))


def append_name(spec: AttentionSpec, table_dtype: str) -> str:
    """The append kernel's function name: `decode_append`, `decode_append_f32` for float32
    rotary tables with a 16-bit spec."""
    return "decode_append_f32" if table_dtype == F32 != spec.dtype else "decode_append"


def rotated_pair(a, b, c, s):
    """(a, b) turned by the angle whose cosine and sine are c and s: (a c - b s, a s + b c)."""
    return a * c - b * s, a * s + b * c


@T.inline
def store_rotated_pair(DST, d0, d1, SRC, s0, s1, h, lo, hi, c, s):
    """DST[d0, d1, h, lo] and [.., hi] = SRC[s0, s1, h, lo] and [.., hi] turned (`rotated_pair`,
    in fp32)."""
    first, second = T.meta_var(rotated_pair(T.Cast(F32, SRC[s0, s1, h, lo]), T.Cast(F32, SRC[s0, s1, h, hi]), c, s))
    DST[d0, d1, h, lo] = T.Cast(DST.dtype, first)
    DST[d0, d1, h, hi] = T.Cast(DST.dtype, second)


@T.inline
def rotate_rows(DST, d0, d1, SRC, s0, s1, heads, pos, COS, SIN, rotary, HALF, D):
    """DST[d0, d1, h, :] = SRC[s0, s1, h, :] rotated at position `pos` (`rotary`: interleaved
    pairs or halves of the first 2 HALF dims, in fp32; the rest copied), h < heads."""
    for h in T.serial(heads):
        if rotary == ROTARY_INTERLEAVED:
            for p in T.serial(HALF):
                store_rotated_pair(DST, d0, d1, SRC, s0, s1, h, 2 * p, 2 * p + 1, T.Cast(F32, COS[pos, p]),
                                   T.Cast(F32, SIN[pos, p]))
        elif rotary == ROTARY_HALVES:
            for p in T.serial(HALF):
                store_rotated_pair(DST, d0, d1, SRC, s0, s1, h, p, p + HALF, T.Cast(F32, COS[pos, p]),
                                   T.Cast(F32, SIN[pos, p]))
        for e in T.serial(T.Select(rotary == ROTARY_NONE, T.int64(0), 2 * HALF), T.int64(D)):
            DST[d0, d1, h, e] = SRC[s0, s1, h, e]


def cache_check_kernel(spec: AttentionSpec | None = None, table_dtype: str = F32) -> tirx.PrimFunc:
    """The CPU decode step's index check, and with `spec` its writes too.

    `decode_check` (block_table (B, max_pages) int32, rows contiguous; cache_seqlens,
    cache_leftpad (B,) int32; new_keys, capacity, num_pages int64; result (2,) int32):
    result[0] the first batch entry b whose keys [leftpad[b], seqlens[b] + new_keys) do not lie
    in order within [0, capacity) (-1: none), result[1] 1 where a table entry, read as
    unsigned, is not below num_pages (a negative one too), else 0. The decode kernels clamp
    what they read anyway (`CacheArgs.page`); this tells a caller that its indices were bad.
    In one native call: with the same checks in numpy (each library call paying for the caches
    that the previous step's kernel emptied), decode steps on the dev box (bf16 B=16 H=32 Hk=8
    D=128, 2 threads, same process) were 1.12x slower at 16-128 keys, 1.02x at 1k.

    With `spec`, `decode_append` (`decode_append_f32` for float32 rotary tables, `table_dtype`):
    a step that writes. Arguments: the same tables, then offset (int64: the scalar length added
    to every cache_seqlens), k, v (B, N, Hk, D) the new tokens, k_cache, v_cache (pages,
    page_size, Hk, D), q and q_rotated (B, Lq, H, D), rotary_cos, rotary_sin (Lro, rotary_dim /
    2), rotary (spec.ROTARY_*), q_steps (int32: the queries sit at consecutive positions), result
    (3,). Batch entry b's new tokens go to cache positions base_b + i, base_b = seqlens[b] +
    offset (page table[b, pos // page_size], row pos % page_size), rotated there where
    `rotary`; q_rotated gets q rotated at base_b (+ i where q_steps). The checks come first
    (keys [leftpad[b], base_b + N) within [0, capacity), leftpad[b] <= base_b; result[2] 1 where
    a rotated position reaches past the tables' Lro rows) and nothing is written unless all
    pass. Rotation as interface._rotate's: in fp32, pairs (2p, 2p + 1) or halves (p, p + half),
    dims past 2 * half copied. One native call: the same in torch ops (a gather of the tables'
    rows, a dozen small elementwise ops, an indexed store) took most of a short decode step."""
    appends = spec is not None
    D = spec.head_dim if appends else 0

    def declare():
        if appends:
            return declare_append_args(spec, table_dtype)
        B, MP = (tirx.Var(n, "int64") for n in ("batch", "max_pages"))
        args = KernelArgs()
        table = args.tensor("block_table", (B, MP), "int32")
        seqlens = args.tensor("cache_seqlens", (B,), "int32", unit_last_stride=False)
        leftpad = args.tensor("cache_leftpad", (B,), "int32", unit_last_stride=False)
        scalars = (args.scalar(n, "int64") for n in ("new_keys", "capacity", "num_pages"))
        return table, seqlens, leftpad, *scalars, args.tensor("result", (2,), "int32"), *[None] * 10

    @T.prim_func(s_tir=True)
    def check():
        T.func_attr({"tirx.noalias": True})
        (TABLE, SEQLENS, LEFTPAD, offset, capacity, num_pages, RESULT,
         K, V, K_CACHE, V_CACHE, Q, Q_ROTATED, COS, SIN, rotary, q_steps) = T.meta_var(declare())
        B, MP = T.meta_var(TABLE.shape)
        if appends:
            N, HK, PAGE, LQ, H, LRO, HALF = T.meta_var((*K.shape[1:3], K_CACHE.shape[1], *Q.shape[1:3], *COS.shape))
        with T.sblock("root"):  # (its only block: the schedule rules start from it)
            top = T.sblock_alloc_buffer((LANES,), "uint32")  # lanes of the largest entry
            reach = T.sblock_alloc_buffer((1,), "int64")  # the furthest rotated position + 1
            for i in T.vectorized(LANES):
                top[i] = T.uint32(0)
            reach[0] = T.int64(0)
            RESULT[0] = -1
            for rb in T.serial(B):
                b = T.meta_var(B - 1 - rb)  # backwards: the first bad entry is written last
                for c in T.serial(MP // LANES):
                    for i in T.vectorized(LANES):
                        top[i] = T.max(top[i], T.Cast("uint32", TABLE[b, c * LANES + i]))
                for p in T.serial(MP // LANES * LANES, MP):
                    top[0] = T.max(top[0], T.Cast("uint32", TABLE[b, p]))
                start = T.meta_var(T.Cast("int64", LEFTPAD[b]))
                base = T.meta_var(T.Cast("int64", SEQLENS[b]) + offset)
                end = T.meta_var(base + N if appends else base)
                if start < T.int64(0) or start > base or end > capacity:
                    RESULT[0] = T.Cast("int32", b)
                if appends:
                    reach[0] = T.max(reach[0], T.max(end, base + T.Select(q_steps != 0, LQ, T.int64(1))))
            for i in T.serial(1, LANES):
                top[0] = T.max(top[0], top[i])
            RESULT[1] = T.Select(T.Cast("uint64", top[0]) >= T.Cast("uint64", num_pages), 1, 0)
            if appends:
                RESULT[2] = T.Select(rotary != ROTARY_NONE and reach[0] > LRO, 1, 0)
                if RESULT[0] == -1 and RESULT[1] == 0 and RESULT[2] == 0:
                    for t in T.parallel(B * N):
                        pos = T.meta_var(T.Cast("int64", SEQLENS[t // N]) + offset + t % N)
                        page = T.meta_var(T.Cast("int64", TABLE[t // N, pos // PAGE]))
                        for h, d in T.grid(HK, T.int64(D)):
                            V_CACHE[page, pos % PAGE, h, d] = V[t // N, t % N, h, d]
                        rotate_rows(K_CACHE, page, pos % PAGE, K, t // N, t % N, HK, pos, COS, SIN, rotary, HALF, D)
                    if rotary != ROTARY_NONE:
                        for t in T.parallel(B * LQ):
                            pos = T.meta_var(T.Cast("int64", SEQLENS[t // LQ]) + offset
                                             + T.Select(q_steps != 0, t % LQ, T.int64(0)))
                            rotate_rows(Q_ROTATED, t // LQ, t % LQ, Q, t // LQ, t % LQ, H, pos, COS, SIN, rotary, HALF,
                                        D)

    return check.with_attr("global_symbol", append_name(spec, table_dtype) if appends else "decode_check")
