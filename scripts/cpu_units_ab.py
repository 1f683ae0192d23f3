"""Same-process A/B of the bf16 kernels' matrix units on one CPU: AMX tiles (sapphirerapids
modules) against `vdpbf16ps` pair dots (cooperlake modules) and torch SDPA; forward and
forward + backward, B = 1, H = 16, medians of interleaved rounds. JSON lines to OUT/cpu-units-ab.jsonl.

    python scripts/cpu_units_ab.py build          # the modules, into $TVMFLASH_CACHE_DIR (needs TVM's compiler)
    python scripts/cpu_units_ab.py run OUT        # on a CPU with AMX (runtime-only TVM will do)
"""
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tvmflash  # noqa: E402
from tvmflash import bench, build  # noqa: E402
from tvmflash.spec import AttentionSpec  # noqa: E402

UNITS = {"amx": "avx512", "pair_dots": "avx512_bf16"}  # name -> TVMFLASH_CPU_TARGET
SHAPES = [(1024, 64), (1024, 128), (4096, 64), (4096, 128)]  # (L, D)


def on(choice: str, fn):
    def call():
        os.environ["TVMFLASH_CPU_TARGET"] = choice
        return fn()
    return call


def run(out: Path) -> None:
    bench.steady_heap()
    rows = []
    for lq, d in SHAPES:
        q, k, v = (torch.randn(1, 16, lq, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        grad = torch.randn_like(q)
        impls = {"torch": lambda: F.scaled_dot_product_attention(q, k, v),
                 **{u: on(c, lambda: tvmflash.scaled_dot_product_attention(q, k, v)) for u, c in UNITS.items()}}
        both = {name: (lambda f=f: torch.autograd.grad(f(), (q, k, v), grad)) for name, f in impls.items()}
        for fn in both.values():  # warm up (first calls load the modules)
            fn()
        iters = 3 if lq >= 4096 else 10
        with torch.no_grad():
            fwd = bench._interleaved_median_ms(impls, 5, iters, "cpu")
        fb = bench._interleaved_median_ms(both, 5, max(iters // 2, 1), "cpu")
        row = {"L": lq, "D": d, "fwd_ms": fwd, "fwd_bwd_ms": fb,
               "vs_torch_fwd": {u: fwd["torch"] / fwd[u] for u in UNITS},
               "vs_torch_fwd_bwd": {u: fb["torch"] / fb[u] for u in UNITS},
               "threads": torch.get_num_threads()}
        print(json.dumps(row), flush=True)
        rows.append(row)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "cpu-units-ab.jsonl", "a") as f:
        f.write(json.dumps({"machine": bench.machine_info("cpu")}) + "\n")
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    if sys.argv[1:] == ["build"]:
        specs = [AttentionSpec("bfloat16", d) for d in (64, 128)]
        for target in (build.AVX512_TARGET, build.AVX512_BF16_TARGET):
            build.build_many(specs, target)
        from tvmflash.cpu import torch_thread_launcher

        torch_thread_launcher(str(build.cache_dir()))  # the OpenMP launcher (the Xeon may lack a C compiler)
    elif sys.argv[1:2] == ["run"] and len(sys.argv) == 3:
        run(Path(sys.argv[2]))
    else:
        sys.exit(__doc__)
