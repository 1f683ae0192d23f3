"""tvmflash.flex.flex_attention vs torch.nn.attention.flex_attention under torch.compile, same
process, same inputs: causal, sliding window, ALiBi as a score_mod and document masking
(bf16, B=1, H=16, D=128, L in {4096, 16384}), forward and forward+backward. Writes
benchmarks/results/cuda-<gpu>-flex.json and .png (ratio > 1: tvmflash is faster).

    python scripts/flex_bench.py [OUT_DIR]      # needs a GPU (and triton for torch's side)
"""
import json
import sys
from pathlib import Path

import torch

from tvmflash import flex
from tvmflash.bench import _auto_iters, _interleaved_median_ms, _warm_up, cuda_tag, machine_info, plot_ratio_bars

B, H, D = 1, 16, 128
SEQLENS = (4096, 16384)
WINDOW = 1024


def cases(seqlen: int, device: str):
    """name -> (score_mod, mask_mod); captured tables live on `device`."""
    g = torch.Generator().manual_seed(0)
    slopes = torch.exp2(-8.0 * torch.arange(1, H + 1) / H).to(device)
    lengths = torch.randint(seqlen // 16, seqlen // 4, (64,), generator=g)
    doc = torch.repeat_interleave(torch.arange(64), lengths)[:seqlen]
    doc = torch.cat([doc, torch.full((seqlen - len(doc),), 64)]).to(device)
    causal = lambda b, h, q, kv: q >= kv  # noqa: E731
    return {
        "causal": (None, causal),
        f"sliding window {WINDOW}": (None, lambda b, h, q, kv: (q >= kv) & (q - kv < WINDOW)),
        "ALiBi score_mod (causal)": (lambda s, b, h, q, kv: s - slopes[h] * (q - kv), causal),
        "document mask (causal)": (None, lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv)),
    }


def specs() -> set:
    """The specs this benchmark calls (scripts/device_prebuild.py builds them)."""
    return {flex.flex_spec(torch.bfloat16, D, *mods) for mods in cases(SEQLENS[0], "cpu").values()}


def main(out_dir: Path) -> None:
    from torch.nn.attention import flex_attention as torch_flex

    device = "cuda"
    # the timing helpers keep the graph of their timed call (retain_graph), which donated
    # buffers of a compiled backward forbid
    import torch._functorch.config as functorch_config

    functorch_config.donated_buffer = False
    compiled = torch.compile(torch_flex.flex_attention, dynamic=False)
    rows = []
    for seqlen in SEQLENS:
        torch.manual_seed(0)
        q, k, v, dout = (torch.randn(B, H, seqlen, D, device=device, dtype=torch.bfloat16) for _ in range(4))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        for name, (score_mod, mask_mod) in cases(seqlen, device).items():
            ours_bm = flex.create_block_mask(mask_mod, 1, 1, seqlen, seqlen, device=device)
            torch_bm = torch_flex.create_block_mask(mask_mod, 1, 1, seqlen, seqlen, device=device)
            impl = {"tvmflash": lambda q, k, v: flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=ours_bm),
                    "torch": lambda q, k, v: compiled(q, k, v, score_mod=score_mod, block_mask=torch_bm)}
            fns = {}
            for label, attn in impl.items():
                _, ms = _warm_up(attn, q, k, v, dout, 2, device)
                fns[f"{label} fwd"] = (lambda a: lambda: a(q, k, v))(attn)
                fns[f"{label} fwd+bwd"] = (lambda a: lambda: torch.autograd.grad(a(q, k, v), (q, k, v), dout))(attn)
            t = _interleaved_median_ms(fns, rounds=5, iters=_auto_iters(ms), device=device)
            row = {"case": name, "seqlen": seqlen, "sparsity": ours_bm.sparsity(), "ms": t,
                   "ratio_fwd": t["torch fwd"] / t["tvmflash fwd"],
                   "ratio_fwd_bwd": t["torch fwd+bwd"] / t["tvmflash fwd+bwd"]}
            rows.append(row)
            print(f"L={seqlen} {name}: fwd {t['tvmflash fwd']:.2f} vs torch {t['torch fwd']:.2f} ms "
                  f"(x{row['ratio_fwd']:.2f}); fwd+bwd {t['tvmflash fwd+bwd']:.2f} vs {t['torch fwd+bwd']:.2f} ms "
                  f"(x{row['ratio_fwd_bwd']:.2f})", flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"machine": machine_info(device), "shape": {"B": B, "H": H, "D": D, "dtype": "bf16"},
            "torch": torch.__version__, "block_size": 128,
            "note": "ratio = torch.compile(flex_attention) time / tvmflash time (> 1: tvmflash is faster)",
            "rows": rows}
    tag = f"{cuda_tag()}-flex"
    (out_dir / f"{tag}.json").write_text(json.dumps(meta, indent=1))
    plot_ratio_bars(out_dir / f"{tag}.png", [f"{r['case']}\nL={r['seqlen']}" for r in rows],
                    {"forward": [r["ratio_fwd"] for r in rows], "forward+backward": [r["ratio_fwd_bwd"] for r in rows]},
                    "torch flex time / tvmflash time",
                    f"flex_attention vs torch.compile(flex_attention), {torch.cuda.get_device_name()}, "
                    f"bf16 B={B} H={H} D={D}", fontsize=6)
    print(out_dir / f"{tag}.json")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results"))
