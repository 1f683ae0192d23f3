"""Knob tuning: compile a grid of candidates on any machine with TVM's compiler, time them on
the machine they are for (TVM runtime only), record the fastest per spec in
`tuning_logs/<target>/knobs.json`, which every later build reads. Targets: `cuda` (the H100;
nvcc here) and `avx512` (the Sapphire Rapids Xeon, 16 threads).

    python -m tvmflash.tune build DIR [forward|backward|decode] [cuda|avx512]  # DIR/<spec>/<knobs>.so + index
    python -m tvmflash.tune time DIR      # on the target machine: DIR/timings.json
    python -m tvmflash.tune record DIR    # here: best knobs -> tuning_logs/<target>/knobs.json

The forward and the backward have separate knobs and are tuned as separate phases: a
candidate varies one phase's knobs (the other's stay at their record) and is timed on that
phase's kernels; the record keeps the best of each phase. The `decode` phase (CUDA) tunes the
split-KV decode kernel of kv_cache specs, and with it the launch's CTAs per SM (which sets the
automatic num_splits): each module is timed at every DECODE_CTAS_PER_SM value.

The CUDA kernels are TIRx native kernels generated from Python knobs, which MetaSchedule traces
cannot describe (see the GPU cookbook). The CPU knobs are MetaSchedule decisions
(`schedules/knobs.py`: sample instructions of the trace), but MetaSchedule's own search
compiles on the measuring machine, and the Xeon has only TVM's runtime: so both targets search
this explicit grid, built here and timed there.
"""
from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

from ._paths import TUNING_LOGS_DIR
from .spec import AttentionSpec

TUNED_SPECS = {
    "cuda": [AttentionSpec(dt, d, causal=c) for dt, d, c in itertools.product(
        ("float16", "bfloat16"), (64, 128), ("none", "top_left", "bottom_right"))],
    "avx512": [AttentionSpec(dt, d) for dt, d in itertools.product(("float32", "bfloat16"), (64, 128))],
    "decode": [AttentionSpec(dt, d, kv_cache=True) for dt, d in itertools.product(("float16", "bfloat16"), (64, 128))],
}
DECODE_CTAS_PER_SM = (2, 3, 4, 6, 8)
DECODE_SEQLENS = (8192, 32768)  # B=16, H=32, Hk=8, one query, pages of 16 keys
CPU_BLOCKS = [(64, 64), (64, 128), (128, 64), (128, 128), (32, 64), (64, 32), (32, 128), (256, 128)]  # (block_q, block_k)
CPU_REGISTER_TILES = [(8, 2), (4, 4), (4, 2)]  # (rows, zmm vectors per row) of the FMA matmuls
CPU_PHASE_KERNELS = {"forward": ("forward", "forward_pack"),
                     "backward": ("backward_delta", "backward_fused", "backward_dkdv", "backward_dq", "backward_pack")}
CPU_MATMULS = {"forward": {"forward": ("qk", "pv")},
               "backward": {"backward_fused": ("qk", "dp", "dv", "dk", "dq"),
                            "backward_dkdv": ("qk", "dp", "dv", "dk"), "backward_dq": ("qk", "dp", "dq")}}
SMEM_LIMIT = 227 * 1024


def candidates(spec: AttentionSpec, phase: str = "forward", arch: str = "sm_90a") -> list[dict]:
    """The knob grid of `phase`'s kernels for `spec` on `arch`: the wgmma kernels' knobs where
    they take the spec (sm_90a), else the mma.sync kernels'."""
    from .schedules import cuda_backward_wgmma, cuda_forward_wgmma

    row_bytes = (spec.head_dim + 8) * 2
    out = []
    d = spec.head_dim
    if phase == "decode":
        return [{"decode_block_n": bn, "decode_stages": st, "decode_l2_prefetch": pf}
                for bn, st, pf in itertools.product((16, 32, 64), (2, 3), (0, 256))
                if (16 + 2 * st * bn) * row_bytes <= SMEM_LIMIT]
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


def cpu_candidates(spec: AttentionSpec, phase: str = "forward") -> list[dict]:
    """The avx512 knob grid of `phase`: block sizes, and for the zmm FMA kernels (all but the
    AMX ones) one register tile shape for all of the phase's matmuls."""
    from .schedules.amx_forward import amx_supported

    prefix = "" if phase == "forward" else "bwd_"
    tiles = [None] if amx_supported(spec) else CPU_REGISTER_TILES
    out = []
    for (bq, bk), tile in itertools.product(CPU_BLOCKS, tiles):
        knobs = {f"{prefix}block_q": bq, f"{prefix}block_k": bk}
        if tile:
            for kernel, matmuls in CPU_MATMULS[phase].items():
                for m in matmuls:
                    knobs[f"{kernel}.{m}.rows"], knobs[f"{kernel}.{m}.vecs"] = tile
        out.append(knobs)
    return out


def _tag(knobs: dict) -> str:
    """A file name for a candidate: its knob values in a fixed order (names can be long)."""
    import hashlib

    text = json.dumps(knobs, sort_keys=True)
    return f"{len(knobs)}k-" + hashlib.sha256(text.encode()).hexdigest()[:12]


def build(out_dir: Path, phase: str = "forward", kind: str = "cuda") -> None:
    from .build import AVX512_TARGET, build_module, cuda_target

    target = cuda_target("sm_90a") if kind == "cuda" else AVX512_TARGET
    index = []
    for spec in TUNED_SPECS["decode" if phase == "decode" else kind]:
        for knobs in candidates(spec, phase) if kind == "cuda" else cpu_candidates(spec, phase):
            lib = out_dir / spec.name / f"{_tag(knobs)}.so"
            lib.parent.mkdir(parents=True, exist_ok=True)
            build_module(spec, target, knobs, only=CPU_PHASE_KERNELS.get(phase)).export_library(str(lib))
            index.append({"spec": spec.to_dict(), "target": kind, "phase": phase, "knobs": knobs,
                          "lib": str(lib.relative_to(out_dir))})
            print(f"built {spec.name} {knobs}", flush=True)
    (out_dir / "index.json").write_text(json.dumps(index, indent=1))


SEQLENS = (1024, 4096)  # a candidate's score: the geometric mean of its times at these lengths


def time_candidates(out_dir: Path) -> None:
    """Time every candidate of out_dir/index.json at each of SEQLENS into out_dir/timings.json,
    at the benchmark's shapes: CUDA B = 16384/L, H = 2048/D; CPU B = 1, H = 16 on torch's
    threads."""
    import math

    from .build import _load

    results = []
    for entry in json.loads((out_dir / "index.json").read_text()):
        spec = _spec(entry["spec"])
        kind = entry.get("target", "cuda")
        module = _load(out_dir / entry["lib"], {"kind": "cuda" if kind == "cuda" else "llvm"})
        kern = {name: module[name] for name in _PHASE_FUNCS[kind]
                if module.implements_function(name, query_imports=True)}
        if entry.get("phase") == "decode":
            results += _time_decode(entry, kern, spec)
            continue
        backward = entry.get("phase") == "backward"
        time_one = _time_one if kind == "cuda" else _time_one_cpu
        per_length = {L: time_one(kern, spec, L, backward) for L in SEQLENS}
        ms = math.prod(per_length.values()) ** (1 / len(SEQLENS))
        unit = 1e9 if kind == "cuda" else 1e6  # TFLOP/s, GFLOP/s
        rate = {L: _flops(spec, L, backward, kind) / t / unit for L, t in per_length.items()}
        results.append({**entry, "ms": ms, "ms_per_seqlen": per_length,
                        "tflops" if kind == "cuda" else "gflops": rate})
        print(f"{spec.name} {entry['knobs']}: " + ", ".join(
            f"L={L} {r:.0f} {'TFLOP/s' if kind == 'cuda' else 'GFLOP/s'}" for L, r in rate.items()), flush=True)
    (out_dir / "timings.json").write_text(json.dumps(results, indent=1))


def _time_decode(entry: dict, kern: dict, spec: AttentionSpec) -> list[dict]:
    """A decode candidate at every DECODE_CTAS_PER_SM: ms (geomean over DECODE_SEQLENS) and
    the K/V bandwidth reached, one result each."""
    import math

    import torch

    from . import ops

    b, h, hk, d = 16, 32, 8, spec.head_dim
    dt = getattr(torch, spec.dtype)
    results = []
    for per_sm in DECODE_CTAS_PER_SM:
        per_length = {}
        for length in DECODE_SEQLENS:
            q = torch.randn(b, h, 1, d, device="cuda", dtype=dt)
            k, v = (torch.randn(b * length // 16, 16, hk, d, device="cuda", dtype=dt) for _ in range(2))
            table = torch.randperm(b * length // 16, device="cuda").view(b, -1).to(torch.int32)
            seqlens = torch.full((b,), length, dtype=torch.int32, device="cuda")
            splits = max(1, per_sm * ops._sm_count(q.device) // (b * hk))
            o_part = torch.empty(b, h, splits, 1, d, device="cuda")
            lse_part = torch.empty(b, h, splits, 1, device="cuda")
            out, lse = torch.empty_like(q), torch.empty(b, h, 1, device="cuda")
            starts = torch.zeros_like(seqlens)

            def call():
                kern["decode"](q, k, v, table, seqlens, starts, 0, o_part, lse_part, d ** -0.5)
                kern["decode_combine"](o_part, lse_part, out, lse)
            call()
            per_length[length] = _cuda_ms(call)
        ms = math.prod(per_length.values()) ** (1 / len(per_length))
        rate = {L: 2 * b * hk * L * d * 2 / (t * 1e-3) / 1e12 for L, t in per_length.items()}
        results.append({**entry, "knobs": {**entry["knobs"], "decode_ctas_per_sm": per_sm}, "ms": ms,
                        "ms_per_seqlen": per_length, "tbps": rate})
        print(f"{spec.name} {results[-1]['knobs']}: " + ", ".join(f"L={L} {r:.2f} TB/s" for L, r in rate.items()),
              flush=True)
    return results


_PHASE_FUNCS = {"cuda": ("forward", "backward_prep", "backward_dkdv_dq", "backward_dq_convert", "backward_dkdv",
                         "backward_dq", "decode", "decode_combine"),
                "avx512": tuple(dict.fromkeys(sum(CPU_PHASE_KERNELS.values(), ())))}


def _shape(spec: AttentionSpec, seqlen: int, kind: str) -> tuple:
    """(batch, heads) of the benchmark at `seqlen`."""
    return (16384 // seqlen, 2048 // spec.head_dim) if kind == "cuda" else (1, 16)


def _flops(spec: AttentionSpec, seqlen: int, backward: bool, kind: str = "cuda") -> float:
    from .bench import flops_forward

    forward = flops_forward(*_shape(spec, seqlen, kind), seqlen, spec.head_dim, spec.causal != "none")
    return forward * (2.5 if backward else 1)  # the benchmark's backward convention


def _time_one(kern: dict, spec: AttentionSpec, seqlen: int, backward: bool) -> float:
    """Milliseconds per call of the forward, or of the backward (prep, dK/dV/dQ, convert)."""
    import torch

    from .ops import _backward_cuda, _on_stream

    dt = getattr(torch, spec.dtype)
    (b, h), d = _shape(spec, seqlen, "cuda"), spec.head_dim
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
        return _cuda_ms(call)


def _cuda_ms(call, iters: int = 20) -> float:
    """Milliseconds per call of `call` over `iters` back-to-back calls (CUDA events)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


CPU_SAMPLES, CPU_SAMPLE_S = 3, 0.1  # a CPU candidate's time: median of this many samples of >= this long


def _time_one_cpu(kern: dict, spec: AttentionSpec, seqlen: int, backward: bool) -> float:
    """Milliseconds per call of the forward (with its packs), or of the backward (delta, the
    planned dK/dV/dQ kernels, packs): the median of CPU_SAMPLES samples after a warm-up call."""
    import statistics
    import time as clock

    import torch

    from .cpu import request_amx
    from .ops import _amx_packs, _backward_cpu

    request_amx()  # before the first AMX kernel of the process

    dt = getattr(torch, spec.dtype)
    b, h = _shape(spec, seqlen, "avx512")
    q, k, v, do = (torch.randn(b, h, seqlen, spec.head_dim, dtype=dt) for _ in range(4))
    o, dq, dk, dv = (torch.empty_like(q) for _ in range(4))
    lse = torch.zeros(b, h, seqlen, dtype=torch.float32)
    scale = spec.head_dim ** -0.5

    def call():
        if backward:
            _backward_cpu(kern, do, q, k, v, o, lse, None, (), scale, dq, dk, dv)
        else:
            kern["forward"](q, k, v, o, lse, scale, *_amx_packs(kern, k, v))

    start = clock.perf_counter()
    call()
    iters = max(1, int(CPU_SAMPLE_S / max(clock.perf_counter() - start, 1e-6)))
    samples = []
    for _ in range(CPU_SAMPLES):
        start = clock.perf_counter()
        for _ in range(iters):
            call()
        samples.append((clock.perf_counter() - start) / iters * 1e3)
    return statistics.median(samples)


def _spec(fields: dict) -> AttentionSpec:
    """A spec from its to_dict() form (logs written before `variants` had `score_mods: []`)."""
    return AttentionSpec(**{k: tuple(v) if k == "variants" else v for k, v in fields.items() if k != "score_mods"})


def record(out_dir: Path) -> None:
    """Merge the fastest candidate per spec and phase into tuning_logs/<target>/knobs.json."""
    best: dict = {}
    for r in json.loads((out_dir / "timings.json").read_text()):
        key = (r.get("target", "cuda"), _spec(r["spec"]).name, r.get("phase", "forward"))
        if key not in best or r["ms"] < best[key]["ms"]:
            best[key] = r
    for kind in sorted({k[0] for k in best}):
        path = TUNING_LOGS_DIR / kind / "knobs.json"
        records = json.loads(path.read_text()) if path.exists() else {}
        for (_, name, phase), r in sorted(item for item in best.items() if item[0][0] == kind):
            records[name] = {**records.get(name, {}), **r["knobs"]}
            print(f"{kind} {name} {phase}: {r['knobs']} {r.get('tflops') or r.get('gflops') or r.get('tbps')}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(records, indent=1, sort_keys=True) + "\n")


def main(argv: list[str]) -> None:
    verb, out_dir, *rest = argv
    start = time.time()
    {"build": build, "time": time_candidates, "record": record}[verb](Path(out_dir), *rest)
    print(f"{verb}: {time.time() - start:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
