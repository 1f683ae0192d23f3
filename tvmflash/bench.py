"""Benchmark tvmflash attention against PyTorch's own SDPA.

Protocol
--------
* Layout (B, H, L, D) with Lq = Lk = L (or a fixed Lq, e.g. 1 for decode); inputs are built once per grid point
  with ``torch.manual_seed(0)`` and shared by every implementation.
* FLOPs: forward = 4·B·H·Lq·Lk·D (halved when causal), backward = 2.5 × forward.
* Forward is timed with autograd enabled (inputs require grad), i.e. the
  forward that a training step runs; forward-only points (``backward=False``, e.g.
  decode) with inputs that do not require grad, as inference runs them.  Backward is timed alone:
  ``torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)`` on a
  forward output computed beforehand, identically for every implementation.
* Warm-up: ``warmup`` forward+backward calls per implementation before timing
  (tvmflash's first call may compile a kernel).
* Timing: ``rounds`` samples per implementation, taken interleaved (the order of
  implementations rotates every round so none systematically runs first).  One
  sample is the mean time of ``iters`` back-to-back calls; the reported time is
  the **median** of the samples.  ``iters=None`` picks it per point so that a
  sample lasts roughly ``SAMPLE_TARGET_S``.
* CPU uses ``time.perf_counter``, with glibc's heap thresholds fixed first
  (``steady_heap``: torch's CPU SDPA otherwise runs up to 2x slower in some processes);
  CUDA uses CUDA events, and additionally
  compares against the FLASH and CUDNN SDPA backends (a backend that rejects
  the point, e.g. FLASH with fp32, is recorded as ``None``).
* ``ratio = baseline_time / tvmflash_time``: above 1 means tvmflash is faster.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import warnings
from datetime import datetime, timezone
from itertools import product
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")
SAMPLE_TARGET_S = 0.2
MAX_AUTO_ITERS = 100
BASELINE = "torch"  # the baseline every row has; CUDA rows add "flash" and "cudnn"
REQUIRED = ("ours", BASELINE)  # the others are skipped where they raise

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# --------------------------------------------------------------------------- #
# Implementations
# --------------------------------------------------------------------------- #
def _implementations(device: str, causal: bool) -> dict[str, Attention]:
    """Name -> attention callable; "ours" first, then the baselines."""
    import tvmflash

    impls: dict[str, Attention] = {
        "ours": lambda q, k, v: tvmflash.scaled_dot_product_attention(q, k, v, is_causal=causal),
        BASELINE: lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
    }
    if device == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def pinned(backend: SDPBackend) -> Attention:
            def attention(q, k, v):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

            return attention

        impls["flash"] = pinned(SDPBackend.FLASH_ATTENTION)
        impls["cudnn"] = pinned(SDPBackend.CUDNN_ATTENTION)
    return impls


# --------------------------------------------------------------------------- #
# Timing
# --------------------------------------------------------------------------- #
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
_steady_heap = False


def steady_heap() -> bool:
    """Keep freed memory in this process's heap (glibc's mallopt; called by the CPU benchmarks
    before they time anything). torch's CPU SDPA allocates its scratch afresh on every call;
    under glibc's adaptive mmap threshold those allocations are, depending on what the
    process allocated before, fresh mappings whose pages fault in on each call: the same torch
    call measured 2.3 or 5.4 ms (bf16 B=1 H=16 L=1024 D=64 on the GPU machine's Xeon) in two
    processes. Fixed thresholds put every process at the fast end: torch at its best, ours
    too. True where applied (recorded by machine_info)."""
    global _steady_heap
    try:
        libc = ctypes.CDLL(None)
        _steady_heap = bool(libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20) and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError):  # not glibc
        _steady_heap = False
    return _steady_heap


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _mean_ms(fn: Callable[[], object], iters: int, device: str) -> float:
    """Mean wall time of one call of ``fn`` over ``iters`` back-to-back calls, in ms, after one
    untimed call: in an interleave the first call would pay for the caches the previous
    function left (a decode at 1k keys reads 67 MB, which the Xeon's L3 and half the H200's L2
    hold: the function timed after another's data ran 8-16% slower than after its own)."""
    fn()
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


def _interleaved_median_ms(fns: dict[str, Callable[[], object]], rounds: int, iters: int, device: str) -> dict[str, float]:
    """Median over ``rounds`` samples per function, each round in a fresh order (seeded shuffle).
    A rotating order kept each function's predecessor fixed, and what runs before a GPU call
    moves its time: on the H100 one module timed as three entries measured 3.7-5.9% slower (bf16
    softcap forward at 16k) as the entry that always followed a plain forward + backward."""
    names = list(fns)
    shuffle = random.Random(0).shuffle
    samples: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        order = list(names)
        shuffle(order)
        for name in order:
            samples[name].append(_mean_ms(fns[name], iters, device))
    return {name: statistics.median(s) for name, s in samples.items()}


def _warm_up(attention: Attention, q, k, v, grad_out, warmup: int, device: str,
             backward: bool = True) -> tuple[torch.Tensor, float]:
    """Run ``warmup`` forward+backward calls, then one timed call; return its output (graph kept) and ms."""
    for _ in range(warmup):
        out = attention(q, k, v)
        if backward:
            torch.autograd.grad(out, (q, k, v), grad_out)
    _sync(device)
    t0 = time.perf_counter()
    out = attention(q, k, v)
    if backward:
        torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)
    _sync(device)
    return out, (time.perf_counter() - t0) * 1e3


def _auto_iters(call_ms: float) -> int:
    return max(1, min(MAX_AUTO_ITERS, round(SAMPLE_TARGET_S * 1e3 / max(call_ms, 1e-3))))


# --------------------------------------------------------------------------- #
# Benchmark grid
# --------------------------------------------------------------------------- #
def flops_forward(batch: int, heads: int, seqlen: int, head_dim: int, causal: bool,
                  seqlen_q: int | None = None) -> float:
    return 4.0 * batch * heads * (seqlen_q or seqlen) * seqlen * head_dim * (0.5 if causal else 1.0)


def _bench_point(
    impls: dict[str, Attention],
    *,
    device: str,
    dtype: str,
    batch: int,
    heads: int,
    seqlen: int,
    seqlen_q: int | None,
    head_dim: int,
    causal: bool,
    rounds: int,
    iters: int | None,
    warmup: int,
    backward: bool,
    status: Callable[[str], None],
) -> dict:
    torch.manual_seed(0)
    shape = (batch, heads, seqlen, head_dim)
    q_shape = (batch, heads, seqlen_q or seqlen, head_dim)
    # forward-only points time inference calls (no autograd graph), as a server makes them
    q, k, v = (torch.randn(sh, device=device, dtype=DTYPES[dtype], requires_grad=backward)
               for sh in (q_shape, shape, shape))
    grad_out = torch.randn(q_shape, device=device, dtype=DTYPES[dtype])

    # Warm-up (compiles tvmflash's kernels on first use) and drop baselines that reject this point.
    status("warm-up (first tvmflash call may compile)")
    outs: dict[str, torch.Tensor] = {}
    call_ms: dict[str, float] = {}
    for name, attention in impls.items():
        try:
            with warnings.catch_warnings():
                if name not in REQUIRED:
                    warnings.simplefilter("ignore")  # sdpa_kernel warns about every backend it can't use
                outs[name], call_ms[name] = _warm_up(attention, q, k, v, grad_out, warmup, device, backward)
        except RuntimeError:
            if name in REQUIRED:
                raise
    n_iters = iters or _auto_iters(max(call_ms.values()) / (3.5 if backward else 1))  # fwd+bwd ~ 3.5 fwd

    status("timing forward")
    fwd = _interleaved_median_ms(
        {name: (lambda a=impls[name]: a(q, k, v)) for name in outs}, rounds, n_iters, device
    )
    bwd = dict.fromkeys(outs)
    if backward:
        status("timing backward")
        bwd = _interleaved_median_ms(
            {name: (lambda o=out: torch.autograd.grad(o, (q, k, v), grad_out, retain_graph=True))
             for name, out in outs.items()},
            rounds,
            n_iters,
            device,
        )

    gflop_fwd = flops_forward(batch, heads, seqlen, head_dim, causal, seqlen_q) / 1e9
    gflop_bwd = 2.5 * gflop_fwd
    timings = {
        name: (
            {
                "fwd_ms": fwd[name],
                "bwd_ms": bwd[name],
                "fwd_gflops": gflop_fwd / (fwd[name] / 1e3),
                "bwd_gflops": gflop_bwd / (bwd[name] / 1e3) if backward else None,
            }
            if name in outs
            else None
        )
        for name in impls
    }
    ratios = {
        name: {"fwd": t["fwd_ms"] / fwd["ours"], "bwd": t["bwd_ms"] / bwd["ours"] if backward else None}
        if t else None
        for name, t in timings.items()
        if name != "ours"
    }
    return {
        "device": device,
        "dtype": dtype,
        "batch": batch,
        "heads": heads,
        "seqlen": seqlen,
        "seqlen_q": seqlen_q or seqlen,
        "head_dim": head_dim,
        "causal": causal,
        "threads": torch.get_num_threads(),
        "fp32_matmul_precision": torch.get_float32_matmul_precision(),
        "rounds": rounds,
        "iters": n_iters,
        "gflop_fwd": gflop_fwd,
        "gflop_bwd": gflop_bwd,
        "fwd_max_abs_diff": (outs["ours"].float() - outs[BASELINE].float()).abs().max().item(),
        "timings": timings,
        "ratio": ratios,
    }


def run(
    *,
    device: str = "cpu",
    dtypes: Iterable[str] = ("fp32", "bf16"),
    seqlens: Iterable[int] = (512, 2048),
    seqlen_q: int | None = None,
    head_dims: Iterable[int] = (64, 128),
    causal: Iterable[bool] = (False,),
    batch: int | None = None,
    heads: int | None = None,
    rounds: int = 5,
    iters: int | None = None,
    warmup: int = 2,
    backward: bool = True,
    fp32_precision: str | None = None,
    console: Console | None = None,
) -> list[dict]:
    """Benchmark every (dtype, causal, head_dim, seqlen) point; one result dict per point.
    With ``backward=False`` only the forward is timed (bwd fields are None); ``seqlen_q`` fixes
    the query length (decode: 1) while ``seqlens`` sets the key length. ``batch``/``heads``
    None follow DESIGN.md's protocol: on CPU B=1, H=16; on CUDA B=16384/L, H=2048/D.
    ``fp32_precision`` ("highest", "high", "medium"): torch's float32 matmul precision during
    the run, for both sides (fp32 forwards on AMX CPUs take the bf16x3 kernel below "highest";
    each row records it).

    Progress goes to ``console`` (stderr by default).
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cpu":
        steady_heap()
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' requested but torch.cuda.is_available() is False")
    unknown = set(dtypes) - DTYPES.keys()
    if unknown:
        raise ValueError(f"unknown dtype(s) {sorted(unknown)}; choose from {list(DTYPES)}")

    points = list(product(dtypes, causal, head_dims, seqlens))
    with float32_matmul_precision(fp32_precision):
        return _run_points(points, device, seqlen_q, batch, heads, rounds, iters, warmup, backward, console)


@contextlib.contextmanager
def float32_matmul_precision(precision: str | None):
    """torch.set_float32_matmul_precision(precision) inside (None: as it is)."""
    old = torch.get_float32_matmul_precision()
    if precision is not None:
        torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


def _run_points(points, device, seqlen_q, batch, heads, rounds, iters, warmup, backward, console) -> list[dict]:
    rows = []
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console or Console(stderr=True)) as progress:
        task = progress.add_task("benchmark", total=len(points))
        for dtype, is_causal, head_dim, seqlen in points:
            label = f"{dtype} D={head_dim} L={seqlen}" + (f" Lq={seqlen_q}" if seqlen_q else "") + (
                " causal" if is_causal else "")

            def status(stage: str, label: str = label) -> None:
                progress.update(task, description=f"{label}: {stage}")

            row = _bench_point(
                _implementations(device, is_causal),
                device=device,
                dtype=dtype,
                batch=batch or (16384 // seqlen if device == "cuda" else 1),
                heads=heads or (2048 // head_dim if device == "cuda" else 16),
                seqlen=seqlen,
                seqlen_q=seqlen_q,
                head_dim=head_dim,
                causal=is_causal,
                rounds=rounds,
                iters=iters,
                warmup=warmup,
                backward=backward,
                status=status,
            )
            rows.append(row)
            r = row["ratio"][BASELINE]
            bwd_text = f"  bwd ×{r['bwd']:.2f}" if backward else ""
            progress.console.log(f"{label}: fwd ×{r['fwd']:.2f}{bwd_text} vs {BASELINE}")
            progress.advance(task)
        progress.update(task, description="done")
    return rows


def cpu_report(out_dir: str | Path, tag: str, rounds: int = 5, long_seqlen: int = 16384) -> list[Path]:
    """The CPU grid of DESIGN.md / issue 4 (B=1, H=16; fp32 and bf16; D {64, 128}; L {1024, 4096};
    forward and backward), its fp32 points again under torch's float32 matmul precision "high"
    (both sides; ours: the bf16x3 forward on AMX), then forward only at L=``long_seqlen`` and
    decode (Lq=1, Lk {4096, ``long_seqlen``}): ``<tag>.json``, ``<tag>-fp32-high.json``,
    ``<tag>-long.json``, ``<tag>-decode.json`` (+ PNGs)."""
    parts = [
        ("", dict(seqlens=[1024, 4096], backward=True, rounds=rounds)),
        ("-fp32-high", dict(dtypes=["fp32"], seqlens=[1024, 4096], backward=True, rounds=rounds, fp32_precision="high")),
        ("-long", dict(seqlens=[long_seqlen], backward=False, rounds=max(2, rounds // 2), warmup=1)),
        ("-decode", dict(seqlens=[4096, long_seqlen], seqlen_q=1, backward=False, rounds=rounds)),
    ]
    paths = []
    for suffix, kwargs in parts:
        rows = run(device="cpu", **{"dtypes": ["fp32", "bf16"], **kwargs}, head_dims=[64, 128])
        print_table(rows)
        paths.append(write_results(rows, out_dir, tag + suffix)[0])
        print(paths[-1], flush=True)
    return paths


# --------------------------------------------------------------------------- #
# Reporting
# --------------------------------------------------------------------------- #
def geomean(values: Iterable[float | None]) -> float:
    """Geometric mean of the non-None values (NaN if there are none)."""
    logs = [math.log(v) for v in values if v is not None]
    return math.exp(sum(logs) / len(logs)) if logs else math.nan


def _ratios(rows: list[dict], baseline: str, pass_: str) -> list[float | None]:
    return [r["ratio"][baseline][pass_] if r["ratio"].get(baseline) else None for r in rows]


def _fmt_gflops(ours: float | None, base: float | None, scale: float) -> str:
    return "—" if ours is None or base is None else f"{ours / scale:.1f} / {base / scale:.1f}"


def _baselines(rows: list[dict]) -> list[str]:
    return list(rows[0]["ratio"]) if rows else []


def _read_cpuinfo() -> tuple[str, list[str]]:
    """(cpu model name, flags) from /proc/cpuinfo; falls back to platform.processor()."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor(), []
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    return fields.get("model name", platform.processor()), fields.get("flags", "").split()


def machine_info(device: str = "cpu") -> dict:
    """Where and with what a benchmark ran."""
    model, flags = _read_cpuinfo()
    import tvmflash

    info = {
        "tvmflash": getattr(tvmflash, "__version__", None),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": model,
        "cpu_count": os.cpu_count(),
        "cpu_flags": {flag: flag in flags for flag in CPU_FLAGS},
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "env": {var: os.environ.get(var) for var in ("OMP_NUM_THREADS", "TVM_NUM_THREADS", "TVMFLASH_CPU_TARGET")},
        "cuda_available": torch.cuda.is_available(),
        "steady_heap": _steady_heap,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git": _git_describe(),
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    else:
        from .build import cpu_target, target_label

        info["tvmflash_cpu_target"] = target_label(cpu_target())
    return info


def cuda_tag() -> str:
    """"cuda-" and the current GPU's model ("cuda-h200" for "NVIDIA H200"): the prefix of the
    result files, so that runs on different GPUs land in different files."""
    words = torch.cuda.get_device_name().replace("NVIDIA", "").split()
    return "cuda-" + (words[0].lower() if words else "gpu")


def _git_describe() -> str | None:
    """The code's revision: $TVMFLASH_REVISION where set (the device scripts set it to the
    revision their modules were built from: the tree copied to the GPU machine carries a
    .git of another commit), else `git describe` of this checkout."""
    if os.environ.get("TVMFLASH_REVISION"):
        return os.environ["TVMFLASH_REVISION"]
    try:
        result = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() or None


def write_revision(folder: str | Path) -> None:
    """folder/REVISION: this checkout's revision (`_git_describe`), which the device scripts
    export as $TVMFLASH_REVISION beside the modules built into `folder`."""
    (Path(folder) / "REVISION").write_text((_git_describe() or "unknown") + "\n")


def write_results(rows: list[dict], out_dir: str | Path, tag: str) -> tuple[Path, Path]:
    """Write ``<out_dir>/<tag>.json`` (rows + machine info) and ``<out_dir>/<tag>.png``; return both paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out_dir / f"{tag}.json", out_dir / f"{tag}.png"
    device = rows[0]["device"] if rows else "cpu"
    summary = {
        name: {p: geomean(_ratios(rows, name, p)) for p in ("fwd", "bwd")} for name in _baselines(rows)
    }
    payload = {
        "tag": tag,
        "machine": machine_info(device),
        "protocol": {
            "time": "median over rounds of the mean of `iters` calls, implementations interleaved",
            "ratio": "baseline_ms / ours_ms (>1: tvmflash faster)",
            "flops": "fwd = 4*B*H*L*L*D (x0.5 causal), bwd = 2.5*fwd",
        },
        "geomean_ratio": summary,
        "rows": rows,
    }
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    _plot(rows, png_path, title=f"tvmflash vs torch SDPA — {tag}")
    return json_path, png_path


def plot_results(json_path: str | Path) -> Path:
    """Re-draw the PNG of a results JSON written by `write_results` (beside it)."""
    json_path = Path(json_path)
    payload = json.loads(json_path.read_text())
    png_path = json_path.with_suffix(".png")
    _plot(payload["rows"], png_path, title=f"tvmflash vs torch SDPA — {payload['tag']}")
    return png_path


def plot_ratio_bars(path: Path, labels: list, series: dict, ylabel: str, title: str, log: bool = False,
                    fontsize: int = 8) -> None:
    """Grouped bars of ratios (1.0 marked): one group per label, one bar per series (name ->
    one value per label). For the scripts' comparisons (variants, flex). Long one-line labels
    are wrapped (side by side they overlapped)."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter

    labels = [label if "\n" in label else textwrap.fill(label, 16) for label in labels]
    fig, ax = plt.subplots(figsize=(max(8.0, 0.9 * len(labels) + 2), 3.8))
    width = 0.76 / len(series)
    for i, (name, values) in enumerate(series.items()):
        ax.bar([x + (i - (len(series) - 1) / 2) * width for x in range(len(labels))], values, width, label=name)
    ax.axhline(1.0, color="k", lw=0.8)
    if log:  # plain numbers on the ticks, not powers of ten
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    ax.set_xticks(list(range(len(labels))), labels, fontsize=fontsize)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _point_label(row: dict) -> str:
    lq = row.get("seqlen_q", row["seqlen"])
    return f"{row['dtype']}\nD{row['head_dim']} L{row['seqlen']}" + (f"\nLq{lq}" if lq != row["seqlen"] else "") + (
        "\ncausal" if row["causal"] else "")


def _plot(rows: list[dict], path: Path, title: str) -> None:
    """Bar chart of the speed-up per point, one panel per pass, one bar per baseline."""
    try:
        import matplotlib
    except ImportError:  # e.g. the GPU machine: plot later from the JSON (tvmflash plot)
        print(f"matplotlib not installed: {path} not written", file=sys.stderr)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    baselines = _baselines(rows)
    width = 0.8 / max(len(baselines), 1)
    x = range(len(rows))
    passes = [p for p in ("fwd", "bwd") if any(v is not None for n in baselines for v in _ratios(rows, n, p))]
    fig, axes = plt.subplots(len(passes), 1, figsize=(max(6.0, 1.1 * len(rows) + 2), 3.5 * len(passes)),
                             sharex=True, squeeze=False)
    axes = axes[:, 0]
    for ax, pass_ in zip(axes, passes):
        for i, name in enumerate(baselines):
            values = [v if v is not None else math.nan for v in _ratios(rows, name, pass_)]
            offsets = [xi + (i - (len(baselines) - 1) / 2) * width for xi in x]
            bars = ax.bar(offsets, values, width, label=f"vs {name}")
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.axhline(1.0, color="black", linewidth=1)
        ax.set_ylim(0, max(1.2, 1.15 * max((v for n in baselines for v in _ratios(rows, n, pass_) if v), default=1)))
        ax.set_ylabel(f"{pass_} speed-up (baseline / ours)")
        ax.legend(fontsize=8)
    axes[-1].set_xticks(list(x), [_point_label(r) for r in rows], fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fmt_ms(ms: float | None) -> str:
    if ms is None:
        return "—"
    return f"{ms:.3f}" if ms < 1 else f"{ms:.2f}"


def _fmt_ratio(ratio: float | None) -> str:
    if ratio is None or math.isnan(ratio):
        return "—"
    color = "green" if ratio >= 1 else "red"
    return f"[{color}]{ratio:.2f}×[/{color}]"


def print_table(rows: list[dict], console: Console | None = None) -> None:
    """Rich table of tvmflash vs torch SDPA per point, with geomean speed-up rows (overall and per dtype)."""
    if console is None:
        # Piped to a file, rich assumes 80 columns and would squash the table; give it room instead.
        console = Console() if Console().is_terminal else Console(width=200)
    if not rows:
        console.print("no results")
        return
    cuda = rows[0]["device"] == "cuda"
    scale, unit = (1e3, "TFLOP/s") if cuda else (1.0, "GFLOP/s")
    extra = [name for name in _baselines(rows) if name != BASELINE]

    table = Table(
        title=f"tvmflash vs torch SDPA ({rows[0]['device']}, {rows[0]['threads']} torch threads)",
        caption="ratio = torch time / ours (>1: tvmflash faster); times are medians of interleaved samples",
    )
    for header in ("dtype", "D", "L", "causal"):
        table.add_column(header)
    for header in ("ours\nfwd ms", "torch\nfwd ms", "fwd\nratio", "ours\nbwd ms", "torch\nbwd ms", "bwd\nratio"):
        table.add_column(header, justify="right")
    table.add_column(f"fwd {unit}\nours / torch", justify="right")
    table.add_column(f"bwd {unit}\nours / torch", justify="right")
    for name in extra:
        table.add_column(f"{name}\nfwd ratio", justify="right")
        table.add_column(f"{name}\nbwd ratio", justify="right")

    def extra_cells(rows_: list[dict]) -> list[str]:
        return [_fmt_ratio(geomean(_ratios(rows_, name, p))) for name in extra for p in ("fwd", "bwd")]

    for r in rows:
        ours, base = r["timings"]["ours"], r["timings"][BASELINE]
        table.add_row(
            r["dtype"],
            str(r["head_dim"]),
            str(r["seqlen"]) + (f" (Lq {r['seqlen_q']})" if r.get("seqlen_q", r["seqlen"]) != r["seqlen"] else ""),
            "yes" if r["causal"] else "no",
            _fmt_ms(ours["fwd_ms"]),
            _fmt_ms(base["fwd_ms"]),
            _fmt_ratio(r["ratio"][BASELINE]["fwd"]),
            _fmt_ms(ours["bwd_ms"]),
            _fmt_ms(base["bwd_ms"]),
            _fmt_ratio(r["ratio"][BASELINE]["bwd"]),
            _fmt_gflops(ours["fwd_gflops"], base["fwd_gflops"], scale),
            _fmt_gflops(ours["bwd_gflops"], base["bwd_gflops"], scale),
            *extra_cells([r]),
        )

    groups = [("geomean", rows)]
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    if len(dtypes) > 1:
        groups += [(f"geomean {d}", [r for r in rows if r["dtype"] == d]) for d in dtypes]
    table.add_section()
    for label, group in groups:
        table.add_row(
            f"[bold]{label}[/bold]", "", "", "", "", "",
            _fmt_ratio(geomean(_ratios(group, BASELINE, "fwd"))),
            "", "",
            _fmt_ratio(geomean(_ratios(group, BASELINE, "bwd"))),
            "", "",
            *extra_cells(group),
        )
    console.print(table)
