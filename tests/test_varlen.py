"""Packed sequences (flash_attn_varlen_func and the packed-input functions) and
merge_attention_states, against a float64 reference run per sequence: ragged batches with empty
and length-1 sequences, Lq != Lk per sequence, GQA, causal / window / ALiBi / softcap / dropout
aligned per sequence, every gradient; the offsets' validation. Each group of CASES builds one
module (spec); lengths and values vary freely."""
import pytest
import torch

import tvmflash
from tvmflash.reference import attention
from test_attention import DTYPES, FLOOR, assert_close, backward_plan

# (lengths_q, lengths_k): empty sequences, a single token, Lq > Lk and Lq < Lk per sequence,
# sequences that straddle kernel tiles
LENGTHS = [
    ([5, 0, 1, 37, 20], [9, 3, 1, 37, 64]),
    ([70, 130, 3], [70, 130, 3]),
    ([1, 1, 1, 1], [40, 0, 17, 90]),  # decode-like: one query per sequence
]


def offsets(lengths, device="cpu"):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)


def make_packed(lengths_q, lengths_k, h, hk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths_q), h, d, generator=g).to(dtype)
    k = torch.randn(sum(lengths_k), hk, d, generator=g).to(dtype)
    v = torch.randn(sum(lengths_k), hk, d, generator=g).to(dtype)
    dout = torch.randn(sum(lengths_q), h, d, generator=g).to(dtype)
    return q, k, v, dout


def per_sequence_reference(q, k, v, dout, lengths_q, lengths_k, dtype, causal, keep=None, dropout_p=0.0,
                           alibi_slopes=None, **variant):
    """out, lse (H, total_q) and grads of the packed inputs, each sequence attended alone in
    `dtype` (flash-attn's per-sequence semantics)."""
    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    outs, lses = [], []
    cu_q, cu_k = offsets(lengths_q).tolist(), offsets(lengths_k).tolist()
    for b in range(len(lengths_q)):
        qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        qb, kb, vb = (x[lo:hi].transpose(0, 1)[None] for x, lo, hi in zip(leaves, (qs, ks, ks), (qe, ke, ke)))
        slopes = None if alibi_slopes is None else alibi_slopes.expand(len(lengths_q), -1)[b].to(dtype)
        drop = None if keep is None else keep[:, qs:qe, ks:ke][None]
        o, lse = attention(qb, kb, vb, causal="bottom_right" if causal else "none", alibi_slopes=slopes,
                           dropout_p=dropout_p, dropout_keep=drop, **variant)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    out = torch.cat(outs)
    lse = torch.cat(lses, dim=1)
    out.backward(dout.to(dtype))
    return out, lse, [x.grad if x.grad is not None else torch.zeros_like(x) for x in leaves]


def check_varlen(lengths_q, lengths_k, h, hk, d, dtype, causal=False, dropout_p=0.0, seed=0,
                 call=tvmflash.flash_attn_varlen_func, **variant):
    """Forward, lse and grads (both CPU backward plans) of flash_attn_varlen_func (or `call`,
    e.g. a compiled one) against the per-sequence reference (float64, and the input dtype for
    the error budget)."""
    q, k, v, dout = make_packed(lengths_q, lengths_k, h, hk, d, dtype, seed)
    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)
    grads = {}
    for plan in ("fused", "split"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        torch.manual_seed(seed)
        out, lse, keep = call(*leaves, cu_q, cu_k, max(lengths_q), max(lengths_k), dropout_p=dropout_p,
                              causal=causal, return_attn_probs=True, **variant)
        with backward_plan(plan):
            out.backward(dout)
        grads[plan] = [x.grad for x in leaves]
    window = variant.pop("window_size", (-1, -1))
    variant["window"] = (window[0], 0 if causal else window[1])
    o64, l64, g64 = per_sequence_reference(q, k, v, dout, lengths_q, lengths_k, torch.float64, causal, keep,
                                           dropout_p, **variant)
    olow, _, glow = per_sequence_reference(q, k, v, dout, lengths_q, lengths_k, dtype, causal, keep, dropout_p,
                                           **variant)
    assert out.shape == q.shape and lse.shape == (h, q.shape[0])
    assert_close("out", out, o64, olow, dtype)
    assert torch.equal(lse.isinf(), l64.isinf()), "lse: -inf rows differ"
    fin = ~l64.isinf()
    if fin.any():
        assert (lse.double()[fin] - l64[fin]).abs().max().item() <= 2e-4
    for plan, plan_grads in grads.items():
        for name, ours, r64, rlow in zip(("dq", "dk", "dv"), plan_grads, g64, glow):
            assert_close(f"{name} ({plan})", ours, r64, rlow, dtype)
    return keep


def alibi(kind, b, h):
    g = torch.Generator().manual_seed(3)
    return torch.rand((h,) if kind == "h" else (b, h), generator=g) * 0.5


# (dtype, causal, window, softcap, alibi kind, dropout): one spec per group
CASES = [
    ("fp32", False, (-1, -1), 0.0, None, 0.0),
    ("fp32", True, (-1, -1), 0.0, None, 0.0),
    ("fp32", True, (6, -1), 0.0, "bh", 0.0),  # causal + window + per-sequence ALiBi slopes
    ("fp32", False, (3, 2), 1.5, "h", 0.0),  # two-sided window + softcap + ALiBi
    ("bf16", True, (-1, -1), 0.0, None, 0.0),
    ("fp16", False, (-1, -1), 0.0, None, 0.3),  # dropout
]


@pytest.mark.parametrize("dtype,causal,window,softcap,alibi_kind,dropout_p", CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("lengths_q,lengths_k", LENGTHS, ids=("ragged", "equal", "decode"))
def test_varlen(dtype, causal, window, softcap, alibi_kind, dropout_p, lengths_q, lengths_k):
    h, hk = (4, 2) if dtype != "bf16" else (6, 1)  # GQA, and MQA
    d = 64 if dtype == "bf16" else 32
    slopes = alibi(alibi_kind, len(lengths_q), h) if alibi_kind else None
    keep = check_varlen(lengths_q, lengths_k, h, hk, d, DTYPES[dtype], causal, dropout_p, window_size=window,
                        softcap=softcap, alibi_slopes=slopes)
    if dropout_p:  # the returned mask is in packed coordinates: (H, total_q, total_k)
        assert keep.shape == (h, sum(lengths_q), sum(lengths_k))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_varlen_is_one_graph(backend):
    """flash_attn_varlen_func compiles with fullgraph=True (the offsets are read by the
    tvmflash::varlen_tables operator when the graph runs): values, lse and every gradient
    against the per-sequence reference, for two batches of other lengths and as many tokens
    through one graph; bad offsets still raise when the graph runs."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(tvmflash.flash_attn_varlen_func, fullgraph=True, backend=backend)
    for lengths_q, lengths_k in [([5, 0, 1, 37, 20], [9, 3, 1, 37, 64]), ([20, 1, 37, 5, 0], [64, 37, 3, 1, 9])]:
        check_varlen(lengths_q, lengths_k, 4, 2, 32, torch.float32, True, call=compiled)  # test_varlen's causal spec
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    q, k, v, _ = make_packed([5, 6], [5, 6], 4, 2, 32, torch.float32)
    with pytest.raises(ValueError, match="must end at the number of tokens"):
        compiled(q, k, v, offsets([5, 6]), offsets([5, 5]), 6, 6, causal=True)


def test_packed_functions_match_the_unpacked_ones():
    """qkvpacked / kvpacked (dense and varlen) are views of the stacked tensor; the gradient
    arrives in it."""
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(2, 33, 3, 4, 32, generator=g).requires_grad_()
    out = tvmflash.flash_attn_qkvpacked_func(qkv, causal=True)
    ref = tvmflash.flash_attn_func(*qkv.unbind(2), causal=True)
    assert torch.equal(out, ref)
    out.sum().backward()
    assert qkv.grad.shape == qkv.shape and qkv.grad.abs().sum() > 0
    q, kv = torch.randn(2, 20, 4, 32, generator=g), torch.randn(2, 33, 2, 2, 32, generator=g)
    assert torch.equal(tvmflash.flash_attn_kvpacked_func(q, kv), tvmflash.flash_attn_func(q, *kv.unbind(2)))

    lengths = [10, 0, 23]
    cu = offsets(lengths)
    qkv = torch.randn(33, 3, 4, 32, generator=g)
    out = tvmflash.flash_attn_varlen_qkvpacked_func(qkv, cu, 23, causal=True)
    assert torch.equal(out, tvmflash.flash_attn_varlen_func(*qkv.unbind(1), cu, cu, 23, 23, causal=True))
    q, kv = torch.randn(33, 4, 32, generator=g), torch.randn(33, 2, 2, 32, generator=g)
    assert torch.equal(tvmflash.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 23, 23),
                       tvmflash.flash_attn_varlen_func(q, *kv.unbind(1), cu, cu, 23, 23))


def test_varlen_equals_dense_for_equal_lengths():
    """A batch of equal-length sequences packed gives the dense function's output bitwise
    (the same kernels' tiles; only the batch walk differs)."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(3, 64, 4, 32, generator=g) for _ in range(3))
    dense = tvmflash.flash_attn_func(q, k, v, causal=True)
    cu = offsets([64] * 3)
    packed = tvmflash.flash_attn_varlen_func(*(x.flatten(0, 1) for x in (q, k, v)), cu, cu, 64, 64, causal=True)
    torch.testing.assert_close(packed.view(3, 64, 4, 32), dense, atol=FLOOR[torch.float32], rtol=0)


def test_cu_seqlens_are_read_once_per_tensor_until_changed():
    """A cu_seqlens pair's checked offsets and kernel tables are reused while the same tensors
    come back unmodified (every layer passes them: no device sync per call); an in-place change
    is read afresh, and a fresh tensor with other offsets is not mistaken for a cached one."""
    from tvmflash import interface

    q, k, v, _ = make_packed([5, 9, 2], [5, 9, 2], 2, 2, 32, torch.float32)
    cu = offsets([5, 9, 2])
    before = tvmflash.flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, causal=True)
    tables = interface._PACKED.get(cu, cu, cu.device)[-1]
    assert interface._PACKED.get(cu, cu, cu.device)[-1] is tables
    cu.copy_(offsets([9, 5, 2]))  # in place: torch's version counter moves
    after = tvmflash.flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, causal=True)
    fresh = tvmflash.flash_attn_varlen_func(q, k, v, offsets([9, 5, 2]), offsets([9, 5, 2]), 9, 9, causal=True)
    assert torch.equal(after, fresh) and not torch.equal(after, before)
    with pytest.raises(ValueError, match=r"max_seqlen_q \(5\) is below"):  # checked on every call
        tvmflash.flash_attn_varlen_func(q, k, v, cu, cu, 5, 9)


def test_cu_seqlens_validation():
    q, k, v = torch.zeros(10, 2, 32), torch.zeros(12, 2, 32), torch.zeros(12, 2, 32)
    good_q, good_k = offsets([4, 6]), offsets([5, 7])

    def call(cu_q=good_q, cu_k=good_k, max_q=6, max_k=7, **kw):
        return tvmflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **kw)

    with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
        call(cu_q=good_q.long())
    with pytest.raises(ValueError, match="must start at 0"):
        call(cu_q=torch.tensor([1, 4, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="non-decreasing"):
        call(cu_k=torch.tensor([0, 8, 5, 12], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"must end at the number of tokens \(12\)"):
        call(cu_k=torch.tensor([0, 5, 11], dtype=torch.int32))
    with pytest.raises(ValueError, match="batch \\+ 1 long"):
        call(cu_k=torch.tensor([0, 5, 6, 12], dtype=torch.int32), max_k=7)
    with pytest.raises(ValueError, match="1-D"):
        call(cu_q=good_q[None])
    with pytest.raises(ValueError, match=r"max_seqlen_k \(6\) is below the longest sequence"):
        call(max_k=6)
    with pytest.raises(TypeError, match="max_seqlen_q must be an int"):
        call(max_q=6.0)
    with pytest.raises(ValueError, match="must be 3-D"):
        tvmflash.flash_attn_varlen_func(q[None], k, v, good_q, good_k, 6, 7)
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(nheads,\) = \(2,\) or \(batch, nheads\) = "
                                         r"\(2, 2\)"):
        call(alibi_slopes=torch.ones(3, 2))
    with pytest.raises(ValueError, match="must be 4-D"):
        call(block_table=torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="stack 3 tensors"):
        tvmflash.flash_attn_varlen_qkvpacked_func(torch.zeros(10, 2, 2, 32), good_q, 6)


@pytest.mark.parametrize("page", [16, 48])
def test_varlen_paged_keys_equal_packed_ones(page):
    """block_table: the keys of each sequence in shuffled pages give the packed call's output
    and gradients (the pages' gradients are the packed keys' gradients, scattered)."""
    g = torch.Generator().manual_seed(page)
    lengths_q, lengths_k = [3, 0, 17, 5], [40, 7, 0, 100]
    q = torch.randn(sum(lengths_q), 4, 32, generator=g)
    k, v = (torch.randn(sum(lengths_k), 2, 32, generator=g) for _ in range(2))
    per_seq = -(-max(lengths_k) // page)
    table = torch.randperm(len(lengths_k) * per_seq + 3, generator=g)[:len(lengths_k) * per_seq]
    table = table.view(len(lengths_k), per_seq).to(torch.int32)
    k_pages, v_pages = (torch.randn(len(lengths_k) * per_seq + 3, page, 2, 32, generator=g) for _ in range(2))
    for b, (start, n) in enumerate(zip(offsets(lengths_k).tolist(), lengths_k)):
        for cache, packed in ((k_pages, k), (v_pages, v)):
            rows = cache[table[b].long()].flatten(0, 1)
            rows[:n] = packed[start:start + n]
            cache[table[b].long()] = rows.view(per_seq, page, 2, 32)
    args = (offsets(lengths_q), offsets(lengths_k), max(lengths_q), max(lengths_k))
    leaves = [x.clone().requires_grad_() for x in (q, k, v, k_pages, v_pages)]
    packed = tvmflash.flash_attn_varlen_func(*leaves[:3], *args, causal=True)
    paged = tvmflash.flash_attn_varlen_func(leaves[0], *leaves[3:], *args, causal=True, block_table=table)
    torch.testing.assert_close(paged, packed, atol=1e-6, rtol=0)
    dout = torch.randn_like(packed)
    (packed * dout).sum().backward()
    dq_packed = leaves[0].grad.clone()
    leaves[0].grad = None
    (paged * dout).sum().backward()
    torch.testing.assert_close(leaves[0].grad, dq_packed, atol=1e-5, rtol=0)
    for b, (start, n) in enumerate(zip(offsets(lengths_k).tolist(), lengths_k)):
        for pages, packed_grad in ((leaves[3], leaves[1].grad), (leaves[4], leaves[2].grad)):
            rows = pages.grad[table[b].long()].flatten(0, 1)
            torch.testing.assert_close(rows[:n], packed_grad[start:start + n], atol=1e-5, rtol=0)
            assert not rows[n:].any()  # positions past the sequence get no gradient
    with pytest.raises(ValueError, match="outside the cache's"):
        tvmflash.flash_attn_varlen_func(q, k_pages, v_pages, *args, block_table=table + 100)
    with pytest.raises(ValueError, match="does not fit block_table"):
        tvmflash.flash_attn_varlen_func(q, k_pages, v_pages, *args, block_table=table[:, :1])


def merge_reference(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a.double(), lse_b.double())
    wa = torch.nan_to_num(torch.exp(lse_a.double() - lse)).unsqueeze(-1)
    wb = torch.nan_to_num(torch.exp(lse_b.double() - lse)).unsqueeze(-1)
    return wa * out_a.double() + wb * out_b.double(), lse


def test_merge_attention_states_equals_attention_over_all_keys():
    """Attention over keys [0, 40) and [40, 100) merged equals attention over [0, 100); rows
    masked out of one half take the other's result, rows masked out of both get 0 / -inf,
    and gradients stay finite."""
    g = torch.Generator().manual_seed(9)
    q, k, v = torch.randn(2, 3, 6, 32, generator=g), torch.randn(2, 3, 100, 32, generator=g), \
        torch.randn(2, 3, 100, 32, generator=g)
    mask = torch.ones(6, 100, dtype=torch.bool)
    mask[1, :40] = False  # sees only the second half
    mask[2, 40:] = False  # only the first
    mask[3] = False  # nothing
    full, lse_full = attention(q.double(), k.double(), v.double(), mask=mask)
    parts = [attention(q, k[:, :, s], v[:, :, s], mask=mask[:, s]) for s in (slice(0, 40), slice(40, 100))]
    leaves = [t.clone().requires_grad_() for part in parts for t in part]
    out, lse = tvmflash.merge_attention_states(*leaves)
    torch.testing.assert_close(out.double(), full, atol=1e-5, rtol=0)
    assert torch.equal(lse.isinf(), lse_full.isinf()) and (out[:, :, 3] == 0).all()
    torch.testing.assert_close(lse[lse.isfinite()].double(), lse_full[lse_full.isfinite()], atol=1e-5, rtol=0)
    (out.sum() + lse[lse.isfinite()].sum()).backward()
    assert all(x.grad.isfinite().all() for x in leaves)
    ref_out, _ = merge_reference(*parts[0], *parts[1])
    torch.testing.assert_close(out.double(), ref_out, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_merge_attention_states_keeps_the_dtype(dtype):
    g = torch.Generator().manual_seed(2)
    out_a, out_b = (torch.randn(4, 7, 64, generator=g).to(DTYPES[dtype]) for _ in range(2))
    lse_a, lse_b = torch.randn(4, 7, generator=g), torch.randn(4, 7, generator=g)
    out, lse = tvmflash.merge_attention_states(out_a, lse_a, out_b, lse_b)
    ref, ref_lse = merge_reference(out_a, lse_a, out_b, lse_b)
    assert out.dtype == DTYPES[dtype] and lse.dtype == torch.float32
    assert_close("merged", out, ref, ref.to(DTYPES[dtype]), DTYPES[dtype])
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-6, rtol=0)


def test_merge_attention_states_validation():
    out, lse = torch.zeros(2, 3, 8), torch.zeros(2, 3)
    with pytest.raises(ValueError, match="out's shape without its last dim"):
        tvmflash.merge_attention_states(out, lse.T, out, lse)
    with pytest.raises(TypeError, match="lse_b must be float32"):
        tvmflash.merge_attention_states(out, lse, out, lse.double())
    with pytest.raises(ValueError, match="one shape"):
        tvmflash.merge_attention_states(out, lse, out[:1], lse[:1])
