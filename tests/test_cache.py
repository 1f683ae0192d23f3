"""The on-disk module cache: reused by a fresh process, rebuilt when corrupt, built once when
two processes ask for the same spec at the same moment."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SNIPPET = """
import torch, tvmflash
q = torch.randn(1, 2, 19, 16)
out = tvmflash.scaled_dot_product_attention(q, q, q)
ref = torch.nn.functional.scaled_dot_product_attention(q, q, q)
assert (out - ref).abs().max() < 1e-5
print("ok")
"""


def start(cache: Path):
    env = {**os.environ, "TVMFLASH_CACHE_DIR": str(cache)}
    env.pop("TVMFLASH_QUIET", None)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    return subprocess.Popen([sys.executable, "-c", SNIPPET], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(proc) -> str:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0 and out.strip() == "ok", err
    return err


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    procs = [start(cache), start(cache)]  # race: both want the same spec
    logs = [finish(p) for p in procs]
    assert sum(log.count("tvmflash: building") for log in logs) == 1, logs
    return cache


def test_fresh_process_reuses_module(built_cache):
    assert "building" not in finish(start(built_cache))


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_module_is_rebuilt(built_cache, tmp_path, damage):
    cache = tmp_path / "cache"
    shutil.copytree(built_cache, cache)  # modules, and the OpenMP launcher (launcher/)
    lib = next(cache.glob("*.so"))
    data = lib.read_bytes()
    lib.write_bytes(data[: len(data) // 2] if damage == "truncate" else data[:-1] + bytes([data[-1] ^ 1]))
    assert "tvmflash: building" in finish(start(cache))
    assert "building" not in finish(start(cache))  # the rebuilt module is trusted again
