"""Build, cache and load compiled kernel modules.

One module per (spec, target) holds the forward and the three backward functions. Modules are
built on first use and cached as shared libraries under `$TVMFLASH_CACHE_DIR` (default
`~/.cache/tvmflash`), keyed by the TVM version, the target, the spec and a hash of the kernel,
schedule and tuning-record sources, so a change to any of them builds anew. Writes are atomic
(temp file + rename) under a file lock, so concurrent processes build a spec once; a sha256
sidecar detects a corrupt or truncated library, which is then rebuilt.

TVM is imported here, lazily: `import tvmflash` does not pay for it.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from filelock import FileLock

from ._paths import PACKAGE_DIR, SCHEDULES_DIR
from .spec import AttentionSpec
from .tuning import tuned_knobs

KERNELS = ("forward", "backward_delta", "backward_dkdv", "backward_dq", "backward_fused")

_modules: dict = {}
_lock = threading.Lock()


def _tvm():
    """Import TVM with a thread pool that cooperates with torch's: as many threads as torch
    uses, and no pinning (TVM's default pins the calling thread, which torch's OpenMP workers
    then inherit)."""
    if "tvm" not in sys.modules:
        import torch

        os.environ.setdefault("TVM_NUM_THREADS", str(torch.get_num_threads()))
        os.environ.setdefault("TVM_BIND_THREADS", "0")
    import tvm

    return tvm


def cache_dir() -> Path:
    path = Path(os.environ.get("TVMFLASH_CACHE_DIR", Path.home() / ".cache" / "tvmflash"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.lru_cache(maxsize=None)
def host_target():
    """LLVM for this CPU; TVMFLASH_HOST_MCPU overrides the CPU model (e.g. `haswell` for an
    AVX2-only build on an AVX512 machine)."""
    tvm = _tvm()
    mcpu = os.environ.get("TVMFLASH_HOST_MCPU") or tvm.target.codegen.llvm_get_system_cpu()
    return tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "num-cores": os.cpu_count() or 1})


def _sources_digest() -> str:
    h = hashlib.sha256()
    for path in sorted((PACKAGE_DIR / "kernels").glob("*.py")) + sorted(SCHEDULES_DIR.glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def module_key(spec: AttentionSpec, target) -> str:
    tvm = _tvm()
    knobs = tuned_knobs("host", spec)
    blob = json.dumps({"tvm": tvm.__version__, "target": str(target), "spec": repr(spec),
                       "sources": _sources_digest(), "knobs": knobs}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def build_module(spec: AttentionSpec, target):
    """Generate, schedule and compile every kernel of `spec` into one module."""
    tvm = _tvm()
    from .kernels.backward import backward_delta_kernel, backward_dkdv_kernel, backward_dq_kernel
    from .kernels.forward import forward_kernel

    from .schedules import host
    knobs = {**host.DEFAULTS, **tuned_knobs("host", spec)}
    bq, bk = knobs["block_q"], knobs["block_k"]
    mod = tvm.IRModule({
        "forward": forward_kernel(spec, bq, bk),
        "backward_delta": backward_delta_kernel(spec, bq),
        "backward_dkdv": backward_dkdv_kernel(spec, bq, bk),
        "backward_dq": backward_dq_kernel(spec, bq, bk),
        "backward_fused": backward_dkdv_kernel(spec, bq, bk, fuse_dq=True),
    })
    sch = tvm.s_tir.Schedule(mod)
    vl = host.vector_length(target)
    for kernel in KERNELS:
        host.schedule(sch, kernel, vl, knobs)
    return tvm.compile(sch.mod, target=target)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _load_verified(lib: Path):
    """The module at `lib`, or None if missing or corrupt (checksum mismatch / load error)."""
    tvm = _tvm()
    check = lib.with_suffix(".sha256")
    if not (lib.exists() and check.exists()):
        return None
    try:
        if check.read_text().strip() != _digest(lib):
            return None
        return tvm.runtime.load_module(str(lib))
    except Exception:  # a library that fails to load is rebuilt like a corrupt one
        return None


def _write_atomic(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _log(msg: str) -> None:
    if not os.environ.get("TVMFLASH_QUIET"):
        print(f"tvmflash: {msg}", file=sys.stderr, flush=True)


def load_cached(spec: AttentionSpec, target=None):
    """The compiled module for `spec`: from this process, from the disk cache, or built now."""
    target = target if target is not None else host_target()
    key = (spec, str(target))
    with _lock:
        if key in _modules:
            return _modules[key]
        lib = cache_dir() / f"{spec.name}-{module_key(spec, target)}.so"
        module = _load_verified(lib)
        if module is None:
            with FileLock(str(lib) + ".lock"):
                module = _load_verified(lib)  # another process may have built it meanwhile
                if module is None:
                    _log(f"building {spec.name} for {target.attrs['mcpu']} (first use; cached in {lib.parent})")
                    start = time.perf_counter()
                    built = build_module(spec, target)
                    _write_atomic(lib, built.export_library)
                    _write_atomic(lib.with_suffix(".sha256"), lambda p: Path(p).write_text(_digest(lib)))
                    _log(f"built {spec.name} in {time.perf_counter() - start:.1f} s")
                    module = _load_verified(lib)
                    if module is None:
                        raise RuntimeError(f"tvmflash: freshly built module {lib} failed to load")
        _modules[key] = {name: module[name] for name in KERNELS}
        _modules[key]["module"] = module
        return _modules[key]
