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
