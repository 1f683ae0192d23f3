"""Same-process A/B of decode modules: flash_attn_with_kvcache (bf16, D = 128, shuffled
pages of 16 and 256) timed with each module in turn, interleaved, in one process, so that two
versions of the split-KV kernels compare on one machine state (runs across sessions differ by
more than the changes measured). Build each version's module into a folder from its checkout,
then time the folders together (on the GPU machine: carry them, TVM's runtime is enough).

    python scripts/decode_ab.py build DIR [--target avx512|host|cuda] [--knobs JSON]   # -> DIR/mod.so
    python scripts/decode_ab.py run DIR_A DIR_B[@SPLITS] ... [--lengths 1024,4096] [--same-page] [--num-splits N] [--out F.jsonl]

On the CPU: `--same-page` points every page-table entry at one page: nothing comes from memory,
so the times are the kernels' compute; every module runs with this checkout's automatic splits
(`ops._cpu_splits`), its own most kv-heads a task. On a GPU (modules built `--target cuda`,
`--knobs` over the tuned ones, e.g. '{"decode_long_stages": 3}'): each module's call is
replayed from a CUDA graph (a decode step's kernel without its host path), beside torch's
cuDNN SDPA graphed on the dense cache, and each entry's time is given against cuDNN's. CPU
speedups are against the first folder's module.
"""
import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

import tvmflash
from tvmflash import AttentionSpec, build, ops
from tvmflash.bench import _interleaved_median_ms, machine_info
from tvmflash.schedules import host

SPEC = replace(AttentionSpec("bfloat16", 128), kv_cache=True)
PAGES = (16, 256)


def target_of(name: str | None) -> dict:
    if name == "cuda":
        return build.cuda_target("sm_90a")
    return build.AVX512_TARGET if name == "avx512" else build.host_target() if name == "host" else build.cpu_target()


def build_into(folder: Path, target: dict, knobs: dict | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    build.build_module(SPEC, target, knobs).export_library(str(folder / "mod.so"))
    (folder / "target.json").write_text(json.dumps(target))
    (folder / "kv_heads.json").write_text(json.dumps(host.SPLIT_MAX_KV_HEADS))
    print(f"{folder / 'mod.so'}: {SPEC.name} for {build.target_label(target)}")


def kv_heads_of(folder: Path) -> int | None:
    """The most kv-heads a task of folder/mod.so's split-KV kernels takes (None: a version from
    before they took a `kv_heads` argument)."""
    path = folder / "kv_heads.json"
    return json.loads(path.read_text()) if path.exists() else None


def without_kv_heads(kernel):
    """A kernel of a version without the `kv_heads` argument, called as the current ones are."""
    return lambda *args: kernel(*args[:-1])


def load(folder: Path) -> dict:
    """The kernels of folder/mod.so by name, as build.load_cached gives them."""
    target = json.loads((folder / "target.json").read_text())
    if target["kind"] == "cuda":
        target = build.cuda_target_for_device(0)
        return build.kernels_from_module(build._load(folder / "mod.so", target), SPEC, target)
    module = build._load(folder / "mod.so", target)
    names = set(build.kernels_of(SPEC, target)) | set(build.CPU_OPTIONAL_KERNELS)
    kernels = {n: module[n] for n in names if module.implements_function(n, query_imports=True)}
    if kv_heads_of(folder) is None:
        kernels.update((n, without_kv_heads(k)) for n, k in kernels.items() if n in ("decode", "decode_row", "decode_tiles"))
    if build.uses_amx(target, kernels) and not build.request_amx():
        sys.exit(f"{folder}: its module runs on AMX, which this CPU or OS does not provide")
    return kernels


def run(entries: list[str], lengths: list[int], batch: int, heads: int, heads_k: int, lq: int, same_page: bool,
        out: Path | None, num_splits: int = 0) -> None:
    """Time each entry, DIR or DIR@N (that folder's module called with num_splits N, else
    `num_splits`), interleaved."""
    folders = {e: Path(e.split("@")[0]) for e in entries}
    names = {e: folders[e].name + (f"@{e.split('@')[1]}" if "@" in e else "") for e in entries}
    modules = {names[e]: load(f) for e, f in folders.items()}
    kv_heads = {names[e]: kv_heads_of(f) for e, f in folders.items()}
    splits_of = {names[e]: int(e.split("@")[1]) if "@" in e else num_splits for e in entries}
    key = (SPEC, torch.device("cpu"), os.environ.get("TVMFLASH_CPU_TARGET", "auto"))  # ops._kernels' cache key
    current = {}

    def using(name):
        ops._loaded[key] = modules[name]
        host.SPLIT_MAX_KV_HEADS = kv_heads[name] or 1  # the splits ops chooses depend on it
        ops._decode_plans.clear()  # a plan keeps its kernel: swap both
        current["splits"] = splits_of[name]

    g = torch.Generator().manual_seed(0)
    for length in lengths:
        for page in PAGES:
            per_seq = length // page
            k, v = (torch.randn(batch * per_seq, page, heads_k, 128, generator=g).bfloat16() for _ in range(2))
            table = torch.randperm(batch * per_seq, generator=g).view(batch, per_seq).int()
            if same_page:
                table.zero_()
            q = torch.randn(batch, lq, heads, 128, generator=g).bfloat16()
            seqlens = torch.full((batch,), length, dtype=torch.int32)

            def call():
                return tvmflash.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, block_table=table,
                                                        num_splits=current["splits"])

            outputs = {}
            for name in modules:
                using(name)
                outputs[name] = call().float()
            first = next(iter(modules))
            diffs = {name: (o - outputs[first]).abs().max().item() for name, o in outputs.items()}

            def timed(name, calls=5):
                def f():
                    using(name)
                    for _ in range(calls):
                        call()
                return f

            ms = {name: t / 5 for name, t in _interleaved_median_ms({n: timed(n) for n in modules}, rounds=7, iters=3,
                                                                     device="cpu").items()}
            row = {"length": length, "page": page, "batch": batch, "heads": heads, "heads_k": heads_k, "lq": lq,
                   "same_page": same_page, "num_splits": splits_of, "ms": ms, "speedup": {n: ms[first] / t for n, t in ms.items()},
                   "max_diff_vs_first": diffs}
            print(json.dumps(row), flush=True)
            if out:
                with out.open("a") as f:
                    f.write(json.dumps({**row, "threads": torch.get_num_threads(),
                                        "cpu": machine_info("cpu")["cpu_model"]}) + "\n")


def run_graphed(folders: list[str], lengths: list[int], out: Path | None) -> None:
    """The GPU A/B: each folder's kernels (their own decode plans, whose scratch the graphs
    use) captured in a CUDA graph per length and page size, replayed interleaved with cuDNN's."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from decode_bench import B, D, DTYPE, H, HK, graphed, paged_cache

    modules = {Path(f).name: load(Path(f)) for f in folders}
    plans = {name: {} for name in modules}
    key = (SPEC, torch.device("cuda", 0), None)  # ops._kernels' cache key
    for length in lengths:
        q = torch.randn(B, 1, H, D, device="cuda", dtype=DTYPE)
        fns, outputs, alive = {}, {}, []  # alive: what the graphs read (a graph does not hold it)
        for page in PAGES:
            k, v, table = paged_cache(length, page, "cuda")
            call = (lambda k, v, t: lambda: tvmflash.flash_attn_with_kvcache(q, k, v, cache_seqlens=length,
                                                                             block_table=t))(k, v, table)
            alive.append(call)
            for name, kernels in modules.items():
                ops._loaded[key], ops._decode_plans = kernels, plans[name]
                outputs[name, page] = call().float()
                fns[f"{name} pages{page}"] = graphed(call)
        kd, vd = (torch.randn(B, HK, length, D, device="cuda", dtype=DTYPE) for _ in range(2))

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q.transpose(1, 2), kd, vd, enable_gqa=True)
        fns["torch cudnn"] = graphed(cudnn)
        ms = _interleaved_median_ms(fns, rounds=9, iters=20, device="cuda")
        first = next(iter(modules))
        row = {"length": length, "us": {n: round(t * 1e3, 2) for n, t in ms.items()},
               "vs_cudnn": {n: round(ms["torch cudnn"] / t, 3) for n, t in ms.items()},
               "max_diff_vs_first": max((o - outputs[first, p]).abs().max().item() for (_, p), o in outputs.items())}
        print(json.dumps(row), flush=True)
        if out:
            with out.open("a") as f:
                f.write(json.dumps({**row, "gpu": torch.cuda.get_device_name()}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build")
    b.add_argument("folder", type=Path)
    b.add_argument("--target", choices=("avx512", "host", "cuda"), help="default: this CPU's (build.cpu_target)")
    b.add_argument("--knobs", default="{}", help="knobs over the tuned ones (JSON)")
    r = sub.add_parser("run")
    r.add_argument("folders", nargs="+", help="DIR, or DIR@N: its module with num_splits N")
    r.add_argument("--lengths", default="1024,4096", help="cache lengths (comma separated)")
    r.add_argument("--batch", type=int, default=16)
    r.add_argument("--heads", default="32,8", help="query heads, kv-heads")
    r.add_argument("--lq", type=int, default=1)
    r.add_argument("--same-page", action="store_true", help="every page-table entry one page (compute only)")
    r.add_argument("--num-splits", type=int, default=0, help="flash_attn_with_kvcache's (0: automatic)")
    r.add_argument("--out", type=Path, help="append the rows to this JSON-lines file")
    args = parser.parse_args()
    if args.command == "build":
        build_into(args.folder, target_of(args.target), json.loads(args.knobs))
    elif torch.cuda.is_available():
        run_graphed(args.folders, [int(x) for x in args.lengths.split(",")], args.out)
    else:
        heads, heads_k = (int(x) for x in args.heads.split(","))
        run(args.folders, [int(x) for x in args.lengths.split(",")], args.batch, heads, heads_k, args.lq,
            args.same_page, args.out, args.num_splits)


if __name__ == "__main__":
    main()
