"""Build-only checks for targets this machine cannot run: the kernels must keep compiling
for AVX512 (Sapphire Rapids) and vectorise onto zmm FMAs there."""
import pytest

from tvmflash import AttentionSpec


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_builds_for_sapphirerapids(dtype):
    from tvmflash.build import CPU_KERNELS, build_module

    target = {"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 16}
    lib = build_module(AttentionSpec(dtype=dtype, head_dim=64, causal="bottom_right", mask="bool"), target)
    for name in CPU_KERNELS:
        assert lib[name] is not None
    asm = lib.mod.inspect_source("asm")
    assert asm.count("zmm") > 100
    assert "vfmadd231ps\t%zmm" in asm or "vfmadd231ps %zmm" in asm
