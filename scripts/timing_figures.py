"""Timing figures of the build-and-deploy workflow (issue 7): cold build time of one forward +
backward spec per target (empty cache), warm load time from the cache in a fresh process, and
the tuning time to reach 95% of the final speed (from a `tvmflash tune` work directory).

    python scripts/timing_figures.py cold [host avx512 cuda]     # here (TVM's compiler)
    python scripts/timing_figures.py warm [cpu|cuda]             # where the modules run
    python scripts/timing_figures.py tune WORK_DIR               # after `tvmflash tune`
Each prints one JSON line (and appends it to $OUT/timing-figures.jsonl when OUT is set).
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SPEC = ("bfloat16", 128, "bottom_right")  # one forward + backward spec (causal bf16, D = 128)

WARM = """
import time, json, sys
start = time.perf_counter()
import torch
t_torch = time.perf_counter()
import tvmflash
from tvmflash import build
from tvmflash.spec import AttentionSpec
build._tvm()
t_import = time.perf_counter()
device = sys.argv[1]
target = build.cuda_target_for_device(0) if device == "cuda" else build.cpu_target()
kernels = build.load_cached(AttentionSpec(*{spec!r}), target)
t_load = time.perf_counter()
print(json.dumps({{"torch_import_s": t_torch - start, "tvmflash_tvm_import_s": t_import - t_torch,
                  "module_load_s": t_load - t_import}}))
"""


def emit(record: dict) -> None:
    line = json.dumps(record)
    print(line)
    if os.environ.get("OUT"):
        with open(Path(os.environ["OUT"]) / "timing-figures.jsonl", "a") as f:
            f.write(line + "\n")


def cold(kinds: list) -> None:
    from tvmflash import build
    from tvmflash.spec import AttentionSpec

    targets = {"host": lambda: {**build.host_target(), "mcpu": os.environ.get("TVMFLASH_HOST_MCPU", "haswell")},
               "avx512": lambda: build.AVX512_TARGET, "cuda": lambda: build.cuda_target("sm_90a")}
    for kind in kinds or ["host", "avx512", "cuda"]:
        with tempfile.TemporaryDirectory() as cache:
            os.environ["TVMFLASH_CACHE_DIR"] = cache
            start = time.perf_counter()
            build.build_cached(AttentionSpec(*SPEC), targets[kind]())
            emit({"figure": "cold build", "target": kind, "spec": AttentionSpec(*SPEC).name,
                  "seconds": round(time.perf_counter() - start, 1), "cores": os.cpu_count()})


def warm(device: str, runs: int = 5) -> None:
    """A fresh process per run; the module is in the cache (built or copied beforehand)."""
    from tvmflash import build
    from tvmflash.spec import AttentionSpec

    target = build.cuda_target("sm_90a") if device == "cuda" else build.cpu_target()
    assert build.library_path(AttentionSpec(*SPEC), target).exists() or device == "cuda", "build it first"
    samples = []
    for _ in range(runs):
        proc = subprocess.run([sys.executable, "-c", WARM.format(spec=SPEC), device], capture_output=True,
                              text=True, env={**os.environ, "TVMFLASH_QUIET": "1"}, check=True)
        samples.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    emit({"figure": "warm load", "device": device, "runs": runs,
          **{k: round(statistics.median(s[k] for s in samples) * 1e3, 1) for k in samples[0]}, "unit": "ms"})


def tune(work_dir: str) -> None:
    from tvmflash.tune import time_to_fraction

    history = [json.loads(line) for line in (Path(work_dir) / "history.jsonl").read_text().splitlines()]
    for (spec, phase), seconds in time_to_fraction(history).items():
        total = max(h["elapsed_s"] for h in history)
        emit({"figure": "tuning to 95% of the final speed", "spec": spec, "phase": phase, "seconds": seconds,
              "run_seconds": total, "candidates": sum(h["spec"] == spec and h["phase"] == phase for h in history)})


if __name__ == "__main__":
    verb, *args = sys.argv[1:]
    {"cold": lambda: cold(args), "warm": lambda: warm(*(args or ["cpu"])), "tune": lambda: tune(*args)}[verb]()
