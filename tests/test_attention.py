"""Forward, lse and all three gradients against a float64 reference.

Error budget (flash-attn's rule): |ours - ref64| <= 2 * |torch-in-input-dtype - ref64| + floor.
Cases are grouped by spec so each compiled module is built once per run (shared cache).
"""
import os
from contextlib import contextmanager

import pytest
import torch

import tvmflash
from tvmflash.reference import attention

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FLOOR = {torch.float32: 2e-5, torch.bfloat16: 2e-3, torch.float16: 1e-3}
SHAPES = [(1, 1), (17, 17), (128, 128), (113, 203), (203, 113), (257, 64)]
HEADS = [(4, 2), (6, 1)]  # GQA 4:2 and 6:1 (MQA); MHA is covered by mask cases


def assert_close(name, ours, ref64, low, dtype):
    ours, ref64, low = ours.double(), ref64.double(), low.double()
    assert not ours.isnan().any(), f"{name}: NaN"
    err = (ours - ref64).abs().max().item()
    budget = 2 * (low - ref64).abs().max().item() + FLOOR[dtype]
    assert err <= budget, f"{name}: max error {err:.3g} > budget {budget:.3g}"


@contextmanager
def backward_plan(plan):
    """Force one of the two backward paths (see tvmflash.ops.backward_plan)."""
    old = os.environ.get("TVMFLASH_BACKWARD")
    os.environ["TVMFLASH_BACKWARD"] = plan
    try:
        yield
    finally:
        if old is None:
            del os.environ["TVMFLASH_BACKWARD"]
        else:
            os.environ["TVMFLASH_BACKWARD"] = old


def check_against_reference(q, k, v, dout, run, causal="none", mask=None, scale=None, **variant):
    """q/k/v/dout in (B, H, L, D); `run(q, k, v)` returns (out, lse) in that layout.
    Gradients are checked on both backward paths. `variant`: window / softcap / alibi_slopes
    for the reference (reference.attention's keywords)."""
    grads = {}
    for plan in ("fused", "split"):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        out, lse = run(*leaves)
        with backward_plan(plan):
            out.backward(dout)
        grads[plan] = [x.grad for x in leaves]

    def reference(dtype):
        xs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        m = mask.to(dtype) if mask is not None and mask.dtype != torch.bool else mask
        o, l = attention(*xs, causal=causal, mask=m, scale=scale, **variant)
        o.backward(dout.to(dtype))
        return o, l, [x.grad for x in xs]

    o64, l64, g64 = reference(torch.float64)
    olow, _, glow = reference(q.dtype)
    assert_close("out", out, o64, olow, q.dtype)
    if lse is not None:
        assert torch.equal(lse.isinf(), l64.isinf()), "lse: -inf rows differ"
        fin = ~l64.isinf()
        assert (lse.double()[fin] - l64[fin]).abs().max().item() <= 2e-4 if fin.any() else True
        assert (lse[~fin] < 0).all(), "lse of a fully masked row must be -inf"
    for plan, plan_grads in grads.items():
        for name, ours, r64, rlow in zip(("dq", "dk", "dv"), plan_grads, g64, glow):
            assert_close(f"{name} ({plan})", ours, r64, rlow, q.dtype)


def make(b, h, hk, lq, lk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=g).to(dtype)
    k = torch.randn(b, hk, lk, d, generator=g).to(dtype)
    v = torch.randn(b, hk, lk, d, generator=g).to(dtype)
    dout = torch.randn(b, h, lq, d, generator=g).to(dtype)
    return q, k, v, dout


def flash_run(causal):
    def run(q, k, v):
        out, lse, _ = tvmflash.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               causal=causal, return_attn_probs=True)
        return out.transpose(1, 2), lse
    return run


# (dtype, head_dim, causal) of the flash_attn_func cases; each is one spec
FLASH_SPECS = [
    ("fp32", 32, False), ("fp32", 64, False), ("fp32", 80, False), ("fp32", 128, False),
    ("fp32", 256, False), ("fp32", 64, True), ("bf16", 64, False), ("bf16", 128, True),
    ("fp16", 64, False), ("fp16", 80, True),
]


@pytest.mark.parametrize("dtype,d,causal", FLASH_SPECS, ids=lambda x: str(x))
@pytest.mark.parametrize("lq,lk", SHAPES, ids=lambda x: str(x))
def test_flash_attn_func(dtype, d, causal, lq, lk):
    h, hk = HEADS[(lq + d) % 2]
    q, k, v, dout = make(2, h, hk, lq, lk, d, DTYPES[dtype])
    check_against_reference(q, k, v, dout, flash_run(causal), causal="bottom_right" if causal else "none")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("lq,lk", SHAPES, ids=lambda x: str(x))
def test_sdpa_causal_top_left(dtype, lq, lk):
    q, k, v, dout = make(2, 4, 2, lq, lk, 64, DTYPES[dtype])

    def run(q, k, v):
        out = tvmflash.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        _, lse = torch.ops.tvmflash.attention_forward(q, k, v, None, 64 ** -0.5, "top_left")
        return out, lse
    check_against_reference(q, k, v, dout, run, causal="top_left")


def masks(kind, b, h, lq, lk, dtype):
    """Masks of several broadcast shapes, each with some fully masked query rows."""
    g = torch.Generator().manual_seed(1)
    shapes = [(lq, lk), (b, 1, lq, lk), (1, h, 1, lk), (b, h, lq, lk)]
    out = []
    for shape in shapes:
        keep = torch.rand(shape, generator=g) > 0.3
        if shape[-2] > 1:
            keep[..., 1, :] = False  # a fully masked query row
        if kind == "bool":
            out.append(keep)
        else:
            bias = torch.randn(shape, generator=g).to(dtype)
            out.append(bias.masked_fill(~keep, float("-inf")))
    return out


@pytest.mark.parametrize("kind,dtype,causal", [("bool", "fp32", False), ("additive", "fp32", False),
                                               ("bool", "fp32", True), ("additive", "bf16", False)],
                         ids=lambda x: str(x))
@pytest.mark.parametrize("lq,lk", [(17, 17), (113, 203), (203, 113)], ids=lambda x: str(x))
def test_sdpa_masks(kind, dtype, causal, lq, lk):
    b, h = 2, 3
    q, k, v, dout = make(b, h, h, lq, lk, 64, DTYPES[dtype])
    for mask in masks(kind, b, h, lq, lk, DTYPES[dtype]):
        def run(q, k, v):
            out = tvmflash.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
            _, lse = torch.ops.tvmflash.attention_forward(q, k, v, mask, 64 ** -0.5,
                                                          "top_left" if causal else "none")
            return out, lse
        check_against_reference(q, k, v, dout, run, causal="top_left" if causal else "none", mask=mask)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("lq,lk", [(1, 1), (1, 300), (5, 2049), (16, 130)], ids=lambda x: str(x))
def test_decode_split_kv(dtype, lq, lk, monkeypatch):
    """Lq <= 16 takes the split-KV forward (ops._forward_split): few heads, so the keys are cut
    into several splits; top-left causal leaves most splits without a visible key, bottom-right
    gives every query the whole cache; a boolean mask hides a whole row."""
    from tvmflash import ops

    calls = []
    split = ops._forward_split
    monkeypatch.setattr(ops, "_forward_split", lambda *a: calls.append(a) or split(*a))
    heads_k = (1, 2) if lq == 1 else (1,)  # 2 query heads a kv-head; 1 (one query row: the one-row kernel)
    for hk in heads_k:
        q, k, v, dout = make(1, 2, hk, lq, lk, 64, DTYPES[dtype])
        for causal in ("top_left", "bottom_right", "none"):
            check_against_reference(q, k, v, dout, lambda q, k, v: torch.ops.tvmflash.attention_forward(
                q, k, v, None, 64 ** -0.5, causal), causal=causal)
        mask = torch.rand(1, 1, lq, lk, generator=torch.Generator().manual_seed(lq)) > 0.3
        mask[..., 0, :] = False
        check_against_reference(q, k, v, dout, lambda q, k, v: torch.ops.tvmflash.attention_forward(
            q, k, v, mask, 64 ** -0.5, "none"), causal="none", mask=mask)
    assert len(calls) == 8 * len(heads_k)  # two forwards (fused and split backward plans) per check


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_decode_split_kv_head_groups(dtype, monkeypatch):
    """Dense K/V take one kv-head a task (ops.DENSE_KV_HEAD_GROUPS); the kernel still takes
    groups of them as the KV cache's tasks do: groups of 4 (all), and of 2 with a short last
    one (3 kv-heads), in SDPA's layout and in flash-attn's (strided views)."""
    from tvmflash import ops

    plans = []
    plan = ops._cpu_split_plan
    monkeypatch.setattr(ops, "_cpu_split_plan", lambda *a, **kw: plans.append(plan(*a, **kw)) or plans[-1])
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert ops._cpu_split_plan({"forward_split": 0}, "forward_split", 16, 32, 8, 1, 1024,
                               kv_head_groups=False) == (0, 1, 1)
    monkeypatch.setattr(ops, "DENSE_KV_HEAD_GROUPS", True)
    run = lambda q, k, v: torch.ops.tvmflash.attention_forward(q, k, v, None, 64 ** -0.5, "none")  # noqa: E731
    for b, h, hk, most in ((4, 8, 4, 8), (1, 6, 3, 2)):  # (8: the kernel clamps it to the 4 kv-heads)
        q, k, v, dout = make(b, h, hk, 1, 300, 64, DTYPES[dtype])
        for layout in ("sdpa", "flash"):
            if layout == "flash":  # (B, L, H, D) tensors, seen as (B, H, L, D) views
                q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
            plans.clear()
            ops._split_plans.clear()
            check_against_reference(q, k, v, dout, run, causal="none")
            assert [p[1] for p in plans] == [most]  # kv-heads a task (the second forward's plan is kept)


def test_cpu_split_counts(monkeypatch):
    """The automatic splits of the CPU split-KV forward: a task a thread at least, at most
    SPLIT_TASK_KEYS keys a task (the Xeon's sweep), never more than one per 64-key block."""
    from tvmflash import ops

    monkeypatch.setattr(torch, "get_num_threads", lambda: 16)
    assert ops._cpu_splits(16, 32, 8, 1, 16384) == 8  # 128 tasks already; 2048 keys a task
    assert ops._cpu_splits(16, 32, 8, 1, 1024) == 1
    assert ops._cpu_splits(1, 16, 16, 1, 1024) == 1  # 16 tasks for 16 threads
    assert ops._cpu_splits(1, 16, 8, 1, 1024) == 2  # 8 tasks
    assert ops._cpu_splits(1, 32, 8, 16, 4096) == 2  # 8 kv-heads x 16 blocks of 4 rows: 128 tasks
    assert ops._cpu_splits(1, 1, 1, 1, 100) == 2  # 16 wanted, 2 blocks of keys
    assert ops._cpu_splits(1, 1, 1, 1, 100, requested=1) == 1
    # the kernel by rows a kv-head: one row, up to 4 on FMAs, more on AMX tiles where the module has them
    kern = {"decode": "fma", "decode_row": "row", "decode_tiles": "tiles"}
    assert [ops._split_kernel(kern, "decode", rows) for rows in (1, 4, 5)] == [("row", 4, 8), ("fma", 4, 8),
                                                                                 ("tiles", 16, 1)]
    assert ops._split_kernel({"decode": "fma"}, "decode", 16) == ("fma", 4, 8)
    # kv-heads a task (the most up to 8 with which the tasks fill the threads) and the splits then
    assert ops._task_kv_heads(16, 32, 8, 1, 4, 8) == 8  # 16 tasks
    assert ops._cpu_splits(16, 32, 8, 1, 1024, task_kv_heads=8) == 1
    assert ops._cpu_splits(16, 32, 8, 1, 4096, task_kv_heads=8) == 2  # 2048 keys a task
    assert ops._task_kv_heads(4, 32, 8, 1, 4, 8) == 2  # 16 tasks
    assert ops._task_kv_heads(1, 32, 8, 1, 4, 8) == 1  # 8 tasks: fill with splits instead
    assert ops._task_kv_heads(1, 16, 16, 1, 4, 8) == 1
    assert ops._task_kv_heads(2, 24, 12, 1, 4, 8) == 1
    assert ops._task_kv_heads(4, 24, 12, 1, 4, 8) == 2  # 4 x 6 tasks (not 4 x 4)
    assert ops._task_kv_heads(1, 32, 8, 16, 4, 8) == 8  # 16 row blocks of the 8 kv-heads
    assert ops._task_kv_heads(16, 32, 8, 1, 16, 1) == 1  # the AMX decode: one kv-head a task
    # the AMX decode's tasks hold 16 rows: 8 kv-heads x 4 blocks, 32 tasks for 16 threads
    assert ops._cpu_splits(1, 32, 8, 16, 1024, task_rows=16) == 1
    assert ops._cpu_splits(1, 32, 8, 4, 4096, task_rows=16) == 2  # 8 tasks: 2 splits


def test_fully_masked_rows_give_zero_output_and_finite_grads():
    q, k, v, dout = make(1, 2, 2, 5, 7, 32, torch.float32)
    mask = torch.zeros(5, 7, dtype=torch.bool)
    q.requires_grad_()
    out = tvmflash.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out.backward(dout)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(q.grad, torch.zeros_like(q))


def test_bottom_right_with_more_queries_than_keys_masks_leading_rows():
    q, k, v, _ = make(1, 2, 2, 9, 4, 32, torch.float32)
    out, lse, _ = tvmflash.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           causal=True, return_attn_probs=True)
    assert torch.equal(out[:, :5], torch.zeros_like(out[:, :5]))
    assert torch.isneginf(lse[..., :5]).all() and torch.isfinite(lse[..., 5:]).all()


@pytest.mark.parametrize("scale", [0.3, -0.3])
def test_strided_views_from_packed_qkv_and_scale(scale):
    """q/k/v sliced from one packed tensor go in without copies; softmax_scale is honoured,
    negative ones too."""
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 37, 3, 4, 64, generator=g)
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    dout = torch.randn(2, 37, 4, 64, generator=g)
    to_bhld = lambda x: x.transpose(1, 2)

    def run(qh, kh, vh):
        out = tvmflash.flash_attn_func(to_bhld(qh), to_bhld(kh), to_bhld(vh), softmax_scale=scale)
        return to_bhld(out), None
    # run() receives (B, H, L, D) leaves; hand it strided ones built from the packed tensor
    qh, kh, vh = (to_bhld(x) for x in (q, k, v))
    check_against_reference(qh, kh, vh, to_bhld(dout), run, scale=scale)


def test_lse_gradient_flows():
    q, k, v, dout = make(1, 2, 2, 33, 45, 32, torch.float64)
    q, k, v = (x.float().requires_grad_() for x in (q, k, v))
    out, lse, _ = tvmflash.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           return_attn_probs=True)
    (out.sum() + lse.sum()).backward()
    xs = [x.detach().double().requires_grad_() for x in (q, k, v)]
    o, l = attention(*xs)
    (o.sum() + l.sum()).backward()
    for ours, ref in zip((q.grad, k.grad, v.grad), (x.grad for x in xs)):
        assert (ours.double() - ref).abs().max() < 1e-5


@pytest.mark.parametrize("plan", ["fused", "split"])
def test_backward_is_bitwise_deterministic(plan):
    q, k, v, dout = make(2, 4, 2, 150, 190, 64, torch.float32)
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def grads():
        out = tvmflash.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        with backward_plan(plan):
            return torch.autograd.grad(out, (q, k, v), dout)
    first, second = grads(), grads()
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_empty_sequences():
    q = torch.randn(1, 2, 0, 32)
    k = torch.randn(1, 2, 5, 32)
    assert tvmflash.scaled_dot_product_attention(q, k, k).shape == (1, 2, 0, 32)
    q = torch.randn(1, 2, 3, 32, requires_grad=True)
    k = torch.randn(1, 2, 0, 32)
    out = tvmflash.scaled_dot_product_attention(q, k, k)
    out.sum().backward()
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(q.grad, torch.zeros_like(q))


def test_torch_compile_fullgraph():
    q, k, v, dout = make(1, 2, 2, 40, 40, 32, torch.float32)
    q.requires_grad_()

    @torch.compile(fullgraph=True, backend="aot_eager")
    def block(q, k, v):
        return tvmflash.scaled_dot_product_attention(q * 2, k, v, is_causal=True).relu()
    out = block(q, k, v)
    out.backward(dout)
    qr = q.detach().clone().requires_grad_()
    ref = torch.nn.functional.scaled_dot_product_attention(qr * 2, k, v, is_causal=True).relu()
    ref.backward(dout)
    assert (out - ref).abs().max() < 1e-5 and (q.grad - qr.grad).abs().max() < 1e-5


NONFINITE_CASES = {  # (tensor, index (b, l, h, d) in flash-attn's layout, value)
    "nan in a query": ("q", (0, 3, 0, 5), float("nan")), "nan in a key": ("k", (0, 4, 1, 2), float("nan")),
    "nan in a value": ("v", (0, 4, 1, 2), float("nan")), "inf in a value": ("v", (1, 4, 0, 7), float("inf")),
    "inf in a query": ("q", (0, 3, 0, 5), float("inf")), "-inf in a key": ("k", (0, 2, 0, 5), float("-inf")),
}


def check_nonfinite_inputs(device, dtype, case, causal, head_dim=16):
    """NaN / Inf in q, k or v reach exactly the outputs they reach in float64 math (every score
    a query attends to; masked keys do not count) and exactly the dq rows of autograd's, and
    the finite values stay right. dK / dV are non-finite wherever autograd's are (never a hidden
    NaN), and more widely where a query row's lse is not finite (its probabilities are
    recomputed from the lse: all NaN, where autograd keeps the zeros of its other keys)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 9, 2, head_dim, generator=g) for _ in range(3))
    name, index, value = NONFINITE_CASES[case]
    dict(q=q, k=k, v=v)[name][index] = value
    q, k, v = (x.to(device, dtype).requires_grad_() for x in (q, k, v))
    out = tvmflash.flash_attn_func(q, k, v, causal=causal)
    out.backward(torch.ones_like(out))
    leaves = [x.detach().double().cpu().transpose(1, 2).requires_grad_() for x in (q, k, v)]
    ref, _ = attention(*leaves, causal="bottom_right" if causal else "none")
    ref.backward(torch.ones_like(ref))
    for what, ours, theirs in [("out", out, ref), *zip(("dq", "dk", "dv"), (x.grad for x in (q, k, v)),
                                                        (x.grad for x in leaves))]:
        ours, theirs = ours.detach().double().cpu(), theirs.transpose(1, 2)
        if what in ("out", "dq"):
            assert torch.equal(ours.isnan(), theirs.isnan()) and torch.equal(ours.isinf(), theirs.isinf()), what
        assert ours.isfinite()[~theirs.isfinite()].sum() == 0, f"{what}: finite where autograd's is not"
        fin = theirs.isfinite() & ours.isfinite()
        tol = (1e-4 if dtype == torch.float32 else 5e-2) * (1 + theirs[fin].abs().max().item() if fin.any() else 1)
        assert not fin.any() or (ours[fin] - theirs[fin]).abs().max() < tol, what


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", NONFINITE_CASES)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_nonfinite_inputs_propagate_like_float64_math(dtype, case, causal):
    check_nonfinite_inputs("cpu", DTYPES[dtype], case, causal)
