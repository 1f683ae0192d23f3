"""What this process's CPU can run: feature flags, and the OS permission AMX needs.

Linux hands out AMX tile state only to processes that ask (arch_prctl ARCH_REQ_XCOMP_PERM for
XTILEDATA); without it the first tile instruction raises SIGILL. Asked once per process,
before the first AMX kernel runs (the permission covers every thread, TVM's workers too).
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

SYS_ARCH_PRCTL = 158
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
# what the AVX512 schedule's sapphirerapids modules execute
AVX512_AMX_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


@functools.lru_cache(maxsize=None)
def request_amx() -> bool:
    """Ask Linux for AMX tile state (once per process); True when granted."""
    if not {"amx_tile", "amx_bf16"} <= cpu_flags():
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def runs_avx512_amx() -> bool:
    """Whether sapphirerapids-class modules (AVX512 + AMX) run here."""
    return set(AVX512_AMX_FLAGS) <= cpu_flags() and request_amx()


# ----------------------------------------------------------------------------- threads
# TVM's CPU modules run their parallel loops on TVM's own thread pool. Next to torch's OpenMP
# pool that is two sets of busy-waiting threads on the same cores: measured on the 16-core Xeon,
# alternating a tvmflash call and a torch SDPA call took 4.7x the time of the two alone. So
# modules are pointed at a launcher that runs their tasks on torch's OpenMP threads instead (the
# libgomp torch loaded; one pool, torch.set_num_threads applies). It is a few lines of C built
# once with the system C compiler; without one, TVM's pool stays, told not to spin.
_LAUNCHER_C = r"""/* tvmflash: TVM parallel launches on the process's OpenMP (libgomp) thread pool */
typedef struct { void *sync_handle; int num_task; } TVMParallelGroupEnv;
typedef int (*FTVMParallelLambda)(int task_id, TVMParallelGroupEnv *penv, void *cdata);
void GOMP_parallel(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags);
void GOMP_barrier(void);
int omp_get_thread_num(void);
int omp_get_num_threads(void);
struct job { FTVMParallelLambda f; void *cdata; volatile int rc; };
static void run(void *p) {
  struct job *j = (struct job *)p;
  TVMParallelGroupEnv env = {0, omp_get_num_threads()};
  int rc = j->f(omp_get_thread_num(), &env, j->cdata);
  if (rc) j->rc = rc;
}
int tvmflash_parallel_launch(FTVMParallelLambda f, void *cdata, int num_task) {
  struct job j = {f, cdata, 0};
  GOMP_parallel(run, &j, num_task > 0 ? (unsigned)num_task : 0u, 0u);
  return j.rc;
}
int tvmflash_parallel_barrier(int task_id, TVMParallelGroupEnv *penv) {
  (void)task_id; (void)penv;
  GOMP_barrier();
  return 0;
}
"""


def _loaded_libgomp() -> str | None:
    """Path of the libgomp this process (torch) has loaded, if any."""
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            path = line.split()[-1]
            if "/libgomp" in path and ".so" in path:
                return path
    except OSError:
        pass
    return None


@functools.lru_cache(maxsize=None)
def torch_thread_launcher(cache_dir: str):
    """The launcher library (built into `cache_dir` on first use), or None where torch does not
    run on libgomp, there is no C compiler, or TVMFLASH_THREADS=tvm."""
    import hashlib
    import os
    import subprocess
    import tempfile

    gomp = _loaded_libgomp()
    if os.environ.get("TVMFLASH_THREADS", "torch") == "tvm" or gomp is None:
        return None
    # linked by soname: the library serves any environment whose torch loads a libgomp.so.1
    tag = hashlib.sha256((_LAUNCHER_C + Path(gomp).name).encode()).hexdigest()[:12]
    lib = Path(cache_dir) / "launcher" / f"omp-launcher-{tag}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
            src, out = Path(tmp) / "launcher.c", Path(tmp) / lib.name
            src.write_text(_LAUNCHER_C)
            try:
                subprocess.run([os.environ.get("CC", "cc"), "-O2", "-shared", "-fPIC", "-o", str(out), str(src), gomp],
                               check=True, capture_output=True)
            except (OSError, subprocess.CalledProcessError):
                return None
            os.replace(out, lib)
    return ctypes.CDLL(str(lib))


def use_torch_threads(module_path: str, cache_dir: str) -> bool:
    """Point the parallel launches of the loaded CPU module at `module_path` to torch's OpenMP
    pool; True if done (else the module keeps TVM's pool)."""
    import os

    launcher = torch_thread_launcher(cache_dir)
    if launcher is None:
        return False
    module = ctypes.CDLL(module_path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)  # TVM's handle
    for slot, impl in (("__TVMBackendParallelLaunch", launcher.tvmflash_parallel_launch),
                       ("__TVMBackendParallelBarrier", launcher.tvmflash_parallel_barrier)):
        try:
            pointer = ctypes.c_void_p.in_dll(module, slot)
        except ValueError:  # the module does not use it
            continue
        pointer.value = ctypes.cast(impl, ctypes.c_void_p).value
    return True
