"""Tuning of the CUDA kernels' knobs: compile a grid of candidates on any machine with nvcc,
time them on the GPU (TVM runtime only), record the fastest per spec in
`tuning_logs/cuda/knobs.json`, which every later build reads.

The CUDA attention kernels are TIRx native kernels generated from Python knobs, which
MetaSchedule traces cannot describe (see the GPU cookbook), so the search is this explicit grid.

    python -m tvmflash.tune_cuda build DIR [forward|backward]  # here: DIR/<spec>/<knobs>.so + index
    python -m tvmflash.tune_cuda time DIR      # on the GPU: DIR/timings.json
    python -m tvmflash.tune_cuda record DIR    # here: best knobs -> tuning_logs/cuda/knobs.json

The forward and the backward have separate knobs and are tuned as separate phases: a
candidate varies one phase's knobs (the other's stay at their record) and is timed on that
phase's kernels; the record keeps the best of each phase.
"""
from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

from ._paths import TUNING_LOGS_DIR
from .spec import AttentionSpec

TUNED_SPECS = [AttentionSpec(dt, d, causal=c) for dt, d, c in itertools.product(
    ("float16", "bfloat16"), (64, 128), ("none", "top_left", "bottom_right"))]
SMEM_LIMIT = 227 * 1024


def candidates(spec: AttentionSpec, phase: str = "forward", arch: str = "sm_90a") -> list[dict]:
    """The knob grid of `phase`'s kernels for `spec` on `arch`: the wgmma kernels' knobs where
    they take the spec (sm_90a), else the mma.sync kernels'."""
    from .schedules import cuda_backward_wgmma, cuda_forward_wgmma

    row_bytes = (spec.head_dim + 8) * 2
    out = []
    d = spec.head_dim
    if phase == "forward" and cuda_forward_wgmma.supports(spec, arch):
        for bn, wg in itertools.product((64, 128), (1, 2)):
            if (64 * wg + 4 * bn) * d * 2 <= SMEM_LIMIT:  # Q + two K and two V tiles
                out.append({"forward_wgmma": 1, "wgmma_block_n": bn, "wgmma_warpgroups": wg})
    elif phase == "forward":
        for bm, bn, q_regs, mt, st in itertools.product((64, 128), (32, 64, 128), (1, 0), (1, 2), (2, 3)):
            # two m-tiles per warp double the accumulators: only where registers allow
            fits_regs = mt == 1 or (bn <= 64 and (d <= 64 or (d <= 128 and bn == 32 and not q_regs)))
            if (bm + 2 * st * bn) * row_bytes <= SMEM_LIMIT and not (q_regs and d > 128) and fits_regs:
                out.append({"block_m": bm, "block_n": bn, "q_in_registers": q_regs, "warp_m_tiles": mt,
                            "stages": st})
    elif cuda_backward_wgmma.supports(spec, arch):
        out = [{"bwd_wgmma": 1, "bwd_wgmma_warpgroups": wg, "bwd_wgmma_block_m": bm}
               for wg, bm in itertools.product((1, 2), (64, 128)) if bm == 64 or d <= 64]
    else:
        for bn, bm, stages, split in itertools.product((64, 128), (32, 64), (2, 3), (1, 2)):
            # split: two CTAs per kv-block share the gradient columns (for large head dims)
            smem = (2 * bn + 2 * stages * bm) * row_bytes + 2 * bn * (bm + 8) * 2 + stages * bm * 8
            if smem <= SMEM_LIMIT and (split == 1) == (d <= 128):
                out.append({"bwd_block_n": bn, "bwd_block_m": bm, "bwd_stages": stages, "bwd_d_split": split})
    return out


def _tag(knobs: dict) -> str:
    return "_".join(f"{k}{v}" for k, v in sorted(knobs.items()))


def build(out_dir: Path, phase: str = "forward") -> None:
    from .build import build_module, cuda_target

    index = []
    for spec in TUNED_SPECS:
        for knobs in candidates(spec, phase):
            lib = out_dir / spec.name / f"{_tag(knobs)}.so"
            lib.parent.mkdir(parents=True, exist_ok=True)
            build_module(spec, cuda_target("sm_90a"), knobs).export_library(str(lib))
            index.append({"spec": spec.to_dict(), "phase": phase, "knobs": knobs,
                          "lib": str(lib.relative_to(out_dir))})
            print(f"built {spec.name} {knobs}", flush=True)
    (out_dir / "index.json").write_text(json.dumps(index, indent=1))


SEQLENS = (1024, 4096)  # a candidate's score: the geometric mean of its times at these lengths


def time_candidates(out_dir: Path) -> None:
    """Time every candidate of out_dir/index.json at each of SEQLENS (B = 16384/L, H = 2048/D,
    the benchmark's shapes) into out_dir/timings.json."""
    import math

    from .build import _load, cuda_target

    results = []
    for entry in json.loads((out_dir / "index.json").read_text()):
        spec = AttentionSpec(**{**entry["spec"], "score_mods": ()})
        kern = _load(out_dir / entry["lib"], cuda_target())
        backward = entry.get("phase") == "backward"
        per_length = {L: _time_one(kern, spec, L, backward) for L in SEQLENS}
        ms = math.prod(per_length.values()) ** (1 / len(SEQLENS))
        results.append({**entry, "ms": ms, "ms_per_seqlen": per_length,
                        "tflops": {L: _flops(spec, L, backward) / t / 1e9 for L, t in per_length.items()}})
        print(f"{spec.name} {entry['knobs']}: " + ", ".join(
            f"L={L} {_flops(spec, L, backward) / t / 1e9:.0f} TFLOP/s" for L, t in per_length.items()), flush=True)
    (out_dir / "timings.json").write_text(json.dumps(results, indent=1))


def _flops(spec: AttentionSpec, seqlen: int, backward: bool) -> float:
    from .bench import flops_forward

    forward = flops_forward(16384 // seqlen, 2048 // spec.head_dim, seqlen, spec.head_dim, spec.causal != "none")
    return forward * (2.5 if backward else 1)  # the benchmark's backward convention


def _time_one(kern: dict, spec: AttentionSpec, seqlen: int, backward: bool) -> float:
    """Milliseconds per call of the forward, or of the backward (prep, dK/dV/dQ, convert)."""
    import torch

    from .ops import _backward_cuda, _on_stream

    dt = getattr(torch, spec.dtype)
    b, h, d = 16384 // seqlen, 2048 // spec.head_dim, spec.head_dim
    q, k, v, do = (torch.randn(b, h, seqlen, d, device="cuda", dtype=dt) for _ in range(4))
    o, dq, dk, dv = (torch.empty_like(q) for _ in range(4))
    lse = torch.empty(b, h, seqlen, device="cuda", dtype=torch.float32)

    def call():
        if backward:
            _backward_cuda(kern, do, q, k, v, o, lse, None, (), d ** -0.5, False, dq, dk, dv)
        else:
            kern["forward"](q, k, v, o, lse, d ** -0.5)

    with _on_stream(q.device):
        kern["forward"](q, k, v, o, lse, d ** -0.5)
        for _ in range(3):
            call()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            call()
        end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 20


def record(out_dir: Path) -> None:
    """Merge the fastest candidate per spec into tuning_logs/cuda/knobs.json."""
    path = TUNING_LOGS_DIR / "cuda" / "knobs.json"
    records = json.loads(path.read_text()) if path.exists() else {}
    best: dict = {}
    for r in json.loads((out_dir / "timings.json").read_text()):
        key = (AttentionSpec(**{**r["spec"], "score_mods": ()}).name, r.get("phase", "forward"))
        if key not in best or r["ms"] < best[key]["ms"]:
            best[key] = r
    for (name, phase), r in sorted(best.items()):
        records[name] = {**records.get(name, {}), **r["knobs"]}
        print(f"{name} {phase}: {r['knobs']} {r['tflops']} TFLOP/s")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records, indent=1, sort_keys=True) + "\n")


def main(argv: list[str]) -> None:
    verb, out_dir, *rest = argv
    start = time.time()
    {"build": build, "time": time_candidates, "record": record}[verb](Path(out_dir), *rest)
    print(f"{verb}: {time.time() - start:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
