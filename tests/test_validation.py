"""Bad input raises a clear ValueError/TypeError naming the argument, before any kernel runs;
features whose kernels do not exist yet raise NotImplementedError."""
import pytest
import torch

import tvmflash


def bshd(b=2, s=8, h=4, d=32, dtype=torch.float32):
    return torch.randn(b, s, h, d, dtype=dtype)


def bhsd(b=2, h=4, s=8, d=32, dtype=torch.float32):
    return torch.randn(b, h, s, d, dtype=dtype)


FLASH_CASES = [
    ("3-D q", dict(q=torch.randn(8, 4, 32)), ValueError, "q must be 4-D"),
    ("list k", dict(k=[[1.0]]), TypeError, "k must be a torch.Tensor"),
    ("integer q", dict(q=torch.ones(2, 8, 4, 32, dtype=torch.int32)), TypeError, "q must be float32"),
    ("dtype mismatch", dict(k=bshd(dtype=torch.float16)), TypeError, "k has dtype"),
    ("batch mismatch", dict(k=bshd(b=3), v=bshd(b=3)), ValueError, "k has batch size 3"),
    ("head_dim mismatch", dict(v=bshd(d=64)), ValueError, "v has head_dim 64"),
    ("heads not a multiple", dict(k=bshd(h=3), v=bshd(h=3)), ValueError, "multiple of the number of key/value heads"),
    ("k/v heads differ", dict(v=bshd(h=2)), ValueError, "v has 2 heads but k has 4"),
    ("k/v length mismatch", dict(v=bshd(s=9)), ValueError, "v has sequence length 9"),
    ("head dim stride", dict(q=bshd(d=64)[..., ::2]), ValueError, "q must be unit-stride in the head dimension"),
    ("head_dim too large", dict(q=bshd(d=512), k=bshd(d=512), v=bshd(d=512)), ValueError, "head_dim must be in"),
    ("scale nan", dict(softmax_scale=float("nan")), ValueError, "softmax_scale must be finite"),
    ("scale string", dict(softmax_scale="0.1"), TypeError, "softmax_scale must be a float"),
    ("scale bool", dict(softmax_scale=True), TypeError, "softmax_scale must be a float"),
    ("window not a pair", dict(window_size=3), ValueError, "window_size must be a pair"),
    ("window floats", dict(window_size=(4.0, 0)), ValueError, "window_size must be a pair of ints"),
    ("softcap negative", dict(softcap=-1.0), ValueError, "softcap must be >= 0"),
    ("softcap inf", dict(softcap=float("inf")), ValueError, "softcap must be >= 0 and finite"),
    ("softcap string", dict(softcap="30"), TypeError, "softcap must be a float"),
    ("alibi shape", dict(alibi_slopes=torch.ones(3)), ValueError, r"alibi_slopes must have shape \(nheads,\)"),
    ("alibi dtype", dict(alibi_slopes=torch.ones(4, dtype=torch.float64)), TypeError, "alibi_slopes must be float32"),
    ("alibi list", dict(alibi_slopes=[1.0] * 4), TypeError, "alibi_slopes must be a torch.Tensor"),
    ("alibi needs grad", dict(alibi_slopes=torch.ones(4, requires_grad=True)), NotImplementedError, "alibi_slopes"),
    ("dropout one", dict(dropout_p=1.0), ValueError, r"dropout_p must be in \[0, 1\)"),
    ("dropout negative", dict(dropout_p=-0.1), ValueError, r"dropout_p must be in \[0, 1\)"),
    ("dropout string", dict(dropout_p="0.1"), TypeError, "dropout_p must be a float"),
]


@pytest.mark.parametrize("case,override,exc,message", FLASH_CASES, ids=[c[0] for c in FLASH_CASES])
def test_flash_attn_func_rejects(case, override, exc, message):
    kwargs = dict(q=bshd(), k=bshd(), v=bshd())
    kwargs.update(override)
    with pytest.raises(exc, match=message):
        tvmflash.flash_attn_func(**kwargs)


SDPA_CASES = [
    ("gqa without enable_gqa", dict(key=bhsd(h=2), value=bhsd(h=2)), ValueError, "enable_gqa=True"),
    ("mask not broadcastable", dict(attn_mask=torch.ones(3, 8, dtype=torch.bool)), ValueError, "attn_mask of shape"),
    ("mask 5-D", dict(attn_mask=torch.ones(1, 1, 1, 8, 8, dtype=torch.bool)), ValueError, "at most 4 dimensions"),
    ("integer mask", dict(attn_mask=torch.ones(8, 8, dtype=torch.int64)), TypeError, "attn_mask must be bool"),
    ("mask not a tensor", dict(attn_mask=[[True]]), TypeError, "attn_mask must be a torch.Tensor"),
    ("mask needs grad", dict(attn_mask=torch.zeros(8, 8, requires_grad=True)), NotImplementedError, "attn_mask"),
    ("scale inf", dict(scale=float("inf")), ValueError, "scale must be finite"),
    ("dropout nan", dict(dropout_p=float("nan")), ValueError, "dropout_p must be in"),
    ("value dtype", dict(value=bhsd(dtype=torch.bfloat16)), TypeError, "value has dtype"),
    ("key batch", dict(key=bhsd(b=1), value=bhsd(b=1)), ValueError, "key has batch size 1 but query"),
]


@pytest.mark.parametrize("case,override,exc,message", SDPA_CASES, ids=[c[0] for c in SDPA_CASES])
def test_sdpa_rejects(case, override, exc, message):
    kwargs = dict(query=bhsd(), key=bhsd(), value=bhsd())
    kwargs.update(override)
    with pytest.raises(exc, match=message):
        tvmflash.scaled_dot_product_attention(**kwargs)


def test_spec_rejects_unknown_values():
    with pytest.raises(ValueError, match="dtype"):
        tvmflash.AttentionSpec(dtype="int8")
    with pytest.raises(ValueError, match="causal"):
        tvmflash.AttentionSpec(causal="diagonal")
    with pytest.raises(ValueError, match="head_dim"):
        tvmflash.AttentionSpec(head_dim=300)
    with pytest.raises(ValueError, match="kv_cache spec takes"):
        tvmflash.AttentionSpec(mask="bool", kv_cache=True)
    with pytest.raises(ValueError, match="kv_cache spec takes"):
        tvmflash.AttentionSpec("float16", variants=("dropout",), kv_cache=True)
