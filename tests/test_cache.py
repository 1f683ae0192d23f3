"""The on-disk module cache: reused by a fresh process, rebuilt when corrupt, built once when
two processes ask for the same spec at the same moment, a temp dir where it cannot be written,
a new key for a new TVM version."""
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


def start(cache: Path, extra_env: dict | None = None):
    env = {**os.environ, "TVMFLASH_CACHE_DIR": str(cache), **(extra_env or {})}
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


def test_unwritable_cache_dir_falls_back_to_a_temp_dir_with_a_warning(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")  # the cache dir would be inside a file: it cannot be created
    env = {"TMPDIR": str(tmp_path / "tmp")}
    (tmp_path / "tmp").mkdir()
    err = finish(start(blocker / "cache", env))
    assert "is not writable; building into" in err and "tvmflash: building" in err
    assert list((tmp_path / "tmp").glob("tvmflash-cache-*/*.so"))


def test_read_only_cache_serves_what_it_holds(built_cache, monkeypatch):
    """Modules already in a read-only cache are used, not rebuilt elsewhere."""
    from tvmflash import build
    from tvmflash.spec import AttentionSpec

    monkeypatch.setenv("TVMFLASH_CACHE_DIR", str(built_cache))
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == built_cache else real_access(p, mode))
    monkeypatch.setattr(build, "build_module", lambda *a, **k: pytest.fail("rebuilt"))
    with pytest.warns(RuntimeWarning, match="not writable"):
        lib = build.build_cached(AttentionSpec("float32", 16), build.cpu_target())
    assert lib.parent == built_cache


def test_a_tvm_version_change_is_a_new_module_key(monkeypatch):
    import tvm

    from tvmflash import build
    from tvmflash.spec import AttentionSpec

    spec, target = AttentionSpec("float32", 16), build.AVX512_TARGET
    key = build.module_key(spec, target)
    monkeypatch.setattr(tvm, "__version__", "0.28.0")
    assert build.module_key(spec, target) != key


BUILD_MANY = """
import os, sys
from tvmflash import build
from tvmflash.spec import AttentionSpec
specs = [AttentionSpec("float32", 16), AttentionSpec("float32", 16, causal="bottom_right")]
build.build_many(specs, build.cpu_target(), jobs=2)
print(" ".join(str(build.library_path(s, build.cpu_target())) for s in specs))
"""


def test_build_many_fills_the_cache_from_forked_workers(built_cache, tmp_path):
    """`build.build_many` (the device prebuild scripts) with two worker processes: a spec the
    cache holds is kept, the missing one is built once, and both are intact afterwards."""
    from tvmflash import build

    cache = tmp_path / "cache"
    shutil.copytree(built_cache, cache)
    held = next(cache.glob("*.so"))
    held_stat = held.stat()
    env = {**os.environ, "TVMFLASH_CACHE_DIR": str(cache)}
    env.pop("TVMFLASH_QUIET", None)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", BUILD_MANY], env=env, text=True, capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    libs = [Path(p) for p in proc.stdout.split()]
    assert held in libs and held.stat().st_mtime_ns == held_stat.st_mtime_ns
    assert proc.stderr.count("tvmflash: building") == 1
    assert all(build._is_intact(lib) for lib in libs)


def test_a_first_build_compiles_its_kernels_in_parts(tmp_path, monkeypatch, capfd):
    """A CPU module's first build splits its kernels over forked processes (each a share, into
    an object file) and links them into one library that holds every kernel; a share may be
    empty; where no child can be forked (a daemonic caller) the kernels build in the calling
    process."""
    import torch

    import tvmflash.build as build
    from tvmflash.ops import spec_for
    from tvmflash.schedules import cpu_schedule

    tvm = build._tvm()
    spec = spec_for(torch.empty(1, 1, 1, 16), None, "none", (-1, -1), 0.0, None, 0.0)
    target = build.cpu_target()
    names = list(cpu_schedule(target).kernels(spec, target, build.default_knobs(spec, target)))
    assert len(names) > 3

    def kernels_in(path):
        module = tvm.runtime.load_module(str(path))
        return [n for n in names if module.implements_function(n)]

    build._export_cpu_in_parts(spec, target, str(tmp_path / "parts.so"), 3)
    assert kernels_in(tmp_path / "parts.so") == names
    assert build._build_cpu(spec, target, part=(len(names), len(names) + 1)) is None

    def no_children(method):
        raise AssertionError("daemonic processes are not allowed to have children")
    monkeypatch.setattr(build.multiprocessing, "get_context", no_children)
    monkeypatch.delenv("TVMFLASH_QUIET", raising=False)
    build._export_cpu_in_parts(spec, target, str(tmp_path / "here.so"), 3)
    assert kernels_in(tmp_path / "here.so") == names
    assert "building it in this one" in capfd.readouterr().err
