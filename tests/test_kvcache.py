"""flash_attn_with_kvcache against a float64 per-batch reference: contiguous caches with shuffled
cache_batch_idx and left padding, paged caches (16- and 48-token pages) with shuffled block
tables, appends at different positions per batch, rotary interleaved and not, GQA, causal with
Lq > 1, windows; the caches' contents after the append; validation."""
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tvmflash
from tvmflash.cpu import cpu_flags
from tvmflash.reference import attention
from test_attention import FLOOR

H, HK, D = 4, 2, 32


def rotate_reference(x, cos, sin, positions, interleaved):
    """Rotary as complex multiplication, one (batch, row) at a time, in float64."""
    out = x.double().clone()
    half = cos.shape[1]
    for b in range(x.shape[0]):
        for i in range(x.shape[1]):
            p = int(positions[b][i])
            turn = torch.complex(cos[p].double(), sin[p].double())
            if interleaved:
                z = torch.complex(out[b, i, :, 0:2 * half:2], out[b, i, :, 1:2 * half:2]) * turn
                out[b, i, :, 0:2 * half:2], out[b, i, :, 1:2 * half:2] = z.real, z.imag
            else:
                z = torch.complex(out[b, i, :, :half], out[b, i, :, half:2 * half]) * turn
                out[b, i, :, :half], out[b, i, :, half:2 * half] = z.real, z.imag
    return out


def logical_cache(cache, b, rows, block_table, page):
    """Sequence b's whole cache (capacity, Hk, D) in logical order."""
    if block_table is None:
        return cache[rows[b]]
    return torch.cat([cache[p] for p in block_table[b].tolist()])


LAYOUTS = ["contiguous", "paged16", "paged48"]
CASES = [(False, (-1, -1), None), (True, (-1, -1), "interleaved"), (True, (5, -1), "halves"),
         (False, (-1, -1), "halves")]
QUERIES_NEW = [(1, 1), (3, 3), (4, 0)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal,window,rotary", CASES)
@pytest.mark.parametrize("lq,new", QUERIES_NEW)
def test_kvcache(layout, causal, window, rotary, lq, new):
    check_kvcache(layout, causal, window, rotary, lq, new)


def check_kvcache(layout, causal, window, rotary, lq, new, device="cpu", dtype=torch.float32, heads=(H, HK), d=D,
                  softcap=0.0, alibi=False, capacity=96, lengths=(10, 0, 57), num_splits=0,
                  call=tvmflash.flash_attn_with_kvcache, table_dtype=torch.float32, strided_new=False):
    """One flash_attn_with_kvcache call (or `call`, e.g. a compiled one) on 3 sequences
    (`lengths` before the append; an empty one gets a token when nothing is appended) against
    the float64 reference per sequence, and the caches after the append. Rotary tables in
    `table_dtype`; `strided_new`: the new k and v every other kv-head of a wider tensor.
    Tolerance: flash-attn's rule (twice the error of the same computation in `dtype`) plus
    a floor."""
    h, hk = heads
    g = torch.Generator().manual_seed(lq * 7 + new)
    B = 3
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype).to(device)  # noqa: E731
    as_index = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    q = rand(B, lq, h, d)
    seqlens = as_index([n or (0 if new else 1) for n in lengths])
    leftpad = None
    block_table, rows, page = None, list(range(B)), None
    if layout == "contiguous":
        k_cache = rand(B + 1, capacity, hk, d)
        rows = [2, 0, 3]
        cache_batch_idx = as_index(rows)
        leftpad = as_index([3, 0, 20])
    else:
        page = int(layout[5:])
        per_seq = -(-capacity // page)
        k_cache = rand(B * per_seq + 2, page, hk, d)
        perm = torch.randperm(B * per_seq + 2, generator=g)[:B * per_seq]
        block_table = perm.view(B, per_seq).to(torch.int32).to(device)
        cache_batch_idx = None
    v_cache = rand(*k_cache.shape)
    k_new, v_new = (rand(B, new, 2 * hk, d)[:, :, ::2] if strided_new else rand(B, new, hk, d) if new else None
                    for _ in range(2))
    cos = sin = None
    if rotary:
        angles = torch.rand(capacity + 8, d // 4, generator=g) * 6.28
        cos, sin = (t.to(table_dtype).to(device) for t in (angles.cos(), angles.sin()))
    slopes = (torch.rand(B, h, generator=g) * 0.3).to(device) if alibi else None
    before_k, before_v = k_cache.clone(), v_cache.clone()

    out, lse = call(
        q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens,
        cache_batch_idx=cache_batch_idx, cache_leftpad=leftpad, block_table=block_table, causal=causal,
        window_size=window, softcap=softcap, rotary_interleaved=rotary == "interleaved", alibi_slopes=slopes,
        num_splits=num_splits, return_softmax_lse=True)
    assert out.shape == q.shape and lse.shape == (B, h, lq)

    pos = seqlens.long().cpu()[:, None]
    k_new, v_new, q, cos, sin = (x.cpu() if x is not None else None for x in (k_new, v_new, q, cos, sin))
    if rotary:
        k_rot = rotate_reference(k_new, cos, sin, pos + torch.arange(new), rotary == "interleaved") if new else None
        q_pos = pos + torch.arange(lq) if causal or window != (-1, -1) else pos.expand(B, lq)
        # the library rotates q into its dtype: the reference starts from that rounded q
        q_ref = rotate_reference(q, cos, sin, q_pos, rotary == "interleaved").to(dtype).double()
    else:
        k_rot, q_ref = (k_new.double() if new else None), q.double()
    pad = leftpad.tolist() if leftpad is not None else [0] * B
    caches = [c.cpu() for c in (k_cache, v_cache, before_k, before_v)]
    table = block_table.cpu() if block_table is not None else None
    for b in range(B):
        end = int(seqlens[b]) + new
        ks, vs, ks0, vs0 = (logical_cache(c, b, rows, table, page) for c in caches)
        # the append: the new rows (rotated) at seqlens[b] ..., everything else untouched
        if new:
            # (16-bit: rotated in fp32 here, in float64 there: roundings may differ by an ulp)
            torch.testing.assert_close(ks[seqlens[b]:end].double(), k_rot[b].to(dtype).double(),
                                       atol=1e-5, rtol=0 if dtype == torch.float32 else 2 ** -7)
            torch.testing.assert_close(vs[seqlens[b]:end], v_new[b], atol=0, rtol=0)
        keep = torch.ones(ks.shape[0], dtype=torch.bool)
        keep[seqlens[b]:end] = False
        assert torch.equal(ks[keep], ks0[keep]) and torch.equal(vs[keep], vs0[keep])
        kb, vb = ks[pad[b]:end], vs[pad[b]:end]
        variant = dict(causal="bottom_right" if causal else "none", window=(window[0], 0 if causal else window[1]),
                       softcap=softcap, alibi_slopes=slopes[b:b + 1].cpu() if alibi else None)
        refs = [attention(x[b].transpose(0, 1)[None], kb.transpose(0, 1)[None], vb.transpose(0, 1)[None],
                          dtype=t, **variant) for x, t in ((q_ref, torch.float64), (q_ref.to(dtype), dtype))]
        err = (out[b].cpu().double() - refs[0][0][0].transpose(0, 1)).abs().max().item()
        low = (refs[1][0][0].double() - refs[0][0][0]).abs().max().item()
        assert err <= 2 * low + FLOOR[dtype], f"batch {b}: error {err:.3g}, {dtype} reference's {low:.3g}"
        fin = refs[0][1][0].isfinite()
        assert torch.equal(lse[b].cpu().isfinite(), fin)
        torch.testing.assert_close(lse[b].cpu()[fin].double(), refs[0][1][0][fin], atol=1e-4 if dtype == torch.float32
                                   else 2e-3, rtol=0)
    # other cache rows (contiguous) are never written
    if layout == "contiguous":
        assert torch.equal(caches[0][1], caches[2][1])


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_decode_step_is_one_graph(backend):
    """A decode step (append with rotary into a paged cache, GQA, the in-place split-KV kernel)
    compiles whole under torch.compile(fullgraph=True): no index tensor is read on the host
    there, as on CUDA (CUDA graphs then take the step, see test_cuda). Values and the caches
    after the append as in eager mode, for two different length sets (one graph for both)."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(tvmflash.flash_attn_with_kvcache, fullgraph=True, backend=backend)
    for lengths in [(10, 0, 57), (31, 5, 0)]:
        check_kvcache("paged16", True, (-1, -1), "interleaved", 1, 1, lengths=lengths, call=compiled)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_kvcache_decode_reads_the_cache_in_place(monkeypatch):
    """Lq <= 16 never gathers the cache; splits that see no key (num_splits > the blocks a
    sequence has) merge to the right answer."""
    from tvmflash import interface

    def no_gather(*args, **kwargs):
        raise AssertionError("the decode path gathered the cache")
    monkeypatch.setattr(interface, "_gathered_kvcache", no_gather)
    check_kvcache("paged48", True, (40, -1), "interleaved", 2, 1, capacity=300, lengths=(100, 0, 290), num_splits=7)
    check_kvcache("contiguous", False, (-1, -1), None, 1, 0, num_splits=1)


def test_kvcache_decode_odd_groups_and_head_dims():
    """The split-KV kernel's row blocks (4 query rows) and value passes (a register block of
    O columns): a group of 5 query heads (a full block and a short one whose repeated rows
    must not be stored), a head dim of 80 (not a multiple of the value pass's 64 columns on
    AVX512), thousands of keys in many blocks over several splits, the automatic splits; one
    query row a kv-head (MHA decode: the one-row kernel); kv-heads in groups (a task's) and a
    short last group."""
    check_kvcache("paged16", False, (-1, -1), None, 1, 0, heads=(5, 1), d=80, capacity=2100,
                  lengths=(2050, 3, 700), num_splits=3)
    check_kvcache("paged16", True, (-1, -1), None, 3, 0, heads=(5, 1), d=80, capacity=2100,
                  lengths=(2050, 3, 700))
    check_kvcache("paged16", False, (-1, -1), None, 1, 0, heads=(3, 3), d=80, capacity=2100,
                  lengths=(2050, 3, 700))
    # more kv-heads than a task takes (8): a full group and a short one, 4-row and one-row kernels
    check_kvcache("paged16", False, (-1, -1), None, 1, 0, heads=(20, 10), d=80, capacity=300,
                  lengths=(290, 3, 100), num_splits=2)
    check_kvcache("paged16", True, (-1, -1), None, 1, 0, heads=(11, 11), d=80, capacity=300,
                  lengths=(290, 3, 100))


@pytest.mark.parametrize("kv_heads", [1, 3, 99])
def test_kvcache_decode_kv_head_groups(kv_heads, monkeypatch):
    """Tasks of kv-heads in groups other than the automatic choice (8 on this shape): one, 3 (a
    short last group), more than a task holds (the kernel takes 8)."""
    from tvmflash import ops

    monkeypatch.setattr(ops, "_task_kv_heads", lambda *args: kv_heads)
    monkeypatch.setattr(ops, "_decode_plans", {})
    check_kvcache("paged16", False, (-1, -1), None, 1, 0, heads=(20, 10), d=80, capacity=300,
                  lengths=(290, 3, 100), num_splits=2)
    check_kvcache("paged16", True, (-1, -1), None, 1, 0, heads=(11, 11), d=80, capacity=300,
                  lengths=(290, 3, 100))


@pytest.mark.parametrize("heads", [(8, 2), (3, 3)])
def test_kvcache_bf16_decode(heads):
    """bf16 decode (Lq = 1) with a head dim of 128 over thousands of keys in pages of 16: the
    4-row kernel (4 query heads a kv-head) and the one-row kernel (MHA), whose bf16 products
    run on fp32 FMAs, or on Zen 5 on `vdpbf16ps` (P rounded to bf16)."""
    check_kvcache("paged16", False, (-1, -1), None, 1, 0, dtype=torch.bfloat16, heads=heads, d=128, capacity=2100,
                  lengths=(2050, 3, 700))


@pytest.mark.skipif("avx512f" not in cpu_flags(), reason="runs an AVX512 module")
def test_kvcache_bf16_decode_without_pair_products(monkeypatch):
    """bf16 decode on the FMA kernels of an AVX512 module (Ice Lake's, which any AVX512 CPU
    runs), their bf16 rows converted into even and odd elements (`decode.store_paired_row`):
    Zen 5 hosts take the pair products by default."""
    from tvmflash import build, ops

    icelake = {"kind": "llvm", "mcpu": "icelake-server", "num-cores": 2}
    monkeypatch.setenv("TVMFLASH_CPU_TARGET", "host")
    monkeypatch.setattr(build, "host_target", lambda: icelake)
    monkeypatch.setattr(ops, "_loaded", {})  # kernels are kept per CPU target choice, not per CPU model
    monkeypatch.setattr(ops, "_decode_plans", {})
    for heads in ((8, 2), (3, 3)):
        check_kvcache("paged16", False, (-1, -1), None, 1, 0, dtype=torch.bfloat16, heads=heads, d=128,
                      capacity=2100, lengths=(2050, 3, 700))
    assert ops._loaded and all(kernels is build.load_cached(spec, icelake) for (spec, _, _), kernels in ops._loaded.items())


@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kvcache_bf16_step_appends_and_rotates_natively(table_dtype, monkeypatch):
    """A bf16 CPU decode step that appends and rotates does both in the decode module's
    `decode_append` (rotary tables in float32 or q's dtype as given, others converted), never in
    torch ops: causal queries at consecutive positions, interleaved pairs and halves, paged and
    contiguous caches, strided new tokens, rotary without new tokens."""
    from tvmflash import interface

    monkeypatch.setattr(interface, "_rotate", lambda *args: pytest.fail("rotated by torch ops"))
    for layout, causal, rotary, lq, new in (("paged16", True, "interleaved", 2, 2), ("contiguous", True, "halves", 3, 3),
                                            ("paged48", False, "halves", 1, 0)):
        check_kvcache(layout, causal, (-1, -1), rotary, lq, new, dtype=torch.bfloat16, heads=(8, 2), d=128,
                      table_dtype=table_dtype, strided_new=new > 0)


@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_kvcache_prefill_gathers(layout):
    """More than 16 queries (a prompt against a cache) run on the varlen kernels."""
    check_kvcache(layout, True, (-1, -1), "halves", 20, 20)


def test_kvcache_bf16_matches_the_dense_function():
    """Without new tokens and with the whole cache, the result is flash_attn_func's."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 5, H, 64, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(2, 40, HK, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    out = tvmflash.flash_attn_with_kvcache(q, k, v, causal=True)
    torch.testing.assert_close(out, tvmflash.flash_attn_func(q, k, v, causal=True), atol=FLOOR[torch.bfloat16],
                               rtol=0)


def test_kvcache_validation():
    q = torch.zeros(2, 1, H, D)
    cache = torch.zeros(2, 32, HK, D)
    seqlens = torch.tensor([4, 5], dtype=torch.int32)
    new = torch.zeros(2, 1, HK, D)
    with pytest.raises(ValueError, match="must be given together"):
        tvmflash.flash_attn_with_kvcache(q, cache, cache.clone(), k=new)
    with pytest.raises(ValueError, match=r"<= the cache's 32 rows"):
        tvmflash.flash_attn_with_kvcache(q, cache, cache.clone(), new, new, cache_seqlens=32)
    with pytest.raises(ValueError, match="cache_seqlens must be int32"):
        tvmflash.flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=seqlens.long())
    with pytest.raises(ValueError, match="page size .* multiple of 16"):
        tvmflash.flash_attn_with_kvcache(q, torch.zeros(4, 24, HK, D), torch.zeros(4, 24, HK, D),
                                         block_table=torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="outside k_cache's 4 pages"):
        tvmflash.flash_attn_with_kvcache(q, torch.zeros(4, 16, HK, D), torch.zeros(4, 16, HK, D),
                                         block_table=torch.tensor([[0], [4]], dtype=torch.int32))
    with pytest.raises(ValueError, match="outside k_cache's 4 pages"):  # a negative page
        tvmflash.flash_attn_with_kvcache(q, torch.zeros(4, 16, HK, D), torch.zeros(4, 16, HK, D),
                                         block_table=torch.tensor([[0], [-1]], dtype=torch.int32))
    # a decode step's tables are checked in the decode module (block tables with contiguous rows:
    # its vector part and its tail here), strided ones on the host
    pages = torch.zeros(4, 16, HK, D)
    table = torch.zeros(2, 20, dtype=torch.int32)
    assert tvmflash.flash_attn_with_kvcache(q, pages, pages.clone(), block_table=table).abs().max() == 0
    for col in (3, 17):
        bad = table.clone()
        bad[1, col] = 4
        for t in (bad, bad.t().contiguous().t()):
            with pytest.raises(ValueError, match="outside k_cache's 4 pages"):
                tvmflash.flash_attn_with_kvcache(q, pages, pages.clone(), block_table=t)
    with pytest.raises(ValueError, match=r"batch 1: need 0 <= cache_leftpad \(6\) <= cache_seqlens \(5\)"):
        tvmflash.flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=seqlens,
                                         cache_leftpad=torch.tensor([0, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cache_batch_idx must index .* got \[-1, 0\]"):
        tvmflash.flash_attn_with_kvcache(q, cache, cache.clone(), cache_batch_idx=torch.tensor([-1, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match="cache_batch_idx must index"):
        tvmflash.flash_attn_with_kvcache(q, cache, cache.clone(), cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32))
    # one int length for all (checked on scalars): negative, and with the leftpad tensor path
    with pytest.raises(ValueError, match=r"batch 0: need 0 <= cache_leftpad \(0\) <= cache_seqlens \(-1\)"):
        tvmflash.flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=-1)
    with pytest.raises(ValueError, match=r"batch 1: need 0 <= cache_leftpad \(5\) <= cache_seqlens \(4\)"):
        tvmflash.flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=4,
                                         cache_leftpad=torch.tensor([0, 5], dtype=torch.int32))
    for lengths in (seqlens, 5):  # per batch entry, one for all
        with pytest.raises(ValueError, match="rotary_cos has 5 positions"):
            tvmflash.flash_attn_with_kvcache(q, cache, cache.clone(), new, new, cache_seqlens=lengths,
                                             rotary_cos=torch.ones(5, 4), rotary_sin=torch.zeros(5, 4))
    with pytest.raises(ValueError, match="num_splits"):
        tvmflash.flash_attn_with_kvcache(q, cache, cache.clone(), num_splits=-1)
    # a step that fails its checks writes nothing, whichever check fails: the end past the
    # cache, the rotary table, a table entry the append does not use
    filled, tokens = torch.randn(4, 16, HK, D), torch.ones(2, 1, HK, D)
    before = filled.clone()
    for kwargs, message in ((dict(cache_seqlens=32), "<= the cache's 32 rows"),
                            (dict(cache_seqlens=seqlens, rotary_cos=torch.ones(5, 4), rotary_sin=torch.zeros(5, 4)),
                             "rotary_cos has 5 positions"),
                            (dict(cache_seqlens=seqlens, block_table=torch.tensor([[0, 1], [2, 4]], dtype=torch.int32)),
                             "outside k_cache's 4 pages")):
        caches = (filled, filled.clone()) if "block_table" in kwargs else (filled.view(2, 32, HK, D),) * 2
        with pytest.raises(ValueError, match=message):
            tvmflash.flash_attn_with_kvcache(q, *caches, tokens, tokens, **kwargs)
        assert torch.equal(filled, before)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("batch,lq", [(0, 1), (2, 0)])
def test_kvcache_decode_without_rows(device, batch, lq):
    """No batch entries or no queries: empty results, nothing launched (an empty CUDA grid
    is an error)."""
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    q = torch.randn(batch, lq, 8, 64, device=device, dtype=dt)
    k_cache, v_cache = (torch.randn(max(batch, 1), 32, 2, 64, device=device, dtype=dt) for _ in range(2))
    out, lse = tvmflash.flash_attn_with_kvcache(q, k_cache[:batch], v_cache[:batch], cache_seqlens=20,
                                                return_softmax_lse=True)
    assert out.shape == (batch, lq, 8, 64) and lse.shape == (batch, 8, lq)


@st.composite
def decode_steps(draw):
    """A decode step that writes: layout, batch, heads, queries, new tokens, rotary, lengths."""
    page = draw(st.sampled_from([0, 16, 32]))  # 0: a contiguous cache with shuffled rows
    b, hk, group = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    lq, new = draw(st.integers(1, 4)), draw(st.integers(0, 4))
    rotary = draw(st.sampled_from([None, "interleaved", "halves"] if new else ["interleaved", "halves"]))
    capacity = 64
    lengths = draw(st.lists(st.integers(0, capacity - new), min_size=b, max_size=b))
    pads = [draw(st.integers(0, n)) for n in lengths] if not page else None
    return dict(page=page, b=b, hk=hk, h=hk * group, lq=lq, new=new, rotary=rotary, rotary_half=draw(st.sampled_from(
        [4, 8, 16])), causal=draw(st.booleans()), lengths=lengths, pads=pads, seed=draw(st.integers(0, 2**16)))


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(decode_steps())
def test_native_step_writes_what_torch_ops_write(p):
    """A CPU decode step's writes in the decode module (`decode_append`) against the same step
    in torch ops (the path traced under torch.compile, taken here by making the call believe it
    is compiling): the same caches and outputs over random layouts, lengths, left padding,
    appends and rotary."""
    g = torch.Generator().manual_seed(p["seed"])
    b, capacity = p["b"], 64
    q = torch.randn(b, p["lq"], p["h"], D, generator=g)
    if p["page"]:
        pages = b * capacity // p["page"] + 1
        cache = torch.randn(pages, p["page"], p["hk"], D, generator=g)
        table = torch.randperm(pages, generator=g)[:b * capacity // p["page"]].view(b, -1).to(torch.int32)
        where = dict(block_table=table)
    else:
        cache = torch.randn(b + 1, capacity, p["hk"], D, generator=g)
        where = dict(cache_batch_idx=torch.randperm(b + 1, generator=g)[:b].to(torch.int32),
                     cache_leftpad=torch.tensor(p["pads"], dtype=torch.int32))
    k_new, v_new = ((torch.randn(b, p["new"], p["hk"], D, generator=g) for _ in range(2)) if p["new"] else (None, None))
    cos = sin = None
    if p["rotary"]:
        angles = torch.rand(capacity + 8, p["rotary_half"], generator=g) * 6.28
        cos, sin = angles.cos(), angles.sin()
    results = []
    for traced in (False, True):
        k_cache, v_cache = cache.clone(), cache.clone() + 1
        with mock.patch.object(torch.compiler, "is_compiling", lambda: traced):
            out, lse = tvmflash.flash_attn_with_kvcache(
                q, k_cache, v_cache, k_new, v_new, cos, sin, cache_seqlens=torch.tensor(p["lengths"], dtype=torch.int32),
                causal=p["causal"], rotary_interleaved=p["rotary"] == "interleaved", return_softmax_lse=True, **where)
        results.append((k_cache, v_cache, out, lse))
    (k_a, v_a, out_a, lse_a), (k_b, v_b, out_b, lse_b) = results
    assert torch.equal(v_a, v_b)
    torch.testing.assert_close(k_a, k_b, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out_a, out_b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_a, lse_b, atol=1e-5, rtol=1e-5)
