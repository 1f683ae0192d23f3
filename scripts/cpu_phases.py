"""Where the CPU time goes: per-kernel times of one forward and one backward call (B=1, H=16;
packs, delta and the main kernels apart, the backward's split plan too) with GFLOP/s per
thread, then the torch/TVM thread interplay (a tvmflash call alternating with a torch SDPA
call, against each alone). One JSON line per measurement; `interplay` as the only argument
runs only the latter.

    python scripts/cpu_phases.py                                 # with device_check_cpu.sh's setup
    TVMFLASH_THREADS=tvm python scripts/cpu_phases.py interplay  # the same on TVM's own pool
"""
import json
import os
import statistics
import sys
import time

import torch

import tvmflash
from tvmflash import ops
from tvmflash.build import cpu_target, load_cached
from tvmflash.cpu import request_amx
from tvmflash.spec import AttentionSpec

SHAPES = [("float32", 64, 4096), ("float32", 128, 4096), ("bfloat16", 64, 4096), ("bfloat16", 128, 4096),
          ("bfloat16", 128, 16384)]  # (dtype, head dim, L); the backward up to L = 4096


def median_ms(fn, samples: int = 3) -> float:
    fn()
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times), 3)


def phases(dtype: str, d: int, L: int) -> dict:
    kern = load_cached(AttentionSpec(dtype, d), cpu_target())
    q, k, v, do = (torch.randn(1, 16, L, d, dtype=getattr(torch, dtype)) for _ in range(4))
    o, dq, dk, dv = (torch.empty_like(q) for _ in range(4))
    lse, delta = torch.empty(1, 16, L), torch.empty(1, 16, L)
    scale = d ** -0.5
    packs_f, packs_b = ops._amx_packs(kern, k, v), ops._amx_backward_packs(kern, q, k, v, do)
    kern["forward"](q, k, v, o, lse, scale, *packs_f)  # the backward's lse
    dq_acc = (ops._scratch("dq_acc", (1, 16, d, packs_b[3].shape[3]), torch.float32, tile_rows=True) if packs_b
              else torch.empty(q.shape, dtype=torch.float32))
    calls = {"forward": lambda: kern[ops._forward_kernel_name(kern, q, k)](q, k, v, o, lse, scale, *packs_f)}
    if packs_f:
        calls["forward_pack"] = lambda: ops._amx_packs(kern, k, v)
    if L <= 4096:
        calls["backward_delta"] = lambda: kern["backward_delta"](o, do, delta)
        calls["backward_fused"] = lambda: kern["backward_fused"](q, k, v, do, lse, delta, dk, dv, dq, dq_acc,
                                                                 scale, *packs_b)
        # the split plan (GQA calls whose batch x kv heads do not fill the threads take it)
        calls["backward_dkdv"] = lambda: kern["backward_dkdv"](q, k, v, do, lse, delta, dk, dv, scale, *packs_b)
        calls["backward_dq"] = lambda: kern["backward_dq"](q, k, v, do, lse, delta, dq, scale, *packs_b)
        if packs_b:
            calls["backward_pack"] = lambda: ops._amx_backward_packs(kern, q, k, v, do)
    threads = torch.get_num_threads()
    out = {"spec": f"{dtype}_d{d}", "L": L, "threads": threads, **{name: median_ms(fn) for name, fn in calls.items()}}
    flops = 4 * 16 * L * L * d
    out["fwd_gflops_per_thread"] = round(flops / out["forward"] / 1e6 / threads, 1)
    if "backward_fused" in out:
        out["bwd_gflops_per_thread"] = round(2.5 * flops / out["backward_fused"] / 1e6 / threads, 1)
    return out


def interplay() -> dict:
    q, k, v = (torch.randn(1, 16, 1024, 64, dtype=torch.bfloat16) for _ in range(3))

    def ours():
        tvmflash.scaled_dot_product_attention(q, k, v)

    def theirs():
        torch.nn.functional.scaled_dot_product_attention(q, k, v)

    def per_round(fns, rounds: int = 20) -> float:
        for fn in fns:
            fn()
        start = time.perf_counter()
        for _ in range(rounds):
            for fn in fns:
                fn()
        return (time.perf_counter() - start) / rounds * 1e3

    alone_ours, alone_torch, pair = (statistics.median(per_round(fns) for _ in range(3))
                                     for fns in ([ours], [theirs], [ours, theirs]))
    return {"interplay_ms": {"ours_alone": round(alone_ours, 3), "torch_alone": round(alone_torch, 3),
                             "alternating_pair": round(pair, 3),
                             "overhead_pct": round(100 * (pair / (alone_ours + alone_torch) - 1), 1)},
            "pool": os.environ.get("TVMFLASH_THREADS", "torch"), "threads": torch.get_num_threads()}


if __name__ == "__main__":
    request_amx()
    if sys.argv[1:] != ["interplay"]:
        for shape in SHAPES:
            print(json.dumps(phases(*shape)), flush=True)
    print(json.dumps(interplay()), flush=True)
