"""Score modifiers: what happens to a scaled score s = (q . k) * scale before the softmax.

Each modifier is target-independent: it maps TIR expressions `(score, b, h, q_idx, kv_idx)` to
a new score expression (-inf removes the pair), so the CPU kernels and the CUDA kernels use the
same code. A modifier may also narrow the kv range a query block needs (and the query range a
kv block needs), which is how kernels *skip* blocks instead of computing and masking them.
A modifier's runtime values (a window's sizes, ALiBi slopes, the softcap) are kernel arguments
named by `arg_names`, declared in `bind` in that order, so one compiled module serves every
value. flex_attention's traced score_mod / mask_mod are `ScoreProgram`s (kernels/program.py
holds the programs and their derivative); a block mask's tile map lets kernels skip empty
tiles (`tile_live`) and skip the mask on full ones (`tile_unmasked` with a `TileAt`). Dropout
(kernels/dropout.py) is declared like a modifier but kept apart by `ScorePipeline`: it acts on
probabilities.
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
from dataclasses import dataclass, replace

from tvm import tirx

import math

from .common import F32, LOG2E, NEG_INF, KernelArgs, Shape, bind_once, fast_exp
from ..spec import BLOCK_MASK_ARGS
from .program import derivative, kind_of, split_band


@dataclass(frozen=True)
class TileAt:
    """Where a kernel tile sits beyond its row ranges: batch, query head and the tile's static
    extent (query rows, key rows), for masks that look tiles up per (b, h)."""

    b: tirx.PrimExpr
    h: tirx.PrimExpr
    extent: tuple


@dataclass(frozen=True)
class ScoreIndex:
    """Where a score sits: batch, query head, absolute query row and key row (int64 exprs).
    `row` (`col`): the query row's (key's) values that `ScorePipeline.row_values` (col_values)
    asked for, where the kernel loaded them once per row (key) instead of once per score.
    `kv_parts`: kv_idx as (a part shared by a tile's scores, a part the compiler unrolls to a
    constant), where the kernel knows it (modifiers may convert the first once per tile,
    `with_kv_parts`)."""

    b: tirx.PrimExpr
    h: tirx.PrimExpr
    q_idx: tirx.PrimExpr
    kv_idx: tirx.PrimExpr
    row: tuple | None = None
    kv_parts: tuple | None = None
    col: tuple | None = None  # the key's values that ScorePipeline.col_values asked for


def with_kv_parts(index, *where, base, offset, col=None) -> ScoreIndex:
    """index(*where, base + offset), the ScoreIndex of a kernel's score, with its key split into
    `kv_parts` when the index keeps the key as given (not when it moves it into a sequence's
    coordinates), and the key's loaded values `col` (ScoreIndex.col)."""
    key = base + offset
    ix = replace(index(*where, key), col=col)
    return replace(ix, kv_parts=(base, offset)) if ix.kv_idx is key else ix


class ScoreMod:
    """Base: identity. Subclasses are frozen dataclasses (they are part of the hashable spec).

    A *mask* (`is_mask`) only keeps or removes pairs (score or -inf); kernels may skip it on
    tiles it provably keeps whole (`tile_visible`)."""

    is_mask = False
    band = False  # a mask whose kv_range of one query row is exactly the keys that row keeps
    unit_grad = True  # `grad` is the constant 1 (a backward needs no per-score factor)
    additive = False  # apply(score) is score + bias(ix, shape, 1)
    arg_names: tuple = ()  # the kernel arguments `bind` declares, in order

    def bind(self, args: KernelArgs, shape: Shape) -> "ScoreMod":
        """Declare extra kernel arguments (called while the kernel is parsed); returns the
        object whose `apply`/`grad` the kernel uses."""
        return self

    def apply(self, score, ix: ScoreIndex, shape: Shape):
        return score

    def grad(self, score, ix: ScoreIndex, shape: Shape):
        """d apply / d score at `score`; masks return 1 (masked entries have p = 0)."""
        return tirx.const(1.0, F32)

    def kv_range(self, q_lo, q_hi, shape: Shape):
        """Keys [lo, hi) that queries [q_lo, q_hi) can attend to; None = no restriction."""
        return None

    def q_range(self, kv_lo, kv_hi, shape: Shape):
        """Queries [lo, hi) that can attend to keys [kv_lo, kv_hi); None = no restriction."""
        return None

    def tile_visible(self, q_lo, q_hi, kv_lo, kv_hi, shape: Shape):
        """For masks: an expression true when every pair of the tile is kept; None = unknown."""
        return None

    def tile_state(self, q_lo, kv_lo, at: "TileAt", shape: Shape):
        """For masks known per tile of (b, h) (a flex block mask): (live, full) expressions, live
        when some pair of the at.extent tile from (q_lo, kv_lo) may be kept, full when all are;
        None = not known per tile."""
        return None

    @property
    def has_band(self) -> bool:
        """For masks: whether every pair it keeps lies in its kv_range / q_range band (a band
        mask, or a flex mask with a band among its conjuncts)."""
        return self.band

    def beyond_band(self, score, ix: ScoreIndex, shape: Shape):
        """apply, less the masking its band does (kernels mask the band by offsets,
        `ScorePipeline.row_band`): nothing for a band, a flex mask's other conjuncts."""
        return score if self.band else self.apply(score, ix, shape)


@dataclass(frozen=True)
class Causal(ScoreMod):
    """Query i sees key j iff j <= i + offset: offset 0 aligns the diagonal top-left (torch
    SDPA), offset Lk - Lq bottom-right (flash-attn)."""

    align: str  # "top_left" | "bottom_right"
    is_mask = True
    band = True

    def offset(self, shape: Shape):
        return shape.seqlen_k - shape.seqlen_q if self.align == "bottom_right" else tirx.const(0, "int64")

    def apply(self, score, ix, shape):
        return tirx.Select(ix.kv_idx <= ix.q_idx + self.offset(shape), score, NEG_INF)

    def kv_range(self, q_lo, q_hi, shape):
        return tirx.const(0, "int64"), q_hi + self.offset(shape)

    def q_range(self, kv_lo, kv_hi, shape):
        return kv_lo - self.offset(shape), shape.seqlen_q

    def tile_visible(self, q_lo, q_hi, kv_lo, kv_hi, shape):
        return kv_hi - 1 <= q_lo + self.offset(shape)


@dataclass(frozen=True)
class Mask(ScoreMod):
    """A (B, H, Lq, Lk) mask tensor, broadcast through zero strides: boolean (keep where true,
    passed as uint8) or additive (added to the score)."""

    kind: str  # "bool" | "additive"
    dtype: str = F32  # additive mask element type (the query dtype)
    arg_names = ("mask",)

    def bind(self, args, shape):
        dt = "uint8" if self.kind == "bool" else self.dtype
        buf = args.tensor("mask", (shape.batch, shape.heads, shape.seqlen_q, shape.seqlen_k), dt,
                          unit_last_stride=False)
        return _BoundMask(self.kind, buf)


@dataclass(frozen=True)
class _BoundMask(ScoreMod):
    kind: str
    buf: tirx.Buffer

    @property
    def is_mask(self):
        return self.kind == "bool"

    def apply(self, score, ix, shape):
        value = self.buf[ix.b, ix.h, ix.q_idx, ix.kv_idx]
        if self.kind == "bool":
            return tirx.Select(value != tirx.const(0, "uint8"), score, NEG_INF)
        return score + tirx.Cast(F32, value)


def _diagonal(ix: ScoreIndex, shape: Shape):
    """i + Lk - Lq - j: how far key j lies left of query i's bottom-right aligned diagonal."""
    return ix.q_idx + shape.seqlen_k - shape.seqlen_q - ix.kv_idx


@dataclass(frozen=True)
class Window(ScoreMod):
    """Sliding window, flash-attn's semantics (bottom-right aligned): query i sees key j iff
    i + Lk - Lq - left <= j <= i + Lk - Lq + right. The sizes are runtime arguments (the caller
    passes an unbounded side as Lq + Lk); blocks outside the window are skipped."""

    is_mask = True
    band = True
    arg_names = ("window_left", "window_right")

    def bind(self, args, shape):
        return _BoundWindow(args.scalar("window_left", "int64"), args.scalar("window_right", "int64"))


@dataclass(frozen=True)
class _BoundWindow(Window):  # the bound forms inherit their variant's class flags
    left: tirx.Var
    right: tirx.Var

    def apply(self, score, ix, shape):
        gap = _diagonal(ix, shape)
        return tirx.Select(tirx.all(gap <= self.left, -gap <= self.right), score, NEG_INF)

    def kv_range(self, q_lo, q_hi, shape):
        off = shape.seqlen_k - shape.seqlen_q
        return q_lo + off - self.left, q_hi + off + self.right

    def q_range(self, kv_lo, kv_hi, shape):
        off = shape.seqlen_k - shape.seqlen_q
        return kv_lo - off - self.right, kv_hi - off + self.left

    def tile_visible(self, q_lo, q_hi, kv_lo, kv_hi, shape):
        off = shape.seqlen_k - shape.seqlen_q
        return tirx.all(kv_lo >= q_hi - 1 + off - self.left, kv_hi - 1 <= q_lo + off + self.right)


@dataclass(frozen=True)
class Alibi(ScoreMod):
    """ALiBi, flash-attn's semantics: score - slope[b, h] * |i + Lk - Lq - j| (the bias is not
    scaled). Slopes are an fp32 (B, H) argument (a (H,) tensor is passed with batch stride 0)."""

    additive = True
    arg_names = ("alibi_slopes",)

    def bind(self, args, shape):
        return _BoundAlibi(args.tensor("alibi_slopes", (shape.batch, shape.heads), F32, unit_last_stride=False))


@dataclass(frozen=True)
class _BoundAlibi(Alibi):
    slopes: tirx.Buffer

    def apply(self, score, ix, shape):
        return score - self.slopes[ix.b, ix.h] * self._distance(ix, shape)

    def bias(self, ix, shape, factor):
        """-slope |distance| times `factor` (a constant: slope x factor is one product per
        kernel, the bias one multiply per score)."""
        return -(self.slopes[ix.b, ix.h] * factor) * self._distance(ix, shape)

    def tile_side(self, q_lo, q_hi, kv_lo, kv_hi, shape):
        """1 when every key of the tile is at or before every query's position i + Lk - Lq,
        -1 when every key is at or after it, 0 when that diagonal crosses the tile (int32)."""
        off = shape.seqlen_k - shape.seqlen_q
        return tirx.Select(kv_hi - 1 <= q_lo + off, tirx.const(1, "int32"),
                           tirx.Select(kv_lo >= q_hi - 1 + off, tirx.const(-1, "int32"), tirx.const(0, "int32")))

    def key_offset(self, ix, k0, shape):
        """d = i + Lk - Lq - k0 of row ix.q_idx (fp32): on a tile of `tile_side` s from key k0 the
        bias is s x slope ((key - k0) - d), a key term plus a row term."""
        return tirx.Cast(F32, tirx.Cast("int32", ix.q_idx + shape.seqlen_k - shape.seqlen_q - k0))

    @staticmethod
    def _distance(ix, shape):
        # in fp32 from a row term and a column term (each converted once where the compiler
        # hoists it; exact up to 2^24 positions), not an int64 difference per score; with the
        # key's parts, the row minus the tile's shared key part once per tile and the constant
        # part a float immediate: no int -> float conversion per score (those run at the
        # softmax exp2's quarter rate)
        row = tirx.Cast(F32, tirx.Cast("int32", ix.q_idx + shape.seqlen_k - shape.seqlen_q))
        if ix.kv_parts is not None:
            base, offset = ix.kv_parts
            return tirx.abs((row - tirx.Cast(F32, tirx.Cast("int32", base))) - tirx.Cast(F32, offset))
        return tirx.abs(row - tirx.Cast(F32, tirx.Cast("int32", ix.kv_idx)))


@dataclass(frozen=True)
class Varlen(ScoreMod):
    """Packed sequences (flash-attn's varlen): the kernel's one batch holds sequences back to
    back. A query sees only its own sequence's keys, and the other modifiers see each score in
    its sequence's coordinates (positions from the sequence's start, its lengths, its index as
    the batch: `local`), so causal, windows and ALiBi align per sequence.

    Each row carries its sequence, as int32 (rows, 5) tables: a query row's [index, query
    start, query count, key start, key count], a key row's [index, key start, key count, query
    start, query count]. So a tile finds its sequences with single loads (no search through
    the offsets, no chains of dependent loads in every range expression). A tile that spans
    several sequences visits the keys of all of them, masked; a tile inside one sequence gets
    the other modifiers' ranges too (ScorePipeline keeps this modifier apart).

    A third table has a row per sequence, [query start, query count, key start, key count]:
    kernels that give each sequence its own query tiles (`ScorePipeline.in_packed_sequence`)
    find their sequence there and need no per-row lookups."""

    is_mask = True
    arg_names = ("varlen_q_rows", "varlen_k_rows", "varlen_seqs")
    ROW_VALUES = 5  # fields per row of the row tables
    SEQ_VALUES = 4  # fields per row of the sequence table

    def bind(self, args, shape):
        return _BoundVarlen(args.tensor("varlen_q_rows", (shape.seqlen_q, self.ROW_VALUES), "int32"),
                            args.tensor("varlen_k_rows", (shape.seqlen_k, self.ROW_VALUES), "int32"),
                            args.tensor("varlen_seqs", (tirx.Var("num_seqs", "int64"), self.SEQ_VALUES), "int32"),
                            shape)


@dataclass(frozen=True)
class _BoundVarlen(Varlen):
    q_rows: tirx.Buffer
    k_rows: tirx.Buffer
    seqs: tirx.Buffer  # (sequences, SEQ_VALUES)
    shape: Shape  # the packed (kernel) shape

    @staticmethod
    def _field(rows, i, c: int):
        """Field c of row i (clamped: tile padding reaches past the last row), as int64."""
        return tirx.Cast("int64", rows[tirx.min(i, rows.shape[0] - 1), c])

    def _shape_of(self, rows, i, queries: bool):
        """The shape of row i's sequence (rows: which table; queries: whether it is q_rows)."""
        own, other = self._field(rows, i, 2), self._field(rows, i, 4)
        lq, lk = (own, other) if queries else (other, own)
        return replace(self.shape, seqlen_q=lq, seqlen_k=lk)

    def row_value(self, q_idx, c):
        """The query row's table field c (an int32 load), for kernels to load once per row."""
        return self.q_rows[tirx.min(q_idx, self.q_rows.shape[0] - 1), c]

    def local(self, ix: ScoreIndex):
        """(index, shape) of a score in its query's sequence."""
        if ix.row is not None:
            q = lambda c: tirx.Cast("int64", ix.row[c])  # noqa: E731
        else:
            q = lambda c: self._field(self.q_rows, ix.q_idx, c)  # noqa: E731
        local = ScoreIndex(q(0), ix.h, ix.q_idx - q(1), ix.kv_idx - q(3))
        return local, replace(self.shape, seqlen_q=q(2), seqlen_k=q(4))

    @staticmethod
    def keeps(ix: ScoreIndex, shape: Shape):
        """Whether a local index's key lies in its query's sequence."""
        return tirx.all(ix.kv_idx >= 0, ix.kv_idx < shape.seqlen_k)

    def tile_local(self, q_lo, q_hi, kv_lo, kv_hi):
        """(inside, shape, local bounds): inside when the tile's queries and keys all lie in one
        sequence, whose shape and tile-relative bounds follow."""
        q = lambda c: self._field(self.q_rows, q_lo, c)  # noqa: E731
        inside = tirx.all(q(0) == self._field(self.q_rows, q_hi - 1, 0), kv_lo >= q(3), kv_hi <= q(3) + q(4))
        return inside, self._shape_of(self.q_rows, q_lo, True), (q_lo - q(1), q_hi - q(1), kv_lo - q(3), kv_hi - q(3))

    def kv_range(self, q_lo, q_hi, ranges):
        """Keys of queries [q_lo, q_hi): their sequences' keys, narrowed by `ranges(lo, hi,
        shape)` (the other modifiers' local ranges) when the rows lie in one sequence."""
        return self._narrow(self.q_rows, q_lo, q_hi, ranges, True)

    def q_range(self, kv_lo, kv_hi, ranges):
        return self._narrow(self.k_rows, kv_lo, kv_hi, ranges, False)

    def _narrow(self, rows, lo, hi, ranges, queries: bool):
        first = lambda c: self._field(rows, lo, c)  # noqa: E731
        last = lambda c: self._field(rows, hi - 1, c)  # noqa: E731
        shape = self._shape_of(rows, lo, queries)
        local = ScorePipeline._intersect(ranges(lo - first(1), hi - first(1), shape), first(4))
        one = first(0) == last(0)
        return (tirx.Select(one, first(3) + local[0], first(3)),
                tirx.Select(one, first(3) + local[1], last(3) + last(4)))


_MATH_TARGET = contextvars.ContextVar("tvmflash_math_target", default="llvm")


@contextlib.contextmanager
def math_target(kind: str):
    """Kernels generated inside are for target kind `kind` ("llvm" | "cuda"): the modifiers'
    math functions pick that target's fast form."""
    token = _MATH_TARGET.set(kind)
    try:
        yield
    finally:
        _MATH_TARGET.reset(token)


def _tanh(x):
    """tanh: CUDA's __tanhf (one MUFU instruction); on CPUs from the vectorising fast_exp (TVM
    lowers tanh to a libm expf call per element there)."""
    if _MATH_TARGET.get() == "cuda":
        return tirx.call_pure_extern(F32, "__tanhf", x)
    return tirx.const(1.0, F32) - tirx.const(2.0, F32) / (fast_exp(x * tirx.const(2.0, F32)) + tirx.const(1.0, F32))


@dataclass(frozen=True)
class Softcap(ScoreMod):
    """score -> softcap * tanh(score / softcap) (Gemma 2; flash-attn's `softcap`), on the scaled
    score; its gradient is 1 - tanh^2. The cap is a runtime fp32 argument (> 0)."""

    arg_names = ("softcap",)
    unit_grad = False

    def bind(self, args, shape):
        return _BoundSoftcap(args.scalar("softcap"))


@dataclass(frozen=True)
class _BoundSoftcap(Softcap):
    cap: tirx.Var

    def apply(self, score, ix, shape):
        return self.cap * _tanh(score * self._inverse())

    def grad(self, score, ix, shape):
        return bind_once(_tanh(score * self._inverse()), lambda t: tirx.const(1.0, F32) - t * t, name="tanh")

    def grad_of_output(self, capped):
        """The gradient from the capped score (cap tanh): 1 - (capped / cap)^2."""
        return bind_once(capped * self._inverse(), lambda t: tirx.const(1.0, F32) - t * t, name="tanh")

    def _inverse(self):
        """1 / cap: loop-invariant, where a division per score would not be hoisted."""
        return tirx.const(1.0, F32) / self.cap


@dataclass(frozen=True)
class ScoreProgram(ScoreMod):
    """A traced flex score_mod (role "score": the new score) or mask_mod (role "mask": keep
    or -inf), kernels/program.py nodes lowered to TIR; captured tensors are kernel arguments
    `<role>_capture<k>` (any strides; indices clamped into them)."""

    role: str
    program: object  # tvmflash.flex.Program: node + captures' (dtype, ndim)
    block: tuple | None = None  # masks with a block map: its (query, key) block size
    @property
    def is_mask(self):
        return self.role == "mask"

    @property
    def unit_grad(self):
        return self.role == "mask" or derivative(self.program.node, self.program.captures) == ("const", 1.0)

    @property
    def arg_names(self):
        names = tuple(f"{self.role}_capture{k}" for k in range(len(self.program.captures)))
        return names + (BLOCK_MASK_ARGS if self.block else ())

    def bind(self, args, shape):
        bufs = []
        for name, (dtype, ndim) in zip(self.arg_names, self.program.captures):
            sizes = [tirx.Var(f"{name}_n{d}", "int64") for d in range(ndim)]
            bufs.append(args.tensor(name, sizes, "uint8" if dtype == "bool" else dtype, unit_last_stride=False))
        lists = ()
        if self.block:  # the tile map, then the kv-block lists of flex's BlockMask
            nq, nk = (tirx.Var(f"mask_blocks_n{d}", "int64") for d in (2, 3))
            bh = (shape.batch, shape.heads)
            lists = tuple(args.tensor(name, (*bh, nq, nk) if "indices" in name or "map" in name else (*bh, nq),
                                      "uint8" if "map" in name else "int32", unit_last_stride=False)
                          for name in BLOCK_MASK_ARGS)
        return _BoundScoreProgram(self.role, self.program, self.block, tuple(bufs), *lists)


def _axis_nodes(node, captures, axis: str) -> tuple:
    """The captured loads of a program whose indices depend on `axis` ("q_idx" or "kv_idx")
    alone besides b and h (doc[q_idx], table[b, h, kv_idx // 64], slopes[h]), outermost ones,
    each once: a kernel may load them once per row (ScorePipeline.row_value) or column
    (col_value) instead of once per score."""
    found = []

    def leaves(n):
        return {n[0]} if n[0] in ("score", "b", "h", "q_idx", "kv_idx") else set().union(
            *(leaves(a) for a in n[(2 if n[0] == "capture" else 1):] if isinstance(a, tuple)))

    def walk(n):
        if n[0] == "const":
            return
        if n[0] == "capture" and leaves(n) <= {"b", "h", axis}:
            if n not in found:
                found.append(n)
            return
        for a in n[(2 if n[0] == "capture" else 1):]:
            if isinstance(a, tuple):
                walk(a)
    walk(node)
    return tuple(found)


@dataclass(frozen=True)
class _BoundScoreProgram(ScoreProgram):
    captures: tuple = ()
    block_map: tirx.Buffer | None = None  # (B, H, q-blocks, kv-blocks): 0 empty, 1 partial, 2 full
    kv_num: tirx.Buffer | None = None  # partial kv-blocks per (b, h, q-block), then their list
    kv_indices: tirx.Buffer | None = None
    full_kv_num: tirx.Buffer | None = None  # the full ones
    full_kv_indices: tirx.Buffer | None = None
    row_offset: int = 0  # where this program's values start in ScoreIndex.row / .col
    col_offset: int = 0

    @functools.cached_property
    def row_nodes(self) -> tuple:
        return _axis_nodes(self.program.node, self.program.captures, "q_idx")

    @functools.cached_property
    def col_nodes(self) -> tuple:
        return tuple(n for n in _axis_nodes(self.program.node, self.program.captures, "kv_idx")
                     if n not in self.row_nodes)

    def row_value(self, b, h, q_idx, c):
        """Row node c of query row q_idx as an int32 (booleans 0 / 1, floats their bits)."""
        return self._held(self.row_nodes[c], ScoreIndex(b, h, q_idx, None))

    def col_value(self, b, h, kv_idx, c):
        """Column node c of key kv_idx as an int32 (booleans 0 / 1, floats their bits)."""
        return self._held(self.col_nodes[c], ScoreIndex(b, h, None, kv_idx))

    def _held(self, node, ix):
        value = self._lower(node, None, ix)
        return tirx.reinterpret(PROGRAM_INT, value) if self._kind(node) == "f" else tirx.Cast(PROGRAM_INT, value)

    @functools.cached_property
    def _band(self) -> tuple:
        """A mask's (band, rest) (`program.split_band`: the conjuncts that bound q_idx - kv_idx
        as (lo, hi), the others); (None, node) for a score program."""
        return split_band(self.program.node) if self.role == "mask" else (None, self.program.node)

    @property
    def band(self):
        """Whether the mask is a band alone (a causal or sliding-window mask_mod): kernels then
        mask its partial tiles with the band's two compares a score (`ScorePipeline.row_band`),
        not the program's index arithmetic."""
        return self._band[0] is not None and self._band[1] is None

    @property
    def has_band(self):
        return self._band[0] is not None

    def beyond_band(self, score, ix, shape):
        band, rest = self._band
        if band is None:
            return self.apply(score, ix, shape)
        if rest is None:
            return score
        return tirx.Select(self._as(self._lower(rest, score, ix), "b", rest), score, NEG_INF)

    def kv_range(self, q_lo, q_hi, shape):
        """The keys a band lets queries [q_lo, q_hi) see, lo <= q_idx - kv_idx <= hi (a mask with
        other conjuncts too keeps fewer); None without a band."""
        band = self._band[0]
        if band is None:
            return None
        lo, hi = band
        return (tirx.const(0, "int64") if hi is None else q_lo - hi,
                shape.seqlen_k if lo is None else q_hi - lo)

    def q_range(self, kv_lo, kv_hi, shape):
        band = self._band[0]
        if band is None:
            return None
        lo, hi = band
        return (tirx.const(0, "int64") if lo is None else kv_lo + lo,
                shape.seqlen_q if hi is None else kv_hi + hi)

    def tile_visible(self, q_lo, q_hi, kv_lo, kv_hi, shape):
        """A band alone keeps a tile whole when its extreme differences lie in it."""
        if not self.band:
            return None
        lo, hi = self._band[0]
        conds = ([] if hi is None else [q_hi - 1 - kv_lo <= hi]) + ([] if lo is None else [q_lo - (kv_hi - 1) >= lo])
        return tirx.all(*conds) if conds else tirx.const(True, "bool")

    def kv_list(self, q_lo, at):
        """(count, k0 of the j-th tile, index of the first tile of a full block) walking only
        the kv tiles of the block lists (partial ones, then full ones), for tiles of at.extent
        that divide the block size; None if not."""
        if self.block_map is None or self.block[0] % at.extent[0] or self.block[1] % at.extent[1]:
            return None
        reps = self.block[1] // at.extent[1]  # kernel tiles per listed block
        qb = q_lo // self.block[0]
        n_partial = tirx.Cast("int64", self.kv_num[at.b, at.h, qb])
        count = (n_partial + tirx.Cast("int64", self.full_kv_num[at.b, at.h, qb])) * reps
        last = self.kv_indices.shape[3] - 1

        def k0(j):
            n = j // reps
            listed = tirx.if_then_else(
                n < n_partial, self.kv_indices[at.b, at.h, qb, tirx.min(n, last)],
                self.full_kv_indices[at.b, at.h, qb, tirx.max(tirx.min(n - n_partial, last), tirx.const(0, "int64"))])
            return tirx.Cast("int64", listed) * self.block[1] + j % reps * at.extent[1]
        return count, k0, n_partial * reps

    def tile_state(self, q_lo, kv_lo, at, shape):
        """OR / AND of the block map's entries over the blocks the tile can span (one when the
        block size is a multiple of the tile's, as usual)."""
        if self.block_map is None:
            return None
        live, full = None, None
        spans = [1 if blk % ext == 0 else -(-ext // blk) + 1 for ext, blk in zip(at.extent, self.block)]
        nq, nk = self.block_map.shape[2], self.block_map.shape[3]
        for a in range(spans[0]):
            for c in range(spans[1]):
                qb = tirx.min(q_lo // self.block[0] + a, nq - 1)
                kb = tirx.min(kv_lo // self.block[1] + c, nk - 1)
                state = self.block_map[at.b, at.h, qb, kb]
                is_live, is_full = state != tirx.const(0, "uint8"), state == tirx.const(2, "uint8")
                live = is_live if live is None else tirx.Or(live, is_live)
                full = is_full if full is None else tirx.And(full, is_full)
        return live, full

    def apply(self, score, ix, shape):
        value = self._lower(self.program.node, score, ix)
        if self.role == "mask":
            return tirx.Select(value, score, NEG_INF)
        return value

    def grad(self, score, ix, shape):
        if self.role == "mask":
            return tirx.const(1.0, F32)
        d_node = derivative(self.program.node, self.program.captures)
        return self._as(self._lower(d_node, score, ix), "f", d_node)

    def _kind(self, node):
        return kind_of(node, self.program.captures)

    def _as(self, expr, kind, node):
        have = self._kind(node)
        if have == kind:
            return expr
        if kind == "f":
            return tirx.Cast(F32, expr)
        if kind == "i":
            return tirx.Cast(PROGRAM_INT, expr)
        return expr != tirx.const(0, expr.dtype)

    def _lower(self, node, score, ix):
        op = node[0]
        if op == "score":
            return score
        if op in ("b", "h", "q_idx", "kv_idx"):
            return tirx.Cast(PROGRAM_INT, getattr(ix, op))
        if op == "const":
            value = node[1]
            return tirx.const(value, "bool" if isinstance(value, bool) else PROGRAM_INT if isinstance(value, int) else F32)
        if op == "capture":
            for held, nodes, offset in ((ix.row, self.row_nodes, self.row_offset),
                                        (ix.col, self.col_nodes, self.col_offset)):
                if held is not None and node in nodes:  # loaded once per row / column (_held)
                    value, kind = held[offset + nodes.index(node)], self._kind(node)
                    if kind == "f":
                        return tirx.reinterpret(F32, value)
                    return value != tirx.const(0, PROGRAM_INT) if kind == "b" else value
            buf = self.captures[node[1]]
            index = [_clamped_index(self._as(self._lower(i, score, ix), "i", i), n) for i, n in zip(node[2:], buf.shape)]
            value = buf[tuple(index)] if index else buf[()]
            kind = self._kind(node)
            if kind == "f":
                return tirx.Cast(F32, value)
            return value != tirx.const(0, buf.dtype) if kind == "b" else tirx.Cast(PROGRAM_INT, value)
        kind = self._kind(node)
        args = node[2:] if op == "where" else node[1:]
        # operands in the kind the op computes in: the result's, or the widest operand's for compares
        work = ({self._kind(a) for a in args} if op in ("lt", "le", "gt", "ge", "eq", "ne") else {kind})
        work = "f" if "f" in work or op in ("div",) + tuple(_FLOAT_OPS) else "i" if "i" in work else "b"
        x = [self._as(self._lower(a, score, ix), work, a) for a in args] if op != "pow" else \
            [self._as(self._lower(node[1], score, ix), kind, node[1])]
        if op == "where":
            return tirx.Select(self._as(self._lower(node[1], score, ix), "b", node[1]), x[0], x[1])
        binary = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
                  "div": lambda a, b: a / b, "floordiv": tirx.floordiv, "mod": tirx.floormod,
                  "min": tirx.min, "max": tirx.max, "lt": lambda a, b: a < b, "le": lambda a, b: a <= b,
                  "gt": lambda a, b: a > b, "ge": lambda a, b: a >= b, "eq": lambda a, b: a == b,
                  "ne": lambda a, b: a != b, "and": tirx.And, "or": tirx.Or, "xor": lambda a, b: a != b}
        if op in binary:
            return binary[op](x[0], x[1])
        if op == "not":
            return tirx.Not(x[0])
        if op == "neg":
            return -x[0]
        if op == "abs":
            return tirx.abs(x[0])
        if op == "pow":
            return _power(x[0], node[2][1])
        return _FLOAT_OPS[op](x[0])


# `ScorePipeline.__call__`'s mode for scores masked by their band (row_band, key_band)
BEYOND_BAND = "beyond_band"


# integer values of programs (indices, captured ids): 32-bit, which GPUs and vector units
# handle natively (int64 -> float conversions are emulated on GPUs); indices stay below 2^31
PROGRAM_INT = "int32"


def _clamped_index(index, n):
    """A program's (int32) index into a captured tensor's dimension of size n, clamped into
    [0, n) in 32-bit arithmetic, as int64 for the address. (Clamped in int64, a 64-bit min and
    max a load sat on a flex mask's partial tiles: H100, the document mask's forward ran 1.12x
    faster at 16k with 32 bits.)"""
    index = tirx.Cast(PROGRAM_INT, index)  # (already int32: a no-op)
    top = tirx.Cast(PROGRAM_INT, tirx.min(n - 1, tirx.const(2**31 - 1, "int64")))
    return tirx.Cast("int64", tirx.max(tirx.min(index, top), tirx.const(0, PROGRAM_INT)))


def _power(x, n):
    """x ** n: repeated products for small integer n (vectorises), else pow()."""
    if isinstance(n, int) and 0 <= n <= 8:
        out = tirx.const(1.0, x.dtype) if x.dtype == F32 else tirx.const(1, x.dtype)
        for _ in range(n):
            out = out * x
        return out
    return tirx.power(x, tirx.const(n, x.dtype))


def _exp(x):
    """exp: CUDA's ex2.approx through exp2; the CPUs' vectorising fast_exp."""
    if _MATH_TARGET.get() == "cuda":
        return tirx.exp2(x * tirx.const(LOG2E, F32))
    return fast_exp(x)


_FLOAT_OPS = {
    "exp": _exp, "exp2": lambda x: _exp(x * tirx.const(math.log(2.0), F32)), "log": tirx.log,
    "log2": lambda x: tirx.log(x) * tirx.const(LOG2E, F32), "sqrt": tirx.sqrt,
    "rsqrt": lambda x: tirx.const(1.0, F32) / tirx.sqrt(x),
    "sigmoid": lambda x: tirx.const(1.0, F32) / (tirx.const(1.0, F32) + _exp(-x)),
    "tanh": lambda x: _tanh(x), "sin": tirx.sin, "cos": tirx.cos,
}


def unit_grad(mods) -> bool:
    """Whether every modifier's gradient is the constant 1 (masks, causal, ALiBi; not softcap)."""
    return all(m.unit_grad for m in mods)


def grad_from_output(mods) -> bool:
    """Whether d(modified score)/d(score) is a function of the modified score alone
    (`ScorePipeline.grad_of_output`): unit gradients, or softcap as the only modifier that
    changes values. A backward can then recover it from P and the row's lse instead of
    keeping a factor per score."""
    changing = [m for m in mods if not m.is_mask]
    return unit_grad(mods) or (len(changing) == 1 and isinstance(changing[0], Softcap))


@dataclass(frozen=True)
class KVWalk:
    """A query tile's kv tiles: `count` of them, the j-th starting at key `k0(j)`; `live(j)`
    is None or an expression false for a tile a block mask says to skip; `first_full`, when a
    block mask's lists are walked, the index of the first tile of a full block (later tiles
    need no mask_mod: `tile_unmasked(..., full=j >= first_full)`, with no tile-map load)."""

    count: tirx.PrimExpr
    k0: object
    live: object
    first_full: tirx.PrimExpr | None = None

    def fetch(self, j):
        """Whether tile j exists and is not skipped (loads ahead of the compute)."""
        live = self.live(j)
        return j < self.count if live is None else tirx.all(j < self.count, live)


def unrolled_choice(values: list, c):
    """values[c] for an int c or, from an unrolled loop, a loop variable (the choice then folds
    to one value once the loop is unrolled)."""
    if isinstance(c, int):
        return values[c]
    value = values[-1]
    for k in range(len(values) - 2, -1, -1):
        value = tirx.if_then_else(c == k, values[k], value)
    return value


class ScorePipeline:
    """The bound modifiers of one kernel, applied in order, plus the sequence bounds."""

    def __init__(self, mods, args: KernelArgs, shape: Shape):
        from .dropout import BoundDropout

        self.shape = shape
        # with packed sequences the other modifiers' per-batch tensors (ALiBi's slopes) have a
        # row per sequence
        packed = any(isinstance(m, Varlen) for m in mods)
        per_seq = replace(shape, batch=tirx.Var("num_seqs", "int64")) if packed else shape
        bound = [m.bind(args, shape if isinstance(m, Varlen) else per_seq) for m in mods]
        # dropout acts on probabilities, not scores: kernels apply it where they have P;
        # packed sequences change every other modifier's coordinates
        self.dropout = next((m for m in bound if isinstance(m, BoundDropout)), None)
        self.seqs = next((m for m in bound if isinstance(m, _BoundVarlen)), None)
        self.mods = [m for m in bound if not isinstance(m, (BoundDropout, _BoundVarlen))]
        # flex programs' row-only and key-only loads (packed sequences take no flex programs):
        # each program finds its own at its offsets into ScoreIndex.row / .col
        rows = cols = 0
        for i, m in enumerate(self.mods):
            if isinstance(m, _BoundScoreProgram):
                self.mods[i] = replace(m, row_offset=rows, col_offset=cols)
                rows, cols = rows + len(m.row_nodes), cols + len(m.col_nodes)
        self.programs = [m for m in self.mods if isinstance(m, _BoundScoreProgram)]
        self.keys_from_zero = False  # kernel key indices may be negative (in_sequence)

    def in_sequence(self, seqlen_q, seqlen_k) -> "ScorePipeline":
        """This pipeline for one sequence whose lengths the kernel loads at run time (a KV
        cache's, per batch entry): scores are indexed from the sequence's first key, and keys
        before it (negative indices: a tile that starts early) are out of bounds too."""
        seq = copy.copy(self)
        seq.shape = replace(self.shape, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
        seq.keys_from_zero = True
        return seq

    def in_packed_sequence(self, seqlen_q, seqlen_k) -> "ScorePipeline":
        """This pipeline for a tile that lies inside one packed sequence of the given lengths
        (kernels that give each sequence its own tiles): the kernel indexes scores from the
        sequence's first query and key, with the sequence as their batch index; no per-row
        lookups."""
        inner = copy.copy(self)
        inner.shape = replace(self.shape, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
        inner.seqs = None
        return inner

    @property
    def row_values(self) -> int:
        """How many int32 values of its query row every score needs (a packed sequence's table
        fields, or flex programs' row-only captured loads; 0 without): a kernel may load
        `row_value(b, h, q_idx, c)` for c < row_values once per row and pass them as
        ScoreIndex.row (kernels that do not, pass None: the scores then load them)."""
        if self.seqs is not None:
            return self.seqs.ROW_VALUES
        return sum(len(m.row_nodes) for m in self.programs)

    def row_value(self, b, h, q_idx, c):
        """Row value c (an int or, from an unrolled loop, a loop variable) of row q_idx."""
        if self.seqs is not None:
            return self.seqs.row_value(q_idx, c)
        values = [m.row_value(b, h, q_idx, k) for m in self.programs for k in range(len(m.row_nodes))]
        return unrolled_choice(values, c)

    @property
    def col_values(self) -> int:
        """How many int32 values of its key every score needs (flex programs' column-only
        captured loads): a kernel may load `col_value(b, h, kv_idx, c)` once per column of a
        tile and pass them as ScoreIndex.col."""
        return sum(len(m.col_nodes) for m in self.programs)

    def col_value(self, b, h, kv_idx, c):
        values = [m.col_value(b, h, kv_idx, k) for m in self.programs for k in range(len(m.col_nodes))]
        return unrolled_choice(values, c)

    def _local(self, ix: ScoreIndex):
        """The index and shape the modifiers see (a packed sequence's own)."""
        return (ix, self.shape) if self.seqs is None else self.seqs.local(ix)

    def modify(self, score, ix: ScoreIndex, masked: bool | str = True):
        """The modifiers (and a packed sequence's bounds) without the kernel's bounds check;
        `masked=False` applies only those that change values, BEYOND_BAND the masks' work
        beyond their band too (`row_band`)."""
        local, shape = self._local(ix)
        for m in self.mods:
            if isinstance(masked, str) and m.is_mask:  # BEYOND_BAND
                score = m.beyond_band(score, local, shape)
            elif masked or not m.is_mask:
                score = m.apply(score, local, shape)
        if masked and not isinstance(masked, str) and self.seqs is not None:
            score = tirx.Select(self.seqs.keeps(local, shape), score, NEG_INF)
        return score

    def __call__(self, score, ix: ScoreIndex, masked: bool | str = True):
        """Modified score; -inf outside the sequences (tile padding). `masked=False` is for
        tiles known to be unmasked (`tile_unmasked`): masks and bounds are skipped;
        BEYOND_BAND for scores a kernel masks by their row's or key's band (`row_band`,
        `key_band`, which hold the bounds): what the masks do beyond it."""
        score = self.modify(score, ix, masked)
        if isinstance(masked, str) or not masked:  # BEYOND_BAND or False
            return score
        inside = [ix.q_idx < self.shape.seqlen_q, ix.kv_idx < self.shape.seqlen_k]
        inside += [ix.kv_idx >= 0] if self.keys_from_zero else []
        return tirx.Select(tirx.all(*inside), score, NEG_INF)

    @property
    def unit_grad(self) -> bool:
        """Whether d(pipeline)/d(score) is 1 wherever p > 0 (no softcap): the backward's dS
        then needs no factor per score."""
        return unit_grad(self.mods)

    def grad_of_output(self, modified):
        """d(pipeline)/d(score) from the modified score (where `grad_from_output(mods)`)."""
        changing = [m for m in self.mods if not m.unit_grad]
        return changing[0].grad_of_output(modified) if changing else tirx.const(1.0, F32)

    @property
    def changes_values(self) -> bool:
        """Whether some modifier changes scores (not only masks them)."""
        return any(not m.is_mask for m in self.mods)

    @property
    def additive(self) -> bool:
        """Whether the modifiers that change scores only add a bias (ALiBi), so that a tile
        without masks may compute score x c + bias x c in one multiply-add (`bias`)."""
        return self.seqs is None and all(m.is_mask or m.additive for m in self.mods)

    def bias(self, ix: ScoreIndex, factor):
        """The additive modifiers' bias of a score times the constant `factor`."""
        terms = [m.bias(ix, self.shape, factor) for m in self.mods if not m.is_mask]
        return functools.reduce(lambda a, b: a + b, terms)

    def _lone_value_mod(self, kind):
        """The only modifier that changes values when it is a `kind` and no sequences are packed
        (the forms kernels may special-case), else None."""
        changing = [m for m in self.mods if not m.is_mask]
        if self.seqs is None and len(changing) == 1 and isinstance(changing[0], kind):
            return changing[0]
        return None

    def _split_alibi(self):
        return self._lone_value_mod(_BoundAlibi)

    @property
    def splits_bias(self) -> bool:
        """Whether the bias splits on tiles off its diagonal into a row term plus a key term
        (ALiBi as the only value modifier, no packed sequences): see `bias_side`."""
        return self._split_alibi() is not None

    def bias_side(self, q_lo, q_hi, kv_lo, kv_hi):
        """Where a splitting bias (`splits_bias`) lies on a tile: 1 or -1 (`_BoundAlibi.tile_side`:
        the bias is then side x `split_slope` x ((key - kv_lo) - `split_offset`)), 0 where it
        does not split (the constant 0 for pipelines without such a bias); the constant 1 under a
        bottom-right causal mask (the tiles it leaves whole lie below the diagonal)."""
        alibi = self._split_alibi()
        if alibi is None:
            return 0
        if any(isinstance(m, Causal) and m.align == "bottom_right" for m in self.mods):
            return 1
        return alibi.tile_side(q_lo, q_hi, kv_lo, kv_hi, self.shape)

    def squashed_values(self, scale):
        """For a pipeline whose only value modifier is a softcap (no packed sequences): (a, c) with
        the modified score of a raw score s equal to c x tanh(a s), scale folded into a; None
        for other pipelines. A forward may keep tanh(a s) and fold c into its exponent."""
        cap = self._lone_value_mod(_BoundSoftcap)
        return None if cap is None else (scale * cap._inverse(), cap.cap)

    @staticmethod
    def squash(value):
        """tanh, as a softcap applies it (`squashed_values`)."""
        return _tanh(value)

    def split_slope(self, b, h, factor):
        """A splitting bias's slope times `factor` for batch b, head h."""
        return self._split_alibi().slopes[b, h] * factor

    def split_offset(self, ix: ScoreIndex, k0):
        """A splitting bias's row offset d of row ix.q_idx on the tile from key k0."""
        return self._split_alibi().key_offset(ix, k0, self.shape)

    def tile_unmasked(self, q_lo, q_hi, kv_lo, kv_hi, at: TileAt | None = None, full=None):
        """An expression true when no pair of the tile [q_lo, q_hi) x [kv_lo, kv_hi) is
        masked or out of bounds: such tiles may use `masked=False`. `at` lets masks known per
        tile (block masks) answer; `full`, where the kernel knows it (KVWalk.first_full), is
        whether the block mask says the tile is full."""
        conds = [q_hi <= self.shape.seqlen_q, kv_hi <= self.shape.seqlen_k]
        conds += [kv_lo >= 0] if self.keys_from_zero else []
        shape, bounds = self.shape, (q_lo, q_hi, kv_lo, kv_hi)
        if self.seqs is not None:
            inside, shape, bounds = self.seqs.tile_local(*bounds)
            conds.append(inside)
        for m in self.mods:
            if m.is_mask:
                visible = m.tile_visible(*bounds, shape)
                if visible is None and full is not None and getattr(m, "block_map", None) is not None:
                    visible = full
                state = m.tile_state(q_lo, kv_lo, at, self.shape) if visible is None and at is not None else None
                if visible is None and state is None:
                    return tirx.const(False, "bool")
                conds.append(visible if visible is not None else state[1])
        return tirx.all(*conds)

    def tile_live(self, q_lo, kv_lo, at: TileAt):
        """An expression false when a block mask says no pair of the at.extent tile from
        (q_lo, kv_lo) is kept (kernels skip the tile); None when nothing is known per tile."""
        states = [m.tile_state(q_lo, kv_lo, at, self.shape) for m in self.mods if m.is_mask]
        lives = [st[0] for st in states if st is not None]
        return tirx.all(*lives) if lives else None

    def kv_walk(self, q_lo, q_hi, block_k: int, at: TileAt) -> "KVWalk":
        """The kv tiles of `block_k` keys a query tile [q_lo, q_hi) of extent at.extent visits:
        only the listed ones of a block mask whose blocks the tiles divide, else every tile in
        `kv_blocks` (skipping a block mask's empty ones through `live`)."""
        for m in self.mods:
            listed = m.kv_list(q_lo, at) if hasattr(m, "kv_list") else None
            if listed is not None:
                count, k0, first_full = listed
                return KVWalk(count, k0, live=lambda j: None, first_full=first_full)
        first, end = self.kv_blocks(q_lo, q_hi, block_k)
        return KVWalk(end - first, lambda j: (first + j) * block_k,
                      live=lambda j: self.tile_live(q_lo, (first + j) * block_k, at))

    def and_live(self, cond, q_lo, kv_lo, at: TileAt):
        """`cond` and `tile_live` (for loads: kernels do not fetch tiles they will skip)."""
        live = self.tile_live(q_lo, kv_lo, at)
        if live is None:
            return cond
        return live if cond is True else tirx.all(cond, live)

    def grad(self, score, ix: ScoreIndex):
        """d(pipeline)/d(score) by the chain rule through each modifier."""
        total = tirx.const(1.0, F32)
        local, shape = self._local(ix)
        for m in self.mods:
            total = total * m.grad(score, local, shape)
            score = m.apply(score, local, shape)
        return total

    def kv_range(self, q_lo, q_hi):
        """Keys [lo, hi) that queries [q_lo, q_hi) can see: the intersection over modifiers."""
        ranges = lambda lo, hi, shape: [m.kv_range(lo, hi, shape) for m in self.mods]  # noqa: E731
        if self.seqs is not None:
            return self.seqs.kv_range(q_lo, q_hi, ranges)
        return self._intersect(ranges(q_lo, q_hi, self.shape), self.shape.seqlen_k)

    def row_band(self, q_idx):
        """For a pipeline whose masks all have a band (causal, window, flex masks with band
        conjuncts) and bounds, without packed sequences: the keys [lo, hi) query row q_idx may
        keep (empty past the last row), so that a kernel can mask a tile's scores with two
        compares of small offsets a score, plus, where `band_rest`, the masks' work beyond the
        band (`__call__` with BEYOND_BAND); None for other pipelines."""
        if not self._masks_have_bands:
            return None
        lo, hi = self.kv_range(q_idx, q_idx + 1)
        return lo, tirx.Select(q_idx < self.shape.seqlen_q, hi, lo)

    def key_band(self, kv_idx):
        """row_band's transpose: the queries [lo, hi) that see key kv_idx (empty past the last
        key), for a backward's S^T tiles; None where row_band is None."""
        if not self._masks_have_bands:
            return None
        lo, hi = self.q_range(kv_idx, kv_idx + 1)
        return lo, tirx.Select(kv_idx < self.shape.seqlen_k, hi, lo)

    @property
    def _masks_have_bands(self) -> bool:
        """Whether every mask has a band (row_band, key_band) and no packed sequences move indices."""
        return self.seqs is None and all(m.has_band for m in self.mods if m.is_mask)

    @property
    def band_rest(self) -> bool:
        """Whether some mask keeps fewer pairs than its band (a flex mask's other conjuncts):
        scores masked by `row_band` then take `__call__(..., BEYOND_BAND)` too."""
        return any(m.is_mask and not m.band for m in self.mods)

    def q_range(self, kv_lo, kv_hi):
        """Queries [lo, hi) that can see keys [kv_lo, kv_hi)."""
        ranges = lambda lo, hi, shape: [m.q_range(lo, hi, shape) for m in self.mods]  # noqa: E731
        if self.seqs is not None:
            return self.seqs.q_range(kv_lo, kv_hi, ranges)
        return self._intersect(ranges(kv_lo, kv_hi, self.shape), self.shape.seqlen_q)

    def kv_blocks(self, q_lo, q_hi, block: int):
        """Indices [first, end) of the kv-blocks of `block` keys that queries [q_lo, q_hi)
        need; empty (end == first) when they see no key."""
        return self._blocks(self.kv_range(q_lo, q_hi), block)

    def q_blocks(self, kv_lo, kv_hi, block: int):
        """Indices [first, end) of the q-blocks of `block` queries that see keys [kv_lo, kv_hi)."""
        return self._blocks(self.q_range(kv_lo, kv_hi), block)

    @staticmethod
    def _blocks(rows, block: int):
        lo, hi = rows  # lo >= 0: _intersect starts from 0
        first = lo // block
        return first, tirx.max((hi + block - 1) // block, first)

    @staticmethod
    def _intersect(ranges, length):
        lo, hi = tirx.const(0, "int64"), length
        for r in ranges:
            if r is not None:
                lo, hi = tirx.max(lo, r[0]), tirx.min(hi, r[1])
        return lo, hi
