"""flex_attention on tvmflash kernels: `score_mod` and `mask_mod` written in plain Python/torch
are traced into a small expression program that the kernel generator lowers to TIR (forward and
backward; the backward's d score_mod / d score is derived from the same program, symbolically).

    from tvmflash.flex import flex_attention, create_block_mask   # was torch.nn.attention.flex_attention

Tracing calls the function once with proxy values (`Traced`) for score, b, h, q_idx and kv_idx.
Supported: + - * / // %, comparisons, & | ~ on booleans, torch.where, abs/exp/exp2/log/log2/
sqrt/rsqrt/sigmoid/tanh/sin/cos, minimum/maximum/clamp, Python numbers, and captured tensors
indexed by the proxies (a per-head bias table, document ids ...): those become kernel arguments,
so new values need no rebuild. Python control flow on a traced value (`if score > 0:`) cannot
be traced and raises TypeError: use torch.where. Captured indices are clamped into the tensor.

A program is a tree of tuples: ("score",), ("b",), ("h",), ("q_idx",), ("kv_idx",),
("const", value), ("capture", k, *index nodes), (op, *argument nodes); hashable, so it is part of
the kernel's AttentionSpec (one module per program; captured values are arguments).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .kernels.program import COMPARE, FLOAT_FUNCS, LEAVES, kind_of


class _Trace:
    """The captured tensors met while tracing (in order of first use)."""

    def __init__(self):
        self.tensors: list = []
        self.const_types: list = []  # type of each constant, in order (1, 1.0 and True are equal keys)

    def capture(self, tensor: torch.Tensor, index: tuple):
        for k, t in enumerate(self.tensors):
            if t is tensor:
                break
        else:
            if tensor.requires_grad:
                raise NotImplementedError("gradients with respect to tensors captured by score_mod/mask_mod "
                                          "are not supported")
            self.tensors.append(tensor)
            k = len(self.tensors) - 1
        if len(index) != tensor.dim():
            raise TypeError(f"a captured tensor of {tensor.dim()} dims must be indexed by {tensor.dim()} "
                            f"traced indices (b, h, q_idx, kv_idx or expressions of them), got {len(index)}")
        return Traced(("capture", k, *(self.lift(i) for i in index)), self)

    def lift(self, x):
        """A program node for an operand."""
        if isinstance(x, Traced):
            return x.node
        if isinstance(x, (bool, int, float)):
            self.const_types.append(type(x).__name__)
            return ("const", x)
        if isinstance(x, torch.Tensor) and x.dim() == 0:
            return self.capture(x, ()).node
        raise TypeError(f"score_mod/mask_mod combined a traced value with {type(x).__name__} "
                        f"{tuple(x.shape) if isinstance(x, torch.Tensor) else ''}: index captured "
                        "tensors by b, h, q_idx or kv_idx")


def _unwrap_index(index):
    return index if isinstance(index, tuple) else (index,)


def _torch_op_table() -> dict:
    """torch function / Tensor method name -> (program op, operands reversed)."""
    spellings = {"add": ("add",), "sub": ("sub",), "mul": ("mul",), "div": ("div", "true_divide", "truediv"),
                 "floordiv": ("floor_divide", "floordiv"), "mod": ("remainder", "mod"),
                 "and": ("logical_and", "and"), "or": ("logical_or", "or"), "xor": ("logical_xor", "xor"),
                 "pow": ("pow",), **{c: (c,) for c in COMPARE}}
    table = {"logical_not": ("not", False), "__invert__": ("not", False)}
    for op, names in spellings.items():
        for n in names:
            table.update({n: (op, False), f"__{n}__": (op, False), f"__r{n}__": (op, True)})
    return table


_TORCH_OPS = _torch_op_table()


class Traced:
    """A value of a score_mod/mask_mod being traced: a program node."""

    __slots__ = ("node", "trace")

    def __init__(self, node, trace: _Trace):
        self.node, self.trace = node, trace

    def _op(self, op, *others, reverse=False):
        args = [self.trace.lift(o) for o in others]
        nodes = [*args, self.node] if reverse else [self.node, *args]
        return Traced((op, *nodes), self.trace)

    __neg__ = lambda self: self._op("neg")  # noqa: E731
    __abs__ = lambda self: self._op("abs")  # noqa: E731
    __hash__ = None

    def __pow__(self, exponent):
        if not isinstance(exponent, (int, float)) or isinstance(exponent, bool):
            raise TypeError("a traced value may only be raised to a constant power")
        return self._op("pow", exponent)

    def __bool__(self):
        raise TypeError("score_mod/mask_mod used Python control flow (if/and/or/bool()) on a traced value; "
                        "use torch.where and the operators & | ~ instead")

    # tensor-method spellings of the functions
    def tanh(self): return self._op("tanh")  # noqa: E704
    def exp(self): return self._op("exp")  # noqa: E704
    def log(self): return self._op("log")  # noqa: E704
    def sigmoid(self): return self._op("sigmoid")  # noqa: E704
    def sqrt(self): return self._op("sqrt")  # noqa: E704
    def abs(self): return self._op("abs")  # noqa: E704

    def clamp(self, min=None, max=None):  # noqa: A002 - torch's names
        out = self
        if min is not None:
            out = out._op("max", min)
        if max is not None:
            out = out._op("min", max)
        return out

    def to(self, *args, **kwargs):
        return self  # kinds are inferred; float math runs in fp32

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        flat = [x for a in (*args, *kwargs.values()) for x in (a if isinstance(a, (tuple, list)) else (a,))]
        trace = next(a.trace for a in flat if isinstance(a, Traced))
        if name == "__getitem__" and isinstance(args[0], torch.Tensor):
            return trace.capture(args[0], _unwrap_index(args[1]))
        if name == "where":
            cond, x, y = args
            return Traced(("where", trace.lift(cond), trace.lift(x), trace.lift(y)), trace)
        if name in FLOAT_FUNCS or name in ("abs", "neg", "negative"):
            return Traced(("neg" if name == "negative" else name, trace.lift(args[0])), trace)
        if name in ("minimum", "maximum", "min", "max") and len(args) == 2:
            return Traced(("min" if name.startswith("min") else "max", trace.lift(args[0]), trace.lift(args[1])),
                          trace)
        if name == "clamp":
            lo = kwargs.get("min", args[1] if len(args) > 1 else None)
            hi = kwargs.get("max", args[2] if len(args) > 2 else None)
            x = args[0] if isinstance(args[0], Traced) else Traced(trace.lift(args[0]), trace)
            return x.clamp(lo, hi)
        op, reverse = _TORCH_OPS.get(name, (None, False))
        if op is None:
            raise TypeError(f"score_mod/mask_mod used {name}, which tvmflash cannot trace")
        nodes = [trace.lift(a) for a in args]
        if reverse:
            nodes = nodes[::-1]
        return Traced((op, *nodes), trace)


def _operator(op: str, reverse: bool):
    return lambda self, *other: self._op(op, *other, reverse=reverse)


# Python's operators on traced values, from the same table as torch's spellings (`**` is
# Traced.__pow__: constant exponents only)
for _name, (_op_name, _reverse) in _TORCH_OPS.items():
    if _name.startswith("__") and hasattr(int, _name) and _op_name != "pow":
        setattr(Traced, _name, _operator(_op_name, _reverse))


@dataclass(frozen=True)
class Program:
    """A traced score_mod (value: float) or mask_mod (keep: bool) and its captures' (dtype,
    ndim); the hashable part of a flex call."""

    node: tuple
    captures: tuple
    # the constants' types: programs that differ only in them (q_idx // 2 vs q_idx // 2.0)
    # compute differently but compare equal without it (outside repr: module names keep theirs)
    const_types: tuple = field(default=(), repr=False)

    @property
    def kind(self) -> str:
        return kind_of(self.node, self.captures)


def trace(fn, role: str):
    """(Program, captured tensors) of a score_mod (role "score") or mask_mod (role "mask")."""
    tr = _Trace()
    leaves = [Traced((name,), tr) for name in LEAVES]
    result = fn(*leaves) if role == "score" else fn(*leaves[1:])
    node = tr.lift(result)
    captures = tuple((str(t.dtype).replace("torch.", ""), t.dim()) for t in tr.tensors)
    program = Program(node, captures, tuple(tr.const_types))
    want = "f" if role == "score" else "b"
    if program.kind != want:
        what = "a float score" if role == "score" else "a boolean (keep) value"
        raise TypeError(f"{role}_mod must return {what}, got a value of kind {program.kind!r}")
    return program, tr.tensors


def flex_programs(score_mod=None, mask=None, block_size: tuple | None = None):
    """The programs a flex call's kernels are built from, ((role, Program, block size), ...), and
    the tensors the mods capture (kernel arguments, in that order). `mask`: a mask_mod in tiles
    of `block_size`, or a BlockMask (its own mask_mod and tiles, traced once)."""
    traced = []  # (role, (Program, tensors), block size)
    if score_mod is not None:
        traced.append(("score", trace(score_mod, "score"), None))
    if isinstance(mask, BlockMask):
        traced.append(("mask", mask.traced_mask(), mask.block_size))
    elif mask is not None:
        traced.append(("mask", trace(mask, "mask"), tuple(block_size)))
    return (tuple((role, program, size) for role, (program, _), size in traced),
            [t for _, (_, tensors), _ in traced for t in tensors])


def flex_spec(dtype: torch.dtype, head_dim: int, score_mod=None, mask_mod=None, block_size: tuple = (128, 128)):
    """The AttentionSpec `flex_attention` calls for these mods (the mask's in tiles of
    `block_size`): what to prebuild, export or tune for a flex model."""
    from .ops import register_flex, spec_for

    programs, _ = flex_programs(score_mod, mask_mod, block_size)
    return spec_for(torch.empty(1, 1, 1, head_dim, dtype=dtype), None, "none", flex=register_flex(programs))


# ----------------------------------------------------------------------------- block masks
@dataclass
class BlockMask:
    """Which (query block, key block) tiles a mask_mod keeps, as torch's BlockMask: per
    (batch, head, q-block) the partial kv-blocks (kv_num_blocks, kv_indices) and the full ones
    (full_kv_num_blocks, full_kv_indices), the transposed q-direction lists for the backward,
    and the mask_mod itself (applied element-wise on partial blocks). Build with
    `create_block_mask`."""

    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    full_kv_num_blocks: torch.Tensor
    full_kv_indices: torch.Tensor
    q_num_blocks: torch.Tensor
    q_indices: torch.Tensor
    full_q_num_blocks: torch.Tensor
    full_q_indices: torch.Tensor
    block_size: tuple
    seq_lengths: tuple
    mask_mod: object
    partial: torch.Tensor  # (B, H, q-blocks, kv-blocks) bool: some but not every pair kept
    full: torch.Tensor     # every pair kept
    # the kernels' view of the mask, made once (a call's host time is what a 4k-token
    # attention costs the GPU): the tile map, and its arguments per call shape (B, H)
    tiles: torch.Tensor = field(init=False, repr=False)
    _kernel_args: dict = field(init=False, repr=False, compare=False, default_factory=dict)
    _traced: tuple = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self):
        self.tiles = self.partial.to(torch.uint8) + 2 * self.full.to(torch.uint8)

    @classmethod
    def from_tiles(cls, partial: torch.Tensor, full: torch.Tensor, block_size: tuple, seq_lengths: tuple,
                   mask_mod) -> "BlockMask":
        """A BlockMask from its (B, H, q-blocks, kv-blocks) partial / full tile maps (disjoint)."""
        lists = [_index_lists(tiles) for tiles in (partial, full, partial.transpose(-1, -2), full.transpose(-1, -2))]
        return cls(*(t for pair in lists for t in pair), tuple(block_size), tuple(seq_lengths), mask_mod, partial, full)

    @property
    def shape(self) -> tuple:
        return (*self.partial.shape[:2], *self.seq_lengths)

    def tile_map(self) -> torch.Tensor:
        """(B, H, q-blocks, kv-blocks) uint8 on the mask's device: 0 empty (kernels skip the
        tile), 1 partial (mask_mod applied per pair), 2 full (mask_mod skipped)."""
        return self.tiles

    def kernel_args(self, batch: int, heads: int) -> tuple:
        """The kernels' block-mask arguments (spec.BLOCK_MASK_ARGS) for inputs of `batch` x
        `heads`: the tile map and the forward's kv-block counts and lists, broadcast over a
        batch or head dimension of 1."""
        args = self._kernel_args.get((batch, heads))
        if args is None:
            tensors = (self.tiles, self.kv_num_blocks, self.kv_indices, self.full_kv_num_blocks, self.full_kv_indices)
            args = self._kernel_args[(batch, heads)] = tuple(t.expand(batch, heads, *t.shape[2:]) for t in tensors)
        return args

    def traced_mask(self) -> tuple:
        """(Program, captured tensors) of the mask_mod, traced on first use and kept: as the
        tiles were, the mask is fixed when made (tracing a call's mods costs a short call's
        host time; torch's BlockMask holds its mask_mod the same way)."""
        if self._traced is None or self._traced[0] is not self.mask_mod:  # (mask_mod reassigned)
            self._traced = (self.mask_mod, *trace(self.mask_mod, "mask"))
        return self._traced[1:]

    def sparsity(self) -> float:
        """Percentage of tiles skipped (neither partial nor full)."""
        live = (self.partial | self.full).float().mean().item()
        return 100.0 * (1.0 - live)


def _dense_mask(mask_mod, B, H, Q_LEN, KV_LEN, device, rows=slice(None)):
    b = torch.arange(B, device=device)[:, None, None, None]
    h = torch.arange(H, device=device)[None, :, None, None]
    q = torch.arange(Q_LEN, device=device)[rows][None, None, :, None]
    kv = torch.arange(KV_LEN, device=device)[None, None, None, :]
    return torch.broadcast_to(mask_mod(b, h, q, kv), (B, H, q.shape[2], KV_LEN))


def _index_lists(live: torch.Tensor):
    """(count, indices) per row of a (..., N, M) bool tile map, live indices first."""
    count = live.sum(-1, dtype=torch.int32)
    order = torch.argsort((~live).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count, order


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=128) -> BlockMask:
    """torch.nn.attention.flex_attention.create_block_mask: evaluates `mask_mod(b, h, q_idx,
    kv_idx)` (broadcast torch tensors; B or H None = the same for all) in row chunks and
    classifies each BLOCK_SIZE tile as empty, partial or full."""
    B, H = B or 1, H or 1
    bq, bk = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else tuple(BLOCK_SIZE)
    nq, nk = -(-Q_LEN // bq), -(-KV_LEN // bk)
    any_kept = torch.zeros(B, H, nq, nk, dtype=torch.bool, device=device)
    all_kept = torch.ones(B, H, nq, nk, dtype=torch.bool, device=device)
    pad = nk * bk - KV_LEN
    for qb in range(nq):  # one q-block of rows at a time: memory B*H*bq*KV_LEN
        keep = _dense_mask(mask_mod, B, H, Q_LEN, KV_LEN, device, slice(qb * bq, (qb + 1) * bq)).to(torch.bool)
        tiles = torch.nn.functional.pad(keep, (0, pad)).view(B, H, keep.shape[2], nk, bk)
        any_kept[:, :, qb] = tiles.any(-1).any(2)
        # as torch: pairs past the sequence ends count as masked, so edge tiles are never full
        all_kept[:, :, qb] = tiles.all(-1).all(2) & (keep.shape[2] == bq)
    full = all_kept & any_kept
    return BlockMask.from_tiles(any_kept & ~full, full, (bq, bk), (Q_LEN, KV_LEN), mask_mod)


def _outside_compiled_graphs(fn):
    """`fn` runs eagerly between torch.compile's graphs (a graph break; fullgraph=True refuses
    it by name): tracing score_mod / mask_mod into kernel programs calls them on this module's
    proxies, which Dynamo cannot trace."""
    reason = ("tvmflash.flex_attention traces score_mod / mask_mod itself and runs between compiled "
              "graphs: call it outside a fullgraph=True region")
    try:
        return torch.compiler.disable(fn, reason=reason)
    except TypeError:  # torch < 2.8 has no `reason`
        return torch.compiler.disable(fn)


@_outside_compiled_graphs
def flex_attention(query, key, value, score_mod=None, block_mask: BlockMask | None = None, scale=None,
                   enable_gqa=False, return_lse=False):
    """torch.nn.attention.flex_attention.flex_attention on tvmflash kernels: query (B, H, Lq, D),
    key/value (B, Hk, Lk, D). score = q.k * scale (default 1/sqrt(D)), then
    `score_mod(score, b, h, q_idx, kv_idx)`, then `block_mask`'s mask_mod; softmax; @ value.
    Returns out, or (out, lse) with `return_lse` (natural log, float32 (B, H, Lq)). A query
    that sees no key gets zeros and lse -inf."""
    from .interface import _check_qkv, _scale
    from .ops import attention, register_flex

    _check_qkv(query, key, value, ("query", "key", "value"))
    if key.shape[1] != query.shape[1] and not enable_gqa:
        raise ValueError(f"query has {query.shape[1]} heads but key has {key.shape[1]}; "
                         "pass enable_gqa=True for grouped-query attention")
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"block_mask must come from tvmflash.flex.create_block_mask, got {type(block_mask).__name__}")
        B, H, Lq, Lk = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
        if block_mask.seq_lengths != (Lq, Lk) or block_mask.shape[0] not in (1, B) or block_mask.shape[1] not in (1, H):
            raise ValueError(f"block_mask was made for (B, H, Q_LEN, KV_LEN) = {block_mask.shape}, "
                             f"the inputs are {(B, H, Lq, Lk)}")
    flex, captures = flex_programs(score_mod, block_mask)
    if block_mask is not None:
        captures += block_mask.kernel_args(B, H)
    for t in captures:
        if t.device != query.device:
            raise ValueError(f"a captured tensor is on {t.device} but query is on {query.device}")
    out, lse = attention(query, key, value, None, _scale(scale, query.shape[-1], "scale"), "none",
                         torch.are_deterministic_algorithms_enabled(), flex=register_flex(flex),
                         flex_captures=captures)
    return (out, lse) if return_lse else out


