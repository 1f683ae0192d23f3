"""Decode (issue 6): flash_attn_with_kvcache with one query per sequence against a paged KV
cache, on the GPU (or, without one, the CPU). For each cache length: our time (paged with 16-
and 256-token pages, pages shuffled), the effective bandwidth (bytes of K and V read / time) as
a fraction of the device's measured copy bandwidth (bytes read + written by a large copy /
time), and torch SDPA on the same problem padded to a dense cache (the fastest torch backend:
each of flash / efficient / cuDNN / math that runs, with enable_gqa and with K/V expanded to
the query heads beforehand; each is timed once, `torch_screen_ms`, and those within 2x of the
fastest are timed interleaved with ours). Bars: GPU >= 80% of the copy bandwidth at >= 8k context and
>= 1.0x torch; CPU >= 1.5x torch.

    python scripts/decode_bench.py [OUT_DIR] [--num-splits 1,2,4] [--lengths 2048,4096]   # B=16, H=32, Hk=8, D=128, bf16

`--num-splits` also times ours at those fixed split counts (entries `ours paged16 splits2`, ...)
in the same interleave: the automatic choice against the alternatives, same process.
`--graphs` (GPU) also times every call replayed from a CUDA graph (entries `... graphed`: no
host path, as in a captured or compiled decode step), ours against torch's graphed calls; the
results go to `<gpu>-decode-graphs.json`.
"""
import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import tvmflash
from tvmflash.bench import _interleaved_median_ms, cuda_tag, machine_info, plot_ratio_bars, steady_heap

B, H, HK, D = 16, 32, 8, 128
DTYPE = torch.bfloat16
LENGTHS = {"cuda": (1024, 2048, 4096, 8192, 16384, 32768, 65536), "cpu": (1024, 4096, 16384)}
PAGES = (16, 256)


def specs() -> set:
    """The specs this benchmark calls (scripts/device_prebuild.py and device_prebuild_cpu.py
    build them)."""
    from dataclasses import replace

    from tvmflash.ops import spec_for

    return {replace(spec_for(torch.empty(1, 1, 1, D, dtype=DTYPE), None, "none"), kv_cache=True)}


def copy_bandwidth(device: str, nbytes: int = 2 << 30) -> float:
    """Bytes moved (read + written) per second by a copy of `nbytes` within `device`."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _interleaved_median_ms({"copy": lambda: dst.copy_(src)}, rounds=5, iters=20 if device == "cuda" else 3,
                                device=device)["copy"]
    return 2 * nbytes / (ms * 1e-3)


def paged_cache(length: int, page: int, device: str, batch: int = B, heads_k: int = HK, shuffle_within: int = 0):
    """K and V caches of `batch` sequences of `length` keys in shuffled pages, and their block
    table. `shuffle_within` > 0 shuffles the pages only within consecutive runs of that many
    (1: pages in order, each sequence's contiguous)."""
    per_seq = length // page
    pages = batch * per_seq
    gen = torch.Generator().manual_seed(length + page)
    if shuffle_within:
        runs = torch.arange(pages).split(shuffle_within)
        order = torch.cat([run[torch.randperm(len(run), generator=gen)] for run in runs]).to(device)
    else:
        order = torch.randperm(pages, generator=gen).to(device)
    k, v = (torch.randn(batch * per_seq, page, heads_k, D, device=device, dtype=DTYPE) for _ in range(2))
    return k, v, order.view(batch, per_seq).to(torch.int32)


def torch_calls(q, length: int) -> dict:
    """torch SDPA on the dense padded problem, one entry per backend and K/V form that runs."""
    k, v = (torch.randn(B, HK, length, D, device=q.device, dtype=DTYPE) for _ in range(2))
    qh = q.transpose(1, 2)
    forms = {"gqa": dict(key=k, value=v, enable_gqa=True),
             "expanded": dict(key=k.repeat_interleave(H // HK, 1), value=v.repeat_interleave(H // HK, 1))}
    calls = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.MATH):
        for form, kwargs in forms.items():
            def call(backend=backend, kwargs=kwargs):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(qh, **kwargs)
            try:
                call()
            except RuntimeError:
                continue
            calls[f"torch {backend.name.lower()} {form}"] = call
    return calls


def graphed(fn):
    """`fn` captured in a CUDA graph (after a call on a side stream: module loads, scratch);
    the result replays it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def main(out_dir: Path, num_splits: tuple = (), lengths: tuple = (), graphs: bool = False) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        steady_heap()  # torch's CPU SDPA at its best in every process (bench.steady_heap)
    torch.manual_seed(0)
    copy = copy_bandwidth(device)
    print(f"{device}: copy bandwidth {copy / 1e12:.2f} TB/s", flush=True)
    rows = []
    for length in lengths or LENGTHS[device]:
        q = torch.randn(B, 1, H, D, device=device, dtype=DTYPE)
        fns = {}
        for page in PAGES:
            k, v, table = paged_cache(length, page, device)
            for splits in (0, *num_splits):
                name = f"ours paged{page}" + (f" splits{splits}" if splits else "")
                fns[name] = (lambda k, v, t, n: lambda: tvmflash.flash_attn_with_kvcache(
                    q, k, v, cache_seqlens=length, block_table=t, num_splits=n))(k, v, table, splits)
                fns[name]()
        torch_fns = torch_calls(q, length)
        screen = _interleaved_median_ms(torch_fns, rounds=1, iters=1, device=device)  # every backend and form once
        # The timed interleave holds ours and the torch calls within 2x of the fastest. The
        # others (the math backend: ~100x slower, gigabytes and bf16 matmuls a call) would run
        # between the timed calls, and on the Xeon a call right after one of them costs 0.2-0.8
        # ms more, ours and torch's alike (a bf16 matmul before a 4M-element add: 0.23 -> 2.6
        # ms), an additive cost that pulls every ratio towards 1.
        fns.update((name, fn) for name, fn in torch_fns.items() if screen[name] <= 2 * min(screen.values()))
        if graphs and device == "cuda":
            for name in list(fns):
                try:
                    fns[f"{name} graphed"] = graphed(fns[name])
                except RuntimeError as e:  # a backend that cannot be captured is left out
                    print(f"    {name}: not captured ({str(e).splitlines()[0]})", flush=True)
        iters = (5 if length >= 32768 else 20) if device == "cuda" else 10
        t = _interleaved_median_ms(fns, rounds=5, iters=iters, device=device)
        del fns, torch_fns
        if device == "cuda":
            torch.cuda.empty_cache()
        kv_bytes = 2 * B * HK * length * D * 2
        best_torch = min((name for name in t if name.startswith("torch") and not name.endswith("graphed")), key=t.get)
        row = {"length": length, "ms": t, "best_torch": best_torch, "kv_bytes": kv_bytes, "torch_screen_ms": screen}
        for page in PAGES:
            ours = t[f"ours paged{page}"]
            row[f"bandwidth_fraction_paged{page}"] = kv_bytes / (ours * 1e-3) / copy
            row[f"vs_torch_paged{page}"] = t[best_torch] / ours
        torch_graphed = [name for name in t if name.startswith("torch") and name.endswith("graphed")]
        if graphs and torch_graphed:
            row["best_torch_graphed"] = min(torch_graphed, key=t.get)
            for page in PAGES:
                row[f"vs_torch_graphed_paged{page}"] = t[row["best_torch_graphed"]] / t[f"ours paged{page} graphed"]
            print("    graphed: " + ", ".join(f"paged{p} {t[f'ours paged{p} graphed'] * 1e3:.1f} us "
                                             f"(x{row[f'vs_torch_graphed_paged{p}']:.2f})" for p in PAGES)
                  + f"; {row['best_torch_graphed']} {t[row['best_torch_graphed']] * 1e3:.1f} us", flush=True)
        rows.append(row)
        print(f"L={length}: " + ", ".join(f"paged{p} {t[f'ours paged{p}'] * 1e3:.1f} us "
                                          f"({row[f'bandwidth_fraction_paged{p}']:.2f} of copy, "
                                          f"x{row[f'vs_torch_paged{p}']:.2f})" for p in PAGES)
              + f"; {best_torch} {t[best_torch] * 1e3:.1f} us", flush=True)
        if num_splits:
            print("    fixed splits: " + ", ".join(f"{name[5:]} {ms * 1e3:.1f} us" for name, ms in t.items()
                                                 if " splits" in name and "graphed" not in name), flush=True)
            if graphs:
                print("    fixed splits, graphed: " + ", ".join(f"{name[5:-8]} {ms * 1e3:.1f} us" for name, ms in t.items()
                                                             if " splits" in name and "graphed" in name), flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = f"{cuda_tag()}-decode" if device == "cuda" else "cpu-kvcache-decode"  # (the Xeon run: cpu-xeon-16core-kvcache-decode)
    tag += "-graphs" if graphs and device == "cuda" else ""
    meta = {"machine": machine_info(device), "copy_bandwidth_bytes_per_s": copy,
            "shape": {"B": B, "H": H, "Hk": HK, "D": D, "Lq": 1, "dtype": "bf16", "pages": PAGES},
            "note": "bandwidth_fraction = K/V bytes / time / copy bandwidth (GPU bar >= 0.8 at >= 8k); "
                    "vs_torch = fastest torch SDPA time / ours (bars: GPU >= 1.0, CPU >= 1.5)", "rows": rows}
    (out_dir / f"{tag}.json").write_text(json.dumps(meta, indent=1))
    labels = [f"{r['length'] // 1024}k" for r in rows]
    keys = (("bandwidth / copy", "bandwidth_fraction"), ("vs torch", "vs_torch"))
    keys += (("vs torch, both graphed", "vs_torch_graphed"),) if all("best_torch_graphed" in r for r in rows) else ()
    series = {f"{name} paged{p}": [r[f"{key}_paged{p}"] for r in rows] for name, key in keys for p in PAGES}
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    plot_ratio_bars(out_dir / f"{tag}.png", labels, series, "fraction of copy bandwidth; torch time / ours",
                    f"decode, {where}, bf16 B={B} H={H} Hk={HK} D={D}, Lq=1, "
                    "paged cache (shuffled pages)")
    print(out_dir / f"{tag}.json")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", nargs="?", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--num-splits", default="", help="comma-separated fixed split counts also timed")
    parser.add_argument("--lengths", default="", help="comma-separated cache lengths (default: the device's grid)")
    parser.add_argument("--graphs", action="store_true", help="also time every call replayed from a CUDA graph")
    args = parser.parse_args()
    ints = lambda text: tuple(int(x) for x in text.split(",") if x)  # noqa: E731
    main(args.out_dir, ints(args.num_splits), ints(args.lengths), args.graphs)
