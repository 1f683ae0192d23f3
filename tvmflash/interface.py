"""Public attention functions: flash-attn 2.x and torch SDPA compatible.

These validate their inputs (clear ValueError/TypeError naming the argument, before any kernel
runs), turn the caller's layout into (batch, heads, seqlen, head_dim) *views* and call
`ops.attention` (the `tvmflash::attention_forward` operator under torch.compile), which
autograd differentiates with our own backward kernels. Features whose kernels do not exist yet raise NotImplementedError, never pass silently.
"""
from __future__ import annotations

import math
import torch

from . import rng
from .ops import attention
from .spec import MAX_HEAD_DIM

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"{name} must be 4-D, got shape {tuple(x.shape)}")
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
    for name, x in zip(names, (q, k, v)):
        if x.data_ptr() % 16 or any(s % 8 for s in x.stride()[:-1]):
            raise ValueError(f"{name} must be 16-byte aligned with strides that are multiples of 8 "
                             f"elements on CUDA, got strides {x.stride()}")


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


def _check_alibi(alibi_slopes, q):
    """ALiBi slopes: float32 (nheads,) or (batch, nheads) on q's device."""
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(alibi_slopes).__name__}")
    B, H = q.shape[0], q.shape[1]
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
        _check_tensor(name, x)
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    _check_qkv(qh, kh, vh)
    window = _check_window(window_size, causal)
    softcap = _check_softcap(softcap)
    alibi_slopes = _check_alibi(alibi_slopes, qh)
    dropout_p = _check_dropout(dropout_p)
    seed = rng.draw_seed(q.device) if dropout_p else None
    out, lse = attention(qh, kh, vh, None, _scale(softmax_scale, q.shape[-1], "softmax_scale"),
                         "bottom_right" if causal else "none", bool(deterministic), *window, softcap, alibi_slopes,
                         dropout_p, seed)
    out = out.transpose(1, 2)
    if not return_attn_probs:
        return out
    keep = rng.keep_mask(*qh.shape[:3], kh.shape[2], dropout_p, seed) if dropout_p else None
    return out, lse, keep
