"""What the attention variants cost (issue 5): each variant against its plain kernel, in the same
process, through flash_attn_func. Sliding window and block-sparse work should fall with the
fraction of skipped kv blocks (window 256 at L=16k: >= 8x faster than full attention); ALiBi
and softcap should cost <= 15% over the plain kernel. Forward and forward+backward, medians of
interleaved samples (tvmflash.bench's protocol). Writes JSON + a plot.

Dropout is also timed on torch's own kernels (SDPA with dropout_p; on CUDA its flash and cuDNN
backends, each pinned), plain and with dropout, in the same interleaving: what dropout costs
them, and our dropout against the fastest of theirs.

    python scripts/variants_bench.py [OUT_DIR] [CASE ...]  # CUDA if available (L=16384), else CPU
                                                           # (L=4096); CASE: substrings of the case
                                                           # names to run (default: all)
"""
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import tvmflash
from tvmflash.bench import (_auto_iters, _interleaved_median_ms, _warm_up, cuda_tag, machine_info, plot_ratio_bars,
                            steady_heap)

B, H, D = 1, 16, 128
# (name, plain kernel's keywords, variant's keywords)
CASES = [
    ("window 256 (non-causal)", dict(causal=False), dict(causal=False, window_size=(256, 256))),
    ("window 256 (causal)", dict(causal=True), dict(causal=True, window_size=(256, 0))),
    ("ALiBi (causal)", dict(causal=True), dict(causal=True, alibi_slopes="slopes")),
    ("ALiBi (non-causal)", dict(causal=False), dict(causal=False, alibi_slopes="slopes")),
    ("softcap 30 (non-causal)", dict(causal=False), dict(causal=False, softcap=30.0)),
    ("dropout 0.1 (non-causal)", dict(causal=False), dict(causal=False, dropout_p=0.1)),
    ("dropout 0.1 (causal)", dict(causal=True), dict(causal=True, dropout_p=0.1)),
]


def setup(device: str):
    dtype = torch.bfloat16
    seqlen = 16384 if device == "cuda" else 4096
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(B, seqlen, H, D, device=device, dtype=dtype) for _ in range(4))
    slopes = torch.rand(H, device=device) * 0.1
    return seqlen, [x.requires_grad_() for x in (q, k, v)], dout, slopes


def specs() -> set:
    """The specs this benchmark calls (scripts/device_prebuild.py builds them)."""
    from tvmflash.ops import spec_for

    q = torch.empty(1, 1, 1, D, dtype=torch.bfloat16)
    out = set()
    for _, *calls in CASES:
        for kw in calls:
            causal = kw.get("causal", False)
            left, right = kw.get("window_size", (-1, -1))
            out.add(spec_for(q, None, "bottom_right" if causal else "none", (left, -1 if causal else right),
                             kw.get("softcap", 0.0), torch.ones(1) if "alibi_slopes" in kw else None,
                             kw.get("dropout_p", 0.0)))
    return out


# window walks (CUDA): (left, right) windows timed on each wgmma forward loop, to place
# tvmflash.ops.SHORT_WALK_KEYS / SHORT_CAUSAL_WALK_KEYS (left + right up to which the lockstep
# loop runs)
WALK_WINDOWS = [(64, 64), (128, 128), (256, 256), (384, 384), (512, 512), (768, 768), (1024, 1024),
                (128, 0), (256, 0), (384, 0), (512, 0), (1024, 0), (1536, 0), (2048, 0)]


def window_walks(q, k, v) -> list:
    """Forward ms of each WALK_WINDOWS window on the warp-specialized and the lockstep loop."""
    from tvmflash import ops

    chosen = ops.SHORT_WALK_KEYS, ops.SHORT_CAUSAL_WALK_KEYS
    q, k, v = (x.detach() for x in (q, k, v))
    rows = []
    try:
        for left, right in WALK_WINDOWS:
            causal = right == 0

            def run(threshold, kw=dict(causal=causal, window_size=(left, right))):
                ops.SHORT_WALK_KEYS = ops.SHORT_CAUSAL_WALK_KEYS = threshold  # forces the loop
                return tvmflash.flash_attn_func(q, k, v, **kw)
            fns = {"warp-specialized": lambda: run(-1), "lockstep": lambda: run(1 << 30)}
            for fn in fns.values():
                fn()
            t = _interleaved_median_ms(fns, rounds=5, iters=_auto_iters(0.5), device="cuda")
            rows.append({"window": [left, right], "causal": causal, "keys": left + right, "ms": t,
                         "lockstep_speedup": t["warp-specialized"] / t["lockstep"]})
            print(f"window {(left, right)}: warp-specialized {t['warp-specialized']:.3f} ms, "
                  f"lockstep {t['lockstep']:.3f} ms (x{rows[-1]['lockstep_speedup']:.2f})", flush=True)
    finally:
        ops.SHORT_WALK_KEYS, ops.SHORT_CAUSAL_WALK_KEYS = chosen
    return rows


def torch_attention(device: str, kw: dict) -> dict:
    """Backend name -> torch SDPA of flash_attn_func's (B, L, H, D) tensors with the case's
    causal flag and dropout_p (CUDA: flash and cuDNN, pinned; CPU: torch's choice)."""
    def sdpa(q, k, v):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             dropout_p=kw.get("dropout_p", 0.0), is_causal=kw.get("causal", False))
        return out.transpose(1, 2)

    if device != "cuda":
        return {"torch": sdpa}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def pinned(backend):
        def attention(q, k, v):
            with sdpa_kernel(backend):
                return sdpa(q, k, v)
        return attention

    return {"torch flash": pinned(SDPBackend.FLASH_ATTENTION), "torch cudnn": pinned(SDPBackend.CUDNN_ATTENTION)}


def timed_calls(fns: dict, label: str, attn, q, k, v, dout, device: str) -> float:
    """Adds `label`'s forward and forward+backward calls of `attn` to `fns`; the warm-up's ms."""
    _, ms = _warm_up(attn, q, k, v, dout, 2, device)
    fns[f"{label} fwd"] = lambda: attn(q, k, v)
    fns[f"{label} fwd+bwd"] = lambda: torch.autograd.grad(attn(q, k, v), (q, k, v), dout)
    return ms


def main(out_dir: Path, only: list) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        steady_heap()  # torch's CPU SDPA at its best in every process (bench.steady_heap)
    seqlen, (q, k, v), dout, slopes = setup(device)
    rows = []
    for name, plain, variant in CASES:
        if only and not any(word in name for word in only):
            continue
        fns = {}
        for label, kw in (("plain", plain), ("variant", variant)):
            kw = {key: slopes if val == "slopes" else val for key, val in kw.items()}
            ms = timed_calls(fns, label, (lambda kw: lambda q, k, v: tvmflash.flash_attn_func(q, k, v, **kw))(kw),
                             q, k, v, dout, device)
        theirs = []
        if "dropout_p" in variant:  # torch has dropout too: its kernels' cost of it, ours against theirs
            for label, kw in (("plain", plain), ("variant", variant)):
                for backend, attn in torch_attention(device, kw).items():
                    try:
                        timed_calls(fns, f"{backend} {label}", attn, q, k, v, dout, device)
                    except RuntimeError:  # a backend that does not take this shape or dropout
                        pass
            theirs = [b for b in torch_attention(device, variant) if f"{b} plain fwd" in fns and f"{b} variant fwd" in fns]
        t = _interleaved_median_ms(fns, rounds=5, iters=_auto_iters(ms), device=device)
        row = {"case": name, "seqlen": seqlen, "ms": t,
               "speedup_fwd": t["plain fwd"] / t["variant fwd"],
               "speedup_fwd_bwd": t["plain fwd+bwd"] / t["variant fwd+bwd"]}
        if theirs:
            for phase in ("fwd", "fwd+bwd"):
                best = min(theirs, key=lambda b: t[f"{b} variant {phase}"])
                key = phase.replace("+", "_")
                row[f"torch_speedup_{key}"] = {b: t[f"{b} plain {phase}"] / t[f"{b} variant {phase}"] for b in theirs}
                row[f"vs_best_torch_{key}"] = t[f"{best} variant {phase}"] / t[f"variant {phase}"]
                row[f"best_torch_{key}"] = best
        rows.append(row)
        print(f"{name}: fwd {t['variant fwd']:.2f} ms vs plain {t['plain fwd']:.2f} ms (x{row['speedup_fwd']:.2f}); "
              f"fwd+bwd {t['variant fwd+bwd']:.2f} vs {t['plain fwd+bwd']:.2f} ms (x{row['speedup_fwd_bwd']:.2f})"
              + (f"; vs torch's best with dropout: fwd x{row['vs_best_torch_fwd']:.2f}, fwd+bwd "
                 f"x{row['vs_best_torch_fwd_bwd']:.2f}; torch's own dropout cost: {row['torch_speedup_fwd']}, "
                 f"{row['torch_speedup_fwd_bwd']}" if theirs else ""), flush=True)
    tag = f"{cuda_tag()}-variants" if device == "cuda" else "cpu-xeon-16core-variants"
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"machine": machine_info(device), "shape": {"B": B, "H": H, "D": D, "L": seqlen, "dtype": "bf16"},
            "note": "speedup = plain time / variant time (> 1: the variant is faster); dropout rows: "
                    "torch_speedup = the same for each torch kernel (its plain / its dropout time), "
                    "vs_best_torch = the fastest torch kernel's dropout time / ours (> 1: ours faster)", "rows": rows}
    if device == "cuda" and not only:
        meta["window_walks"] = window_walks(q, k, v)
    if only:
        tag += "-" + "-".join(word.split()[0].lower() for word in only)  # a partial run: its own files
    (out_dir / f"{tag}.json").write_text(json.dumps(meta, indent=1))
    plot_ratio_bars(out_dir / f"{tag}.png", [r["case"] for r in rows],
                    {"forward": [r["speedup_fwd"] for r in rows], "forward+backward": [r["speedup_fwd_bwd"] for r in rows]},
                    "plain time / variant time", f"variants vs plain kernel, {device}, bf16 B={B} H={H} L={seqlen} D={D}",
                    log=True)
    print(out_dir / f"{tag}.json")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results"), sys.argv[2:])
