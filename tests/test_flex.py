"""flex_attention: score_mod / mask_mod written in torch are traced into the kernels (forward,
lse and every gradient, the score_mod's derivative taken from the traced program) and checked
against the float64 reference calling the same functions on index tensors, and against torch's
own flex_attention; create_block_mask against torch's; clear errors for what cannot be traced."""
import pytest
import torch

from tvmflash import flex
from tvmflash.reference import attention
from test_attention import DTYPES, check_against_reference, make

L_DOC = 300  # document ids cover this many positions


def _tables(h):
    g = torch.Generator().manual_seed(4)
    return {"slopes": torch.rand(h, generator=g) * 0.2, "bias": torch.randn(h, 2 * L_DOC, generator=g) * 0.5,
            "doc": torch.cat([torch.full((n,), i) for i, n in enumerate((40, 90, 1, 169))])}


def _mods(case, t):
    """(score_mod, mask_mod) of a named case; t: captured tables."""
    causal = lambda b, h, q, kv: q >= kv  # noqa: E731
    return {
        "causal mask": (None, causal),
        "alibi score": (lambda s, b, h, q, kv: s - t["slopes"][h] * torch.abs(q - kv), None),
        "softcap score": (lambda s, b, h, q, kv: 20 * torch.tanh(s / 20), None),
        "relative bias + causal": (lambda s, b, h, q, kv: s + t["bias"][h, q - kv + L_DOC], causal),
        "document mask": (None, lambda b, h, q, kv: (t["doc"][q] == t["doc"][kv]) & (q >= kv)),
        "sliding window": (None, lambda b, h, q, kv: (q >= kv) & (q - kv <= 37)),
        "two-sided band": (None, lambda b, h, q, kv: torch.abs(q - kv + 3) <= 6),  # -9 <= q - kv <= 3
        "where + sigmoid": (lambda s, b, h, q, kv: torch.where(kv % 3 == 0, s * torch.sigmoid(s), s - 1.0), None),
        "rows see nothing": (lambda s, b, h, q, kv: s * 0.5, lambda b, h, q, kv: kv < q - 20),
    }[case]


CASES = ["causal mask", "alibi score", "softcap score", "relative bias + causal", "document mask",
         "sliding window", "two-sided band", "where + sigmoid", "rows see nothing"]
SHAPES = [(17, 203), (203, 17), (113, 113), (5, 203)]  # 5 queries: the split-KV forward (10 rows a kv-head)


def flex_run(score_mod, mask_mod, lq, lk, gqa):
    def run(q, k, v):
        bm = flex.create_block_mask(mask_mod, None, None, lq, lk) if mask_mod else None
        return flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=gqa, return_lse=True)
    return run


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("lq,lk", SHAPES, ids=str)
def test_flex_matches_reference(case, lq, lk):
    b, h, hk, d = 2, 4, 2, 64
    q, k, v, dout = make(b, h, hk, lq, lk, d, torch.float32, seed=lq + 3 * lk)
    score_mod, mask_mod = _mods(case, _tables(h))
    check_against_reference(q, k, v, dout, flex_run(score_mod, mask_mod, lq, lk, True),
                            score_mod=score_mod, mask_mod=mask_mod)


@pytest.mark.parametrize("case", ["relative bias + causal", "softcap score"])
@pytest.mark.parametrize("lq", [130, 5], ids=str)  # 5: the split-KV forward (AMX: test_avx512.py)
def test_flex_bf16(case, lq):
    check_flex_bf16(case, lq, 150)


def check_flex_bf16(case, lq, lk):
    """A named case in bf16 (4 query heads on one kv-head): forward, lse and every gradient."""
    q, k, v, dout = make(1, 4, 1, lq, lk, 64, DTYPES["bf16"], seed=8)
    score_mod, mask_mod = _mods(case, _tables(4))
    check_against_reference(q, k, v, dout, flex_run(score_mod, mask_mod, lq, lk, True),
                            score_mod=score_mod, mask_mod=mask_mod)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_same_as_torch_flex_attention():
    """User code ports by changing the import: same outputs as torch's flex_attention."""
    from torch.nn.attention import flex_attention as torch_flex

    t = _tables(4)
    q, k, v, _ = make(1, 4, 4, 96, 96, 64, torch.float32, seed=3)
    score_mod = lambda s, b, h, q, kv: s - t["slopes"][h] * torch.abs(q - kv)  # noqa: E731
    mask_mod = lambda b, h, q, kv: (t["doc"][q] == t["doc"][kv]) & (q >= kv)  # noqa: E731
    ours = flex.flex_attention(q, k, v, score_mod=score_mod,
                               block_mask=flex.create_block_mask(mask_mod, 1, 4, 96, 96, BLOCK_SIZE=32))
    theirs = torch_flex.flex_attention(q, k, v, score_mod=score_mod,
                                       block_mask=torch_flex.create_block_mask(mask_mod, 1, 4, 96, 96, device="cpu",
                                                                               BLOCK_SIZE=32))
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=0)


def test_block_mask_matches_torch():
    from torch.nn.attention import flex_attention as torch_flex

    doc = _tables(1)["doc"]
    mask_mod = lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv)  # noqa: E731
    ours = flex.create_block_mask(mask_mod, 1, 1, 300, 300, BLOCK_SIZE=64)
    theirs = torch_flex.create_block_mask(mask_mod, 1, 1, 300, 300, device="cpu", BLOCK_SIZE=64)
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    n = ours.kv_num_blocks[0, 0]
    for row, count in enumerate(n.tolist()):
        assert sorted(ours.kv_indices[0, 0, row, :count].tolist()) == sorted(theirs.kv_indices[0, 0, row, :count].tolist())
    assert 0 < ours.sparsity() < 100


def test_captured_values_are_arguments():
    """New values of a captured tensor reuse the compiled module and change the result."""
    q, k, v, _ = make(1, 2, 2, 40, 40, 32, torch.float32, seed=1)
    bias = torch.zeros(2)
    score_mod = lambda s, b, h, q, kv: s + bias[h] * (kv - q)  # noqa: E731
    a = flex.flex_attention(q, k, v, score_mod=score_mod)
    bias += 0.3
    b = flex.flex_attention(q, k, v, score_mod=score_mod)
    assert not torch.allclose(a, b)
    ref = flex_run(score_mod, None, 40, 40, False)(q, k, v)[0]
    torch.testing.assert_close(b, ref)


def test_block_mask_kernel_arguments_are_made_once():
    """A call's host time is the whole GPU time of a 4k-token attention: the block mask's tile
    map (0 empty, 1 partial, 2 full) and its arguments per (B, H) are made once per mask."""
    bm = flex.create_block_mask(lambda b, h, q, kv: q >= kv, 1, 1, 256, 384)
    args = bm.kernel_args(2, 4)
    assert args is bm.kernel_args(2, 4) and bm.tile_map() is bm.tiles
    assert [tuple(a.shape) for a in args] == [(2, 4, 2, 3), (2, 4, 2), (2, 4, 2, 3), (2, 4, 2), (2, 4, 2, 3)]
    assert args[0][1, 3].tolist() == [[1, 0, 0], [2, 1, 0]]  # the diagonal partial, above it empty


def test_block_mask_traces_its_mask_mod_once():
    """Tracing a mask_mod costs a short call's host time: a BlockMask traces its own once (the
    same program and captured tensors each call), again only if its mask_mod is replaced."""
    doc = torch.tensor([0, 0, 1, 1, 1, 2])
    traced = []

    def same_document(b, h, q, kv):
        traced.append(q)
        return doc[q] == doc[kv]

    bm = flex.create_block_mask(same_document, 1, 1, 6, 6, BLOCK_SIZE=16)
    made = len(traced)
    first = flex.flex_programs(None, bm)
    assert flex.flex_programs(None, bm) == first and len(traced) == made + 1
    assert first[1] == [doc] and first[0][0][2] == (16, 16)
    assert first == flex.flex_programs(None, same_document, (16, 16))
    bm.mask_mod = lambda b, h, q, kv: q >= kv
    assert flex.flex_programs(None, bm)[0][0][1] == flex.trace(bm.mask_mod, "mask")[0] != first[0][0][1]


def test_constants_of_other_types_make_other_programs():
    """1, 1.0 and True compare equal in Python, but q // 2 and q // 2.0 compute differently: the
    programs (part of the kernel spec and its in-process cache key) must differ."""
    traced = [flex.trace(fn, "mask")[0] for fn in (lambda b, h, q, kv: q // 2 >= kv, lambda b, h, q, kv: q // 2.0 >= kv,
                                                     lambda b, h, q, kv: q // 2 >= kv)]
    assert traced[0] != traced[1] and traced[0] == traced[2]
    from tvmflash.ops import register_flex

    keys = [register_flex((("mask", p, None),)) for p in traced]
    assert keys[0] != keys[1] and keys[0] == keys[2]


def test_row_and_key_loads_are_found():
    """The captured loads a kernel may make once per query row or key: those whose indices
    depend on q_idx (kv_idx) and b, h alone; outermost, each once."""
    from tvmflash.kernels.score_mods import _axis_nodes

    doc, keep, bias = torch.zeros(2, 8, dtype=torch.int64), torch.ones(8, dtype=torch.bool), torch.zeros(8)
    program = flex.trace(lambda s, b, h, q, kv: torch.where((doc[b, q] == doc[b, kv]) & keep[kv] & (doc[b, q] > 0),
                                                            s + bias[q] + doc[b, q - kv], s), "score")[0]
    q_doc, kv_doc, kv_keep = (("capture", 0, ("b",), ("q_idx",)), ("capture", 0, ("b",), ("kv_idx",)),
                              ("capture", 1, ("kv_idx",)))
    q_bias = ("capture", 2, ("q_idx",))
    assert _axis_nodes(program.node, program.captures, "q_idx") == (q_doc, q_bias)  # not doc[b, q - kv]
    assert _axis_nodes(program.node, program.captures, "kv_idx") == (kv_doc, kv_keep)


_DOC = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3, 3, 3] * 4)


@pytest.mark.parametrize("mask_mod,band,pure", [
    (lambda b, h, q, kv: q >= kv, (0, None), True),
    (lambda b, h, q, kv: (q >= kv) & (q - kv < 1024), (0, 1023), True),
    (lambda b, h, q, kv: kv < q - 20, (21, None), True),
    (lambda b, h, q, kv: (kv <= q + 9) & (3 >= q - kv), (-9, 3), True),
    (lambda b, h, q, kv: kv + 5 > q, (None, 4), True),
    (lambda b, h, q, kv: -(kv - q) == 2, (2, 2), True),
    (lambda b, h, q, kv: (_DOC[q] == _DOC[kv]) & (q >= kv), (0, None), False),
    (lambda b, h, q, kv: (q >= kv) & (h < 1) & (kv >= q - 6), (0, 6), False),
    (lambda b, h, q, kv: 2 * q >= kv, None, False),  # not a difference of indices
    (lambda b, h, q, kv: q - kv < 3.5, None, False),  # float compares stay in the program
    (lambda b, h, q, kv: (q >= kv) | (kv > 30), None, False),
    (lambda b, h, q, kv: torch.abs(kv - q) < 4, (-3, 3), True),  # a symmetric window
    (lambda b, h, q, kv: 3 > (q - kv + 2).abs(), (-4, 0), True),
    (lambda b, h, q, kv: ~(q < kv) & (_DOC[q] == _DOC[kv]), (0, None), False),
    (lambda b, h, q, kv: torch.abs(q - kv) > 3, None, False),  # two bands' union
    (lambda b, h, q, kv: torch.abs(q - kv) <= -1, (1, -1), True),  # keeps nothing
], ids=range(16))
def test_bands_are_found(mask_mod, band, pure):
    """A mask's band (the conjuncts bounding d = q_idx - kv_idx, which kernels mask with two
    compares and use to skip tiles): the one found, and checked against mask_mod on a grid
    (a band alone equals the mask; with other conjuncts, the mask implies it)."""
    from tvmflash.kernels.program import split_band

    found, rest = split_band(flex.trace(mask_mod, "mask")[0].node)
    assert found == band and (rest is None) == pure
    if band is None:
        return
    q, kv = torch.arange(40)[:, None], torch.arange(40)[None, :]
    d = q - kv
    in_band = (d >= (band[0] if band[0] is not None else -99)) & (d <= (band[1] if band[1] is not None else 99))
    keep = torch.broadcast_to(mask_mod(torch.tensor(0), torch.tensor(0), q, kv), in_band.shape)
    assert torch.equal(keep, in_band) if pure else not (keep & ~in_band).any()


@pytest.mark.parametrize("mask_mod", [
    lambda b, h, q, kv: (q >= kv) & (q // 7 == kv // 7),  # documents of 7 and causal
    lambda b, h, q, kv: (q >= kv) & (q - kv < 5),
    lambda b, h, q, kv: (kv <= q + 3) & (2 >= q - kv) & (kv % 3 != 1),
    lambda b, h, q, kv: (torch.abs(q - kv) < 4) & ~(kv > q + 1) & (q % 5 != 2),
], ids=["documents", "window", "two-sided and more", "symmetric window and more"])
def test_band_masking_equals_the_mask(mask_mod):
    """What the CUDA kernels compute on a masked tile where the masks have a band: a score is
    kept when its key lies in its row's band (`row_band`; or its query in its key's band,
    `key_band`, S^T tiles) and the masks' work beyond the band keeps it (BEYOND_BAND). Checked
    against the whole pipeline (masks and bounds) on every pair, past both ends too, by folding
    the kernels' TIR expressions to constants."""
    from tvm import sym, tirx

    from tvmflash.kernels.common import Shape
    from tvmflash.kernels.score_mods import BEYOND_BAND, ScoreIndex, ScorePipeline, ScoreProgram

    analyzer = sym.Analyzer()

    def folded(expr):
        expr = analyzer.simplify(expr)
        assert isinstance(expr, (tirx.IntImm, tirx.FloatImm)), expr
        return expr.value

    lq, lk = 19, 26
    const = lambda n: tirx.const(n, "int64")  # noqa: E731
    shape = Shape(*(const(n) for n in (1, 1, 1, lq, lk)))
    pipeline = ScorePipeline([ScoreProgram("mask", flex.trace(mask_mod, "mask")[0])], None, shape)
    one = tirx.const(1.0, "float32")
    for q in range(lq + 2):
        lo, hi = (folded(x) for x in pipeline.row_band(const(q)))
        for kv in range(lk + 2):
            ix = ScoreIndex(const(0), const(0), const(q), const(kv))
            kept = folded(pipeline(one, ix, True)) == 1.0
            beyond = folded(pipeline(one, ix, BEYOND_BAND)) == 1.0
            q_lo, q_hi = (folded(x) for x in pipeline.key_band(const(kv)))
            assert kept == (lo <= kv < hi and beyond) == (q_lo <= q < q_hi and beyond), (q, kv)


@pytest.mark.parametrize("fn,exc,message", [
    (lambda s, b, h, q, kv: s if s > 0 else s * 2, TypeError, "Python control flow"),
    (lambda s, b, h, q, kv: s + torch.ones(3), TypeError, "index captured tensors"),
    (lambda s, b, h, q, kv: q > kv, TypeError, "must return a float score"),
    (lambda s, b, h, q, kv: s + torch.ones(2, 2)[h], TypeError, "must be indexed by 2"),
    (lambda s, b, h, q, kv: torch.erf(s), TypeError, "cannot trace"),
    # no kernel computes gradients of captured tables: refused, not silently zero
    (lambda s, b, h, q, kv: s + torch.ones(2, requires_grad=True)[h], NotImplementedError,
     "gradients with respect to tensors captured"),
])
def test_untraceable_score_mods_raise(fn, exc, message):
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(exc, match=message):
        flex.flex_attention(q, q, q, score_mod=fn)


def test_block_mask_shape_is_checked():
    q = torch.randn(1, 2, 8, 16)
    bm = flex.create_block_mask(lambda b, h, q, kv: q >= kv, 1, 2, 16, 16)
    with pytest.raises(ValueError, match="block_mask was made for"):
        flex.flex_attention(q, q, q, block_mask=bm)


def test_empty_tiles_are_skipped():
    """Tiles the block mask calls empty are not computed: emptying q-block 1 (queries 128..255)
    leaves those rows with no key (out 0, lse -inf, zero dq) although mask_mod keeps pairs there;
    the other rows match the reference. Backward too (both plans)."""
    from test_attention import backward_plan

    mask_mod = lambda b, h, q, kv: q - kv < 200  # noqa: E731
    q, k, v, dout = make(1, 2, 2, 300, 280, 64, torch.float32, seed=12)
    bm = flex.create_block_mask(mask_mod, 1, 2, 300, 280, BLOCK_SIZE=128)
    keep = torch.ones_like(bm.partial)
    keep[:, :, 1] = False  # q-block 1 sees no tile
    bm = flex.BlockMask.from_tiles(bm.partial & keep, bm.full & keep, bm.block_size, bm.seq_lengths, bm.mask_mod)
    for plan in ("fused", "split"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out, lse = flex.flex_attention(*leaves, block_mask=bm, return_lse=True)
        with backward_plan(plan):
            out.backward(dout)
        assert (lse[:, :, 128:256] == float("-inf")).all() and (out[:, :, 128:256] == 0).all()
        assert (leaves[0].grad[:, :, 128:256] == 0).all()
        keep_rows = torch.cat([torch.arange(128), torch.arange(256, 300)])
        ref_out, _ = attention(q.double(), k.double(), v.double(), mask_mod=mask_mod)
        torch.testing.assert_close(out[:, :, keep_rows].double(), ref_out[:, :, keep_rows], atol=2e-5, rtol=0)


def test_flex_runs_between_compiled_graphs():
    """Under torch.compile, flex_attention runs eagerly at a graph break while the code around it
    compiles: the same values and gradients as eager mode. fullgraph=True refuses the call by
    name (Dynamo cannot trace the score_mod tracing)."""
    import torch._dynamo

    b, h, hk, lq, lk, d = 2, 4, 2, 113, 113, 64
    q, k, v, dout = make(b, h, hk, lq, lk, d, torch.float32, seed=5)
    score_mod, mask_mod = _mods("relative bias + causal", _tables(h))  # the spec test_flex_matches_reference builds
    bm = flex.create_block_mask(mask_mod, None, None, lq, lk)

    def layer(q, k, v):
        return flex.flex_attention(q * 2, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True).relu()

    results = []
    for run in (layer, torch.compile(layer, backend="aot_eager")):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = run(*leaves)
        out.backward(dout)
        results.append((out, *(x.grad for x in leaves)))
    assert results[0][0].abs().max() > 0.1
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=0)
    torch._dynamo.reset()  # else the fullgraph call would reuse the compiled frames above
    with pytest.raises(Exception, match="flex_attention"):
        torch.compile(layer, backend="aot_eager", fullgraph=True)(q, k, v)
