"""The AVX512 / AMX path (schedules/avx512.py, amx_forward.py, amx_backward.py).

Build checks (`test_asm_*`, they need TVM's compiler) run everywhere, CI has no AVX512: the
sapphirerapids modules compile and their assembly holds what the schedule intends (zmm FMAs; AMX
tile products for the bf16 forward and backward; `vdpbf16ps` for them on avx512_bf16 CPUs
without AMX).
The correctness matrix runs those modules against the float64 reference, on CPUs with AVX512 +
AMX only (skipped elsewhere); TVMFLASH_CPU_TARGET=avx512 pins the path whatever `auto` picks.
The bf16 tests also run the kernels' pair-dot unit (`bf16_unit` "avx512_bf16":
TVMFLASH_CPU_TARGET=avx512_bf16, cooperlake modules) on CPUs with avx512_bf16.
"""
import functools
import re

import pytest
import torch

import tvmflash
from tvmflash import AttentionSpec
from tvmflash.build import has_compiler
from tvmflash.cpu import cpu_flags, runs_avx512_amx
from test_attention import DTYPES, backward_plan, check_against_reference, flash_run, make, masks
from test_kvcache import check_kvcache
from test_variants import alibi, flash_variant_run

SPR = {"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 16}


@functools.lru_cache(maxsize=None)
def spr_asm(spec: AttentionSpec) -> dict:
    """Assembly of each kernel of `spec`'s sapphirerapids module (built once per run)."""
    from tvmflash.build import build_module

    asm = build_module(spec, SPR).mod.inspect_source("asm")
    funcs, name = {}, None
    for line in asm.splitlines():
        if line.endswith("_compute_:"):  # a kernel's body (TVM outlines it from the packed wrapper)
            name = line[:-len("_compute_:")]
        elif name:
            funcs[name] = funcs.get(name, "") + line + "\n"
    return funcs


def test_asm_bf16_forward_runs_on_amx_tiles():
    asm = spr_asm(AttentionSpec("bfloat16", 64, causal="bottom_right"))
    for name in ("forward", "forward_long"):  # q-blocks for short and for long keys
        fwd = asm[name]
        assert "ldtilecfg" in fwd and "tilerelease" in fwd
        assert fwd.count("tdpbf16ps") >= 8 and fwd.count("tileloadd") >= 8 and "tilestored" in fwd
        assert "zmm" in fwd and "vfmadd" in fwd  # softmax (fast exp) on AVX512
        assert "expf" not in fwd  # fast exp, no libm calls
        # exp2: x - floor(x) by vreduceps, 2^floor(x) by vscalefps (amx.exp2_16)
        assert "vreduceps" in fwd and "vscalefps" in fwd
        # O's rows from O^T's and Q^T's pairs from Q's 16 x 16 blocks by two-source shuffles
        # (amx.transpose_16), not gathers; 1 / l a division a row (up to 256 rows a q-block, 16
        # a vector), not one an output (64 dims x 64 or 256 rows)
        assert "vpermt2" in fwd and "gather" not in fwd and fwd.count("vdivps") <= 16


def test_asm_fp32_high_precision_forward_runs_on_amx_tiles():
    """fp32 modules for AMX hold the bf16x3 forward and backward (torch's float32 matmul
    precision "high"): their kernels on tiles, P / dS split with the bf16 conversion
    (`vcvtne2ps2bf16`), as in their packs, which gather the transposed operands' columns."""
    asm = spr_asm(AttentionSpec("float32", 128, causal="bottom_right"))
    for name in ("forward_bf16x3", "forward_bf16x3_long"):
        fwd = asm[name]
        assert "ldtilecfg" in fwd and fwd.count("tdpbf16ps") >= 8 and "vcvtne2ps2bf16" in fwd
    for name in ("backward_bf16x3_fused", "backward_bf16x3_dkdv", "backward_bf16x3_dq"):
        assert asm[name].count("tdpbf16ps") >= 8 and "vcvtne2ps2bf16" in asm[name]
    for name in ("forward_pack_bf16x3", "backward_pack_bf16x3"):
        pack = asm[name]
        assert "vcvtne2ps2bf16" in pack and ("vgatherdps" in pack or "vpgatherdd" in pack)
    assert "tdpbf16ps" not in asm["forward"]  # the default precision's forward: fp32 FMAs
    assert "vfmadd" in asm["forward"]


def test_asm_amx_transposing_packs_move_words():
    """The packs that transpose move 32-bit words, not 16-bit elements one by one: the
    forward's V^T by shuffles of 16 x 16 word blocks (amx.word_block_columns), the backward's
    K^T and Q / dO pairs by gathers (`vpgatherdd`, amx.word_column)."""
    asm = spr_asm(AttentionSpec("bfloat16", 64, causal="bottom_right"))
    for name in ("forward_pack", "forward_pack_vt"):
        assert "vpermt2" in asm[name] and "gather" not in asm[name] and "vpinsrw" not in asm[name], name
    assert "vpgatherdd" in asm["backward_pack"] and "vpinsrw" not in asm["backward_pack"]


def test_asm_bf16_backward_runs_on_amx_tiles():
    asm = spr_asm(AttentionSpec("bfloat16", 64, causal="bottom_right"))
    # tile products per 32 x 32 block: fused 5 GEMMs, dK/dV 4, dQ 3 (S^T, dP^T, dQ^T)
    for name, gemms in (("backward_fused", 5), ("backward_dkdv", 4), ("backward_dq", 3)):
        body = asm[name]
        assert "ldtilecfg" in body and "tilerelease" in body, name
        assert body.count("tdpbf16ps") >= 4 * gemms, name
        assert "vfmadd" in body and "expf" not in body, name  # fast exp on AVX512


def test_asm_bf16_dropout_runs_on_amx_tiles():
    """Dropout keeps the bf16 forward and backward on AMX tiles, its Philox words computed in
    vectors (vpmuludq: 32 x 32 -> 64-bit products of 8 calls at once)."""
    asm = spr_asm(AttentionSpec("bfloat16", 64, causal="bottom_right", variants=("dropout",)))
    for name in ("forward", "backward_fused", "backward_dkdv", "backward_dq"):
        assert asm[name].count("tdpbf16ps") >= 8 and "vpmuludq" in asm[name], name


def test_asm_bf16_backward_keeps_modified_scores_in_vectors():
    """P and dS of the AMX backward are 16-lane loops in the kernel: left to LLVM's vectorizer
    they ran scalar where a modifier indexes scores (ALiBi, windows; ~200-300 scalar float ops
    a kernel, 4-10x the plain backward's time on the Xeon)."""
    asm = spr_asm(AttentionSpec("bfloat16", 64, causal="bottom_right", variants=("alibi", "window")))
    scalar = re.compile(r"^\s+v(?:add|sub|mul|div|max|min|ucomi|f[n]?m(?:add|sub)\d{3}|cvtsi2)ss\s", re.M)
    for name in ("backward_fused", "backward_dkdv", "backward_dq"):
        assert len(scalar.findall(asm[name])) <= 16, name
        assert asm[name].count("vfmadd213ps\t%zmm") + asm[name].count("vfmadd231ps\t%zmm") >= 8, name


def test_asm_flex_capture_backward_builds_for_amx():
    """A score_mod that gathers from a captured table at q - kv (relative bias) builds for the
    AMX backward: TVM's TIR CSE let-bound its 128-lane gather index and its bound analysis
    aborted the build (CI on an AMX machine); such modules now leave CSE to LLVM."""
    from tvmflash.build import build_module
    from tvmflash.flex import trace

    bias = torch.zeros(4, 600)
    program, _ = trace(lambda s, b, h, q, kv: s + bias[h, q - kv + 300], "score")
    spec = AttentionSpec("bfloat16", 64, flex=(("score", program, None),))
    asm = build_module(spec, SPR, only=("backward_dkdv", "backward_dq")).mod.inspect_source("asm")
    assert asm.count("tdpbf16ps") >= 4 * (4 + 3)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_asm_fp32_and_fp16_run_on_zmm_fmas(dtype):
    asm = spr_asm(AttentionSpec(dtype, 64))
    for name in ("forward", "backward_dkdv", "backward_dq"):
        assert asm[name].count("vfmadd231ps\t%zmm") + asm[name].count("vfmadd213ps\t%zmm") > 20, name
        assert "tdpbf16ps" not in asm[name]


def test_asm_decode_prefetches_rows_on_fmas_and_tiles():
    """The bf16 cache decode kernels prefetch their K / V rows into L2 (prefetcht1: a kv-head's
    rows lie at a stride the hardware prefetchers do not follow); the 4-row and one-row kernels
    compute on zmm FMAs, the kernels for more rows a kv-head (`*_tiles`, also the dense
    split-KV forward's) on AMX tiles."""
    from dataclasses import replace

    asm = spr_asm(replace(AttentionSpec("bfloat16", 128), kv_cache=True))
    for name in ("decode", "decode_tiles"):
        assert asm[name].count("prefetcht1") >= 8, name
    assert asm["decode"].count("vfmadd231ps\t%zmm") >= 32 and "dpbf16ps" not in asm["decode"]
    assert asm["decode_row"].count("vfmadd231ps\t%zmm") >= 8 and "dpbf16ps" not in asm["decode_row"]
    assert asm["decode_tiles"].count("tdpbf16ps") >= 8 and "vpermt2w" in asm["decode_tiles"]
    assert spr_asm(AttentionSpec("bfloat16", 64, causal="bottom_right"))["forward_split_tiles"].count("tdpbf16ps") >= 4


def test_asm_bf16_without_amx_takes_pair_dots():
    """On avx512_bf16 CPUs without AMX (Zen 4 here; schedules/avx512.BF16_DOT_CPUS) the bf16
    forward and backward are the AMX kernels with each tile product on `vdpbf16ps` register
    blocks (amx.PAIR_DOTS: 16 accumulators, A's pairs broadcast from memory); no tile code."""
    from tvmflash.build import build_module

    asm = build_module(AttentionSpec("bfloat16", 64, causal="bottom_right"),
                       {"kind": "llvm", "mcpu": "znver4"}).mod.inspect_source("asm")
    assert "tdpbf16ps" not in asm and "ldtilecfg" not in asm and "tilerelease" not in asm
    bodies = {name: asm.split(f"\n{name}_compute_:", 1)[1].split("_compute_:", 1)[0]
              for name in ("forward", "forward_long", "backward_fused", "backward_dkdv", "backward_dq")}
    # a register block's 16 products per pair of the reduction, at least, per GEMM
    for name, gemms in (("forward", 2), ("forward_long", 2), ("backward_fused", 5), ("backward_dkdv", 4),
                        ("backward_dq", 3)):
        assert bodies[name].count("vdpbf16ps") >= 16 * gemms, name
        assert "vscalefps" in bodies[name] or name.startswith("backward"), name
    assert re.search(r"vdpbf16ps\s+(?:-?0x[0-9a-f]+)?\(%\w+(?:,%\w+,\d)?\)\{1to16\}", asm) or \
        "vbroadcastss" in bodies["forward"]  # A's pair broadcast (embedded or by one load)


def test_asm_zen5_decode_takes_bf16_pair_products():
    """On Zen 5 (schedules/avx512.PAIR_DOT_CPUS) the 4-row and one-row decode kernels take bf16
    pairs on `vdpbf16ps` (V's rows of two keys interleaved by `vpermt2w`, P packed by
    `vcvtne2ps2bf16`); no AMX."""
    from dataclasses import replace

    from tvmflash.build import build_module

    lib = build_module(replace(AttentionSpec("bfloat16", 128), kv_cache=True), {"kind": "llvm", "mcpu": "znver5"})
    asm = lib.mod.inspect_source("asm")
    assert "tdpbf16ps" not in asm and "ldtilecfg" not in asm
    for name, products in (("decode", 32), ("decode_row", 8)):  # 16 a key (4 rows), 4 (one row) at least
        body = asm.split(f"{name}_compute_:", 1)[1].split("_compute_:", 1)[0]
        assert body.count("vdpbf16ps") >= products and "vpermt2w" in body and "vcvtne2ps2bf16" in body, name


needs_amx = pytest.mark.skipif(not runs_avx512_amx(), reason="CPU lacks AVX512 + AMX (or the OS denies AMX)")
# the bf16 kernels' matrix units: AMX tiles (sapphirerapids modules) and avx512_bf16 pair dots
# (cooperlake modules, which also run on AMX CPUs; scripts/device_prebuild_cpu.py builds only the
# AMX modules, so where TVM is runtime only an AMX CPU checks just its own unit)
PAIR_DOTS_RUN = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= cpu_flags() and (
    has_compiler() or not runs_avx512_amx())
needs_pair_dots = pytest.mark.skipif(not PAIR_DOTS_RUN,
                                     reason="CPU lacks AVX512 + avx512_bf16 (or TVM is runtime only on an AMX CPU)")
BF16_UNITS = [pytest.param("avx512", id="amx", marks=needs_amx),
              pytest.param("avx512_bf16", id="pair_dots", marks=needs_pair_dots)]


@pytest.fixture(params=BF16_UNITS)
def bf16_unit(request, monkeypatch):
    """Runs a bf16 test on each matrix unit this CPU has (TVMFLASH_CPU_TARGET)."""
    monkeypatch.setenv("TVMFLASH_CPU_TARGET", request.param)
    return request.param


@pytest.fixture(autouse=True)
def avx512_target(monkeypatch):
    monkeypatch.setenv("TVMFLASH_CPU_TARGET", "avx512")


SHAPES = [(1, 1), (17, 17), (113, 203), (203, 113), (257, 64), (300, 300)]
# (dtype, head_dim, causal): bf16 with D % 32 == 0 takes the AMX forward, the rest zmm FMAs
SPECS = [("bf16", 64, False), ("bf16", 64, True), ("bf16", 128, True), ("bf16", 80, False),
         ("fp16", 64, True), ("fp32", 64, False), ("fp32", 128, True)]


@needs_amx
@pytest.mark.parametrize("dtype,d,causal", SPECS, ids=lambda x: str(x))
@pytest.mark.parametrize("lq,lk", SHAPES, ids=lambda x: str(x))
def test_matrix(dtype, d, causal, lq, lk):
    check_matrix_case(dtype, d, causal, lq, lk)


@needs_pair_dots
@pytest.mark.parametrize("dtype,d,causal", [s for s in SPECS if s[0] == "bf16" and s[1] % 32 == 0], ids=str)
@pytest.mark.parametrize("lq,lk", SHAPES, ids=lambda x: str(x))
def test_matrix_pair_dots(dtype, d, causal, lq, lk, monkeypatch):
    """The bf16 kernels on avx512_bf16 pair dots (test_matrix runs their AMX unit)."""
    monkeypatch.setenv("TVMFLASH_CPU_TARGET", "avx512_bf16")
    check_matrix_case(dtype, d, causal, lq, lk)


def check_matrix_case(dtype, d, causal, lq, lk):
    h, hk = [(4, 2), (6, 1), (3, 3)][(lq + d) % 3]
    q, k, v, dout = make(2, h, hk, lq, lk, d, DTYPES[dtype])
    check_against_reference(q, k, v, dout, flash_run(causal), causal="bottom_right" if causal else "none")


MASK_CASES = [("bool", "bf16", True), ("additive", "bf16", False), ("bool", "fp32", False)]


@needs_amx
@pytest.mark.parametrize("kind,dtype,causal", MASK_CASES, ids=lambda x: str(x))
def test_masks(kind, dtype, causal):
    b, h, lq, lk = 2, 3, 113, 203
    q, k, v, dout = make(b, h, h, lq, lk, 64, DTYPES[dtype])
    for mask in masks(kind, b, h, lq, lk, DTYPES[dtype]):
        def run(q, k, v):
            out = tvmflash.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
            _, lse = torch.ops.tvmflash.attention_forward(q, k, v, mask, 64 ** -0.5,
                                                          "top_left" if causal else "none")
            return out, lse
        check_against_reference(q, k, v, dout, run, causal="top_left" if causal else "none", mask=mask)


def test_decode_and_strided_inputs(bf16_unit):
    """Lq = 1 against a long cache; q/k/v as strided views of packed tensors (K/V are packed
    by the bf16 kernels' packs, never copied by the caller); both matrix units."""
    g = torch.Generator().manual_seed(5)
    kv = torch.randn(2, 1000, 2, 4, 128, generator=g).bfloat16()
    k, v = kv.unbind(2)
    q = torch.randn(2, 1, 8, 128, generator=g).bfloat16()
    dout = torch.randn(2, 1, 8, 128, generator=g).bfloat16()
    t = lambda x: x.transpose(1, 2)
    check_against_reference(t(q), t(k), t(v), t(dout), flash_run(True), causal="bottom_right")


def test_bf16_path_is_taken(bf16_unit):
    from tvmflash import build
    from tvmflash.ops import _kernels

    target = build.cpu_target()
    assert target == {"avx512": build.AVX512_TARGET, "avx512_bf16": build.AVX512_BF16_TARGET}[bf16_unit]
    kernels = _kernels(AttentionSpec("bfloat16", 64), torch.device("cpu"))
    assert "forward_pack" in kernels and "backward_pack" in kernels and "forward_long" in kernels


@pytest.mark.skipif(not has_compiler(), reason="imports the schedules: needs TVM's compiler, not its runtime")
def test_zen_hosts_take_pair_dots():
    """Zen 4 / 5 host targets (auto on those CPUs) take the pair-dot unit; AVX2 hosts neither;
    TVMFLASH_CPU_TARGET's avx512 / avx512_bf16 targets tiles / pair dots."""
    from tvmflash import build
    from tvmflash.schedules.amx import PAIR_DOTS, TILES
    from tvmflash.schedules.avx512 import bf16_unit

    assert bf16_unit(build.AVX512_TARGET) is TILES and bf16_unit(build.AVX512_BF16_TARGET) is PAIR_DOTS
    assert bf16_unit({"kind": "llvm", "mcpu": "znver5"}) is PAIR_DOTS
    assert bf16_unit({"kind": "llvm", "mcpu": "znver4"}) is PAIR_DOTS
    assert bf16_unit({"kind": "llvm", "mcpu": "emeraldrapids"}) is TILES
    assert bf16_unit({"kind": "llvm", "mcpu": "znver3"}) is None
    # Intel's vdpbf16ps issues at half the FMAs' rate: Cooper Lake keeps the FMA kernels unless
    # the target names the feature (TVMFLASH_CPU_TARGET=avx512_bf16)
    assert bf16_unit({"kind": "llvm", "mcpu": "cooperlake"}) is None
    assert bf16_unit({"kind": "llvm", "mcpu": "cooperlake", "mattr": ["+avx512bf16"]}) is PAIR_DOTS


def test_bf16_forward_for_long_keys(bf16_unit):
    """Keys whose K and V^T packs pass AMX_LONG_KV_BYTES run `forward_long` (q-blocks of
    long_block_q rows) when there are AMX_LONG_MIN_QUERIES queries: GQA, causal with Lq != Lk,
    a partial last q-block and kv block."""
    from tvmflash import ops
    from tvmflash.schedules.avx512 import AMX_KV_PAD, AMX_LONG_KV_BYTES, AMX_LONG_MIN_QUERIES

    q, k, v, dout = make(1, 4, 2, 300, 2100, 128, torch.bfloat16)
    kernels = ops._kernels(AttentionSpec("bfloat16", 128, causal="bottom_right"), torch.device("cpu"))
    assert 2 * ops._amx_padded(2100, AMX_KV_PAD) * 128 * 2 >= AMX_LONG_KV_BYTES and q.shape[2] >= AMX_LONG_MIN_QUERIES
    assert ops._forward_kernel_name(kernels, q, k) == "forward_long"
    assert ops._forward_kernel_name(kernels, q, k[:, :, :1000]) == "forward"  # short keys
    assert ops._forward_kernel_name(kernels, q[:, :, :40], k) == "forward"  # few queries
    check_against_reference(q, k, v, dout, flash_run(True), causal="bottom_right")


def test_long_keys_take_tall_q_blocks():
    """`forward_long` runs where a kv-head's K and V^T packs reach AMX_LONG_KV_BYTES (L = 2048
    at D = 128, 4096 at D = 64) and there are AMX_LONG_MIN_QUERIES queries (no module is built:
    the choice is the dispatch's)."""
    from tvmflash import ops

    kernels = {"forward": None, "forward_long": None}
    q = k = torch.empty(1, 1, 2048, 128, dtype=torch.bfloat16)
    assert ops._forward_kernel_name(kernels, q, k) == "forward_long"
    assert ops._forward_kernel_name(kernels, q, k[:, :, :1024]) == "forward"
    assert ops._forward_kernel_name(kernels, q, k[..., :64]) == "forward"  # D = 64: 512 KiB
    assert ops._forward_kernel_name(kernels, q[:, :, :255], k) == "forward"


def test_bf16_forward_reads_whole_keys_in_place(bf16_unit):
    """Keys that fill whole padded lengths (multiples of AMX_KV_PAD) are not copied: the
    forward's tile loads read K where it lies (here in flash-attn's (B, L, H, D) storage, rows
    H * D apart), only V^T is packed; both forwards, GQA, causal with Lq != Lk."""
    from tvmflash import ops
    from tvmflash.schedules.avx512 import AMX_KV_PAD

    kernels = ops._kernels(AttentionSpec("bfloat16", 128, causal="bottom_right"), torch.device("cpu"))
    for lq, lk in ((77, 2 * AMX_KV_PAD), (300, 9 * AMX_KV_PAD)):
        q, k, v, dout = (x.transpose(1, 2).contiguous().transpose(1, 2)
                         for x in make(2, 4, 2, lq, lk, 128, torch.bfloat16))
        assert ops._amx_packs(kernels, k, v)[0] is k
        assert ops._amx_packs(kernels, k[:, :, 1:], v[:, :, 1:])[0].stride(2) == 128  # padded: packed
        assert ops._forward_kernel_name(kernels, q, k) == ("forward" if lq < 256 else "forward_long")
        check_against_reference(q, k, v, dout, flash_run(True), causal="bottom_right")
    # 16 heads of 128: rows 4 KB apart, a K tile's 16 rows in one L1 set: copied
    q, k, v, dout = (x.transpose(1, 2).contiguous().transpose(1, 2)
                     for x in make(1, 16, 16, 100, 2 * AMX_KV_PAD, 128, torch.bfloat16))
    kp = ops._amx_packs(kernels, k, v)[0]
    assert kp is not k and kp.stride(2) == 128 and torch.equal(kp, k)
    check_against_reference(q, k, v, dout, flash_run(True), causal="bottom_right")


@pytest.fixture
def precision_high():
    """torch.set_float32_matmul_precision("high") for one test: fp32 forwards on the bf16x3
    kernel where the module has it."""
    from tvmflash.bench import float32_matmul_precision

    with float32_matmul_precision("high"):
        yield


# the bf16x3 forward's error budget (absolute, on outputs and lse of unit-variance inputs): its
# products carry ~17 mantissa bits (measured 2e-6 .. 3e-5 here), bf16's 8 (5e-3 .. 2e-2 on these
# shapes: a forward that dropped the lo terms would fail), fp32 FMAs' 24 (1e-7 .. 1e-6)
HIGH_BUDGET = 2e-4


def check_high_precision(q, k, v, dout, run, monkeypatch, causal="none", mask=None, **variant):
    """An fp32 call under precision "high" takes the bf16x3 forward and backward (their packs
    are called; both backward plans) and matches the float64 reference within HIGH_BUDGET
    (out, lse) and, relative to their size, 2 HIGH_BUDGET (gradients)."""
    from tvmflash import ops
    from tvmflash.reference import attention

    families = []
    real_forward_packs, real_backward_packs = ops._bf16x3_packs, ops._amx_backward_packs
    monkeypatch.setattr(ops, "_bf16x3_packs", lambda *a: families.append("forward") or real_forward_packs(*a))
    monkeypatch.setattr(ops, "_amx_backward_packs", lambda *a: families.append(a[-1]) or real_backward_packs(*a))
    xs = [x.detach().double().requires_grad_() for x in (q, k, v)]
    o64, l64 = attention(*xs, causal=causal, mask=mask, **variant)
    o64.backward(dout.double())
    for plan in ("fused", "split"):
        families.clear()
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        out, lse = run(*leaves)
        with backward_plan(plan):
            out.backward(dout)
        assert "forward" in families and families[-1] == "backward_bf16x3" and "backward" not in families, families
        assert (out.double() - o64).abs().max().item() <= HIGH_BUDGET
        assert torch.equal(lse.isinf(), l64.isinf())
        fin = ~l64.isinf()
        assert not fin.any() or (lse.double()[fin] - l64[fin]).abs().max().item() <= HIGH_BUDGET
        for name, ours, ref in zip(("dq", "dk", "dv"), (x.grad for x in leaves), (x.grad for x in xs)):
            err = (ours.double() - ref).abs().max().item()
            assert err <= 2 * HIGH_BUDGET * (1 + ref.abs().max().item()), f"{name} ({plan}): {err:.3g}"


@pytest.mark.parametrize("d,causal", [(64, False), (128, True)], ids=str)
@pytest.mark.parametrize("lq,lk", [s for s in SHAPES if s[0] > 16] + [(300, 4100)], ids=str)
def test_fp32_high_precision_forward(d, causal, lq, lk, bf16_unit, precision_high, monkeypatch):
    """fp32 under torch's float32 matmul precision "high": the bf16x3 forward and backward
    (schedules/amx_forward.py, amx_backward.py on fp32 specs) on both matrix units; GQA,
    strided (B, L, H, D) views, causal with Lq != Lk and fully masked rows, 300 x 4100 on
    `forward_bf16x3_long`. (Decode-like
    calls, Lq <= host.SPLIT_MAX_Q, keep the split-KV FMA kernels: memory-bound.)"""
    h, hk = [(4, 2), (6, 1), (3, 3)][(lq + d) % 3]
    from tvmflash import ops

    q, k, v, dout = make(2, h, hk, lq, lk, d, torch.float32, seed=lq * lk)
    kernels = ops._kernels(AttentionSpec("float32", d, causal="bottom_right" if causal else "none"), torch.device("cpu"))
    long_keys = ops._forward_kernel_name(kernels, q, k, family="forward_bf16x3") == "forward_bf16x3_long"
    assert long_keys == (lk > 4096)
    check_high_precision(q, k, v, dout, flash_run(causal), monkeypatch, causal="bottom_right" if causal else "none")


# the spec of test_fp32_high_precision_mask_and_variants' variants (scripts/device_prebuild_cpu.py)
HIGH_VARIANT_SPEC = AttentionSpec("float32", 64, causal="bottom_right", variants=("softcap", "alibi", "window"))


def test_fp32_high_precision_mask_and_variants(bf16_unit, precision_high, monkeypatch):
    """The bf16x3 forward through the score pipeline: a boolean mask with fully masked rows;
    causal + window + softcap + ALiBi with GQA."""
    from tvmflash import ops

    b, h, lq, lk = 2, 3, 113, 203
    q, k, v, dout = make(b, h, h, lq, lk, 64, torch.float32, seed=3)
    mask = masks("bool", b, h, lq, lk, torch.float32)[0]

    def masked(q, k, v):
        out = tvmflash.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out, torch.ops.tvmflash.attention_forward(q, k, v, mask, 64 ** -0.5, "none")[1]
    check_high_precision(q, k, v, dout, masked, monkeypatch, mask=mask)
    q, k, v, dout = make(1, 4, 2, 300, 700, 64, torch.float32, seed=4)
    slopes = alibi("h", 1, 4)
    assert ops.spec_for(q, None, "bottom_right", (96, 0), 5.0, slopes, 0.0) == HIGH_VARIANT_SPEC
    run = flash_variant_run(True, window_size=(96, 0), softcap=5.0, alibi_slopes=slopes)
    check_high_precision(q, k, v, dout, run, monkeypatch, causal="bottom_right", window=(96, 0), softcap=5.0,
                         alibi_slopes=slopes)


def test_fp32_highest_precision_keeps_fma_kernels(bf16_unit):
    """The default precision ("highest") never takes the bf16x3 kernels; fp32 modules hold them
    only for AMX targets and the avx512_bf16 test target (Zen hosts' pair dots would be slower
    than their FMAs)."""
    from tvmflash import ops

    kernels = ops._kernels(AttentionSpec("float32", 64), torch.device("cpu"))
    assert {"forward_bf16x3", "forward_bf16x3_long", "backward_bf16x3_fused", "backward_bf16x3_dq"} <= set(kernels)
    q = torch.empty(1, 1, 1, 64)
    assert torch.get_float32_matmul_precision() == "highest" and not ops._takes_bf16x3(kernels, q)
    assert not ops._takes_bf16x3(kernels, q.bfloat16())


# (causal, softcap, ALiBi slopes' kind) of test_bf16_variants (scripts/device_prebuild_cpu.py builds them)
AMX_VARIANTS = [(False, 0.0, "h"), (True, 0.0, "bh"), (False, 20.0, None), (True, 5.0, None), (True, 5.0, "h")]


def amx_spec(causal, window, softcap, alibi_kind, dropout_p, d):
    """The bf16 spec of an AMX variant or dropout case."""
    from tvmflash.ops import spec_for

    return spec_for(torch.empty(1, 1, 1, d, dtype=torch.bfloat16), None, "bottom_right" if causal else "none",
                    window, softcap, torch.ones(1) if alibi_kind else None, dropout_p)


def amx_variant_specs() -> set:
    """The specs of test_bf16_variants and test_bf16_dropout."""
    return ({amx_spec(causal, (-1, -1), softcap, kind, 0.0, d) for causal, softcap, kind in AMX_VARIANTS
             for d in (64, 128)} | {amx_spec(*case) for case in AMX_DROPOUT})


@pytest.mark.parametrize("causal,softcap,alibi_kind", AMX_VARIANTS, ids=lambda x: str(x))
@pytest.mark.parametrize("lq,lk,d", [(1000, 1000, 64), (300, 700, 64), (700, 300, 128), (300, 2100, 128)],
                         ids=lambda x: str(x))
def test_bf16_variants(causal, softcap, alibi_kind, lq, lk, d, bf16_unit):
    """ALiBi and softcap on the bf16 kernels, both matrix units (both forwards: 300 x 2100 takes forward_long): whole
    tiles on either side of ALiBi's diagonal take its split bias and a lone softcap's whole
    tiles their tanh in the exponent (amx_forward.exponent); the others, and softcap with
    ALiBi, go through the rewriting pass. Forward, lse, every gradient."""
    q, k, v, dout = make(1, 4, 2, lq, lk, d, torch.bfloat16, seed=lq + lk)
    slopes = alibi(alibi_kind, 1, 4) if alibi_kind else None
    check_against_reference(q, k, v, dout, flash_variant_run(causal, softcap=softcap, alibi_slopes=slopes),
                            causal="bottom_right" if causal else "none", softcap=softcap, alibi_slopes=slopes)


@pytest.mark.parametrize("scale", [None, -0.05])
@pytest.mark.parametrize("lq,lk", [(300, 2100), (203, 450)], ids=str)
def test_bf16_softcap_small_and_saturated_scores(scale, lq, lk, bf16_unit):
    """A lone softcap's whole tiles take tanh's odd polynomial where a chunk's scaled scores all
    lie within half the cap (amx_forward.small_scores) and the exact tanh elsewhere: heads whose
    scores all sit far below -cap or far above +cap (saturated), heads of ordinary scores, and
    one whose keys mix both (each chunk decides), under either sign of the scale, both forwards
    (300 x 2100 takes forward_long). Forward, lse, every gradient against float64."""
    q, k, v, dout = make(1, 4, 4, lq, lk, 128, torch.float32, seed=lq)
    q[:, :2] = q[:, :2].abs() * 4  # head 0: every score far below -cap, head 1 far above +cap
    k[:, 0], k[:, 1] = -k[:, 0].abs() * 4, k[:, 1].abs() * 4
    k[:, 3, ::97] *= 8  # head 3: a few large keys scattered among ordinary ones
    q, k, v, dout = (x.bfloat16() for x in (q, k, v, dout))

    def run(qh, kh, vh):
        out, lse, _ = tvmflash.flash_attn_func(*(x.transpose(1, 2) for x in (qh, kh, vh)), softmax_scale=scale,
                                               softcap=20.0, return_attn_probs=True)
        return out.transpose(1, 2), lse
    check_against_reference(q, k, v, dout, run, scale=scale, softcap=20.0)


@pytest.mark.skipif(not has_compiler(), reason="evaluates TIR expressions: needs TVM's compiler, not its runtime")
@pytest.mark.parametrize("lq,lk,q0", [(2048, 2048, 1024), (300, 2100, 0), (2100, 300, 1792), (64, 64, 0)])
def test_alibi_walk_visits_every_block_once_from_the_diagonal(lq, lk, q0):
    """amx_forward.diagonal_walk (the ALiBi forward's kv order): a permutation of the q-block's
    kv blocks that starts at the block of its middle row's diagonal (clamped into the range),
    descends to the first block, then ascends."""
    from tvm import tirx
    from tvm.sym.analyzer import Analyzer

    from tvmflash.schedules.amx_forward import diagonal_walk

    bq, bk = 64, 64
    lo, hi = 0, -(-lk // bk)
    blocks = [int(Analyzer().simplify(diagonal_walk(tirx.IntImm("int64", lo + t), lo, hi, q0, lq, lk, bq, bk)))
              for t in range(hi - lo)]
    first = min(max((q0 + bq // 2 + lk - lq) // bk, lo), hi - 1)
    assert sorted(blocks) == list(range(lo, hi)) and blocks[0] == first
    assert blocks == list(range(first, lo - 1, -1)) + list(range(first + 1, hi))


# (causal, window, softcap, ALiBi slopes' kind, dropout_p, head dim): one module each (built by
# scripts/device_prebuild_cpu.py with AMX_VARIANTS' through amx_variant_specs), two shapes
# and backward plans each (300 x 2100 at head dim 128 runs forward_long)
AMX_DROPOUT = [(False, (-1, -1), 0.0, None, 0.3, 128), (True, (-1, -1), 0.0, None, 0.1, 64),
               (True, (64, 0), 5.0, "h", 0.2, 64)]
AMX_DROPOUT_SHAPES = [[(300, 2100, "fused"), (203, 113, "split")], [(113, 203, "split"), (17, 17, "fused")],
                      [(113, 203, "fused"), (203, 113, "split")]]


@pytest.mark.parametrize("causal,window,softcap,alibi_kind,dropout_p,d,lq,lk,plan",
                         [(*case, *shape) for case, shapes in zip(AMX_DROPOUT, AMX_DROPOUT_SHAPES) for shape in shapes],
                         ids=str)
def test_bf16_dropout(causal, window, softcap, alibi_kind, dropout_p, d, lq, lk, plan, monkeypatch, bf16_unit):
    """Dropout on the bf16 kernels, both matrix units (Z multiplies P where the P.V operand is packed; the backward's
    dV and dS take it): forward (300 x 2100: forward_long), lse and every gradient against the
    float64 reference with the keep mask the call returns; both backward plans, GQA, with
    window, softcap and ALiBi."""
    from test_dropout import dropout_run, keep_of_run
    from test_variants import reference_window
    from tvmflash import ops

    monkeypatch.setenv("TVMFLASH_BACKWARD", plan)
    spec = amx_spec(causal, window, softcap, alibi_kind, dropout_p, d)
    assert "forward_pack" in ops._kernels(spec, torch.device("cpu"))  # the bf16 kernels take dropout
    b, h = 2, 4
    q, k, v, dout = make(b, h, 2, lq, lk, d, torch.bfloat16, seed=lq + lk)
    slopes = alibi(alibi_kind, b, h) if alibi_kind else None
    check_against_reference(q, k, v, dout, dropout_run(causal, dropout_p, window_size=window, softcap=softcap,
                                                       alibi_slopes=slopes),
                            causal="bottom_right" if causal else "none", window=reference_window(window, causal),
                            softcap=softcap, alibi_slopes=slopes, dropout_p=dropout_p,
                            dropout_keep=keep_of_run(b, h, lq, lk, dropout_p))


@pytest.mark.parametrize("plan", ["fused", "split"])
def test_bf16_backward_plans(plan, monkeypatch, bf16_unit):
    """Both backward plans of the bf16 kernels on each unit (the matrix mostly takes the fused one), GQA, odd sizes."""
    monkeypatch.setenv("TVMFLASH_BACKWARD", plan)
    q, k, v, dout = make(3, 4, 2, 77, 161, 128, torch.bfloat16)
    check_against_reference(q, k, v, dout, flash_run(True), causal="bottom_right")


@pytest.mark.parametrize("direction", ["rising", "falling"])
def test_bf16_forward_running_max(direction, bf16_unit):
    """Scores that climb (or fall) steeply from kv block to kv block: the bf16 forward moves its
    running max only when a block passes it by more than GROW (then rescales and recomputes),
    and keeps probabilities up to 2^GROW otherwise; both paths against the reference."""
    g = torch.Generator().manual_seed(7)
    lq, lk, d = 70, 600, 64
    u = torch.randn(d, generator=g)
    ramp = torch.linspace(-6, 6, lk) if direction == "rising" else torch.linspace(6, -6, lk)
    # key j is about ramp[j] * u: with q ~ u the scores span about +-6 * |u|^2 / sqrt(d) ~ +-48,
    # steps of a few units inside a block and of many between the first and last blocks
    k = (ramp[:, None] * u + 0.3 * torch.randn(lk, d, generator=g))[None, None].expand(2, 2, lk, d)
    q = (u + 0.3 * torch.randn(2, 4, lq, d, generator=g))
    v = torch.randn(2, 2, lk, d, generator=g)
    dout = torch.randn(2, 4, lq, d, generator=g)
    q, k, v, dout = (x.contiguous().bfloat16() for x in (q, k, v, dout))
    check_against_reference(q, k, v, dout, flash_run(False))


@needs_amx
@pytest.mark.parametrize("layout,lq,heads,d", [("paged16", 1, (5, 1), 128), ("paged16", 3, (5, 1), 128),
                                               ("paged16", 1, (4, 4), 128), ("paged48", 1, (32, 8), 128),
                                               ("paged16", 3, (16, 2), 64), ("contiguous", 2, (8, 2), 128)])
def test_kvcache_decode(layout, lq, heads, d):
    """flash_attn_with_kvcache's split-KV kernels on the AVX512 path: bf16 on AMX tiles for more
    than 4 rows a kv-head (16-row tasks: 5 rows, a short block whose repeated rows are not
    stored; 15; 24 rows, two blocks; 8), the FMA kernel for 4 (32 heads over 8), one query
    row a kv-head on the one-row FMA kernel, thousands of
    keys over several splits, pages of 16 and 48 (16-key groups that K's tile loads read in
    place) and a contiguous cache whose capacity is no multiple of 16, with left padding (the
    groups that leave the cache are staged)."""
    capacity = 2101 if layout == "contiguous" else 2100
    check_kvcache(layout, False, (-1, -1), None, lq, 0, dtype=torch.bfloat16, heads=heads, d=d,
                  capacity=capacity, lengths=(2050, 3, 700) if layout != "contiguous" else (2078, 3, 700))


@needs_amx
@pytest.mark.parametrize("variant", ["causal_window", "softcap", "alibi"])
def test_kvcache_decode_variants(variant):
    """The AMX decode's score pass (16 rows a vector, rows of several heads and queries):
    causal with a window at Lq = 3 (and rotary: the step's append on this target), softcap,
    ALiBi, over splits and a cache with left padding."""
    kw = {"causal_window": dict(causal=True, window=(300, -1)), "softcap": dict(softcap=5.0),
          "alibi": dict(alibi=True)}[variant]
    causal, window = kw.pop("causal", False), kw.pop("window", (-1, -1))
    check_kvcache("contiguous", causal, window, "interleaved" if causal else None, 3, 1, dtype=torch.bfloat16,
                  heads=(8, 2), d=128, capacity=1000, lengths=(900, 3, 400), num_splits=2, **kw)


@needs_amx
@pytest.mark.parametrize("case", ["relative bias + causal", "document mask"])
@pytest.mark.parametrize("lq", [130, 5], ids=str)  # 5: the split-KV forward on AMX tiles
def test_flex_bf16_on_amx(case, lq):
    """flex_attention on the AMX kernels (the rest of the suite runs flex on the host path): a
    score_mod gathering from a captured table under a causal mask_mod, and a document mask
    whose block mask has empty and partial blocks; forward, lse and every gradient."""
    from test_flex import check_flex_bf16

    check_flex_bf16(case, lq, 300)
