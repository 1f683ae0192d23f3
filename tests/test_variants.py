"""Attention variants through flash_attn_func (flash-attn's semantics): sliding window, ALiBi,
softcap and their combinations with causal and GQA; forward, lse and every gradient against the
float64 reference, odd sizes, rows that see no key. The variants' values are kernel arguments,
so each group of cases below builds one module (its spec) and the values vary freely."""
import pytest
import torch

import tvmflash
from tvmflash.ops import spec_for
from test_attention import DTYPES, check_against_reference, make

SHAPES = [(1, 1), (17, 203), (203, 17), (113, 113)]


def flash_variant_run(causal, **variant):
    def run(q, k, v):
        out, lse, _ = tvmflash.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               causal=causal, return_attn_probs=True, **variant)
        return out.transpose(1, 2), lse
    return run


def reference_window(window, causal):
    """The reference's (left, right) for flash-attn's window_size (causal: right = 0)."""
    return (window[0], 0 if causal else window[1])


def alibi(kind, b, h, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.rand((h,) if kind == "h" else (b, h), generator=g) * 0.5


# (dtype, causal, window_size, softcap, alibi kind): one spec per group of values
CASES = [
    ("fp32", False, (37, 5), 0.0, None),
    ("fp32", False, (0, 0), 0.0, None),  # the bottom-right diagonal only
    ("fp32", False, (-1, 3), 0.0, None),
    ("fp32", True, (50, -1), 0.0, "bh"),  # causal + window + ALiBi
    ("fp32", True, (0, -1), 0.0, "h"),
    ("fp32", False, (-1, -1), 1.5, None),  # softcap well inside tanh's bend
    ("fp32", False, (-1, -1), 30.0, None),
    ("bf16", True, (-1, -1), 2.0, "h"),  # softcap + ALiBi (+ causal), bf16 tolerances
    ("bf16", True, (-1, -1), 5.0, "bh"),
]


@pytest.mark.parametrize("dtype,causal,window,softcap,alibi_kind", CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("lq,lk", SHAPES, ids=lambda x: str(x))
def test_variants(dtype, causal, window, softcap, alibi_kind, lq, lk):
    b, h, hk, d = 2, 4, 2, 64
    q, k, v, dout = make(b, h, hk, lq, lk, d, DTYPES[dtype], seed=lq + lk)
    slopes = alibi(alibi_kind, b, h) if alibi_kind else None
    check_against_reference(q, k, v, dout,
                            flash_variant_run(causal, window_size=window, softcap=softcap, alibi_slopes=slopes),
                            causal="bottom_right" if causal else "none",
                            window=reference_window(window, causal), softcap=softcap, alibi_slopes=slopes)


def test_window_rows_that_see_no_key():
    """Lq > Lk with a window: query i sees keys i - 70 - 4 .. i - 70, so queries 0..69 see none
    (out 0, lse -inf, zero dq), checked on top of the reference comparison."""
    q, k, v, dout = make(1, 2, 2, 90, 20, 64, torch.float32, seed=11)
    run = flash_variant_run(False, window_size=(4, 0))
    check_against_reference(q, k, v, dout, run, window=(4, 0))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = run(*leaves)
    assert (lse[:, :, :70] == float("-inf")).all() and lse[:, :, 70:].isfinite().all()
    assert (out[:, :, :70] == 0).all()
    out.backward(dout)
    assert (leaves[0].grad[:, :, :70] == 0).all()


def test_variant_values_share_one_module():
    """Window sizes, softcap values and slopes are kernel arguments: the spec (one compiled
    module) depends only on which variants a call uses."""
    q = torch.zeros(1, 2, 8, 64)
    a = spec_for(q, None, "none", (3, 1), 2.0, torch.ones(2))
    assert a == spec_for(q, None, "none", (100, 0), 7.5, torch.zeros(1, 2))
    assert a != spec_for(q, None, "none", (3, 1), 0.0, torch.ones(2))
    assert spec_for(q, None, "none") == spec_for(q, None, "none", (-1, -1), 0.0, None)


def test_kernel_argument_order_matches_the_modifiers():
    """ops passes the modifiers' arguments in AttentionSpec.kernel_arg_names() order (pure
    Python, for runtime-only deployments); the kernels declare them in modifiers() order."""
    spec = tvmflash.AttentionSpec("float32", 64, causal="top_left", mask="additive",
                                  variants=("softcap", "alibi", "window"))
    assert [n for m in spec.modifiers() for n in m.arg_names] == list(spec.kernel_arg_names())
    assert spec.kernel_arg_names() == ("softcap", "alibi_slopes", "mask", "window_left", "window_right")
    with pytest.raises(ValueError, match="variants"):
        tvmflash.AttentionSpec(variants=("window", "softcap"))


def test_polynomial_exp2_keeps_to_its_bound():
    """The softcap forward's FMA-pipe exponent (schedules/cuda_mma.poly_exp2_into), its steps
    replayed in float32: round by ROUNDER, the cubic on the fraction, the integer part added
    to the exponent bits. Relative error <= 1e-4 over the range it serves, 2^-125 below it."""
    import numpy as np

    from tvmflash.schedules.cuda_mma import POLY_EXP2, ROUNDER

    f32 = np.float32
    x = np.concatenate([np.linspace(-125, 0, 1_000_001), -np.logspace(-8, 0, 1001), [-1e4, -126.0]]).astype(f32)
    clamped = np.maximum(x, f32(-125))
    rounded = clamped + f32(ROUNDER)
    frac = clamped - (rounded - f32(ROUNDER))
    assert np.abs(frac).max() <= 0.5
    poly = ((f32(POLY_EXP2[3]) * frac + f32(POLY_EXP2[2])) * frac + f32(POLY_EXP2[1])) * frac + f32(POLY_EXP2[0])
    bits = poly.view(np.int32) + (rounded.view(np.int32) << np.int32(23))
    got = bits.view(f32).astype(np.float64)
    want = np.exp2(clamped.astype(np.float64))
    assert np.abs(got / want - 1).max() < 1e-4
    assert got[-2] == got[-1] == got[0]  # x[0] = -125: below it the clamp holds


@pytest.mark.parametrize("lq,lk", [(1000, 1000), (113, 203), (203, 113), (300, 4000)], ids=str)
def test_alibi_bias_splits_into_row_and_key_terms_off_its_diagonal(lq, lk):
    """The CUDA forwards' split ALiBi (schedules/cuda_mma.split_bias_tile): on a tile that
    `tile_side` puts on side s, s (key - k0 - d) is exactly -|i + Lk - Lq - key| for every pair,
    and side 0 is left to tiles the diagonal does cross (those keep the full bias)."""
    import tvm
    from tvm import tirx

    from tvmflash.kernels.common import Shape
    from tvmflash.kernels.score_mods import ScoreIndex, _BoundAlibi

    fold = tvm.sym.Analyzer().simplify
    c = lambda x: tirx.const(x, "int64")  # noqa: E731
    shape = Shape(c(1), c(1), c(1), c(lq), c(lk))
    alibi, sides = _BoundAlibi(slopes=None), set()
    for q_lo in range(0, lq, 64):
        q_hi = min(q_lo + 64, lq)
        for k0 in range(0, lk, 48):  # tiles of 64 keys, overlapping: starts off the 64-grid too
            side = int(fold(alibi.tile_side(c(q_lo), c(q_hi), c(k0), c(k0 + 64), shape)))
            sides.add(side)
            dist = torch.arange(q_lo, q_hi)[:, None] + lk - lq - torch.arange(k0, k0 + 64)[None, :]
            if side == 0:
                assert (dist > 0).any() and (dist < 0).any(), (q_lo, k0)
                continue
            d = torch.tensor([float(fold(alibi.key_offset(ScoreIndex(c(0), c(0), c(i), None), c(k0), shape)))
                              for i in range(q_lo, q_hi)])
            split = side * (torch.arange(64)[None, :] - d[:, None])
            assert torch.equal(split, -dist.abs().double()), (q_lo, k0, side)
    assert sides == {-1, 0, 1}


def test_band_masks_are_their_scores_masks():
    """ScorePipeline.row_band / key_band (the CUDA kernels mask a tile's scores through them
    where every mask is a band: two compares a score) keep exactly the pairs the pipeline's
    elementwise masks and bounds keep, rows and keys past the ends included (empty bands)."""
    from tvm import tirx
    from tvm.sym.analyzer import Analyzer

    from tvmflash.kernels.common import Shape
    from tvmflash.kernels.score_mods import Causal, ScoreIndex, ScorePipeline, Window

    class Args:  # the window's sizes as plain variables (no kernel being parsed)
        @staticmethod
        def scalar(name, dtype="float32"):
            return tirx.Var(name, dtype)

    shape = Shape.fresh()

    def at(expr, values):  # expr with these variables' values, folded to an int
        analyzer = Analyzer()
        for var, value in values.items():
            analyzer.bind(var, tirx.const(value, "int64"))
        return int(analyzer.simplify(expr))
    q, kv = tirx.Var("q", "int64"), tirx.Var("kv", "int64")
    for mods in ([Causal("bottom_right")], [Causal("top_left")], [Window()], [Causal("bottom_right"), Window()]):
        pipe = ScorePipeline(mods, Args(), shape)
        window = next((m for m in pipe.mods if isinstance(m, Window)), None)
        keep = pipe(tirx.const(1.0, "float32"), ScoreIndex(0, 0, q, kv)) > 0
        forms = (keep, *pipe.row_band(q), *pipe.key_band(kv))
        for lq, lk, (left, right) in [(5, 9, (2, 1)), (9, 5, (0, 0)), (7, 7, (16, 0)), (6, 8, (1, 3))]:
            sizes = {shape.seqlen_q: lq, shape.seqlen_k: lk}
            if window is not None:
                sizes.update({window.left: left, window.right: right})
            kept = {(i, j) for i in range(lq) for j in range(lk) if at(keep, {**sizes, q: i, kv: j})}
            for i in range(lq + 2):
                lo, hi = at(forms[1], {**sizes, q: i}), at(forms[2], {**sizes, q: i})
                assert {j for j in range(-2, lk + 2) if lo <= j < hi} == {j for j in range(lk) if (i, j) in kept}
            for j in range(lk + 2):
                lo, hi = at(forms[3], {**sizes, kv: j}), at(forms[4], {**sizes, kv: j})
                assert {i for i in range(-2, lq + 2) if lo <= i < hi} == {i for i in range(lq) if (i, j) in kept}
