"""CUDA kernels. On any machine with nvcc: every CUDA spec of the matrix builds for sm_90a (and
one for sm_80) into a module that carries a cubin, not source. On a GPU (the device check,
scripts/device_check.sh): forward and gradients against a float64 reference with flash-attn's
error rule (error <= 2x that of the same computation done by torch in the input dtype), and the
deterministic backward bitwise reproducible."""
import shutil
import subprocess

import pytest
import torch

import tvmflash
from tvmflash import flex
from tvmflash.spec import AttentionSpec
from tvmflash.reference import attention

def _compiler_available() -> bool:
    import tvm_ffi

    __import__("tvm")  # registers TVM's global functions
    return tvm_ffi.get_global_func("target.build.cuda", allow_missing=True) is not None


needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None or not _compiler_available(),
                                reason="needs nvcc and the TVM compiler")
needs_compiler = pytest.mark.skipif(not _compiler_available(), reason="needs the TVM compiler")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

BUILD_SPECS = [AttentionSpec("float16", d) for d in (32, 64, 80, 96, 128, 192, 256)] + [
    AttentionSpec("bfloat16", 128, causal="bottom_right"),
    AttentionSpec("float16", 64, causal="top_left", mask="bool"),
    AttentionSpec("bfloat16", 64, mask="additive"),
    AttentionSpec("bfloat16", 128, causal="bottom_right", variants=("window",), kv_cache=True),  # decode kernels
]


@needs_nvcc
@pytest.mark.parametrize("spec", BUILD_SPECS, ids=lambda s: s.name)
def test_cuda_module_builds_with_cubin(spec, tmp_path):
    from tvmflash.build import build_module, cuda_target

    lib = tmp_path / "m.so"
    build_module(spec, cuda_target("sm_90a")).export_library(str(lib))
    data = lib.read_bytes()
    assert data.count(b"\x7fELF") >= 2, "no cubin embedded next to the host library"
    assert b"cubin" in data and b"__global__" not in data, "module carries CUDA source, not a binary"


@needs_compiler
@pytest.mark.parametrize("width", [64, 128, 256])
def test_swizzled_rows_keep_copies_in_one_line_and_ldmatrix_free_of_conflicts(width):
    """SwizzledRows (the decode kernel's shared-memory tiles): each row holds every element
    once; a copy's eight 16-byte chunks of one 128-byte run of a row fill one 128-byte line
    (the property that keeps cp.async's global requests whole); ldmatrix's eight rows of one
    chunk fall in eight different bank groups."""
    from tvmflash.schedules.cuda_mma import SwizzledRows

    def where(r, c):  # the flat element offset of [r, c]
        return r * width + SwizzledRows.column(r, c)

    for r in range(16):
        assert sorted(where(r, c) - r * width for c in range(width)) == list(range(width))
        for run in range(width // 64):
            lines = {where(r, run * 64 + k * 8) // 64 for k in range(8)}
            assert lines == {(r * width + run * 64) // 64}
    for r0 in (0, 8):
        for c in range(0, width, 8):
            assert len({where(r0 + i, c) // 8 % 8 for i in range(8)}) == 8  # 16-byte bank groups
    assert not SwizzledRows.fits(96)


@needs_nvcc
@pytest.mark.parametrize("head_dim,warps,block_n", [(128, 1, 32), (128, 8, 128), (96, 4, 64), (256, 2, 64)])
def test_cuda_decode_kernel_builds_for_other_warp_counts(head_dim, warps, block_n):
    """The decode kernel's shapes the records do not pick (head dim 128 takes 4 warps on the
    H200) still build: a retuned record may choose them. Among them the epilogue's uneven
    cases: more threads than head-dim columns (8 warps; 4 at head dim 96, padded rows), and
    several columns a thread (head dim 256). (Their results matched a float64 reference on
    the H200 with 1, 3 and 8 splits, empty sequences and 16-row blocks, in a probe run.)"""
    from tvmflash.build import build_module, cuda_target

    spec = AttentionSpec("bfloat16", head_dim, kv_cache=True)
    build_module(spec, cuda_target("sm_90a"), {"decode_warps": warps, "decode_block_n": block_n})


@needs_compiler  # the schedules import TVM's script layer, which a runtime-only TVM lacks
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_decode_knobs_fit_shared_memory(dtype):
    """Every head dim's decode knobs (defaults fitted by cuda_decode.default_knobs, under the
    tuning records) leave each kernel's pool within an SM's shared memory: decode_long's
    default 128-key tiles did not at head dim 256 (265 KB), a launch that would have failed."""
    from tvmflash.build import cuda_target, default_knobs
    from tvmflash.schedules.cuda_decode import shared_bytes
    from tvmflash.schedules.cuda_mma import SHARED_LIMIT
    from tvmflash.tuning import DECODE_PHASES, tuned_knobs

    for d in (32, 64, 96, 128, 192, 256):
        spec = AttentionSpec(dtype, d, kv_cache=True)
        knobs = {**default_knobs(spec, cuda_target("sm_90a")), **tuned_knobs("cuda", spec)}
        for phase in DECODE_PHASES:
            need = shared_bytes(d, *(knobs[f"{phase}_{k}"] for k in ("block_n", "warps", "stages")))
            assert need <= SHARED_LIMIT, (d, phase, need)


@needs_nvcc
def test_cuda_decode_kernel_builds_with_a_deep_ring():
    """Six ring buffers of 64 keys (head dim 128, 4 warps: 201 KB, the two-CTA plan's ring in
    one CTA, for a one-CTA-an-SM plan without splits) build; a pool past an SM's 227 KB is
    refused with its size, before any code is generated."""
    from tvmflash.build import build_module, cuda_target
    from tvmflash.schedules.cuda_decode import DEFAULTS, decode_kernel_cuda

    spec = AttentionSpec("bfloat16", 128, kv_cache=True)
    build_module(spec, cuda_target("sm_90a"), {"decode_warps": 4, "decode_block_n": 64, "decode_stages": 6})
    with pytest.raises(ValueError, match="bytes of shared memory at head dim 128"):
        decode_kernel_cuda(spec, {**DEFAULTS, "decode_warps": 4, "decode_block_n": 128, "decode_stages": 6})
    with pytest.raises(ValueError, match=r"stages 7 \(2 \.\. 6\)"):
        decode_kernel_cuda(spec, {**DEFAULTS, "decode_stages": 7})


@needs_nvcc
@pytest.mark.parametrize("knobs", [{}, {"wgmma_persistent": 1}, {"wgmma_persistent": 0},
                                   {"wgmma_persistent": 0, "wgmma_uniform_warpgroup": 0},
                                   {"wgmma_stages": 2, "wgmma_pingpong": 0},
                                   {"wgmma_stages": 4, "wgmma_block_n": 64}, {"wgmma_producer": 0},
                                   {"block_mask": True},
                                   {"block_mask": True, "wgmma_persistent": 0, "wgmma_stage_lists": 0},
                                   {"block_mask": True, "wgmma_persistent": 0, "wgmma_stage_lists": 1}],
                         ids=["default", "persistent-static", "cta-an-item", "cta-an-item-lane-warpgroup",
                              "2stages-free", "4stages", "lockstep", "mask", "mask-lists-in-place", "mask-lists-staged"])
def test_wgmma_forward_loop_forms_build(knobs, tmp_path):
    """The wgmma forward's loops at D=128 build with nvcc: the warp-specialized one (a producer
    warpgroup, mbarrier rings, named-barrier turns), persistent (items drawn from a counter or
    strided) or a CTA an item, at the records' knobs and at the other ring depths and free issue
    a retune may pick, the lockstep one, and a block mask's walk with its tile lists read in
    place or staged. ptxas keeps the
    warp-specialized loop's register hand-over: where code after it was shared by both roles
    (the persistent loop's first form), it ignored setmaxnreg (C7507), spilled, and serialized
    every wgmma (C7512)."""
    import tvm
    import tvm_ffi
    from tvmflash import build

    knobs = dict(knobs)
    masked = knobs.pop("block_mask", False)
    causal_mask = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx  # noqa: E731
    spec = (flex.flex_spec(torch.bfloat16, 128, None, causal_mask) if masked
            else AttentionSpec("bfloat16", 128, causal="bottom_right"))
    kernels = build.cuda_kernels(spec, "sm_90a", knobs)
    script = kernels["forward"].script()
    ws = knobs.get("wgmma_producer", 1) == 1
    assert ("setmaxnreg" in script, "mbarrier" in script) == (ws, ws)
    assert ("T.ptx.bar(" in script) == (ws and knobs.get("wgmma_pingpong", 1) == 1)  # the turns
    build._prepare_cuda_codegen()
    sources = []
    tvm_ffi.register_global_func("tvm_callback_cuda_compile", lambda code: (sources.append(code), build._nvcc_cubin(code))[1],
                                 override=True)
    try:
        with tvm.target.Target(build.cuda_target("sm_90a")) as target:
            tvm.compile(tvm.IRModule({"forward": kernels["forward"]}), target=target, tir_pipeline="tirx")
    finally:
        build._prepare_cuda_codegen()
    (tmp_path / "forward.cu").write_text(sources[0])
    proc = subprocess.run(["nvcc", "--cubin", "-O3", "-arch=sm_90a", "-o", str(tmp_path / "forward.cubin"),
                           str(tmp_path / "forward.cu")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "C7507" not in proc.stderr and "C7512" not in proc.stderr, proc.stderr[-2000:]


@needs_compiler
def test_lockstep_forward_declares_the_ctas_an_sm_its_shared_memory_allows():
    """The D=64 lockstep forward (one warpgroup) tells ptxas that three CTAs share an SM, which
    holds it to 170 registers a thread (it took 193 on its own and lost a CTA an SM); the
    warp-specialized D=128 one runs a CTA an SM and says nothing."""
    from tvmflash.build import cuda_kernels

    lockstep = cuda_kernels(AttentionSpec("bfloat16", 64), "sm_90a", {"wgmma_warpgroups": 1, "wgmma_block_n": 128})
    assert '"tirx.launch_bounds_min_blocks_per_sm": 3' in lockstep["forward"].script()
    specialized = cuda_kernels(AttentionSpec("bfloat16", 128), "sm_90a")["forward"]
    assert "launch_bounds_min_blocks_per_sm" not in specialized.script()


@needs_compiler
def test_wgmma_forward_refuses_rings_that_do_not_fit_shared_memory():
    from tvmflash.build import cuda_kernels

    with pytest.raises(ValueError, match="shared memory"):
        cuda_kernels(AttentionSpec("bfloat16", 256), "sm_90a", {"wgmma_producer": 1, "wgmma_stages": 4})


@needs_compiler
def test_wgmma_backward_refuses_tiles_that_do_not_fit_shared_memory():
    """128-query blocks at head dim 128 (a knob override; the tuner's grid leaves them out)
    need 355 KB: refused when the kernel is generated, not at its first launch."""
    from tvmflash.build import cuda_kernels

    with pytest.raises(ValueError, match="363520 bytes of shared memory at head dim 128"):
        cuda_kernels(AttentionSpec("bfloat16", 128), "sm_90a", {"bwd_wgmma_block_m": 128})
    cuda_kernels(AttentionSpec("bfloat16", 64), "sm_90a", {"bwd_wgmma_block_m": 128})  # 64: fits


@needs_compiler
def test_window_modules_hold_the_lockstep_forward_for_short_windows():
    """At D=128 a windowed module holds the warp-specialized forward and the lockstep one
    ("forward_short"); a window of at most SHORT_WALK_KEYS keys on both sides together
    (SHORT_CAUSAL_WALK_KEYS under a causal mask) runs the latter, an unbounded side or a longer
    window the former; other modules hold one forward."""
    from tvmflash.kernels.score_mods import math_target
    from tvmflash.interface import _check_window
    from tvmflash.ops import SHORT_CAUSAL_WALK_KEYS, SHORT_WALK_KEYS, _forward_kernel_name
    from tvmflash.schedules.cuda_kernels import default_knobs, forward_kernels

    def forwards(spec, arch):
        with math_target("cuda"):
            return forward_kernels(spec, arch, {**default_knobs(spec), "forward_wgmma": 1})

    kernels = forwards(AttentionSpec("bfloat16", 128, causal="bottom_right", variants=("window",)), "sm_90a")
    assert "setmaxnreg" in kernels["forward"].script() and "setmaxnreg" not in kernels["forward_short"].script()
    assert kernels["forward_short"].attrs["global_symbol"] == "forward_short"
    half, causal_keys = SHORT_WALK_KEYS // 2, SHORT_CAUSAL_WALK_KEYS
    for window, causal, name in (((causal_keys, 0), True, "forward_short"), ((half, half), False, "forward_short"),
                                 ((causal_keys, 5), True, "forward_short"), ((causal_keys + 1, 0), True, "forward"),
                                 ((half, half + 1), False, "forward"), ((256, -1), False, "forward"),
                                 ((-1, 0), True, "forward"), ((-1, -1), False, "forward")):
        # as the call's window reaches the kernels (a causal call's right side is -1)
        assert _forward_kernel_name(kernels, None, None, _check_window(window, causal), causal) == name, window
    assert _forward_kernel_name({"forward": None}, None, None, (256, 0), False) == "forward"
    for spec, arch in ((AttentionSpec("bfloat16", 128, causal="bottom_right"), "sm_90a"),
                       (AttentionSpec("bfloat16", 64, variants=("window",)), "sm_90a"),  # lockstep already
                       (AttentionSpec("bfloat16", 128, variants=("window",)), "sm_80")):
        assert list(forwards(spec, arch)) == ["forward"], (spec.name, arch)


@needs_compiler
def test_hopper_kernels_run_on_wgmma_where_they_take_the_spec():
    from tvmflash.build import cuda_kernels

    def uses_wgmma(spec, arch):  # forward, atomic-dQ backward, deterministic dQ
        kernels = cuda_kernels(spec, arch)
        return tuple("wgmma" in kernels[name].script() for name in ("forward", "backward_dkdv_dq", "backward_dq"))

    assert uses_wgmma(AttentionSpec("bfloat16", 64), "sm_90a") == (True, True, False)
    assert uses_wgmma(AttentionSpec("float16", 128, causal="top_left"), "sm_90a") == (True, True, False)
    assert uses_wgmma(AttentionSpec("float16", 256), "sm_90a") == (True, False, False)
    assert uses_wgmma(AttentionSpec("float16", 96), "sm_90a") == (False, False, False)
    assert uses_wgmma(AttentionSpec("float16", 128), "sm_80") == (False, False, False)
    # dropout's and softcap's backward too (64-query blocks; softcap's factor recomputed from P)
    assert uses_wgmma(AttentionSpec("bfloat16", 64, variants=("dropout",)), "sm_90a") == (True, True, False)
    assert uses_wgmma(AttentionSpec("bfloat16", 128, variants=("softcap",)), "sm_90a") == (True, True, False)
    # flex: block masks walk the wgmma kernels too (the forward where its tiles divide the
    # blocks); a score_mod whose derivative is not 1 keeps the mma backward
    expected = {"softcap score": (True, False, False), "document mask": (True, True, False),
                "alibi + document, 64-blocks": (False, True, False)}
    specs = {name: spec for (name, *_), spec in zip(_flex_cases(), cuda_flex_specs())}
    assert expected.keys() <= specs.keys(), "a renamed flex case would skip its check"
    for name, kernels in expected.items():
        assert uses_wgmma(specs[name], "sm_90a") == kernels, name


@needs_compiler
@pytest.mark.parametrize("head_dim,parts,swizzle", [(96, 1, False), (64, 2, True), (128, 2, True), (128, 1, True)])
def test_dq_accumulator_layout_is_a_permutation_with_a_run_per_block_row(head_dim, parts, swizzle):
    # every dQ element gets its own place in the (LQ, D) accumulator, and a column block's rows
    # are one run (the wgmma backward adds a warpgroup's rows with one bulk reduction)
    import tvm
    from tvmflash.schedules.cuda_backward import DqAccLayout

    layout, lq, analyzer = DqAccLayout(head_dim, parts, swizzle), 13, tvm.sym.Analyzer()

    def flat(index):
        r, c = (int(analyzer.simplify(tvm.tirx.const(0, "int64") + x)) for x in index)
        assert 0 <= r < lq and 0 <= c < head_dim
        return r * head_dim + c

    places = {(row, col): flat(layout.index(lq, row, col)) for row in range(lq) for col in range(head_dim)}
    assert sorted(places.values()) == list(range(lq * head_dim))
    for part in range(parts):
        for row in range(lq):
            start = flat(layout.row_start(lq, part, row))
            cols = range(part * layout.cols, (part + 1) * layout.cols)
            assert sorted(places[row, c] for c in cols) == list(range(start, start + layout.cols))
            if row + 1 < lq:
                assert flat(layout.row_start(lq, part, row + 1)) == start + layout.cols


@needs_compiler
@pytest.mark.parametrize("tiles,pairs,group,kv_mib,l2_mib", [(32, 16, 1, 2, 8), (7, 6, 2, 2, 8), (5, 3, 1, 64, 8),
                                                              (4, 10, 1, 1, 3), (3, 1, 4, 1, 8)])
def test_grid_position_is_rank_major_within_sections_that_fit_l2(tiles, pairs, group, kv_mib, l2_mib):
    # the CTAs (one-dimensional grid, started in order) cover every (tile rank, pair) once,
    # ranks major within sections of consecutive pairs whose K/V fit in the L2 share
    import tvm
    from tvmflash.schedules.cuda_mma import grid_position

    analyzer = tvm.sym.Analyzer()
    places = [tuple(int(analyzer.simplify(x)) for x in grid_position(c, tiles, pairs, group, kv_mib << 20, l2_mib << 20))
              for c in range(tiles * pairs)]
    assert sorted(places) == [(r, p) for r in range(tiles) for p in range(pairs)]
    per_section = min(max(l2_mib // kv_mib, 1) * group, pairs)
    for first in range(0, pairs, per_section):
        section = [pl for pl in places if first <= pl[1] < first + per_section]
        assert section == places[first * tiles:(first + len(section) // tiles) * tiles]  # one run of CTAs
        assert [r for r, _ in section] == sorted(r for r, _ in section)  # ranks major
        assert -(-len({p for _, p in section}) // group) * kv_mib <= max(l2_mib, kv_mib)  # K/V fit (or one kv-head)


@needs_nvcc
def test_cuda_module_builds_for_sm80(tmp_path):
    from tvmflash.build import build_module, cuda_target

    build_module(AttentionSpec("bfloat16", 128, causal="top_left"), cuda_target("sm_80")).export_library(
        str(tmp_path / "m.so"))


def _heads(d):
    return (6, 2) if d in (32, 96, 192) else (4, 4)  # GQA on some head dims


def _check_close(name, got, ref64, low, atol=1e-3):
    err = (got.double() - ref64).abs().max().item()
    budget = 2 * (low.double() - ref64).abs().max().item() + atol
    assert err <= budget, f"{name} error {err:.3g} > {budget:.3g}"


def _reference_bshd(causal):
    """The float reference on flash-attn's (B, L, H, D) layout."""
    def ref(q, k, v):
        return attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)[0].transpose(1, 2)
    return ref


def _grads(fn, inputs, dout):
    inputs = [x.detach().requires_grad_() for x in inputs]
    out = fn(*inputs)
    return torch.autograd.grad(out, inputs, dout)


GPU_SHAPES = [(1, 1), (17, 17), (128, 128), (113, 203), (203, 113), (257, 64), (1000, 1000)]


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("d", [32, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq,lk", GPU_SHAPES, ids=str)
def test_cuda_forward_matches_reference(dtype, d, causal, lq, lk):
    g = torch.Generator(device="cuda").manual_seed(0)
    h, hk = _heads(d)
    q = torch.randn(2, lq, h, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(2, lk, hk, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(2, lk, hk, d, device="cuda", dtype=dtype, generator=g)
    out, lse, _ = tvmflash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    mode = "bottom_right" if causal else "none"
    bhld = [x.transpose(1, 2) for x in (q, k, v)]
    o64, l64 = attention(*[x.double() for x in bhld], causal=mode)
    olow, _ = attention(*bhld, causal=mode)
    err = (out.transpose(1, 2).double() - o64).abs().max().item()
    budget = 2 * (olow.double() - o64).abs().max().item() + 1e-3
    assert err <= budget, f"out error {err:.3g} > {budget:.3g}"
    assert torch.equal(lse.isinf(), l64.isinf())
    fin = ~l64.isinf()
    if fin.any():
        assert (lse.double()[fin] - l64[fin]).abs().max().item() < 1e-3


@needs_gpu
def test_cuda_forward_calls_in_turn_on_two_streams_and_a_graph():
    """Every CUDA forward takes a counter from which persistent kernels draw their work items
    and which their last draw zeroes for the next launch (ops._item_counter, one a stream):
    calls of different sizes in turn on two streams and replays of a captured call each give
    the output of a call made alone."""
    g = torch.Generator(device="cuda").manual_seed(11)
    shapes = [(2, 1000, 900), (1, 4096, 4096), (3, 129, 2000)]
    inputs = [tuple(torch.randn(b, lq if i == 0 else lk, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g)
                    for i in range(3)) for b, lq, lk in shapes]
    alone = [tvmflash.flash_attn_func(*x, causal=True) for x in inputs]
    side = torch.cuda.Stream()
    for turn in range(3):
        for i, x in enumerate(inputs):
            stream = side if (i + turn) % 2 else torch.cuda.current_stream()
            with torch.cuda.stream(stream):
                out = tvmflash.flash_attn_func(*x, causal=True)
            stream.synchronize()
            assert torch.equal(out, alone[i]), (turn, shapes[i])
    graph = torch.cuda.CUDAGraph()
    tvmflash.flash_attn_func(*inputs[1], causal=True)  # (loads outside the capture)
    with torch.cuda.graph(graph):
        captured = tvmflash.flash_attn_func(*inputs[1], causal=True)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, alone[1])
        assert torch.equal(tvmflash.flash_attn_func(*inputs[0], causal=True), alone[0])


@needs_gpu
@pytest.mark.parametrize("d", [96, 128], ids=["mma", "wgmma"])
@pytest.mark.parametrize("scale", [-0.2, 0.05])
def test_cuda_softmax_scale_of_either_sign(d, scale):
    """The wgmma forward (D=128) takes an unmasked tile's max over raw scores and scales it
    after: under a negative softmax_scale the smallest raw score is the max; the mma.sync
    forward (D=96) scales first (causal, Lq != Lk: masked tiles too)."""
    from test_attention import check_against_reference

    g = torch.Generator(device="cuda").manual_seed(1)
    q, dout = (torch.randn(2, 4, 203, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    k, v = (torch.randn(2, 4, 300, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))

    def run(qh, kh, vh):
        out, lse, _ = tvmflash.flash_attn_func(*(x.transpose(1, 2) for x in (qh, kh, vh)), softmax_scale=scale,
                                               causal=True, return_attn_probs=True)
        return out.transpose(1, 2), lse
    check_against_reference(q, k, v, dout, run, causal="bottom_right", scale=scale)


@needs_gpu
@pytest.mark.parametrize("scale", [-0.2, 0.05])
@pytest.mark.parametrize("dtype,d,causal", [(torch.float16, 64, True), (torch.bfloat16, 128, False)], ids=str)
def test_cuda_softcap_under_a_scale_of_either_sign(scale, dtype, d, causal):
    """A lone softcap on the wgmma forward keeps tanh(scale s / cap) of unmasked tiles and
    scales by the cap after their max (`cuda_mma.raw_values`): a negative softmax_scale flips
    tanh's argument, not the max (both wgmma loops: lockstep at D=64, warp-specialized at 128)."""
    from test_attention import check_against_reference

    g = torch.Generator(device="cuda").manual_seed(3)
    q, dout = (torch.randn(2, 4, 203, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    k, v = (torch.randn(2, 4, 300, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))

    def run(qh, kh, vh):
        out, lse, _ = tvmflash.flash_attn_func(*(x.transpose(1, 2) for x in (qh, kh, vh)), softmax_scale=scale,
                                               causal=causal, softcap=4.0, return_attn_probs=True)
        return out.transpose(1, 2), lse
    check_against_reference(q, k, v, dout, run, causal="bottom_right" if causal else "none", scale=scale,
                            softcap=4.0)


@needs_gpu
@pytest.mark.parametrize("cap", [5.0, 50.0, 200.0])
def test_cuda_softcap_keeps_saturated_rows(cap):
    """A softcap's rows whose scores all sit near -cap or +cap (tanh saturated: the row's
    probabilities all but equal), ordinary rows, rows with a few large scores among ordinary
    ones and rows with no key (bottom-right causal, Lq > Lk) match a float64 reference, o and
    lse, on the bf16 wgmma forward."""
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(2, 4, 300, 128, device="cuda", generator=g)
    k, v = (torch.randn(2, 4, 190, 128, device="cuda", generator=g) for _ in range(2))
    q[:, :2] = q[:, :2].abs() * 6  # head 0: every score far below -cap, head 1 far above +cap
    k[:, 0], k[:, 1] = -k[:, 0].abs() * 6, k[:, 1].abs() * 6
    k[:, 3, ::37] *= 40  # head 3: a few large keys among ordinary ones
    q, k, v = (x.bfloat16() for x in (q, k, v))
    out, lse, _ = tvmflash.flash_attn_func(*(x.transpose(1, 2) for x in (q, k, v)), causal=True, softcap=cap,
                                           return_attn_probs=True)
    o64, lse64 = attention(q.double(), k.double(), v.double(), causal="bottom_right", softcap=cap)
    olow, _ = attention(q, k, v, causal="bottom_right", softcap=cap)
    assert (out.transpose(1, 2).double() - o64).abs().max() <= 2 * (olow.double() - o64).abs().max() + 1e-3
    assert torch.equal(lse.isneginf(), lse64.isneginf()) and lse.isneginf()[:, :, :110].all()
    live = ~lse64.isneginf()  # lse up to cap + ln(190): tanh's relative error carries over
    assert ((lse.double()[live] - lse64[live]).abs() <= 2e-4 + 3e-5 * lse64[live].abs()).all()


@needs_gpu
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_cuda_forward_masks(kind):
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(2, 3, n, 64, device="cuda", dtype=torch.float16, generator=g) for n in (77, 130, 130))
    keep = torch.rand(2, 1, 77, 130, device="cuda", generator=g) > 0.3
    keep[..., 5, :] = False
    mask = keep if kind == "bool" else torch.randn(keep.shape, device="cuda", generator=g).half().masked_fill(~keep, float("-inf"))
    out = tvmflash.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    o64, _ = attention(q.double(), k.double(), v.double(), mask=mask if kind == "bool" else mask.double())
    olow, _ = attention(q, k, v, mask=mask)
    assert (out.double() - o64).abs().max() <= 2 * (olow.double() - o64).abs().max() + 1e-3
    assert torch.equal(out[:, :, 5], torch.zeros_like(out[:, :, 5]))


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("d", [32, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("lq,lk", [(1, 1), (113, 203), (203, 113), (257, 64), (1000, 1000)], ids=str)
def test_cuda_backward_matches_reference(dtype, d, causal, deterministic, lq, lk):
    g = torch.Generator(device="cuda").manual_seed(2)
    h, hk = _heads(d)
    q = torch.randn(2, lq, h, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(2, lk, hk, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(2, lk, hk, d, device="cuda", dtype=dtype, generator=g)
    dout = torch.randn(2, lq, h, d, device="cuda", dtype=dtype, generator=g)
    mode = "bottom_right" if causal else "none"
    ours = _grads(lambda q, k, v: tvmflash.flash_attn_func(q, k, v, causal=causal, deterministic=deterministic),
                  (q, k, v), dout)
    ref = _reference_bshd(mode)
    ref64 = _grads(ref, [x.double() for x in (q, k, v)], dout.double())
    low = _grads(ref, (q, k, v), dout)
    for name, a, r, lo in zip(("dq", "dk", "dv"), ours, ref64, low):
        _check_close(name, a, r, lo)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_cuda_backward_deterministic_is_bitwise_reproducible(dtype):
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(2, 777, 8, 128, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(2, 901, 2, 128, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    dout = torch.randn_like(q)
    fn = lambda q, k, v: tvmflash.flash_attn_func(q, k, v, causal=True, deterministic=True)  # noqa: E731
    first = _grads(fn, (q, k, v), dout)
    for _ in range(3):
        for a, b in zip(first, _grads(fn, (q, k, v), dout)):
            assert torch.equal(a, b)


@needs_gpu
@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_cuda_backward_masks_and_top_left_causal(kind, is_causal):
    g = torch.Generator(device="cuda").manual_seed(4)
    q, k, v = (torch.randn(2, 3, n, 64, device="cuda", dtype=torch.float16, generator=g) for n in (77, 130, 130))
    dout = torch.randn_like(q)
    keep = torch.rand(2, 1, 77, 130, device="cuda", generator=g) > 0.3
    keep[..., 5, :] = False  # a fully masked row: zero output, zero gradients
    mask = keep if kind == "bool" else torch.randn(keep.shape, device="cuda", generator=g).half().masked_fill(
        ~keep, float("-inf"))
    ours = _grads(lambda q, k, v: tvmflash.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal),
                  (q, k, v), dout)
    mode = "top_left" if is_causal else "none"
    m64 = mask if kind == "bool" else mask.double()
    ref64 = _grads(lambda q, k, v: attention(q, k, v, causal=mode, mask=m64)[0],
                   [x.double() for x in (q, k, v)], dout.double())
    low = _grads(lambda q, k, v: attention(q, k, v, causal=mode, mask=mask)[0], (q, k, v), dout)
    for name, a, r, lo in zip(("dq", "dk", "dv"), ours, ref64, low):
        _check_close(name, a, r, lo)
    assert torch.equal(ours[0][:, :, 5], torch.zeros_like(ours[0][:, :, 5]))


@needs_gpu
def test_cuda_backward_through_lse():
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(1, 150, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))

    def loss(fn, q, k, v):
        out, lse = fn(q, k, v)
        return (out.double() ** 2).sum() + (lse.double() * torch.linspace(0, 1, lse.shape[-1], device="cuda")).sum()

    def ours(q, k, v):
        out, lse, _ = tvmflash.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        return out, lse

    def ref(q, k, v):
        out, lse = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal="bottom_right")
        return out.transpose(1, 2), lse

    args = [x.detach().requires_grad_() for x in (q, k, v)]
    got = torch.autograd.grad(loss(ours, *args), args)
    args64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want = torch.autograd.grad(loss(ref, *args64), args64)
    argslo = [x.detach().requires_grad_() for x in (q, k, v)]
    low = torch.autograd.grad(loss(ref, *argslo), argslo)
    for name, a, r, lo in zip(("dq", "dk", "dv"), got, want, low):
        _check_close(name, a, r, lo)


@needs_gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_cuda_head_dim_80(deterministic):
    """A head dim whose 16-column tiles do not split evenly over the dQ warps."""
    g = torch.Generator(device="cuda").manual_seed(6)
    q, k, v = (torch.randn(2, n, 4, 80, device="cuda", dtype=torch.float16, generator=g) for n in (150, 190, 190))
    dout = torch.randn_like(q)
    fn = lambda q, k, v: tvmflash.flash_attn_func(q, k, v, causal=True, deterministic=deterministic)  # noqa: E731
    ours = _grads(fn, (q, k, v), dout)
    ref = _reference_bshd("bottom_right")
    ref64 = _grads(ref, [x.double() for x in (q, k, v)], dout.double())
    low = _grads(ref, (q, k, v), dout)
    _check_close("out", fn(q, k, v), ref(*[x.double() for x in (q, k, v)]), ref(q, k, v))
    for name, a, r, lo in zip(("dq", "dk", "dv"), ours, ref64, low):
        _check_close(name, a, r, lo)


# (dtype, head dim, causal, window_size, alibi, softcap, dropout_p) on the CUDA kernels
CUDA_VARIANTS = [(torch.float16, 64, False, (100, 7), False, 0.0, 0.0),
                 (torch.bfloat16, 128, True, (256, -1), True, 0.0, 0.0),
                 (torch.float16, 64, True, (-1, -1), True, 0.0, 0.0),
                 (torch.bfloat16, 128, False, (-1, -1), False, 2.0, 0.0),
                 (torch.float16, 64, True, (-1, -1), True, 5.0, 0.0),
                 (torch.bfloat16, 128, False, (-1, -1), False, 0.0, 0.2),
                 (torch.float16, 64, True, (100, -1), True, 0.0, 0.3),
                 (torch.bfloat16, 64, False, (-1, -1), False, 3.0, 0.1),
                 (torch.bfloat16, 128, True, (-1, -1), False, 50.0, 0.0),  # Gemma 2's cap
                 # softcap on the wgmma backward's 128-query blocks (its factor from P in 16 bits)
                 (torch.float16, 64, True, (-1, -1), False, 4.0, 0.0),
                 # ALiBi without a causal mask: forward tiles on either side of its diagonal take
                 # the split bias, those it crosses the full one (warp-specialized wgmma; mma.sync)
                 (torch.bfloat16, 128, False, (-1, -1), True, 0.0, 0.0),
                 (torch.float16, 96, False, (200, 30), True, 0.0, 0.0)]


def cuda_variant_specs() -> list:
    """The specs of CUDA_VARIANTS (scripts/device_prebuild.py builds them for the device)."""
    from tvmflash.ops import spec_for

    out = []
    for dtype, d, causal, window, alibi, softcap, dropout_p in CUDA_VARIANTS:
        q = torch.empty(1, 1, 1, d, dtype=dtype)
        out.append(spec_for(q, None, "bottom_right" if causal else "none",
                            (window[0], -1 if causal else window[1]), softcap, torch.ones(1) if alibi else None,
                            dropout_p))
    return out


@needs_gpu
@pytest.mark.parametrize("dtype,d,causal,window,alibi,softcap,dropout_p", CUDA_VARIANTS, ids=str)
@pytest.mark.parametrize("lq,lk", [(1, 1), (113, 203), (203, 113), (1000, 1000)], ids=str)
def test_cuda_variants(dtype, d, causal, window, alibi, softcap, dropout_p, lq, lk):
    if dropout_p and lk == 1:
        pytest.skip("one key: dq is exactly 0, the kernels' delta from the rounded O is not (test_dropout.py)")
    g = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(2, lq, 4, d, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(2, lk, 2, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    dout = torch.randn(2, lq, 4, d, device="cuda", dtype=dtype, generator=g)
    slopes = torch.rand(2, 4, device="cuda", generator=g) * 0.3 if alibi else None
    mode = "bottom_right" if causal else "none"
    keep = None
    if dropout_p:
        torch.manual_seed(11)
        keep = tvmflash.flash_attn_func(q, k, v, causal=causal, window_size=window, alibi_slopes=slopes,
                                        softcap=softcap, dropout_p=dropout_p, return_attn_probs=True)[2]
    variant = dict(window=(window[0], 0 if causal else window[1]), alibi_slopes=slopes, softcap=softcap,
                   dropout_p=dropout_p, dropout_keep=keep)

    def ours(q, k, v, deterministic=False):
        torch.manual_seed(11)  # the same dropout mask on every call
        return tvmflash.flash_attn_func(q, k, v, causal=causal, window_size=window, alibi_slopes=slopes,
                                        softcap=softcap, dropout_p=dropout_p, deterministic=deterministic)

    def ref(q, k, v):
        return attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=mode,
                         **variant)[0].transpose(1, 2)
    _check_close("out", ours(q, k, v), ref(*[x.double() for x in (q, k, v)]), ref(q, k, v))
    ref64 = _grads(ref, [x.double() for x in (q, k, v)], dout.double())
    low = _grads(ref, (q, k, v), dout)
    # dropout and softcap (its factor recomputed from P) in both dQ kernels
    for deterministic in (False, True) if dropout_p or softcap else (False,):
        run = lambda q, k, v: ours(q, k, v, deterministic)  # noqa: E731
        for name, a, r, lo in zip(("dq", "dk", "dv"), _grads(run, (q, k, v), dout), ref64, low):
            _check_close(f"{name} (deterministic={deterministic})", a, r, lo)


@needs_gpu
@pytest.mark.parametrize("loop", ["warp-specialized", "lockstep"])
@pytest.mark.parametrize("window", [(256, 0), (1500, 0), (0, 0)], ids=str)
def test_cuda_window_forward_loops(monkeypatch, loop, window):
    """A windowed D=128 module holds both wgmma forward loops and the window's size chooses
    (ops.SHORT_CAUSAL_WALK_KEYS); either loop computes every window: the threshold is forced
    each way here. Lq != Lk, 2 q-heads a kv-head, queries that see a single key."""
    from tvmflash import ops

    monkeypatch.setattr(ops, "SHORT_CAUSAL_WALK_KEYS", 1 << 30 if loop == "lockstep" else -1)
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(2, 777, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, 1900, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    kern = ops._kernels(cuda_variant_specs()[1], q.device)  # bf16 d128 causal window (+ ALiBi)
    ran = []
    for name in ("forward", "forward_short"):  # which of the two the call launches
        monkeypatch.setitem(kern, name, lambda *args, fn=kern[name], name=name: (ran.append(name), fn(*args))[1])
    slopes = torch.rand(2, 4, device="cuda", generator=g) * 0.3
    out, lse, _ = tvmflash.flash_attn_func(q, k, v, causal=True, window_size=window, alibi_slopes=slopes,
                                           return_attn_probs=True)
    assert ran == ["forward_short" if loop == "lockstep" else "forward"]

    def ref(*x):
        return attention(*(t.transpose(1, 2) for t in x), causal="bottom_right", window=window, alibi_slopes=slopes)
    ref64, ref_lse = ref(q.double(), k.double(), v.double())
    _check_close("out", out, ref64.transpose(1, 2), ref(q, k, v)[0].transpose(1, 2))
    assert (lse.double() - ref_lse).abs().max() < 1e-3


def _flex_cases():
    """(name, dtype, head dim, score_mod, mask_mod, block size) on the CUDA kernels, with
    captured tables on the GPU."""
    g = torch.Generator().manual_seed(5)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    slopes = (torch.rand(4, generator=g) * 0.2).to(dev)
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate((300, 500, 1, 223))])
    # per-batch segments, key padding: several row / key values (loaded once per row / key),
    # integer and boolean, in a score_mod and a mask_mod at once (the block mask is made for
    # every batch entry at once: the mask_mod does not depend on b)
    seg = torch.stack([doc, torch.arange(1024) // 200]).to(dev)
    keep = (torch.rand(1024, generator=g) > 0.1).to(dev)
    doc = doc.to(dev)
    return [
        ("alibi score + causal", torch.bfloat16, 128, lambda s, b, h, q, kv: s - slopes[h] * torch.abs(q - kv),
         lambda b, h, q, kv: q >= kv, 128),
        ("softcap score", torch.float16, 64, lambda s, b, h, q, kv: 20 * torch.tanh(s / 20), None, None),
        ("document mask", torch.bfloat16, 64, None, lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv), 128),
        ("sliding window", torch.float16, 128, None, lambda b, h, q, kv: (q >= kv) & (q - kv <= 200), 128),
        # the mma forward: walking the block lists (no wgmma for D 96), and skipping through the
        # tile map (64-blocks do not divide its 128-row tiles)
        ("sliding window d96", torch.float16, 96, None, lambda b, h, q, kv: (q >= kv) & (q - kv <= 200), 128),
        ("alibi + document, 64-blocks", torch.bfloat16, 64, lambda s, b, h, q, kv: s - slopes[h] * torch.abs(q - kv),
         lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv), 64),
        ("segments score + padded documents", torch.float16, 128,
         lambda s, b, h, q, kv: torch.where(seg[b, q] == seg[b, kv], s, s - 1.0),
         lambda b, h, q, kv: (doc[q // 2] <= doc[kv]) & keep[kv] & (q >= kv), 128),
    ]


def cuda_flex_specs() -> list:
    """The specs of _flex_cases (scripts/device_prebuild.py builds them for the device)."""
    return [flex.flex_spec(dtype, d, score_mod, mask_mod, (block, block))
            for _, dtype, d, score_mod, mask_mod, block in _flex_cases()]


@needs_gpu
@pytest.mark.parametrize("case", range(len(_flex_cases())), ids=lambda i: _flex_cases()[i][0])
@pytest.mark.parametrize("lq,lk", [(113, 203), (1024, 1024)], ids=str)
def test_cuda_flex(case, lq, lk):
    _, dtype, d, score_mod, mask_mod, block = _flex_cases()[case]
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(2, 4, lq, d, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(2, 2, lk, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    dout = torch.randn_like(q)
    bm = flex.create_block_mask(mask_mod, None, None, lq, lk, device="cuda", BLOCK_SIZE=block) if mask_mod else None

    def ours(q, k, v):
        return flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True)

    def ref(q, k, v):
        return attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)[0]
    _check_close("out", ours(q, k, v), ref(*[x.double() for x in (q, k, v)]), ref(q, k, v))
    grads = zip(("dq", "dk", "dv"), _grads(ours, (q, k, v), dout),
                _grads(ref, [x.double() for x in (q, k, v)], dout.double()), _grads(ref, (q, k, v), dout))
    for name, a, r, lo in grads:
        _check_close(name, a, r, lo)


@needs_gpu
def test_cuda_flex_skips_empty_tiles():
    """Emptying a q-block of the block mask leaves its rows without keys (out 0, lse -inf, dq 0)
    on the CUDA kernels too: the tiles are skipped, not masked."""
    _, dtype, d, _, mask_mod, block = _flex_cases()[3]  # a built spec: the sliding window
    q, k, v = (torch.randn(1, 2, 384, d, device="cuda", dtype=dtype) for _ in range(3))
    bm = flex.create_block_mask(mask_mod, 1, 2, 384, 384, device="cuda", BLOCK_SIZE=block)
    keep = torch.ones_like(bm.partial)
    keep[:, :, 1] = False  # q-block 1 sees no tile
    bm = flex.BlockMask.from_tiles(bm.partial & keep, bm.full & keep, bm.block_size, bm.seq_lengths, bm.mask_mod)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = flex.flex_attention(*leaves, block_mask=bm, return_lse=True)
    out.backward(torch.randn_like(out))
    assert (lse[:, :, 128:256] == float("-inf")).all() and (out[:, :, 128:256] == 0).all()
    assert lse[:, :, :128].isfinite().all() and (leaves[0].grad[:, :, 128:256] == 0).all()


# packed sequences: (dtype, head dim, causal, window_size, alibi, dropout_p)
CUDA_VARLEN = [(torch.bfloat16, 128, False, (-1, -1), False, 0.0),
               (torch.bfloat16, 128, True, (-1, -1), False, 0.0),
               (torch.float16, 64, True, (100, -1), True, 0.0),
               (torch.float16, 64, False, (-1, -1), False, 0.2),
               (torch.float16, 96, True, (-1, -1), False, 0.0)]  # the mma.sync forward (D not a multiple of 64)
# sequences that straddle the kernels' 64- and 128-row tiles, empty and one-token ones, decode
# and many sequences with runs of empty ones (the per-sequence tiles' binary search). (Not 65
# queries on one key with dropout: that key's dK is a sum of 65 rounding residuals of dS = 0,
# which fp16 O and delta leave at twice the fp16 reference's error.)
CUDA_VARLEN_LENGTHS = [([300, 0, 1, 517, 64], [300, 5, 1, 700, 64]), ([1, 1, 1], [1000, 0, 77]),
                       ([0, 0, 3, 130, 0, 0, 0, 64, 65, 1, 200, 0] * 4, [0, 7, 3, 130, 0, 9, 0, 64, 33, 300, 200, 0] * 4)]


def cuda_varlen_specs() -> list:
    """The specs of CUDA_VARLEN (scripts/device_prebuild.py builds them for the device)."""
    from tvmflash.ops import spec_for

    return [spec_for(torch.empty(1, 1, 1, d, dtype=dtype), None, "bottom_right" if causal else "none",
                     (window[0], -1 if causal else window[1]), 0.0, torch.ones(1) if alibi else None, dropout_p,
                     packed=True)
            for dtype, d, causal, window, alibi, dropout_p in CUDA_VARLEN]


@needs_gpu
@pytest.mark.parametrize("dtype,d,causal,window,alibi,dropout_p", CUDA_VARLEN, ids=str)
@pytest.mark.parametrize("lengths_q,lengths_k", CUDA_VARLEN_LENGTHS, ids=("ragged", "decode", "many"))
@pytest.mark.parametrize("deterministic", [False, True])
def test_cuda_varlen(dtype, d, causal, window, alibi, dropout_p, lengths_q, lengths_k, deterministic):
    from test_varlen import offsets, per_sequence_reference

    g = torch.Generator(device="cuda").manual_seed(4)
    q = torch.randn(sum(lengths_q), 4, d, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(sum(lengths_k), 2, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    dout = torch.randn_like(q)
    slopes = torch.rand(len(lengths_q), 4, device="cuda", generator=g) * 0.3 if alibi else None
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    torch.manual_seed(11)
    out, lse, keep = tvmflash.flash_attn_varlen_func(
        *leaves, offsets(lengths_q, "cuda"), offsets(lengths_k, "cuda"), max(lengths_q), max(lengths_k),
        dropout_p=dropout_p, causal=causal, window_size=window, alibi_slopes=slopes, deterministic=deterministic,
        return_attn_probs=True)
    out.backward(dout)
    variant = dict(window=(window[0], 0 if causal else window[1]), alibi_slopes=slopes)
    refs = [per_sequence_reference(q, k, v, dout, lengths_q, lengths_k, t, causal, keep, dropout_p, **variant)
            for t in (torch.float64, dtype)]
    _check_close("out", out, refs[0][0], refs[1][0])
    fin = refs[0][1].isfinite()
    assert torch.equal(lse.isfinite(), fin) and (lse[fin].double() - refs[0][1][fin]).abs().max() < 1e-3
    for name, a, r, lo in zip(("dq", "dk", "dv"), (x.grad for x in leaves), refs[0][2], refs[1][2]):
        _check_close(f"{name} (deterministic={deterministic})", a, r, lo)


# flash_attn_with_kvcache reading the cache in place: (dtype, head dim, (heads, kv heads), softcap, alibi)
# fp16 d128: the record with the most shared memory; bf16 d96: padded shared-memory rows (the others swizzled)
CUDA_KVCACHE = [(torch.bfloat16, 128, (8, 2), 0.0, False), (torch.float16, 64, (4, 4), 30.0, True),
                (torch.float16, 128, (6, 1), 0.0, False), (torch.bfloat16, 96, (4, 2), 0.0, False),
                (torch.bfloat16, 256, (4, 1), 0.0, False)]  # (256: decode_long's tile fitted to shared memory)


def cuda_kvcache_specs() -> list:
    """The decode specs the kvcache tests use (scripts/device_prebuild.py builds them)."""
    from dataclasses import replace

    from test_kvcache import CASES
    from tvmflash.interface import _check_window
    from tvmflash.ops import spec_for

    return [replace(spec_for(torch.empty(1, 1, 1, d, dtype=dtype), None, "bottom_right" if causal else "none",
                             _check_window(window, causal), softcap, torch.ones(1) if alibi else None), kv_cache=True)
            for dtype, d, _, softcap, alibi in CUDA_KVCACHE for causal, window, _ in CASES]


@needs_gpu
@pytest.mark.parametrize("dtype,d,heads,softcap,alibi", CUDA_KVCACHE, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "paged16", "paged48", "paged256"])
@pytest.mark.parametrize("causal,window,rotary", __import__("test_kvcache").CASES, ids=str)
@pytest.mark.parametrize("lq,new", [(1, 1), (3, 3), (4, 0), (16, 2)])
def test_cuda_kvcache_in_place(dtype, d, heads, softcap, alibi, layout, causal, window, rotary, lq, new):
    from test_kvcache import check_kvcache

    check_kvcache(layout, causal, window, rotary, lq, new, "cuda", dtype, heads, d, softcap, alibi)


@needs_gpu
def test_cuda_kvcache_append_skips_tokens_outside_the_cache():
    """CUDA steps do not check their indices (that would wait for the GPU): a new token at a
    position past the cache, or on a page outside it, is not written, nor is anything else."""
    dt = torch.bfloat16
    k_cache, v_cache = (torch.randn(8, 16, 2, 128, device="cuda", dtype=dt) for _ in range(2))
    before = k_cache.clone(), v_cache.clone()
    table = torch.tensor([[0, 1], [2, 8]], device="cuda", dtype=torch.int32)  # batch 1's second page: none
    lengths = torch.tensor([32, 20], device="cuda", dtype=torch.int32)  # batch 0 full, batch 1 on its second page
    q = torch.randn(2, 1, 4, 128, device="cuda", dtype=dt)
    new = torch.randn(2, 1, 2, 128, device="cuda", dtype=dt)
    cos, sin = torch.ones(40, 64, device="cuda", dtype=dt), torch.zeros(40, 64, device="cuda", dtype=dt)
    tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cos, sin, cache_seqlens=lengths, block_table=table)
    torch.cuda.synchronize()
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


@needs_gpu
@pytest.mark.parametrize("layout", ["contiguous", "paged16", "paged256"])
@pytest.mark.parametrize("num_splits", [0, 1, 7])
def test_cuda_kvcache_long(layout, num_splits):
    """Thousands of keys: many tiles per split, splits that see no key (short sequences); the
    rotary tables in q's dtype (the append kernel `decode_append`; float32 ones take
    `decode_append_f32`, as in test_cuda_kvcache_in_place)."""
    from test_kvcache import check_kvcache

    check_kvcache(layout, True, (-1, -1), "interleaved", 2, 1, "cuda", torch.bfloat16, (8, 2), 128,
                  capacity=2100, lengths=(700, 0, 2000), num_splits=num_splits, table_dtype=torch.bfloat16)


@needs_gpu
@pytest.mark.parametrize("spec,phase", [(AttentionSpec("bfloat16", 128, causal="bottom_right"), "forward"),
                                        (AttentionSpec("bfloat16", 128, causal="bottom_right"), "backward"),
                                        (AttentionSpec("bfloat16", 128, kv_cache=True), "decode"),
                                        (AttentionSpec("bfloat16", 128, kv_cache=True), "decode_long")],
                         ids=["forward", "backward", "decode", "decode_long"])
def test_the_tuners_check_passes_the_shipped_modules(spec, phase):
    """`tvmflash tune` checks each candidate on the GPU (tune.check_candidate) before timing
    it: the records' modules pass (its rejections are tested on the CPU, test_tune.py)."""
    from tvmflash import tune
    from tvmflash.ops import _kernels

    tune.check_candidate(dict(_kernels(spec, torch.device("cuda"))), spec, phase, "cuda")


@needs_gpu
def test_cuda_graph_capture_of_forward_backward_and_decode():
    """A training step (forward + backward) and a decode step captured in CUDA graphs replay
    with new inputs to the same results as eager calls: no host syncs, no allocations outside
    the graph's pool."""
    torch.manual_seed(0)
    dt = torch.bfloat16
    q, k, v, dout = (torch.randn(2, 300, 4, 128, device="cuda", dtype=dt) for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def step():
        out = tvmflash.flash_attn_func(q, k, v, causal=True)
        out.backward(dout)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (module loads, workspace) outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    for x in (q, k, v):
        x.grad = None
    with torch.cuda.graph(graph):
        static_out = step()
    with torch.no_grad():
        for x in (q, k, v, dout):
            x.copy_(torch.randn_like(x))
    graph.replay()
    eager = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    ref = tvmflash.flash_attn_func(*eager, causal=True)
    ref.backward(dout)
    assert torch.equal(static_out, ref)
    for x, e in zip((q, k, v), eager):  # dQ accumulates atomically: equal up to summation order
        assert (x.grad.float() - e.grad.float()).abs().max() < 2e-2

    # decode: one query per sequence against a paged cache, lengths in a device tensor
    pages = torch.randperm(64, device="cuda", dtype=torch.int32).view(4, 16)
    k_cache, v_cache = (torch.randn(64, 16, 2, 128, device="cuda", dtype=dt) for _ in range(2))
    lengths = torch.tensor([5, 100, 256, 17], device="cuda", dtype=torch.int32)
    query = torch.randn(4, 1, 8, 128, device="cuda", dtype=dt)

    def decode():
        return tvmflash.flash_attn_with_kvcache(query, k_cache, v_cache, cache_seqlens=lengths, block_table=pages)

    with torch.cuda.stream(side):
        decode()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_decoded = decode()
    query.copy_(torch.randn_like(query))
    lengths.copy_(torch.tensor([200, 1, 33, 250], device="cuda", dtype=torch.int32))
    graph.replay()
    assert torch.equal(static_decoded, decode())


@needs_gpu
def test_cuda_compiled_decode_step():
    """A decode step (append into a paged cache, then attention) compiled whole, fullgraph,
    with CUDA graphs (mode="reduce-overhead"; the caches marked static, as a model's buffers
    are): three steps with new tokens and lengths give what eager calls on a copy give."""
    import torch._dynamo

    torch._dynamo.reset()
    dt = torch.bfloat16
    pages = torch.randperm(64, device="cuda", dtype=torch.int32).view(4, 16)
    k_cache, v_cache = (torch.randn(64, 16, 2, 128, device="cuda", dtype=dt) for _ in range(2))
    eager_k, eager_v = k_cache.clone(), v_cache.clone()
    for cache in (k_cache, v_cache):
        torch._dynamo.mark_static_address(cache)
    lengths = torch.tensor([5, 100, 250, 17], device="cuda", dtype=torch.int32)

    def step(query, k, v, k_cache, v_cache, lengths):
        return tvmflash.flash_attn_with_kvcache(query, k_cache, v_cache, k, v, cache_seqlens=lengths,
                                                block_table=pages)

    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        query = torch.randn(4, 1, 8, 128, device="cuda", dtype=dt)
        k, v = (torch.randn(4, 1, 2, 128, device="cuda", dtype=dt) for _ in range(2))
        out = compiled(query, k, v, k_cache, v_cache, lengths).clone()
        assert torch.equal(out, step(query, k, v, eager_k, eager_v, lengths))
        assert torch.equal(k_cache, eager_k) and torch.equal(v_cache, eager_v)
        lengths += 1


@needs_gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_cuda_compiled_attention(mode):
    """flash_attn_func and SDPA compiled with fullgraph=True on CUDA (the tensors' addresses
    are checked by the operator when the graph runs; with mode="reduce-overhead" in CUDA
    graphs): forward and gradients as eager."""
    import torch._dynamo

    torch._dynamo.reset()

    def block(q, k, v):
        a = tvmflash.flash_attn_func(q * 2, k, v, causal=True)
        return tvmflash.scaled_dot_product_attention(a.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                     is_causal=True).relu()

    compiled = torch.compile(block, fullgraph=True, mode=mode)
    q, k, v, dout = (torch.randn(2, 300, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    results = []
    for call in (block, compiled, compiled):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = call(*leaves)
        out.backward(dout.transpose(1, 2))
        results.append([out.detach().clone(), *(x.grad for x in leaves)])
    for eager, graphed in zip(results[0], results[2]):  # dQ accumulates atomically: equal up to summation order
        assert (eager.float() - graphed.float()).abs().max() < 2e-2


@needs_gpu
def test_cuda_backward_takes_a_misaligned_output_gradient():
    """A gradient of the output that starts 2 bytes past a 16-byte boundary (a contiguous view
    at an odd offset) gives the gradients an aligned copy gives."""
    q, k, v = (torch.randn(1, 130, 2, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    out = tvmflash.flash_attn_func(q, k, v, causal=True)
    flat = torch.randn(out.numel() + 1, device="cuda", dtype=torch.float16)
    dout = flat[1:].view(out.shape)
    assert dout.data_ptr() % 16 and dout.is_contiguous()
    grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    aligned = torch.autograd.grad(out, (q, k, v), dout.clone())
    for g, a in zip(grads, aligned):  # dQ accumulates atomically: equal up to summation order
        assert (g.float() - a.float()).abs().max() < 1e-2


@needs_gpu
def test_cuda_compiled_varlen_step():
    """flash_attn_varlen_func compiled with fullgraph=True and mode="reduce-overhead": the
    offsets' read (a sync) stays out of the CUDA graphs; forward and gradients as eager, for
    two batches of other lengths."""
    import torch._dynamo

    torch._dynamo.reset()
    compiled = torch.compile(tvmflash.flash_attn_varlen_func, fullgraph=True, mode="reduce-overhead")
    for lengths in ([100, 3, 257], [7, 300, 53]):
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        q, k, v, dout = (torch.randn(sum(lengths), 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        results = []
        for call in (tvmflash.flash_attn_varlen_func, compiled):
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            out = call(*leaves, cu, cu, max(lengths), max(lengths), causal=True)
            out.backward(dout)
            results.append([out.detach().clone(), *(x.grad for x in leaves)])
        for eager, graphed in zip(*results):  # dQ accumulates atomically: equal up to summation order
            assert (eager.float() - graphed.float()).abs().max() < 2e-2


@needs_gpu
def test_cuda_tensors_above_2_31_elements():
    """q/k/v/out of 2^31 + 2^17 elements (one head of 2^24 + 1024 positions, D = 128, a
    64-key causal window so the work stays small): the rows past element 2^31 attend, and
    their gradients flow, as the same problem on a slice of the last positions."""
    length, d, w, tail = 2 ** 24 + 1024, 128, 63, 256
    if torch.cuda.get_device_properties(0).total_memory < 60 * 2 ** 30:
        pytest.skip("needs ~50 GB of GPU memory")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, length, 1, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    assert q.numel() > 2 ** 31
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = tvmflash.flash_attn_func(q, k, v, causal=True, window_size=(w, 0))
    dout = torch.zeros_like(out)
    dout[:, -tail:] = torch.randn(1, tail, 1, d, device="cuda", dtype=torch.bfloat16, generator=g)
    out.backward(dout)
    # the last `tail` queries see keys [L - tail - w, L): the same problem on that slice
    sq, sk, sv = (x.detach()[:, s:].clone().requires_grad_()
                  for x, s in ((q, length - tail), (k, length - tail - w), (v, length - tail - w)))
    ref = tvmflash.flash_attn_func(sq, sk, sv, causal=True, window_size=(w, 0))
    ref.backward(dout[:, -tail:])
    assert (out[:, -tail:].float() - ref.float()).abs().max() < 1e-2  # tiles cut elsewhere: sums reorder
    assert (q.grad[:, -tail:].float() - sq.grad.float()).abs().max() < 1e-2
    # keys in the last `tail` positions get gradients only from the slice's queries
    assert (k.grad[:, -tail:].float() - sk.grad[:, w:].float()).abs().max() < 1e-2
    assert (v.grad[:, -tail:].float() - sv.grad[:, w:].float()).abs().max() < 1e-2
    del q, k, v, out, dout


RUNTIME_ONLY_CUDA = """
import torch, tvmflash
from tvmflash import build
assert not build.has_compiler()
q, k, v, dout = (torch.randn(2, 333, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
leaves = [x.clone().requires_grad_() for x in (q, k, v)]
out = tvmflash.flash_attn_func(*leaves, causal=True)
out.backward(dout)
ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
ref = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in ref_leaves), is_causal=True)
ref.transpose(1, 2).backward(dout)
assert (out - ref.transpose(1, 2)).abs().max() < 2e-2
assert all((a.grad - b.grad).abs().max() < 5e-2 for a, b in zip(leaves, ref_leaves))
print("ok")
"""


@needs_gpu
def test_cuda_runs_exported_modules_with_the_runtime_only(tmp_path):
    """Modules exported on another machine (`tvmflash export --target cuda`, directory in
    TVMFLASH_TEST_EXPORTED) run in a process with TVM's runtime only and an empty cache."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    exported = os.environ.get("TVMFLASH_TEST_EXPORTED")
    if not exported:
        pytest.skip("TVMFLASH_TEST_EXPORTED names no exported directory")
    env = {**os.environ, "TVM_USE_RUNTIME_LIB": "1", "TVMFLASH_EXPORTED": exported,
           "TVMFLASH_CACHE_DIR": str(tmp_path / "empty")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", RUNTIME_ONLY_CUDA], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
    assert not list((tmp_path / "empty").glob("*.so"))


@needs_gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", ["nan in a query", "nan in a key", "nan in a value", "inf in a value",
                                  "inf in a query", "-inf in a key"])
def test_cuda_nonfinite_inputs_propagate_like_float64_math(case, causal):
    from test_attention import check_nonfinite_inputs

    check_nonfinite_inputs("cuda", torch.bfloat16, case, causal, head_dim=64)
