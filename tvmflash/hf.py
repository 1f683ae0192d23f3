"""A Hugging Face transformers attention function backed by tvmflash.

    from transformers import AttentionInterface, AutoModelForCausalLM
    import tvmflash.hf
    AttentionInterface.register("tvmflash", tvmflash.hf.attention_forward)
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="tvmflash")

Same contract and semantics as transformers' `sdpa_attention_forward` (which is torch SDPA):
query (batch, heads, q_len, head_dim), key/value with the model's kv heads (GQA is native, no
repeat), the model's 4-D attention mask (bool or additive; None for plain causal), returns
(output (batch, q_len, heads, head_dim), None). transformers is not a dependency.
"""
from __future__ import annotations

from typing import Optional

import torch

from .interface import scaled_dot_product_attention


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                      scaling: Optional[float] = None, is_causal: Optional[bool] = None, **kwargs):
    if attention_mask is not None and attention_mask.ndim == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    if is_causal is None:  # transformers' rule: causal only without a mask, never for one query
        is_causal = query.shape[2] > 1 and attention_mask is None and getattr(module, "is_causal", True)
    out = scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                       is_causal=is_causal, scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None
