"""Integration: a transformer block using tvmflash under torch.compile(fullgraph=True) (no graph
breaks, same values and gradients as eager torch SDPA), and the Hugging Face attention hook."""
import pytest
import torch
from torch import nn

import tvmflash
import tvmflash.hf


class Block(nn.Module):
    """Pre-norm transformer block with GQA attention."""

    def __init__(self, dim=64, heads=4, kv_heads=2, attention=tvmflash.scaled_dot_product_attention):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.attention = attention
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, -1, self.head_dim).transpose(1, 2).split(
            [self.heads, self.kv_heads, self.kv_heads], dim=1)
        a = self.attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, -1))
        return x + self.mlp(self.norm2(x))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_transformer_block_has_no_graph_breaks(backend):
    torch.manual_seed(0)
    block = Block()
    reference = Block(attention=torch.nn.functional.scaled_dot_product_attention)
    reference.load_state_dict(block.state_dict())
    x = torch.randn(2, 37, 64)
    explained = torch._dynamo.explain(block)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    out, ref = compiled(x), reference(x)
    out.square().sum().backward()
    ref.square().sum().backward()
    assert (out - ref).abs().max() < 1e-4
    for (name, p), r in zip(block.named_parameters(), reference.parameters()):
        assert (p.grad - r.grad).abs().max() < 1e-3, name


class _Attention(nn.Module):  # what transformers passes as `module`
    is_causal = True


@pytest.mark.parametrize("mask", [None, "additive", "bool"])
def test_hugging_face_attention_hook(mask):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 19, 32), torch.randn(2, 2, 19, 32), torch.randn(2, 2, 19, 32)
    attn_mask = None
    if mask:
        keep = torch.rand(2, 1, 19, 25) > 0.3  # longer than the keys: the hook slices it
        attn_mask = keep if mask == "bool" else torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    out, weights = tvmflash.hf.attention_forward(_Attention(), q, k, v, attn_mask, scaling=0.2)
    sliced = None if attn_mask is None else attn_mask[..., :19]
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                           attn_mask=sliced, is_causal=mask is None, scale=0.2)
    assert weights is None and out.shape == (2, 19, 4, 32)
    finite = ~ref.isnan()  # torch gives NaN where a row sees no key, tvmflash zeros
    assert (out.transpose(1, 2)[finite] - ref[finite]).abs().max() < 1e-5
