"""Packed-sequence prefill (issue 6): flash_attn_varlen_func on a mixed batch against our own
dense kernel on the same tokens (one flash_attn_func call per sequence, the same FLOPs) and
against torch SDPA per sequence, in the same process (tvmflash.bench's interleaved medians).
Bar: varlen throughput >= 0.95x the dense kernel's. Forward and forward+backward; writes JSON
and a plot.

    python scripts/varlen_bench.py [OUT_DIR]   # CUDA if available (32k tokens, lengths 128..8k), else CPU
"""
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import tvmflash
from tvmflash.bench import _auto_iters, _interleaved_median_ms, _warm_up, cuda_tag, machine_info, plot_ratio_bars

H, D = 16, 128
DTYPE = torch.bfloat16


def mixed_lengths(total: int, low: int, high: int, seed: int = 0) -> list:
    """Random lengths in [low, high] (odd ones included) summing to `total`."""
    g = torch.Generator().manual_seed(seed)
    lengths = []
    while total - sum(lengths) > high:
        lengths.append(int(torch.randint(low, high + 1, (), generator=g)))
    return lengths + [total - sum(lengths)]


def specs() -> set:
    """The CUDA specs this benchmark calls (scripts/device_prebuild.py builds them)."""
    from tvmflash.ops import spec_for

    q = torch.empty(1, 1, 1, D, dtype=DTYPE)
    return {spec_for(q, None, "bottom_right" if causal else "none", packed=packed)
            for causal in (False, True) for packed in (False, True)}


def main(out_dir: Path) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    total, low, high = (32768, 128, 8192) if device == "cuda" else (2048, 32, 512)
    lengths = mixed_lengths(total, low, high)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(total, H, D, device=device, dtype=DTYPE) for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    pieces = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    rows = []
    for causal in (False, True):
        calls = {
            "varlen": lambda q, k, v: tvmflash.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths),
                                                                      causal=causal),
            "dense per sequence": lambda q, k, v: torch.cat([
                tvmflash.flash_attn_func(q[None, a:b], k[None, a:b], v[None, a:b], causal=causal)[0]
                for a, b in pieces]),
            "torch SDPA per sequence": lambda q, k, v: torch.cat([
                F.scaled_dot_product_attention(*(x[None, a:b].transpose(1, 2) for x in (q, k, v)),
                                               is_causal=causal)[0].transpose(0, 1) for a, b in pieces]),
        }
        fns, ms = {}, 0.0
        for label, attn in calls.items():
            _, ms_one = _warm_up(attn, q, k, v, dout, 2, device)
            ms = max(ms, ms_one)
            fns[f"{label} fwd"] = (lambda a: lambda: a(q, k, v))(attn)
            fns[f"{label} fwd+bwd"] = (lambda a: lambda: torch.autograd.grad(a(q, k, v), (q, k, v), dout))(attn)
        t = _interleaved_median_ms(fns, rounds=5, iters=_auto_iters(ms), device=device)
        row = {"causal": causal, "ms": t}
        for pass_ in ("fwd", "fwd+bwd"):
            row[f"vs_dense_{pass_}"] = t[f"dense per sequence {pass_}"] / t[f"varlen {pass_}"]
            row[f"vs_torch_{pass_}"] = t[f"torch SDPA per sequence {pass_}"] / t[f"varlen {pass_}"]
        rows.append(row)
        print(f"causal={causal}: varlen fwd {t['varlen fwd']:.2f} ms, dense per sequence {t['dense per sequence fwd']:.2f}"
              f" ms (x{row['vs_dense_fwd']:.3f}), torch {t['torch SDPA per sequence fwd']:.2f} ms; fwd+bwd "
              f"{t['varlen fwd+bwd']:.2f} / {t['dense per sequence fwd+bwd']:.2f} ms (x{row['vs_dense_fwd+bwd']:.3f}),"
              f" torch {t['torch SDPA per sequence fwd+bwd']:.2f} ms", flush=True)
    tag = f"{cuda_tag()}-varlen" if device == "cuda" else "cpu-varlen"
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"machine": machine_info(device),
            "shape": {"tokens": total, "lengths": lengths, "H": H, "D": D, "dtype": "bf16"},
            "note": "vs_x = x's time / varlen time (>= 0.95 vs our dense kernel is the bar)", "rows": rows}
    (out_dir / f"{tag}.json").write_text(json.dumps(meta, indent=1))
    labels = [f"{'causal' if r['causal'] else 'non-causal'} {p}" for r in rows for p in ("fwd", "fwd+bwd")]
    plot_ratio_bars(out_dir / f"{tag}.png", labels,
                    {"vs our dense kernel per sequence": [r[f"vs_dense_{p}"] for r in rows for p in ("fwd", "fwd+bwd")],
                     "vs torch SDPA per sequence": [r[f"vs_torch_{p}"] for r in rows for p in ("fwd", "fwd+bwd")]},
                    "their time / varlen time",
                    f"varlen prefill, {device}, bf16 {len(lengths)} sequences {low}..{high}, {total} tokens, H={H} D={D}")
    print(out_dir / f"{tag}.json")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results"))
