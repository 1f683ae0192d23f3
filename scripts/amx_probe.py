"""AMX tile throughput on this machine, to set the AMX kernels' time against what the tiles
can do: `tdpbf16ps` issued back to back on four accumulators (no loads), and 32 x 32 C blocks
shaped like the kernels' tile GEMMs (schedules/amx.py: 2 x 2 C tiles, A and B tiles loaded per
k-step, C zeroed before and stored after) with k = 2 or 4 steps (head dim 64 / 128 of Q.K^T),
A read from L1 or streamed from a 512 KB region (L2). Prints ns per `tdpbf16ps` and GFLOP/s
per core at 1 and 16 threads, one JSON line each.

    python scripts/amx_probe.py build   # where TVM's compiler is: writes .devcache/cpu/amx_probe.so
    python scripts/amx_probe.py         # on the AMX machine (TVM's runtime is enough)
"""
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
LIB = ROOT / ".devcache" / "cpu" / "amx_probe.so"  # next to device_prebuild_cpu.py's modules
TASKS = 16
SCRATCH = 1 << 20  # bytes per task
FLOP_PER_TDP = 16 * 16 * 32 * 2
TDP_PER_ITER = 16
# name -> (k-steps per C block or 0 for tdpbf16ps alone, A streamed from L2)
PATTERNS = {"tdp_only": (0, False), "block_k2_l1": (2, False), "block_k4_l1": (4, False),
            "block_k4_l2": (4, True)}


def probe_kernel(name: str, k_steps: int, a_from_l2: bool):
    from tvm.script import tirx as T

    from tvmflash.schedules.amx import amx, configure_tiles, release_tiles, row_bytes, tmm

    blocks = TDP_PER_ITER // (4 * k_steps) if k_steps else 0

    @T.prim_func(s_tir=True)
    def kernel(buf: T.Buffer((TASKS, SCRATCH), "uint8"), iters: T.int32):
        T.func_attr({"tirx.noalias": True})
        for t in T.parallel(TASKS):
            with T.sblock("task"):
                vt = T.axis.spatial(TASKS, t)
                cfg = T.sblock_alloc_buffer((64,), "uint8")
                configure_tiles(cfg)
                for c in T.unroll(8):
                    T.evaluate(amx("tileloadd64", tmm(c), T.address_of(buf[vt, c * 1024]), row_bytes(64)))
                for it in T.serial(iters):
                    if k_steps == 0:
                        for r in T.unroll(TDP_PER_ITER // 4):
                            for c in T.unroll(4):
                                T.evaluate(amx("tdpbf16ps", tmm(c), tmm(4 + c // 2), tmm(6 + c % 2)))
                    else:
                        for blk in T.unroll(blocks):
                            for c in T.unroll(4):
                                T.evaluate(amx("tilezero", tmm(c)))
                            for kc in T.unroll(k_steps):
                                step = T.meta_var((it * blocks + blk) * k_steps + kc)
                                a_at = T.meta_var(65536 + step % 224 * 2048 if a_from_l2 else 8192 + kc * 2048)
                                for x in T.unroll(2):
                                    T.evaluate(amx("tileloadd64", tmm(4 + x), T.address_of(buf[vt, a_at + x * 1024]),
                                                   row_bytes(64)))
                                    T.evaluate(amx("tileloadd64", tmm(6 + x),
                                                   T.address_of(buf[vt, 16384 + kc * 2048 + x * 1024]), row_bytes(64)))
                                for c in T.unroll(4):
                                    T.evaluate(amx("tdpbf16ps", tmm(c), tmm(4 + c // 2), tmm(6 + c % 2)))
                            for c in T.unroll(4):
                                T.evaluate(amx("tilestored64", tmm(c), T.address_of(buf[vt, 32768 + c * 1024]),
                                               row_bytes(64)))
                release_tiles()

    return kernel.with_attr("global_symbol", name)


def build() -> None:
    import tvm

    from tvmflash.build import AVX512_TARGET

    mod = tvm.IRModule({name: probe_kernel(name, *shape) for name, shape in PATTERNS.items()})
    LIB.parent.mkdir(parents=True, exist_ok=True)
    tvm.compile(mod, target=tvm.target.Target(AVX512_TARGET)).export_library(str(LIB))
    print(f"wrote {LIB}")


def measure(iters: int = 20000) -> None:
    import torch
    import tvm

    from tvmflash.build import cache_dir
    from tvmflash.cpu import request_amx, use_torch_threads

    assert request_amx(), "no AMX here"
    mod = tvm.runtime.load_module(str(LIB))
    use_torch_threads(str(LIB), str(cache_dir()))
    buf = torch.zeros(TASKS, SCRATCH, dtype=torch.uint8)
    for threads in (1, TASKS):
        torch.set_num_threads(threads)
        for name in PATTERNS:
            fn = mod[name]
            fn(buf, 10)
            best = min(_seconds(fn, buf, iters) for _ in range(5))
            tdp_per_thread = iters * TDP_PER_ITER * TASKS / threads
            print(json.dumps({"pattern": name, "threads": threads, "ns_per_tdp": round(best / tdp_per_thread * 1e9, 2),
                              "gflops_per_core": round(FLOP_PER_TDP * tdp_per_thread / best / 1e9, 1)}), flush=True)


def _seconds(fn, buf, iters: int) -> float:
    start = time.perf_counter()
    fn(buf, iters)
    return time.perf_counter() - start


if __name__ == "__main__":
    build() if sys.argv[1:] == ["build"] else measure()
