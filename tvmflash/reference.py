"""Plain PyTorch attention, the semantics every kernel is checked against (by the tests, and by
`tvmflash tune`, which rejects a candidate whose results differ): (B, H, L, D) layout, any
dtype (float64 for the ground truth, the input dtype for flash-attn's error budget). A query
that sees no key gets output 0 and lse -inf, with finite gradients."""
import math

import torch


def keep_mask(lq, lk, causal="none", mask=None, shape=None, device="cpu"):
    """Boolean (.., Lq, Lk) 'may attend' mask for the causal mode and a bool mask."""
    i = torch.arange(lq, device=device)[:, None]
    j = torch.arange(lk, device=device)[None, :]
    if causal == "top_left":
        keep = j <= i
    elif causal == "bottom_right":
        keep = j <= i + (lk - lq)
    else:
        keep = torch.ones(lq, lk, dtype=torch.bool, device=device)
    if mask is not None and mask.dtype == torch.bool:
        keep = keep & mask
    return keep.expand(shape) if shape is not None else keep


def attention(q, k, v, causal="none", mask=None, scale=None, dtype=None, window=(-1, -1), softcap=0.0,
              alibi_slopes=None, dropout_p=0.0, dropout_keep=None, score_mod=None, mask_mod=None):
    """Returns (out, lse). `dtype` is the compute type (default: q's). window / softcap /
    alibi_slopes as flash-attn's (bottom-right aligned, softcap before ALiBi). Dropout: the
    probabilities times `dropout_keep` (bool, (B, H, Lq, Lk)) / (1 - dropout_p); lse unchanged.
    flex's `score_mod(score, b, h, q_idx, kv_idx)` and `mask_mod(b, h, q_idx, kv_idx)` are called
    on broadcast index tensors, as torch's own math path does."""
    dtype = dtype or q.dtype
    q, k, v = (x.to(dtype) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    lq, lk = q.shape[2], k.shape[2]
    gap = (torch.arange(lq, device=s.device)[:, None] + lk - lq - torch.arange(lk, device=s.device)[None, :])
    idx = [torch.arange(n, device=s.device).view([-1 if d == i else 1 for d in range(4)])
           for i, n in enumerate(s.shape)]  # b, h, q_idx, kv_idx
    if score_mod is not None:
        s = score_mod(s, *idx).to(dtype)  # captured fp32 tables would promote a bf16 s
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(dtype).expand(q.shape[0], q.shape[1])[:, :, None, None]
        s = s - slopes * gap.abs().to(dtype)
    if mask is not None and mask.dtype != torch.bool:
        s = s + mask.to(dtype)
    keep = keep_mask(q.shape[2], k.shape[2], causal, mask, s.shape, s.device)
    if mask_mod is not None:
        keep = keep & torch.broadcast_to(mask_mod(*idx), keep.shape)
    left, right = window
    if left >= 0:
        keep = keep & (gap <= left)
    if right >= 0:
        keep = keep & (-gap <= right)
    s = s.masked_fill(~keep, float("-inf"))
    dead = ~keep.any(-1, keepdim=True) | (s == float("-inf")).all(-1, keepdim=True)
    s = s.masked_fill(dead, 0.0)
    lse = torch.logsumexp(s.float() if dtype != torch.float64 else s, -1, keepdim=True)
    p = torch.exp(s - lse.to(dtype)).masked_fill(dead, 0.0)
    if dropout_keep is not None:
        p = p * dropout_keep.to(dtype) / (1 - dropout_p)
    out = p @ v
    return out, lse.squeeze(-1).masked_fill(dead.squeeze(-1), float("-inf"))
