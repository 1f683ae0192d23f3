"""Exported modules (`tvmflash export`, `tvmflash.load_exported`): a process with TVM's runtime
only (TVM_USE_RUNTIME_LIB=1, an empty cache) runs them; a manifest that does not match its
libraries is refused."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

RUNTIME_ONLY = """
import torch, tvmflash
from tvmflash import build
from tvmflash.reference import attention
assert not build.has_compiler()
q, k, v = (torch.randn(2, 37, 4, 32, dtype=torch.float64).float().requires_grad_() for _ in range(3))
out = tvmflash.flash_attn_func(q, k, v, causal=True)
out.backward(torch.ones_like(out))
t = lambda x: x.detach().double().transpose(1, 2).requires_grad_()
q64, k64, v64 = t(q), t(k), t(v)
ref, _ = attention(q64, k64, v64, causal="bottom_right")
ref.backward(torch.ones_like(ref))
assert (out.double() - ref.transpose(1, 2)).abs().max() < 1e-5
assert (q.grad.double() - q64.grad.transpose(1, 2)).abs().max() < 1e-4
try:
    tvmflash.flash_attn_func(q.half(), k.half(), v.half())
except RuntimeError as err:
    assert "not exported" in str(err) and "runtime only" in str(err), err
else:
    raise AssertionError("a spec that was not exported ran")
print("ok")
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from typer.testing import CliRunner

    from tvmflash.cli import app

    out = tmp_path_factory.mktemp("exported")
    result = CliRunner().invoke(app, ["export", "--target", "host", "--spec", "fp32:d32:causal", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


def test_manifest_describes_each_module(exported):
    from tvmflash import build, deploy
    from tvmflash.spec import AttentionSpec

    manifest = json.loads((exported / "manifest.json").read_text())
    (module,) = manifest["modules"]
    assert module["spec_name"] == AttentionSpec("float32", 32, "bottom_right").name
    assert module["target"] == build.host_target() and module["tvm"] == build._tvm().__version__
    assert "forward" in module["kernels"] and len(module["sha256"]) == 64 and module["tuning_sha256"]
    assert module["kernel_abi"] == deploy.KERNEL_ABI["llvm"]
    assert (exported / module["file"]).stat().st_size == module["size"]


def test_runtime_only_process_runs_exported_modules(exported, tmp_path):
    tests = Path(__file__).parent
    env = {**os.environ, "TVM_USE_RUNTIME_LIB": "1", "TVMFLASH_EXPORTED": str(exported),
           "TVMFLASH_CACHE_DIR": str(tmp_path / "empty-cache"), "TVMFLASH_CPU_TARGET": "host",
           "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests), os.environ.get("PYTHONPATH", "")])}
    env.pop("TVMFLASH_HOST_MCPU", None)  # runtime only: the host target comes from the manifest
    proc = subprocess.run([sys.executable, "-c", RUNTIME_ONLY], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
    assert not list((tmp_path / "empty-cache").glob("*.so"))  # nothing built


@pytest.mark.parametrize("damage", ["library", "tvm version", "kernel abi"])
def test_a_manifest_that_does_not_match_is_refused(exported, tmp_path, damage):
    import shutil

    from tvmflash import load_exported

    copy = tmp_path / "copy"
    shutil.copytree(exported, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    if damage == "library":
        lib = copy / manifest["modules"][0]["file"]
        data = lib.read_bytes()
        lib.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif damage == "tvm version":
        manifest["modules"][0]["tvm"] = "0.19.0"
    else:  # an export from before a change of the kernels' arguments
        manifest["modules"][0]["kernel_abi"] += 1
    (copy / "manifest.json").write_text(json.dumps(manifest))
    match = {"library": "sha256 does not match", "tvm version": "built by TVM 0.19", "kernel abi": "export it again"}
    with pytest.raises(ValueError, match=match[damage]):
        load_exported(copy)
    with pytest.raises(ValueError, match="no manifest.json"):
        load_exported(tmp_path)


def test_flex_specs_are_not_exported(tmp_path):
    from tvmflash import build, deploy, flex
    from tvmflash.spec import AttentionSpec

    program, _ = flex.trace(lambda score, b, h, q_idx, kv_idx: score * 2.0, "score")
    spec = AttentionSpec("float32", 16, flex=(("score", program, None),))
    with pytest.raises(ValueError, match="flex"):
        deploy.export([spec], build.AVX512_TARGET, tmp_path)
