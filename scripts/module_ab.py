"""Same-process A/B of one spec's module across versions of the code: `flash_attn_func` timed with
each folder's module in turn (forward, and forward + backward), interleaved, in one process, so
that two versions compare on one machine state (runs across processes and sessions differ by
more than most changes). Build each version's module into a folder from its checkout, then time
the folders together on the machine that runs them (TVM's runtime is enough there).

    python scripts/module_ab.py build DIR SPEC [--target cuda|avx512|host] [--knobs JSON]   # SPEC: presets.parse_spec's
                                                                   # or flex:CASE (below)
    python scripts/module_ab.py run DIR_A DIR_B ... [--shape B,L,H,D] [--kwargs JSON] [--plain] [--out F.jsonl]
                                   [--fp32-precision high]   # inputs of the folders' spec's dtype
                                   [--sdpa-layout] [--forward-only]

`--kwargs`: flash_attn_func's keywords for the call (e.g. '{"softcap": 30.0}'; "alibi_slopes":
true passes random slopes), which must select the folders' spec. `--plain` also times the call
without the variant's keywords (causal kept) from the ordinary module cache, and reports each
folder's time against it. Speedups are against the first folder. SPEC `flex:CASE` is one of
scripts/flex_bench.py's cases, named by its first word (causal, sliding, alibi, document): the
folders' modules are timed under `tvmflash.flex.flex_attention` with that case's score_mod and
block mask (--shape's B,L,H,D; the tensors in flex's (B, H, L, D) layout).
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tvmflash  # noqa: E402
from tvmflash import build, flex, ops  # noqa: E402
from tvmflash.bench import _interleaved_median_ms, float32_matmul_precision, machine_info  # noqa: E402
from tvmflash.presets import parse_spec  # noqa: E402
from tvmflash.spec import AttentionSpec  # noqa: E402

FLEX = "flex:"
TARGETS = {"cuda": lambda: build.cuda_target("sm_90a"), "avx512": lambda: build.AVX512_TARGET,
           "host": build.host_target}


def flex_case(text: str, seqlen: int, device: str):
    """flex_bench's case `flex:WORD`: (score_mod, mask_mod), captured tables on `device`."""
    from flex_bench import cases  # scripts/, this script's folder

    for name, mods in cases(seqlen, device).items():
        if name.split()[0].lower() == text[len(FLEX):].lower():
            return mods
    sys.exit(f"no flex_bench case {text!r} (its cases: {', '.join(cases(seqlen, device))})")


def spec_of_call(text: str) -> AttentionSpec:
    """The spec a folder's call (SPEC) names."""
    if text.startswith(FLEX):
        from flex_bench import D  # its cases' head dim (bf16)

        return flex.flex_spec(torch.bfloat16, D, *flex_case(text, 4096, "cpu"))
    return parse_spec(text)


def build_into(folder: Path, text: str, target: dict, knobs: dict) -> None:
    spec = spec_of_call(text)
    folder.mkdir(parents=True, exist_ok=True)
    build.build_module(spec, target, knobs).export_library(str(folder / "mod.so"))
    (folder / "spec.json").write_text(json.dumps(spec.to_dict()))
    (folder / "call.txt").write_text(text)
    (folder / "target.json").write_text(json.dumps(target))
    print(f"{folder / 'mod.so'}: {spec.name} for {build.target_label(target)}")


def load(folder: Path, device: torch.device, spec: AttentionSpec) -> dict:
    """The kernels of folder/mod.so by name, as build.load_cached gives them (the CUDA module is
    loaded for this device's arch whatever the folder's target says)."""
    target = json.loads((folder / "target.json").read_text())
    if device.type == "cuda":
        target = build.cuda_target_for_device(device.index or 0)
    return build.kernels_from_module(build._load(folder / "mod.so", target), spec, target)


def call_of(folder: Path) -> str:
    """The SPEC the folder was built from ('' for folders older than call.txt)."""
    return (folder / "call.txt").read_text() if (folder / "call.txt").exists() else ""


def spec_of(folder: Path, call: str) -> AttentionSpec:
    """The folder's spec (a flex spec's programs do not read back from spec.json: its call)."""
    from tvmflash.deploy import spec_from_dict

    return spec_of_call(call) if call.startswith(FLEX) else spec_from_dict(json.loads((folder / "spec.json").read_text()))


def run(folders: list[Path], shape: tuple, kwargs: dict, plain: bool, out: Path | None, sdpa_layout: bool = False,
        forward_only: bool = False) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    call_text = call_of(folders[0])
    spec = spec_of(folders[0], call_text)
    dtype = getattr(torch, spec.dtype)
    batch, seqlen, heads, head_dim = shape
    flex_call = call_text.startswith(FLEX)
    g = torch.Generator(device=device).manual_seed(0)
    heads_first = flex_call or sdpa_layout
    layout = (batch, heads, seqlen, head_dim) if heads_first else (batch, seqlen, heads, head_dim)
    q, k, v, dout = (torch.randn(layout, device=device, dtype=dtype, generator=g) for _ in range(4))
    if sdpa_layout and not flex_call:  # flash_attn_func's (B, L, H, D) views of (B, H, L, D) memory
        q, k, v, dout = (x.transpose(1, 2) for x in (q, k, v, dout))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    if kwargs.get("alibi_slopes") is True:
        kwargs["alibi_slopes"] = torch.rand(heads, device=device, generator=g) * 0.1
    if flex_call:
        score_mod, mask_mod = flex_case(call_text, seqlen, device.type)
        called = flex.flex_spec(dtype, head_dim, score_mod, mask_mod)
        block_mask = flex.create_block_mask(mask_mod, 1, 1, seqlen, seqlen, device=device) if mask_mod else None
        attention = lambda q, k, v, **_: flex.flex_attention(q, k, v, score_mod=score_mod,  # noqa: E731
                                                              block_mask=block_mask)
        if plain:
            sys.exit("--plain times flash_attn_func's plain call: not for flex cases")
    else:
        causal = kwargs.get("causal", False)
        left, right = kwargs.get("window_size", (-1, -1))
        called = ops.spec_for(q, None, "bottom_right" if causal else "none", (left, -1 if causal else right),
                              kwargs.get("softcap", 0.0), kwargs.get("alibi_slopes"), kwargs.get("dropout_p", 0.0))
        attention = tvmflash.flash_attn_func
    if called != spec:
        sys.exit(f"the call takes {called.name}, not the folders' {spec.name}")
    modules = {f.name: load(f, device, spec) for f in folders}
    choice = None if device.type == "cuda" else os.environ.get("TVMFLASH_CPU_TARGET", "auto")
    key = (spec, q.device, choice)  # ops._kernels' cache key (the tensors' device: cuda:0, not cuda)

    def calls(name, call_kwargs, use=None):
        def fwd():
            if use:
                ops._loaded[key] = modules[use]
            with torch.no_grad():
                attention(q, k, v, **call_kwargs)

        def fwd_bwd():
            if use:
                ops._loaded[key] = modules[use]
            torch.autograd.grad(attention(q, k, v, **call_kwargs), (q, k, v), dout)
        return {f"{name} fwd": fwd} if forward_only else {f"{name} fwd": fwd, f"{name} fwd+bwd": fwd_bwd}

    fns = {}
    for name in modules:
        fns.update(calls(name, kwargs, name))
    if plain:
        fns.update(calls("plain", {"causal": kwargs.get("causal", False)}))
    outputs, again = {}, {}  # again: a second call's difference from the first
    for name in modules:
        ops._loaded[key] = modules[name]
        if ops._kernels(spec, q.device) is not modules[name]:
            sys.exit("the calls would not take the folders' modules (ops._kernels' key changed?)")
        with torch.no_grad():
            outputs[name] = attention(q, k, v, **kwargs).float()
            again[name] = (attention(q, k, v, **kwargs).float() - outputs[name]).abs().max().item()
    first = folders[0].name
    diffs = {n: (o - outputs[first]).abs().max().item() for n, o in outputs.items()}
    for fn in fns.values():  # warm up (first calls load the modules)
        fn()
    iters = 3 if device.type == "cuda" else 1
    ms = _interleaved_median_ms(fns, rounds=7, iters=iters, device=device.type)
    passes = ("fwd",) if forward_only else ("fwd", "fwd+bwd")
    row = {"spec": spec.name, "call": call_text, "shape": shape, "sdpa_layout": sdpa_layout, "fp32_matmul_precision": torch.get_float32_matmul_precision(),
           "kwargs": {name: value for name, value in kwargs.items() if not torch.is_tensor(value)},
           "ms": ms, "max_diff_vs_first": diffs, "max_diff_second_call": again,
           "speedup": {p: {n: ms[f"{first} {p}"] / ms[f"{n} {p}"] for n in modules} for p in passes}}
    if plain:
        row["vs_plain"] = {p: {n: ms[f"plain {p}"] / ms[f"{n} {p}"] for n in modules} for p in passes}
    print(json.dumps(row), flush=True)
    if out:
        with out.open("a") as f:
            f.write(json.dumps({**row, "machine": machine_info(device.type)}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build")
    b.add_argument("folder", type=Path)
    b.add_argument("spec", help="e.g. bf16:d128:softcap (tvmflash.presets.parse_spec), or flex:document")
    b.add_argument("--target", choices=sorted(TARGETS), default="cuda")
    b.add_argument("--knobs", default="{}", help="knobs over the tuned ones (JSON), e.g. '{\"wgmma_poly_exp2\": 0}'")
    r = sub.add_parser("run")
    r.add_argument("folders", nargs="+", type=Path)
    r.add_argument("--shape", default="1,16384,16,128", help="B,L,H,D")
    r.add_argument("--kwargs", default="{}", help="flash_attn_func keywords (JSON)")
    r.add_argument("--plain", action="store_true", help="also time the call without the variant")
    r.add_argument("--out", type=Path)
    r.add_argument("--fp32-precision", choices=("highest", "high", "medium"),
                   help="torch.set_float32_matmul_precision for the run (fp32 on AMX: 'high' takes the bf16x3 kernels)")
    r.add_argument("--sdpa-layout", action="store_true",
                   help="q, k, v in (B, H, L, D) memory, as scaled_dot_product_attention takes them (the CPU grid's layout)")
    r.add_argument("--forward-only", action="store_true")
    args = parser.parse_args()
    if args.command == "build":
        build_into(args.folder, args.spec, TARGETS[args.target](), json.loads(args.knobs))
    else:
        with float32_matmul_precision(args.fp32_precision):
            run(args.folders, tuple(int(x) for x in args.shape.split(",")), json.loads(args.kwargs), args.plain,
                args.out, args.sdpa_layout, args.forward_only)


if __name__ == "__main__":
    main()
