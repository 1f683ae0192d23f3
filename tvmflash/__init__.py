"""tvmflash: FlashAttention forward and backward written as Apache TVM TensorIR, compiled per
target, called from PyTorch.

    import tvmflash
    out = tvmflash.flash_attn_func(q, k, v, causal=True)              # flash-attn 2.x API
    out = tvmflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k)  # packed sequences
    out = tvmflash.scaled_dot_product_attention(q, k, v, attn_mask=m)  # torch SDPA API
    out = tvmflash.flex_attention(q, k, v, score_mod=fn, block_mask=bm)  # torch flex_attention API
    tvmflash.load_exported("modules/")   # modules from `tvmflash export` (TVM's runtime only)

Importing is cheap: TVM loads on the first call that needs a kernel.
"""
from ._paths import import_schedules
from .deploy import load_exported
from .flex import BlockMask, create_block_mask, flex_attention
from .interface import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                        flash_attn_varlen_func, flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func,
                        flash_attn_with_kvcache, merge_attention_states, scaled_dot_product_attention)
from .spec import AttentionSpec

import_schedules()  # schedules/ lives beside the package in a checkout, inside it in a wheel

__version__ = "0.1.0"
__all__ = ["AttentionSpec", "BlockMask", "create_block_mask", "flash_attn_func", "flash_attn_kvpacked_func",
           "flash_attn_qkvpacked_func", "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache", "flex_attention", "load_exported",
           "merge_attention_states", "scaled_dot_product_attention"]
