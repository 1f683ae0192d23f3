"""Build, cache and load compiled kernel modules.

One module per (spec, target) holds every kernel of that spec for that target. Targets are
described by plain dicts (TVM's JSON target form), so finding a cached module needs no
compiler: a deployment with only TVM's runtime loads what was built elsewhere.

Modules are built on first use and cached as shared libraries under `$TVMFLASH_CACHE_DIR`
(default `~/.cache/tvmflash`), keyed by the TVM version, the target, the spec and a hash of the
kernel, schedule and tuning-record sources, so a change to any of them builds anew. Writes are
atomic (temp file + rename) under a file lock, so concurrent processes build a spec once; a
sha256 sidecar detects a corrupt or truncated library, which is then rebuilt.

TVM is imported here, lazily: `import tvmflash` does not pay for it.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

from filelock import FileLock

from ._paths import PACKAGE_DIR, SCHEDULES_DIR
from .cpu import request_amx, runs_avx512_amx, use_torch_threads
from .spec import AttentionSpec
from .tuning import DECODE_PHASES, tuned_knobs

CPU_KERNELS = ("forward", "backward_delta", "backward_dkdv", "backward_dq",
               "backward_fused")
# AMX operand packing; the split-KV decode forward (not for dropout: training only), its
# one-query-row variants (schedules/host.py) and its AMX variants for more rows a kv-head
# (schedules/amx_decode.py); a 16-bit kv_cache module's append for float32 rotary tables
CPU_OPTIONAL_KERNELS = ("forward_pack", "forward_pack_vt", "forward_long", "backward_pack", "forward_split",
                        "forward_split_row", "forward_split_tiles", "forward_split_combine", "decode_row",
                        "decode_tiles", "decode_append_f32", "forward_bf16x3", "forward_bf16x3_long", "forward_pack_bf16x3",
                        "backward_bf16x3_fused", "backward_bf16x3_dkdv", "backward_bf16x3_dq", "backward_pack_bf16x3")
# in every module that runs on AMX tiles (`forward_pack` also in those whose bf16 kernels take
# avx512_bf16's pair products instead: see uses_amx)
AMX_KERNELS = ("forward_pack", "decode_tiles", "forward_split_tiles", "forward_bf16x3")
CUDA_KERNELS = ("forward", "backward_prep", "backward_dkdv_dq", "backward_dq_convert", "backward_dkdv",
                "backward_dq")
DECODE_KERNELS = ("decode", "decode_combine", "decode_check", "decode_append")  # a kv_cache spec's CPU module
# one per page-size plan (on CUDA a kernel merges its splits itself), and a step's append
CUDA_DECODE_KERNELS = (*DECODE_PHASES, "decode_append", "decode_append_f32")
CUDA_OPTIONAL_KERNELS = ("forward_short",)  # the lockstep forward for short windows (schedules/cuda_kernels.py)

_modules: dict = {}
_lock = threading.Lock()


def _tvm():
    """Import TVM with a thread pool that cooperates with torch's: as many threads as torch
    uses, no pinning (TVM's default pins the calling thread, which torch's OpenMP workers then
    inherit), no busy-waiting after a launch. (CPU modules normally run on torch's own threads
    instead: cpu.use_torch_threads.)"""
    if "tvm" not in sys.modules:
        import torch

        os.environ.setdefault("TVM_NUM_THREADS", str(torch.get_num_threads()))
        os.environ.setdefault("TVM_BIND_THREADS", "0")
        os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "0")
    import tvm

    return tvm


def has_compiler() -> bool:
    """Whether TVM's compiler is here (not a runtime-only TVM: TVM_USE_RUNTIME_LIB=1, or the
    GPU machine's runtime bundle)."""
    import tvm_ffi

    _tvm()
    return tvm_ffi.get_global_func("target.build.llvm", allow_missing=True) is not None


def configured_cache_dir() -> Path:
    """$TVMFLASH_CACHE_DIR, default ~/.cache/tvmflash (modules are looked up here first)."""
    return Path(os.environ.get("TVMFLASH_CACHE_DIR", Path.home() / ".cache" / "tvmflash"))


def cache_dir() -> Path:
    """Where modules are written: the configured cache directory, or, where that cannot be
    written (a read-only mount), a per-user directory under the system's temp dir (warned once)."""
    path = configured_cache_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
        if os.access(path, os.W_OK):
            return path
    except OSError:
        pass
    fallback = Path(tempfile.gettempdir()) / f"tvmflash-cache-{os.getuid()}"
    fallback.mkdir(parents=True, exist_ok=True)
    if path not in _warned_read_only:
        _warned_read_only.add(path)
        warnings.warn(f"tvmflash: the cache directory {path} is not writable; building into {fallback}",
                      RuntimeWarning, stacklevel=2)
    return fallback


_warned_read_only: set = set()


# ----------------------------------------------------------------------------- targets
@functools.lru_cache(maxsize=None)
def host_target() -> dict:
    """LLVM for this CPU; TVMFLASH_HOST_MCPU overrides the CPU model (e.g. `haswell` for an
    AVX2-only build on an AVX512 machine). A runtime-only TVM cannot ask LLVM: it takes the
    model of the exported host modules."""
    from .deploy import exported_host_mcpu

    mcpu = os.environ.get("TVMFLASH_HOST_MCPU")
    if not mcpu:
        mcpu = _tvm().target.codegen.llvm_get_system_cpu() if has_compiler() else exported_host_mcpu()
    if not mcpu:
        raise RuntimeError("TVM's compiler is not available (runtime only) and no exported host module was "
                           "loaded: set TVMFLASH_HOST_MCPU or load modules exported for this CPU")
    return {"kind": "llvm", "mcpu": mcpu, "num-cores": os.cpu_count() or 1}


# Sapphire Rapids class (AVX512 + avx512_bf16/fp16 + AMX); num-cores only informs MetaSchedule,
# fixed so modules built on one machine are found (same cache key) on another
AVX512_TARGET = {"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 16}


# AVX512 with the bf16 kernels' products on `vdpbf16ps` (named in mattr: schedules/avx512.bf16_unit)
# and no AMX: an Intel model, so that such modules also run on AMX Xeons (tests, A/Bs); Zen 4 / 5
# hosts get their own models from host_target(), which take the same kernels (BF16_DOT_CPUS)
AVX512_BF16_TARGET = {"kind": "llvm", "mcpu": "cooperlake", "mattr": ["+avx512bf16"], "num-cores": 16}
CPU_TARGET_CHOICES = ("auto", "avx512", "avx512_bf16", "host")


def cpu_target() -> dict:
    """The target CPU tensors run on: AVX512_TARGET where this CPU runs it (AVX512 + AMX,
    detected at run time), else host_target(). TVMFLASH_CPU_TARGET=avx512|avx512_bf16|host
    forces one."""
    choice = os.environ.get("TVMFLASH_CPU_TARGET", "auto")
    if choice not in CPU_TARGET_CHOICES:
        raise ValueError(f"TVMFLASH_CPU_TARGET={choice!r}: expected one of {', '.join(CPU_TARGET_CHOICES)}")
    if choice == "avx512" or (choice == "auto" and runs_avx512_amx()):
        return AVX512_TARGET
    if choice == "avx512_bf16":
        return AVX512_BF16_TARGET
    return host_target()


def uses_amx(target: dict, kernels) -> bool:
    """Whether a module of `target` holding `kernels` (names) runs AMX tile instructions."""
    from .schedules.avx512 import has_amx

    return target["kind"] == "llvm" and has_amx(target) and any(name in kernels for name in AMX_KERNELS)


def cuda_target(arch: str | None = None) -> dict:
    """CUDA for `arch` (default: TVMFLASH_CUDA_ARCH, else sm_90a)."""
    arch = arch or os.environ.get("TVMFLASH_CUDA_ARCH", "sm_90a")
    return {"kind": "cuda", "arch": arch, "max_threads_per_block": 1024,
            "max_shared_memory_per_block": 232448 if arch.startswith("sm_9") else 166912,
            "host": {"kind": "llvm"}}


@functools.lru_cache(maxsize=None)
def cuda_target_for_device(index: int) -> dict:
    import torch

    major, minor = torch.cuda.get_device_capability(index)
    return cuda_target(f"sm_{major}{minor}{'a' if major == 9 else ''}")


def kernels_of(spec: AttentionSpec, target: dict) -> tuple:
    if spec.kv_cache:
        return CUDA_DECODE_KERNELS if target["kind"] == "cuda" else DECODE_KERNELS
    return CUDA_KERNELS if target["kind"] == "cuda" else CPU_KERNELS


def target_label(target: dict) -> str:
    return target.get("arch") or target.get("mcpu") or target["kind"]


# ----------------------------------------------------------------------------- building
def _sources_digest(target: dict) -> str:
    """Hash of the kernel sources and of the schedules of `target`'s kind (CUDA modules do not
    depend on the CPU schedules, nor CPU modules on `schedules/cuda_*`)."""
    cuda = target["kind"] == "cuda"
    schedules = [p for p in sorted(SCHEDULES_DIR.glob("*.py")) if p.name.startswith("cuda_") == cuda]
    h = hashlib.sha256()
    # what generates kernels: the kernels, the spec (its modifier order), the dropout RNG
    generators = sorted((PACKAGE_DIR / "kernels").glob("*.py")) + [PACKAGE_DIR / "spec.py", PACKAGE_DIR / "rng.py"]
    for path in generators + schedules:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _tuning_kind(target: dict) -> str:
    if target["kind"] == "cuda":
        return "cuda"
    from .schedules import cpu_schedule

    return cpu_schedule(target).__name__.rsplit(".", 1)[-1]  # host | avx512


def module_key(spec: AttentionSpec, target: dict) -> str:
    tvm = _tvm()  # threads set up before TVM starts its pool (the runtime-only import is enough)

    blob = json.dumps({"tvm": tvm.__version__, "target": target, "spec": repr(spec),
                       "sources": _sources_digest(target), "knobs": tuned_knobs(_tuning_kind(target), spec)},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def build_module(spec: AttentionSpec, target: dict, knobs: dict | None = None, only: tuple | None = None):
    """Generate, schedule and compile every kernel of `spec` for `target` into one module;
    `knobs` override the tuned/default ones (tuning candidates); `only` keeps the CPU kernels
    of those names (a tuning phase's)."""
    if target["kind"] == "cuda":
        return _build_cuda(spec, target, knobs)
    return _build_cpu(spec, target, knobs, only)


def default_knobs(spec: AttentionSpec, target: dict) -> dict:
    """The knobs `spec`'s schedule for `target` takes where no record sets them."""
    if target["kind"] == "cuda":
        from .schedules import cuda_kernels

        return cuda_kernels.default_knobs(spec)
    from .schedules import cpu_schedule

    return dict(cpu_schedule(target).DEFAULTS)


def _build_cpu(spec: AttentionSpec, target: dict, knobs: dict | None = None, only: tuple | None = None,
               part: tuple | None = None):
    """`part` (i, n): only every n-th kernel from the i-th (`_export_cpu_in_parts`); None if
    that share is empty."""
    tvm = _tvm()
    from .kernels.common import long_scores
    from .schedules import cpu_schedule

    schedule = cpu_schedule(target)
    knobs = {**default_knobs(spec, target), **tuned_knobs(_tuning_kind(target), spec), **(knobs or {})}
    with long_scores("varlen" in spec.variants or spec.kv_cache):  # per-sequence coordinates in every score
        funcs = {name: f for name, f in schedule.kernels(spec, target, knobs).items() if only is None or name in only}
    if part is not None:
        funcs = dict(list(funcs.items())[part[0]::part[1]])
        if not funcs:
            return None
    sch = tvm.s_tir.Schedule(tvm.IRModule(funcs))
    for kernel in funcs:
        schedule.schedule(sch, kernel, target, knobs)
    # TVM 0.27's TIR CSE binds a flex capture's vector gather index (int64x128 on the AMX
    # backward) to a let whose bound analysis builds an ill-typed Select and aborts the build;
    # LLVM eliminates the same common subexpressions, so such modules skip TIR's pass
    gathers = any(program.captures for _, program, _ in spec.flex)
    with tvm.transform.PassContext(config={"tirx.disable_cse_tir": gathers}):
        return tvm.compile(sch.mod, target=tvm.target.Target(target))


def cuda_kernels(spec: AttentionSpec, arch: str, knobs: dict | None = None) -> dict:
    """Every CUDA kernel of `spec` by module function name (schedules/cuda_kernels.py chooses
    them). `knobs` override the tuned/default ones (tuning candidates)."""
    from .kernels.score_mods import math_target
    from .schedules import cuda_kernels as kernels

    knobs = {**default_knobs(spec, cuda_target(arch)), **tuned_knobs("cuda", spec), **(knobs or {})}
    with math_target("cuda"):
        return kernels.kernels(spec, arch, knobs)


def _build_cuda(spec: AttentionSpec, target: dict, knobs: dict | None = None):
    tvm = _tvm()
    _prepare_cuda_codegen()
    mod = tvm.IRModule(cuda_kernels(spec, target["arch"], knobs))
    tvm_target = tvm.target.Target(target)
    with tvm_target:  # the nvcc callback reads the arch from the current target
        return tvm.compile(mod, target=tvm_target, tir_pipeline="tirx")


# CUDA binaries, not source. TVM's codegen compiles CUDA through `tvm_callback_cuda_compile`
# only when its CUDA runtime library is loaded; otherwise it keeps source that each loading
# process would have to compile. That library needs the driver (libcuda.so.1), so on machines
# without one (CI, the dev box) a stub of the nine entry points it links is built and loaded
# first: nothing is ever launched at build time.
_DRIVER_STUB = """/* tvmflash: stand-in for the CUDA driver at build time; every call fails */
#define STUB(name) int name(void) { return 100; /* CUDA_ERROR_NO_DEVICE */ }
STUB(cuDeviceGetName) STUB(cuFuncSetAttribute) STUB(cuGetErrorName) STUB(cuGetErrorString)
STUB(cuLaunchKernelEx) STUB(cuModuleGetFunction) STUB(cuModuleLoadData) STUB(cuModuleUnload)
STUB(cuTensorMapEncodeTiled)
"""


def _load_cuda_runtime() -> None:
    """Load TVM's CUDA runtime library (`libtvm_runtime_cuda.so`), which a runtime-only TVM
    does not load by itself; falls back to the driver stub where there is no driver."""
    import tvm
    import tvm_ffi

    if tvm_ffi.get_global_func("ffi.Module.load_from_bytes.cuda", allow_missing=True) is not None:
        return
    try:
        ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
    except OSError:
        stub = cache_dir() / "driver-stub" / "libcuda.so.1"
        if not stub.exists():
            stub.parent.mkdir(parents=True, exist_ok=True)
            src = stub.parent / "cuda_stub.c"
            src.write_text(_DRIVER_STUB)
            cc = os.environ.get("CC", "gcc")
            _write_atomic(stub, lambda tmp: subprocess.check_call(
                [cc, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", tmp, str(src)]))
        ctypes.CDLL(str(stub), mode=ctypes.RTLD_GLOBAL)
    ctypes.CDLL(str(Path(tvm.__file__).parent / "lib" / "libtvm_runtime_cuda.so"), mode=ctypes.RTLD_GLOBAL)


def _nvcc_cubin(code: str) -> bytearray:
    tvm = _tvm()
    target = tvm.target.Target.current(allow_none=True)
    arch = str(target.attrs["arch"]) if target is not None else "sm_90a"
    with tempfile.TemporaryDirectory(prefix="tvmflash-nvcc-") as tmp:
        src, out = Path(tmp) / "kernels.cu", Path(tmp) / "kernels.cubin"
        src.write_text(code)
        proc = subprocess.run([os.environ.get("NVCC", "nvcc"), "-w", "--cubin", "-O3", f"-arch={arch}",
                               "-o", str(out), str(src)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed for {arch}:\n{proc.stderr[-4000:]}")
        return bytearray(out.read_bytes())


def _prepare_cuda_codegen() -> None:
    import tvm_ffi

    _load_cuda_runtime()
    tvm_ffi.register_global_func("tvm_callback_cuda_compile", _nvcc_cubin, override=True)


# ----------------------------------------------------------------------------- cache
def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _is_intact(lib: Path) -> bool:
    check = lib.with_suffix(".sha256")
    return lib.exists() and check.exists() and check.read_text().strip() == _digest(lib)


def _load(lib: Path, target: dict):
    if target["kind"] == "cuda":
        _load_cuda_runtime()
        return _tvm().runtime.load_module(str(lib))
    module = _tvm().runtime.load_module(str(lib))
    use_torch_threads(str(lib), str(cache_dir()))  # parallel loops on torch's OpenMP threads
    return module


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


def library_path(spec: AttentionSpec, target: dict) -> Path:
    return cache_dir() / f"{spec.name}-{target_label(target)}-{module_key(spec, target)}.so"


def build_cached(spec: AttentionSpec, target: dict, rebuild: bool = False) -> Path:
    """The cached library of `spec` for `target`, built now if missing or corrupt (or if
    `rebuild`). Safe when several processes ask at once: one builds, the others wait."""
    lib = library_path(spec, target)
    if not rebuild and _is_intact(lib):
        return lib
    shipped = configured_cache_dir() / lib.name  # a read-only cache still serves what it holds
    if not rebuild and shipped != lib and _is_intact(shipped):
        return shipped
    if not has_compiler():
        raise RuntimeError(f"no module for {spec.name} on {target_label(target)}: it was not exported (see "
                           "tvmflash.load_exported / TVMFLASH_EXPORTED) nor cached, and TVM's compiler is not "
                           "available here (runtime only) to build it")
    with FileLock(str(lib) + ".lock"):
        if not rebuild and _is_intact(lib):  # another process built it meanwhile
            return lib
        _log(f"building {spec.name} for {target_label(target)} (first use; cached in {lib.parent})")
        start = time.perf_counter()
        jobs = _build_jobs(target)
        if jobs > 1:
            _write_atomic(lib, lambda path: _export_cpu_in_parts(spec, target, path, jobs))
        else:
            _write_atomic(lib, build_module(spec, target).export_library)
        _write_atomic(lib.with_suffix(".sha256"), lambda p: Path(p).write_text(_digest(lib)))
        _log(f"built {spec.name} in {time.perf_counter() - start:.1f} s")
    return lib


# A CPU module's kernels compile in this many processes at once (4.6 s of a 26 s bf16 module
# generate the kernels, which each process repeats, 11.4 s run TIR's passes and 10 s LLVM's
# codegen, single-threaded: dev box, 2 cores); more than this gains little over the repeats.
MAX_BUILD_JOBS = 8
_in_build_pool = False  # in build_many's workers, which build specs side by side already


def _build_jobs(target: dict) -> int:
    """Processes a module's first build splits its kernels over: $TVMFLASH_BUILD_JOBS, else
    one a core up to MAX_BUILD_JOBS; 1 for CUDA (one nvcc compile) and in build_many's workers."""
    if target["kind"] == "cuda" or _in_build_pool:
        return 1
    jobs = int(os.environ.get("TVMFLASH_BUILD_JOBS", 0)) or min(os.cpu_count() or 1, MAX_BUILD_JOBS)
    return max(1, jobs)


def _compile_part(spec: AttentionSpec, target: dict, part: tuple, obj: str) -> None:
    built = _build_cpu(spec, target, part=part)
    if built is not None:
        built.mod.write_to_file(obj)


def _export_cpu_in_parts(spec: AttentionSpec, target: dict, path: str, jobs: int) -> None:
    """The CPU module of `spec` at `path`, its kernels compiled in `jobs` forked processes (each
    every jobs-th kernel, into an object file) and linked into one library, as export_library
    links one module's object. Where forking fails (a daemonic caller, such as a DataLoader
    worker, may not have children) or a part does, the kernels build in this process."""
    from tvm.support import cc

    with tempfile.TemporaryDirectory() as tmp:
        objs = [os.path.join(tmp, f"part{i}.o") for i in range(jobs)]
        try:
            ctx = multiprocessing.get_context("fork")
            procs = [ctx.Process(target=_compile_part, args=(spec, target, (i, jobs), obj))
                     for i, obj in enumerate(objs)]
            for proc in procs:
                proc.start()
            for proc in procs:
                proc.join()
            failed = [proc.exitcode for proc in procs if proc.exitcode != 0]
        except (AssertionError, OSError, ValueError) as err:  # no children here (or no fork at all)
            failed = [err]
        if failed:
            _log(f"building {spec.name} in {jobs} processes failed ({failed}); building it in this one")
            build_module(spec, target).export_library(path)
            return
        cc.create_shared(path, [obj for obj in objs if os.path.exists(obj)])


# build_many's work list, set before its workers fork (tasks carry only an index: flex specs
# hold traced programs, which do not pickle)
_forked_work = None


def build_many(specs, target: dict, jobs: int | None = None, on_built=None) -> None:
    """`build_cached` every spec of `specs`, `jobs` processes at once (default:
    $TVMFLASH_PREBUILD_JOBS, else one a core; a build is a single-threaded compile, plus nvcc
    for CUDA); the cache's file locks keep the workers apart. `on_built(spec, seconds,
    was_cached)` is called here as each one is done (progress)."""
    global _forked_work
    ordered = sorted(specs, key=lambda s: s.name)
    jobs = jobs or int(os.environ.get("TVMFLASH_PREBUILD_JOBS", 0)) or os.cpu_count() or 1
    jobs = max(1, min(jobs, len(ordered)))
    report = on_built or (lambda spec, seconds, was_cached: None)
    if jobs == 1:
        for index in range(len(ordered)):
            report(ordered[index], *_build_timed(ordered, target, index))
        return
    _forked_work = (ordered, target)
    try:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            for index, seconds, was_cached in pool.imap_unordered(_build_forked, range(len(ordered))):
                report(ordered[index], seconds, was_cached)
    finally:
        _forked_work = None


def _build_timed(specs, target: dict, index: int) -> tuple:
    was_cached = _is_intact(library_path(specs[index], target))
    start = time.perf_counter()
    build_cached(specs[index], target)
    return time.perf_counter() - start, was_cached


def _build_forked(index: int) -> tuple:
    global _in_build_pool
    _in_build_pool = True
    return (index, *_build_timed(*_forked_work, index))


def load_cached(spec: AttentionSpec, target: dict | None = None) -> dict:
    """The kernels of `spec` for `target` (default: cpu_target()), by name: from this process,
    from exported modules (tvmflash.deploy), from the disk cache, or built now. A cached
    library that fails to load is rebuilt once."""
    from .deploy import exported_library

    target = target if target is not None else cpu_target()
    key = (spec, json.dumps(target, sort_keys=True))
    with _lock:
        if key not in _modules:
            exported = exported_library(spec, target)
            if exported is not None:  # checked when it was loaded
                module = _load(exported, target)
            else:
                lib = build_cached(spec, target)
                try:
                    module = _load(lib, target)
                except Exception:  # noqa: BLE001 - e.g. a library built for another machine
                    module = _load(build_cached(spec, target, rebuild=True), target)
            _modules[key] = kernels_from_module(module, spec, target)
        return _modules[key]


def kernels_from_module(module, spec: AttentionSpec, target: dict) -> dict:
    """A loaded module's kernels of `spec` by name: those `kernels_of` names and the optional
    ones it holds. AMX kernels get the process's AMX permission first (RuntimeError without)."""
    kernels = {name: module[name] for name in kernels_of(spec, target)}
    optional = CUDA_OPTIONAL_KERNELS if target["kind"] == "cuda" else CPU_OPTIONAL_KERNELS
    kernels.update((name, module[name]) for name in optional if module.implements_function(name, query_imports=True))
    if uses_amx(target, kernels) and not request_amx():
        raise RuntimeError(f"{spec.name} for {target_label(target)} runs on AMX, which this CPU or OS does not provide")
    return kernels
