"""Public attention functions: flash-attn 2.x and torch SDPA compatible.

These validate their inputs (clear ValueError/TypeError naming the argument, before any kernel
runs), turn the caller's layout into (batch, heads, seqlen, head_dim) *views* and call
`ops.attention` (the `tvmflash::attention_forward` operator under torch.compile), which
autograd differentiates with our own backward kernels. Features whose kernels do not exist yet raise NotImplementedError, never pass silently.
"""
from __future__ import annotations

import functools
import itertools
import math
import weakref

import numpy as np
import torch

from . import ops, rng
from .ops import attention
from .spec import MAX_HEAD_DIM

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_tensor(name: str, x, ndim: int = 4, layout: str = "") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D{layout}, got shape {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        raise ValueError(f"{name} must be unit-stride in the head dimension (last), got strides {x.stride()}")


def _check_qkv(q, k, v, names=("q", "k", "v")) -> None:
    """q: (B, H, Lq, D), k/v: (B, Hk, Lk, D) views; `names` are the caller's argument names."""
    qn, kn, vn = names
    for name, x in zip(names, (q, k, v)):
        _check_tensor(name, x)
    for name, x in ((kn, k), (vn, v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {x.dtype} but {qn} has {q.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but {qn} is on {q.device}")
        if x.shape[0] != q.shape[0]:
            raise ValueError(f"{name} has batch size {x.shape[0]} but {qn} has {q.shape[0]}")
        if x.shape[-1] != q.shape[-1]:
            raise ValueError(f"{name} has head_dim {x.shape[-1]} but {qn} has {q.shape[-1]}")
    if v.shape[1] != k.shape[1]:
        raise ValueError(f"{vn} has {v.shape[1]} heads but {kn} has {k.shape[1]}")
    if v.shape[2] != k.shape[2]:
        raise ValueError(f"{vn} has sequence length {v.shape[2]} but {kn} has {k.shape[2]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"the number of heads of {qn} ({q.shape[1]}) must be a multiple of the "
                         f"number of key/value heads ({k.shape[1]})")
    if not 0 < q.shape[-1] <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {q.shape[-1]}")
    if q.device.type == "cuda":
        _check_cuda(q, k, v, names)
    elif q.device.type != "cpu":
        raise NotImplementedError(f"tvmflash runs on CPU and CUDA tensors, got a {q.device.type} tensor")


def _check_cuda(q, k, v, names) -> None:
    """The tensor-core kernels load 16-byte rows with cp.async and run fp16/bf16 mma."""
    if q.dtype == torch.float32:
        raise TypeError(f"{names[0]} is float32: on CUDA tvmflash takes float16 or bfloat16")
    if q.shape[-1] % 16:
        raise ValueError(f"head_dim must be a multiple of 16 on CUDA, got {q.shape[-1]}")
    ops.check_cuda_addresses(names, (q, k, v))


def _scale(scale, head_dim: int, name: str) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{name} must be a float or None, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"{name} must be finite, got {scale}")
    return float(scale)


def _check_mask(mask, q, k):
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and mask.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"attn_mask must be bool or float32/float16/bfloat16, got {mask.dtype}")
    if mask.device != q.device:
        raise ValueError(f"attn_mask is on {mask.device} but query is on {q.device}")
    if mask.requires_grad:
        raise NotImplementedError("gradients with respect to attn_mask are not supported")
    full = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    if mask.dim() > 4:
        raise ValueError(f"attn_mask must have at most 4 dimensions, got shape {tuple(mask.shape)}")
    try:
        if torch.broadcast_shapes(mask.shape, full) != torch.Size(full):
            raise RuntimeError
    except RuntimeError:
        raise ValueError(f"attn_mask of shape {tuple(mask.shape)} is not broadcastable to "
                         f"(batch, heads, seqlen_q, seqlen_k) = {full}") from None
    return mask


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention, on tvmflash kernels.

    query (B, H, Lq, D), key/value (B, Hk, Lk, D), any strides with the head dim unit-stride.
    `is_causal` aligns the diagonal top-left (query i sees keys j <= i), as torch does.
    `attn_mask`: boolean (True = attend) or additive float, broadcastable to (B, H, Lq, Lk);
    it may be combined with `is_causal`. With `enable_gqa`, H must be a multiple of Hk.
    A query row that sees no key returns zeros (torch's math path does the same). Under
    `torch.use_deterministic_algorithms(True)` the CUDA backward avoids atomics.
    `dropout_p > 0` drops probabilities as torch does (whenever it is nonzero, so pass 0.0 in
    eval mode), with a counter-based RNG seeded from torch's generator of the query's device
    (reproducible under `torch.manual_seed`; the backward regenerates the same mask).
    """
    _check_qkv(query, key, value, ("query", "key", "value"))
    if key.shape[1] != query.shape[1] and not enable_gqa:
        raise ValueError(f"query has {query.shape[1]} heads but key has {key.shape[1]}; "
                         "pass enable_gqa=True for grouped-query attention")
    dropout_p = _check_dropout(dropout_p)
    mask = _check_mask(attn_mask, query, key)
    out, _ = attention(query, key, value, mask, _scale(scale, query.shape[-1], "scale"),
                       "top_left" if is_causal else "none", torch.are_deterministic_algorithms_enabled(),
                       dropout_p=dropout_p, dropout_rng=rng.draw_seed(query.device) if dropout_p else None)
    return out


def _check_window(window_size, causal: bool) -> tuple:
    """flash-attn's window: (left, right) ints, negative = unbounded; causal caps right at 0.
    Returns the pair the kernels take, -1 for a side that does not restrict beyond `causal`."""
    if type(window_size) is tuple and window_size == (-1, -1) and type(window_size[0]) is type(window_size[1]) is int:
        return window_size  # the common case, checked in a fraction of a microsecond (decode calls count them)
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2
            and all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        raise ValueError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    left, right = (max(int(w), -1) for w in window_size)
    if causal:
        right = -1  # the causal mask already stops at the diagonal (flash-attn sets right = 0)
    return left, right


def _check_softcap(softcap) -> float:
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float, got {type(softcap).__name__}")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap must be >= 0 and finite (0 disables it), got {softcap}")
    return float(softcap)


def _check_dropout(dropout_p) -> float:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return float(dropout_p)


def _check_alibi(alibi_slopes, q, batch: int):
    """ALiBi slopes: float32 (nheads,) or (batch, nheads) on q's device."""
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(alibi_slopes).__name__}")
    B, H = batch, q.shape[1]
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
    if alibi_slopes.device != q.device:
        raise ValueError(f"alibi_slopes is on {alibi_slopes.device} but q is on {q.device}")
    if tuple(alibi_slopes.shape) not in ((H,), (B, H)):
        raise ValueError(f"alibi_slopes must have shape (nheads,) = ({H},) or (batch, nheads) = ({B}, {H}), "
                         f"got {tuple(alibi_slopes.shape)}")
    if alibi_slopes.requires_grad:
        raise NotImplementedError("gradients with respect to alibi_slopes are not supported")
    return alibi_slopes


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn.flash_attn_func: q (B, Lq, H, D), k/v (B, Lk, Hk, D) -> out (B, Lq, H, D).

    `causal` aligns the diagonal bottom-right (query i sees keys j <= i + Lk - Lq), as
    flash-attn 2.1+ does. GQA/MQA when H is a multiple of Hk. Variants, with flash-attn's
    semantics: `window_size=(left, right)` lets query i see keys i + Lk - Lq - left ...
    i + Lk - Lq + right (-1: unbounded; kv blocks outside the window are skipped);
    `softcap > 0` maps each scaled score s to softcap * tanh(s / softcap); `alibi_slopes`
    (float32, (H,) or (B, H)) subtracts slope * |i + Lk - Lq - j| after scaling.
    `dropout_p` in [0, 1) drops each probability with that chance and scales kept ones by
    1 / (1 - dropout_p), after the softmax (lse is not affected); the mask comes from a Philox
    counter-based RNG (tvmflash/rng.py) seeded from torch's generator of q's device, so
    `torch.manual_seed` reproduces it, and the backward regenerates it. With
    `return_attn_probs` returns (out, softmax_lse, keep): lse is float32 (B, H, Lq), natural
    log, -inf for a query that sees no key; keep is the boolean (B, H, Lq, Lk) dropout keep
    mask (None without dropout; computed in torch, for testing: it takes B*H*Lq*Lk memory). `deterministic=True` makes the CUDA backward
    bitwise reproducible (dQ without atomics, somewhat slower); the CPU backward always is.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x, 4, " (batch, seqlen, nheads, head_dim)")
    out, lse, keep = _flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p,
                                      softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                      return_attn_probs)
    out = out.transpose(1, 2)
    return (out, lse, keep) if return_attn_probs else out


def _flash_attention(qh, kh, vh, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                     deterministic, return_attn_probs, seqlens=None, num_seqs=None, names=("q", "k", "v")):
    """flash-attn's semantics on (B, H, L, D) views: (out view, lse, keep mask or None).
    `seqlens` (`_packed_rows`' row tables) packs `num_seqs` sequences into B = 1."""
    _check_qkv(qh, kh, vh, names)
    window = _check_window(window_size, causal)
    softcap = _check_softcap(softcap)
    alibi_slopes = _check_alibi(alibi_slopes, qh, qh.shape[0] if seqlens is None else num_seqs)
    if alibi_slopes is not None and seqlens is not None:  # a row per sequence
        alibi_slopes = alibi_slopes.expand(num_seqs, qh.shape[1])
    dropout_p = _check_dropout(dropout_p)
    seed = rng.draw_seed(qh.device) if dropout_p else None
    out, lse = attention(qh, kh, vh, None, _scale(softmax_scale, qh.shape[-1], "softmax_scale"),
                         "bottom_right" if causal else "none", bool(deterministic), *window, softcap, alibi_slopes,
                         dropout_p, seed, seqlens)
    keep = None
    if return_attn_probs and dropout_p:
        keep = rng.keep_mask(*qh.shape[:3], kh.shape[2], dropout_p, seed)
    return out, lse, keep


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn.flash_attn_qkvpacked_func: qkv (B, L, 3, H, D), the stacked q, k, v (their
    gradient arrives in one tensor); otherwise as `flash_attn_func`."""
    _check_tensor("qkv", qkv, 5, " (batch, seqlen, 3, nheads, head_dim)")
    _check_stacked("qkv", qkv, 3)
    return flash_attn_func(*qkv.unbind(2), dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn.flash_attn_kvpacked_func: q (B, Lq, H, D), kv (B, Lk, 2, Hk, D) the stacked
    k, v; otherwise as `flash_attn_func`."""
    _check_tensor("kv", kv, 5, " (batch, seqlen_k, 2, nheads_k, head_dim)")
    _check_stacked("kv", kv, 2)
    return flash_attn_func(q, *kv.unbind(2), dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def _check_stacked(name: str, x, n: int) -> None:
    if x.shape[-3] != n:
        raise ValueError(f"{name} must stack {n} tensors in dimension {x.dim() - 3}, got shape {tuple(x.shape)}")


def _cu_offsets(name: str, cu, device) -> list:
    """cu_seqlens' offsets as a host list (one sync on CUDA), checked: an int32 (batch + 1,)
    tensor on the tensors' device, 0 first, non-decreasing."""
    _check_cu_tensor(name, cu, device)
    offsets = cu.tolist()
    if offsets[0] != 0:
        raise ValueError(f"{name} must start at 0, got {offsets[0]}")
    if any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"{name} must be non-decreasing, got {offsets}")
    return offsets


def _check_cu_tensor(name: str, cu, device) -> None:
    """cu_seqlens is an int32 (batch + 1,) tensor on the tensors' device (checked without
    reading it)."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must be 1-D of length batch + 1, got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but the tensors are on {device}")


def _check_same_batch(entries_q: int, entries_k: int) -> None:
    if entries_q != entries_k:
        raise ValueError(f"cu_seqlens_q has {entries_q} entries but cu_seqlens_k has {entries_k}: "
                         "both must be batch + 1 long")


def _check_max_seqlen(max_name: str, max_seqlen) -> None:
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
        raise TypeError(f"{max_name} must be an int, got {type(max_seqlen).__name__}")


def _check_fits(name: str, offsets: list, longest: int, total, max_name: str, max_seqlen) -> None:
    """The offsets end at the token count `total` (None: any); `max_seqlen` is an int no
    smaller than the longest sequence."""
    if total is not None and offsets[-1] != total:
        raise ValueError(f"{name} must end at the number of tokens ({total}), got {offsets[-1]}")
    _check_max_seqlen(max_name, max_seqlen)
    if max_seqlen < longest:
        raise ValueError(f"{max_name} ({max_seqlen}) is below the longest sequence of {name} ({longest})")


def _packed_rows(offsets_q: list, offsets_k: list, device) -> list:
    """The kernels' packed-sequence arguments (kernels/score_mods.py's Varlen) from the host
    offsets: per query row [sequence, query start, query count, key start, key count], per key
    row [sequence, key start, key count, query start, query count], per sequence [query start,
    query count, key start, key count]."""
    n = len(offsets_q) - 1
    seq = torch.tensor([[b, offsets_q[b], offsets_q[b + 1] - offsets_q[b], offsets_k[b], offsets_k[b + 1] - offsets_k[b]]
                        for b in range(n)], dtype=torch.int32).reshape(n, 5)
    rows_q = seq.repeat_interleave(seq[:, 2].long(), dim=0)
    rows_k = seq[:, [0, 3, 4, 1, 2]].repeat_interleave(seq[:, 4].long(), dim=0)
    return [rows_q.to(device), rows_k.to(device), seq[:, 1:].contiguous().to(device)]


class _PackedSequences:
    """Checked offsets and kernel tables of recent cu_seqlens pairs. Every layer of a model
    passes the same cu_seqlens tensors: while the same tensor objects come again unmodified
    (torch's version counter), their offsets are not read back (a device sync) nor their
    tables rebuilt and uploaded, which cost about as much as the attention of a short batch.
    Entries hold weak references: a freed tensor never matches a new one at its address."""

    SIZE = 8

    def __init__(self):
        self.entries = []  # (weakref q, weakref k, versions, value), most recent first

    @staticmethod
    def _versions(cu_q, cu_k):
        try:
            return cu_q._version, cu_k._version
        except RuntimeError:  # inference-mode tensors have no version counter: not cached
            return None

    def get(self, cu_q, cu_k, device):
        """(offsets_q, offsets_k, longest q, longest k, tables) of the pair."""
        versions = self._versions(cu_q, cu_k) if isinstance(cu_q, torch.Tensor) and isinstance(cu_k, torch.Tensor) \
            else None
        for ref_q, ref_k, seen, value in self.entries:
            if versions is not None and ref_q() is cu_q and ref_k() is cu_k and seen == versions \
                    and cu_q.device == device:
                return value
        offsets_q, offsets_k = _cu_offsets("cu_seqlens_q", cu_q, device), _cu_offsets("cu_seqlens_k", cu_k, device)
        _check_same_batch(len(offsets_q), len(offsets_k))
        longest = [max((b - a for a, b in zip(o, o[1:])), default=0) for o in (offsets_q, offsets_k)]
        value = (offsets_q, offsets_k, *longest, _packed_rows(offsets_q, offsets_k, device))
        if versions is not None and not torch.compiler.is_compiling():
            self.entries = [(weakref.ref(cu_q), weakref.ref(cu_k), versions, value)] + self.entries[:self.SIZE - 1]
        return value


_PACKED = _PackedSequences()


# reading the offsets syncs with the GPU: not inside a CUDA graph (torch.compile's
# mode="reduce-overhead" leaves such operators out of its graphs; older torch has no tag)
_HOST_READS = tuple(t for t in [getattr(torch.Tag, "cudagraph_unsafe", None)] if t is not None)


@torch.library.custom_op("tvmflash::varlen_tables", mutates_args=(), tags=_HOST_READS)
def varlen_tables(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int, total_k: int,
                  max_seqlen_q: int, max_seqlen_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A cu_seqlens pair's kernel tables (`_packed_rows`), its offsets checked against the token
    counts and the max_seqlen bounds: the part of `flash_attn_varlen_func` that reads the
    offsets, as an operator, so that under torch.compile the reads happen when the graph runs
    (its output shapes follow from the token counts and the batch)."""
    offsets_q, offsets_k, longest_q, longest_k, tables = _PACKED.get(cu_seqlens_q, cu_seqlens_k, cu_seqlens_q.device)
    _check_fits("cu_seqlens_q", offsets_q, longest_q, total_q, "max_seqlen_q", max_seqlen_q)
    _check_fits("cu_seqlens_k", offsets_k, longest_k, total_k, "max_seqlen_k", max_seqlen_k)
    return tuple(t.clone() for t in tables)  # an operator's outputs are its own


@varlen_tables.register_fake
def _(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k):
    new = cu_seqlens_q.new_empty
    return new((total_q, 5)), new((total_k, 5)), new((cu_seqlens_q.shape[0] - 1, 4))


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """flash_attn.flash_attn_varlen_func: sequences packed back to back, q (total_q, H, D),
    k/v (total_k, Hk, D); sequence b owns rows cu_seqlens_q[b] .. cu_seqlens_q[b+1] of q and
    cu_seqlens_k[b] .. cu_seqlens_k[b+1] of k and v (int32 (batch + 1,) offsets; empty
    sequences allowed). Every keyword is `flash_attn_func`'s, applied per sequence: causal and
    windows align each sequence's own bottom-right corner, ALiBi slopes are (H,) or (batch, H).
    Returns out (total_q, H, D); with `return_attn_probs`, (out, lse (H, total_q), keep), keep
    the (H, total_q, total_k) dropout mask in packed coordinates (None without dropout).
    The offsets are checked (read to the host: one sync on CUDA); `max_seqlen_*` must bound the
    lengths (the kernels do not need them). Under torch.compile (without block_table) that read
    is the `tvmflash::varlen_tables` operator, so the call compiles with fullgraph=True.

    Paged keys: with `block_table` (int32 (batch, max_blocks)), k and v are paged caches
    (num_blocks, page_size, Hk, D) (page size a multiple of 16) and sequence b's keys are the
    first cu_seqlens_k[b+1] - cu_seqlens_k[b] positions of its pages, in table order. They are
    gathered into one packed tensor (a copy; gradients flow back into the pages)."""
    _check_tensor("q", q, 3, " (total_tokens, nheads, head_dim)")
    for name, x in (("k", k), ("v", v)):
        _check_tensor(name, x, 3 if block_table is None else 4,
                      " (total_tokens, nheads, head_dim)" if block_table is None
                      else " (num_blocks, page_size, nheads_k, head_dim) with block_table")
    if torch.compiler.is_compiling() and block_table is None:  # the offsets are read when the graph runs
        for name, cu, max_name, max_seqlen in (("cu_seqlens_q", cu_seqlens_q, "max_seqlen_q", max_seqlen_q),
                                               ("cu_seqlens_k", cu_seqlens_k, "max_seqlen_k", max_seqlen_k)):
            _check_cu_tensor(name, cu, q.device)
            _check_max_seqlen(max_name, max_seqlen)
        _check_same_batch(cu_seqlens_q.shape[0], cu_seqlens_k.shape[0])
        tables = list(varlen_tables(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k))
        num_seqs = cu_seqlens_q.shape[0] - 1
    else:
        offsets_q, offsets_k, longest_q, longest_k, tables = _PACKED.get(cu_seqlens_q, cu_seqlens_k, q.device)
        _check_fits("cu_seqlens_q", offsets_q, longest_q, q.shape[0], "max_seqlen_q", max_seqlen_q)
        _check_fits("cu_seqlens_k", offsets_k, longest_k, k.shape[0] if block_table is None else None,
                    "max_seqlen_k", max_seqlen_k)
        if block_table is not None:
            k, v = _gathered_pages(k, v, block_table, offsets_k)
        num_seqs = len(offsets_q) - 1
    out, lse, keep = _varlen_attention(q, k, v, tables, num_seqs, dropout_p, softmax_scale, causal,
                                       window_size, softcap, alibi_slopes, deterministic, return_attn_probs)
    return (out, lse, keep) if return_attn_probs else out


def _gathered_pages(k_cache, v_cache, block_table, offsets_k: list) -> tuple:
    """Packed (total_k, Hk, D) keys and values of paged caches: sequence b's first
    offsets_k[b+1] - offsets_k[b] positions of its pages (block_table's row b, checked)."""
    batch = len(offsets_k) - 1
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k and v (paged) must have one shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2 \
            or block_table.shape[0] != batch or block_table.device != k_cache.device:
        raise ValueError(f"block_table must be an int32 (batch, max_blocks) tensor on the cache's device, batch = {batch}")
    page = k_cache.shape[1]
    if page % 16:
        raise ValueError(f"the page size (k.shape[1]) must be a multiple of 16, got {page}")
    lengths = [b - a for a, b in zip(offsets_k, offsets_k[1:])]
    if max(lengths, default=0) > block_table.shape[1] * page:
        raise ValueError(f"a sequence of {max(lengths)} keys does not fit block_table's {block_table.shape[1]} pages "
                         f"of {page}")
    used = [block_table[b, :-(-n // page)] for b, n in enumerate(lengths)]
    pages = torch.cat(used) if used else block_table.new_zeros(0)
    if not bool(((pages >= 0) & (pages < k_cache.shape[0])).all()):
        raise ValueError(f"block_table holds a page outside the cache's {k_cache.shape[0]} pages")
    return tuple(torch.cat([_sequence_keys(c, block_table[b], 0, n) for b, n in enumerate(lengths)]) if lengths
                 else c.new_zeros(0, *c.shape[2:]) for c in (k_cache, v_cache))


def _sequence_keys(cache, pages, start: int, end: int):
    """Positions [start, end) of a paged cache's sequence whose pages are `pages` (in order)."""
    return cache[pages[:-(-end // cache.shape[1])].long()].flatten(0, 1)[start:end]


def _varlen_attention(q, k, v, tables: list, num_seqs: int, dropout_p, softmax_scale, causal, window_size,
                      softcap, alibi_slopes, deterministic, return_attn_probs):
    """Packed sequences given the kernels' tables (`_packed_rows`): (out (total_q, H, D), lse
    (H, total_q), keep (H, total_q, total_k) or None)."""
    as_batch = lambda x: x.transpose(0, 1).unsqueeze(0)  # noqa: E731  (T, H, D) -> (1, H, T, D) view
    out, lse, keep = _flash_attention(as_batch(q), as_batch(k), as_batch(v), dropout_p, softmax_scale, causal,
                                      window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                                      tables, num_seqs)
    return out[0].transpose(0, 1), lse[0], None if keep is None else keep[0]


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """flash_attn.flash_attn_varlen_qkvpacked_func: qkv (total, 3, H, D); otherwise as
    `flash_attn_varlen_func` with the same offsets for queries and keys."""
    _check_tensor("qkv", qkv, 4, " (total_tokens, 3, nheads, head_dim)")
    _check_stacked("qkv", qkv, 3)
    return flash_attn_varlen_func(*qkv.unbind(1), cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn.flash_attn_varlen_kvpacked_func: q (total_q, H, D), kv (total_k, 2, Hk, D);
    otherwise as `flash_attn_varlen_func`."""
    _check_tensor("kv", kv, 4, " (total_tokens_k, 2, nheads_k, head_dim)")
    _check_stacked("kv", kv, 2)
    return flash_attn_varlen_func(q, *kv.unbind(1), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def merge_attention_states(out_a, lse_a, out_b, lse_b):
    """Attention over the union of two disjoint sets of keys, from the results over each:
    out (..., D) and lse (...) = out's shape less the head dim (float32, natural log; -inf for
    a query that saw no key), as this library's functions return them (flash-attn's lse is
    (B, H, Lq) against out (B, Lq, H, D): pass lse.transpose(1, 2), or out.transpose(1, 2)).
    Returns (out, lse): lse = log(e^lse_a + e^lse_b), out = the lse-weighted sum of the two, in
    out_a's dtype, accumulated in fp32; a query neither saw gets out = 0 and lse = -inf.
    Split-KV decode and context parallelism combine partial results this way. Differentiable."""
    for name, x in (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.device != out_a.device:
            raise ValueError(f"{name} is on {x.device} but out_a is on {out_a.device}")
    if out_a.dim() < 1 or out_a.shape != out_b.shape:
        raise ValueError(f"out_a and out_b must have one shape, got {tuple(out_a.shape)} and {tuple(out_b.shape)}")
    if out_b.dtype != out_a.dtype or out_a.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"out_a and out_b must share a float dtype, got {out_a.dtype} and {out_b.dtype}")
    for name, x in (("lse_a", lse_a), ("lse_b", lse_b)):
        if x.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {x.dtype}")
        if x.shape != out_a.shape[:-1]:
            raise ValueError(f"{name} must have out's shape without its last dim, {tuple(out_a.shape[:-1])}, "
                             f"got {tuple(x.shape)}")
    # where neither saw a key, -inf - -inf would be NaN (in the value or its gradient): those
    # rows take a finite stand-in, then lse -inf and weights 0
    top = torch.maximum(lse_a, lse_b)
    seen = top > float("-inf")
    top = torch.where(seen, top, 0.0)
    total = torch.where(seen, (lse_a - top).exp() + (lse_b - top).exp(), 1.0)
    lse = torch.where(seen, top + total.log(), float("-inf"))
    weight_a, weight_b = (torch.where(seen, x - lse, float("-inf")).exp().unsqueeze(-1) for x in (lse_a, lse_b))
    out = (weight_a * out_a.float() + weight_b * out_b.float()).to(out_a.dtype)
    return out, lse


def _rotate(x, cos, sin, positions, interleaved: bool):
    """Rotary embedding of x (B, L, H, D) at `positions` (B, L): the first 2 * cos.shape[1] dims
    rotate, as pairs (2i, 2i + 1) when `interleaved` (GPT-J), else halves (GPT-NeoX); in fp32."""
    half = cos.shape[1]
    c, s = (t.float()[positions].unsqueeze(2) for t in (cos, sin))  # (B, L, 1, half)
    part = x[..., :2 * half].float()
    if interleaved:
        a, b = part[..., 0::2], part[..., 1::2]
        turned = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        a, b = part[..., :half], part[..., half:]
        turned = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    return torch.cat((turned.to(x.dtype), x[..., 2 * half:]), dim=-1)


def _check_index_tensor(name: str, x, batch: int, device):
    """An int32 (batch,) tensor on `device` (checked without reading it), or None."""
    if x is None:
        return None
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(x).__name__}")
    if x.dtype != torch.int32 or tuple(x.shape) != (batch,):
        raise ValueError(f"{name} must be int32 of shape (batch,) = ({batch},), got {x.dtype} {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but q is on {device}")
    return x


@functools.lru_cache(maxsize=64)
def _zeros_int32(n: int, device) -> torch.Tensor:
    """(n,) int32 zeros on `device`, kept (decode calls are short: no fresh tensor or view each;
    only ever read)."""
    return torch.zeros(n, dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=16)
def _arange_int32(n: int, device) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int32, device=device)


# flash_attn_with_kvcache reads the cache in place for up to this many queries (decode,
# speculative decode): schedules/cuda_decode.py, kernels/decode.py
DECODE_MAX_QUERIES = 16


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """flash_attn.flash_attn_with_kvcache (inference: no gradients). q (B, Lq, H, D) attends to
    keys [cache_leftpad[b], cache_seqlens[b] + Lnew) of its cache; the new k, v (B, Lnew, Hk, D),
    if given, are first written into the caches in place at cache_seqlens[b] ... (after rotary).

    Caches: (B_cache, Lc, Hk, D) with `cache_batch_idx` (int32 (B,)) choosing each batch's row,
    or paged, (num_blocks, page_size, Hk, D) with `block_table` (int32 (B, max_blocks)) listing
    each sequence's pages in order (page_size a multiple of 16). `cache_seqlens`: int or int32
    (B,) (None: the whole cache). Rotary (`rotary_cos`/`rotary_sin`, (Lro, rotary_dim / 2)):
    the new keys at positions cache_seqlens + i, q at cache_seqlens + i when causal or windowed,
    else all at cache_seqlens; interleaved pairs or halves (`rotary_interleaved`). causal aligns
    q's last row with the last key. Returns out (B, Lq, H, D), and lse (B, H, Lq) with
    `return_softmax_lse`.

    For Lq <= 16 (decode, speculative decode; on CUDA fp16/bf16 with head_dim % 16 == 0) a
    split-KV kernel reads the cache in place, pages included, and merges its splits by lse;
    `num_splits` sets their number (0: chosen from the shape and the device). On CUDA that path
    never waits for the GPU, so it does not read the index tensors to check them: block_table
    entries and lengths are clamped to the cache (reads stay in bounds), new tokens at positions
    past the cache or on pages outside it are not written, rotary positions past the tables take
    their last row (under torch.compile, where the step is torch ops, both fail in torch's
    indexing). On the CPU every index is checked before anything is written (a decode step in
    the decode module: one native call checks, appends and rotates; under torch.compile not at
    all, since there the path is one graph, as on CUDA: `fullgraph=True` and CUDA graphs take a
    decode step whole). Longer q (prefill with a cache) gathers each sequence's keys into one
    packed tensor for the varlen kernels (under torch.compile a graph break: the gather reads
    the lengths)."""
    _check_tensor("q", q, 4, " (batch, seqlen_q, nheads, head_dim)")
    B, Lq, H, D = q.shape
    paged = block_table is not None
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(name, x, 4, " (num_blocks, page_size, nheads_k, head_dim)" if paged
                      else " (batch_cache, seqlen_cache, nheads_k, head_dim)")
        if x.dtype != q.dtype or x.device != q.device:
            raise ValueError(f"{name} must match q's dtype and device ({q.dtype}, {q.device}), got {x.dtype}, {x.device}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: automatic), got {num_splits!r}")
    if paged:
        if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2 \
                or block_table.shape[0] != B or block_table.device != q.device:
            raise ValueError(f"block_table must be an int32 (batch, max_blocks) tensor on q's device, batch = {B}")
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx does not apply to a paged cache (block_table picks the pages)")
        page = k_cache.shape[1]
        if page % 16:
            raise ValueError(f"the page size (k_cache.shape[1]) must be a multiple of 16, got {page}")
        capacity = block_table.shape[1] * page
    else:
        capacity = k_cache.shape[1]
    rows = _check_index_tensor("cache_batch_idx", cache_batch_idx, B, q.device)
    if isinstance(cache_seqlens, bool) or not (cache_seqlens is None or isinstance(cache_seqlens, int)):
        cache_seqlens = _check_index_tensor("cache_seqlens", cache_seqlens, B, q.device)
    leftpad = _check_index_tensor("cache_leftpad", cache_leftpad, B, q.device)
    if (k is None) != (v is None):
        raise ValueError("k and v (the new tokens) must be given together")
    new = 0
    if k is not None:
        for name, x in (("k", k), ("v", v)):
            _check_tensor(name, x, 4, " (batch, seqlen_new, nheads_k, head_dim)")
            if x.shape[0] != B or x.shape[2:] != k_cache.shape[2:] or x.dtype != q.dtype or x.device != q.device:
                raise ValueError(f"{name} must be (batch, seqlen_new, nheads_k, head_dim) = ({B}, *, "
                                 f"{k_cache.shape[2]}, {k_cache.shape[3]}) in q's dtype and device, got {tuple(x.shape)}")
        if v.shape != k.shape:
            raise ValueError(f"v has shape {tuple(v.shape)} but k has {tuple(k.shape)}")
        new = k.shape[1]
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None and (rotary_cos.dim() != 2 or rotary_cos.shape != rotary_sin.shape
                                   or 2 * rotary_cos.shape[1] > D):
        raise ValueError(f"rotary_cos/rotary_sin must be (seqlen_ro, rotary_dim / 2) with rotary_dim <= "
                         f"head_dim ({D}), got {tuple(rotary_cos.shape)} and {tuple(rotary_sin.shape)}")
    # the scalar arguments are checked before anything is written
    scale = _scale(softmax_scale, D, "softmax_scale")
    window = _check_window(window_size, causal)
    softcap = _check_softcap(softcap)
    if alibi_slopes is not None:
        _check_alibi(alibi_slopes, q.transpose(1, 2), B)
    q_steps = causal or window != (-1, -1)  # the queries sit at consecutive positions (rotary)
    in_place = (Lq <= DECODE_MAX_QUERIES and k_cache.shape[2] > 0 and H % k_cache.shape[2] == 0
                and (not q.is_cuda or (q.dtype != torch.float32 and D % 16 == 0)))
    zeros = _zeros_int32(B, q.device)
    if isinstance(cache_seqlens, torch.Tensor):
        seqlens, length = cache_seqlens, 0
    else:  # one length for every batch entry: a scalar added to zero per-batch lengths (no tensor to make)
        seqlens, length = zeros, capacity if cache_seqlens is None else cache_seqlens
    leftpad = zeros if leftpad is None else leftpad
    if rows is None and not paged:
        rows = _arange_int32(B, q.device)
    table = block_table if paged else rows[:, None]
    # a CPU decode step checks its indices in the decode module, and writes its new tokens and
    # rotates there too: one native call (numpy's checks, each in caches the last step's kernel
    # emptied, cost 25-60 us a step; the append and rotary as torch ops 0.08-0.5 ms on 2 cores);
    # on CUDA eager steps append and rotate in one launch too (in torch ops, about twenty)
    eager = in_place and q.numel() > 0 and not torch.compiler.is_compiling() and table.stride(1) == 1
    native_check = eager and not q.is_cuda
    step = ops.CacheStep(k, v, rotary_cos, rotary_sin, rotary_interleaved, q_steps) \
        if eager and (new or rotary_cos is not None) else None
    check = functools.partial(_check_cache_indices, k_cache, block_table, rows, B, None if seqlens is zeros else seqlens,
                              length, None if leftpad is zeros else leftpad, new, capacity, rotary_cos, Lq, q_steps)
    if not (native_check or in_place and (q.is_cuda or torch.compiler.is_compiling())):
        check()  # (on the CPU reading them costs little, beside a decode step)
    if (rotary_cos is not None or new) and step is None:
        with torch.no_grad():
            positions = seqlens.long()[:, None] + length  # where the new tokens go
            if rotary_cos is not None:
                steps = torch.arange(max(Lq, new), device=q.device)
                q_pos = positions + steps[:Lq] if q_steps else positions.expand(B, Lq)
                q = _rotate(q, rotary_cos, rotary_sin, q_pos, rotary_interleaved)
                if k is not None:
                    k = _rotate(k, rotary_cos, rotary_sin, positions + steps[:new], rotary_interleaved)
            if new:  # append in place
                at = positions + torch.arange(new, device=q.device)  # (B, new) absolute positions
                if paged:
                    where = (block_table.long().gather(1, at // page), at % page)
                else:
                    where = (rows.long()[:, None].expand(B, new), at)
                k_cache[where] = k
                v_cache[where] = v
    if in_place:
        try:
            out, lse = ops.decode_kv_cache(q.transpose(1, 2), k_cache, v_cache, table, seqlens, leftpad, length + new,
                                           scale, causal, window, softcap, alibi_slopes, num_splits, native_check, step)
        except ops.CacheIndexError:
            check()  # raises, saying which index
            raise
    else:
        with torch.no_grad():
            out, lse = _gathered_kvcache(q, k_cache, v_cache, block_table, rows, seqlens + length, leftpad, new,
                                         scale, causal, window, softcap, alibi_slopes)
    return (out, lse) if return_softmax_lse else out


def _check_cache_indices(k_cache, block_table, rows, batch: int, seqlens, length: int, leftpad, new: int,
                         capacity: int, rotary_cos, Lq: int, q_steps: bool) -> None:
    """The index tensors' values (read to the host): pages and rows inside the cache, 0 <=
    leftpad <= seqlens + length, room for the new tokens, rotary tables long enough. `seqlens`
    and `leftpad` None: zeros (one length for all, no padding: checked on scalars); an empty
    batch has no lengths to check. Read as
    numpy arrays: on the 16-core Xeon the same checks as torch ops on these (B,)-sized tensors
    cost 40-55 us, a twentieth of a 1k-key decode step."""
    # one pass (a max) over pages or rows: negative entries read as unsigned are past the end too
    if block_table is not None:
        if block_table.numel() and _host_array(block_table).view(np.uint32).max() >= k_cache.shape[0]:
            raise ValueError(f"block_table holds a page outside k_cache's {k_cache.shape[0]} pages")
    elif rows is not None:
        picked = _host_array(rows)
        if picked.size and picked.view(np.uint32).max() >= k_cache.shape[0]:
            raise ValueError(f"cache_batch_idx must index k_cache's {k_cache.shape[0]} rows, got {picked.tolist()}")

    def bad_entry(b, pad, seqlen, end):
        return ValueError(f"batch {b}: need 0 <= cache_leftpad ({pad}) <= cache_seqlens ({seqlen}) and "
                          f"cache_seqlens + new tokens ({end}) <= the cache's {capacity} rows")

    if not batch:
        return
    if seqlens is None and leftpad is None:
        if length < 0 or length + new > capacity:
            raise bad_entry(0, 0, length, length + new)
        ends_max, lengths_max = length + new, length
    else:
        lengths = (_host_array(seqlens).astype(np.int64) if seqlens is not None else np.zeros(batch, np.int64)) + length
        pads = _host_array(leftpad) if leftpad is not None else np.zeros(batch, np.int32)
        ends = lengths + new
        bad = (pads < 0) | (pads > lengths) | (ends > capacity)
        if bad.any():
            b = int(bad.argmax())
            raise bad_entry(b, pads[b], lengths[b], ends[b])
        ends_max, lengths_max = int(ends.max()), int(lengths.max())
    if rotary_cos is not None:
        reach = max(ends_max, lengths_max + (Lq if q_steps else 1))
        if reach > rotary_cos.shape[0]:
            raise ValueError(f"rotary_cos has {rotary_cos.shape[0]} positions; the cache reaches {reach}")


def _host_array(x: torch.Tensor) -> np.ndarray:
    """An index tensor's values as a numpy array (a view on the CPU)."""
    return x.numpy() if x.device.type == "cpu" else x.cpu().numpy()


def _gathered_kvcache(q, k_cache, v_cache, block_table, rows, seqlens, leftpad, new: int, softmax_scale, causal,
                      window_size, softcap, alibi_slopes) -> tuple:
    """flash_attn_with_kvcache through the varlen kernels: each sequence's keys [leftpad, end)
    gathered into one packed tensor (out (B, Lq, H, D), lse (B, H, Lq))."""
    B, Lq, H, D = q.shape
    ends = (seqlens + new).tolist()
    starts, rows = leftpad.tolist(), None if rows is None else rows.tolist()

    def used(cache, b):
        if block_table is not None:
            return _sequence_keys(cache, block_table[b], starts[b], ends[b])
        return cache[rows[b], starts[b]:ends[b]]
    keys, values = (torch.cat([used(c, b) for b in range(B)]) for c in (k_cache, v_cache))
    offsets_k = [0, *itertools.accumulate(e - p for e, p in zip(ends, starts))]
    tables = _packed_rows([b * Lq for b in range(B + 1)], offsets_k, q.device)
    out, lse, _ = _varlen_attention(q.reshape(B * Lq, H, D), keys, values, tables, B, 0.0, softmax_scale, causal,
                                    window_size, softcap, alibi_slopes, False, True)
    return out.view(B, Lq, H, D), lse.view(H, B, Lq).transpose(0, 1)
