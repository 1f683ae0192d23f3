"""The ``tvmflash`` command line.

Heavy imports (torch, tvmflash kernels, matplotlib) happen inside the commands
so that ``tvmflash --help`` starts fast.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(
    name="tvmflash",
    help="FlashAttention kernels written in Apache TVM TensorIR.",
    no_args_is_help=True,
    add_completion=False,
)


class Device(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


class Target(str, Enum):
    cuda = "cuda"
    avx512 = "avx512"
    host = "host"


class DType(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class Fp32Precision(str, Enum):
    highest = "highest"
    high = "high"
    medium = "medium"


@app.command()
def bench(
    device: Annotated[Device, typer.Option(help="Device to benchmark on.")] = Device.cpu,
    dtype: Annotated[Optional[list[DType]], typer.Option(help="Data type (repeatable). (default: cpu fp32 bf16, cuda fp16 bf16)")] = None,
    seqlen: Annotated[Optional[list[int]], typer.Option(help="Sequence length L = Lq = Lk (repeatable). (default: cpu 512 2048, cuda 1024 4096 16384)")] = None,
    head_dim: Annotated[list[int], typer.Option(help="Head dimension D (repeatable).")] = [64, 128],
    causal: Annotated[Optional[bool], typer.Option(help="Only causal / only non-causal. (default: cpu non-causal, cuda both)")] = None,
    backward: Annotated[bool, typer.Option(help="Also time the backward pass.")] = True,
    batch: Annotated[Optional[int], typer.Option(help="Batch size B. (default: cpu 1, cuda 16384/L)")] = None,
    heads: Annotated[Optional[int], typer.Option(help="Number of heads H. (default: cpu 16, cuda 2048/D)")] = None,
    iters: Annotated[
        Optional[int], typer.Option(help="Calls per timing sample (default: sized so a sample takes ~0.2 s).")
    ] = None,
    rounds: Annotated[int, typer.Option(help="Interleaved timing samples per implementation; the median is reported.")] = 5,
    out: Annotated[Path, typer.Option(help="Directory for the JSON and PNG results.")] = Path("benchmarks/results"),
    tag: Annotated[Optional[str], typer.Option(help="Result file name stem (default: the device).")] = None,
    fp32_precision: Annotated[Optional[Fp32Precision], typer.Option(
        help="torch.set_float32_matmul_precision for the run, both sides (CPU fp32 on AMX: 'high' takes the bf16x3 forward).")] = None,
) -> None:
    """Time tvmflash against torch's scaled_dot_product_attention (forward and backward)."""
    from rich.console import Console

    from tvmflash import bench as b

    cuda = device == Device.cuda
    rows = b.run(
        device=device.value,
        dtypes=[d.value for d in dtype] if dtype else (["fp16", "bf16"] if cuda else ["fp32", "bf16"]),
        seqlens=seqlen or ([1024, 4096, 16384] if cuda else [512, 2048]),
        head_dims=head_dim,
        causal=(causal,) if causal is not None else ((False, True) if cuda else (False,)),
        batch=batch,
        heads=heads,
        rounds=rounds,
        iters=iters,
        backward=backward,
        fp32_precision=fp32_precision.value if fp32_precision else None,
    )
    b.print_table(rows)
    json_path, png_path = b.write_results(rows, out, tag or device.value)
    Console().print(f"results: {json_path}\nplot:    {png_path}")


# the options that choose specs and targets, shared by build, export and tune
SpecOption = Annotated[Optional[list[str]], typer.Option(
    help="Spec (repeatable): dtype:dN[:causal][:softcap][:alibi][:window][:kvcache], e.g. bf16:d128:causal.")]
PresetOption = Annotated[Optional[str], typer.Option(help="The specs of a model (see `tvmflash info`).")]
PresetDTypeOption = Annotated[DType, typer.Option(help="Data type of a preset's specs.")]
ArchOption = Annotated[Optional[str], typer.Option(help="CUDA arch (default: this machine's GPU, else sm_90a).")]
McpuOption = Annotated[Optional[str], typer.Option(help="LLVM CPU model of the host target (default: this CPU).")]


def _select_specs(spec: Optional[list[str]], model_preset: Optional[str], dtype: DType) -> tuple[list, dict]:
    """The specs named on the command line, and the variants' values (a preset's window and
    softcap; for timing)."""
    from tvmflash.presets import DTYPE_NAMES, MODEL_PRESETS, parse_spec

    if bool(spec) == bool(model_preset):
        raise typer.BadParameter("give --spec or --model-preset (one of them)")
    if model_preset:
        if model_preset not in MODEL_PRESETS:
            raise typer.BadParameter(f"unknown preset {model_preset!r}; presets: {', '.join(MODEL_PRESETS)}")
        preset = MODEL_PRESETS[model_preset]
        return preset.specs(DTYPE_NAMES[dtype.value]), preset.values
    try:
        return [parse_spec(s) for s in spec], {}
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None


def _target(target: Target, arch: Optional[str], mcpu: Optional[str]) -> dict:
    """The target of `build` / `export`: tune's (CUDA: `arch`, else this machine's GPU);
    `mcpu` picks the host target's CPU model."""
    import os

    from tvmflash.tune import target_of

    if target == Target.host and mcpu:
        os.environ["TVMFLASH_HOST_MCPU"] = mcpu
    return target_of(target.value, arch)


def _build_specs(console, specs: list, target: dict, out: Optional[Path]) -> None:
    """Build each spec's module for `target` into the cache, one process a core
    (`build.build_many`), with a progress bar (a cold build takes seconds to minutes per spec),
    and export them to `out`."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tvmflash import build, deploy

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as bar:
        task = bar.add_task(f"building {len(specs)} modules for {build.target_label(target)}", total=len(specs))

        def built(spec, seconds, was_cached):
            bar.console.print(f"{spec.name}: {'cached' if was_cached else f'built in {seconds:.1f} s'}")
            bar.update(task, advance=1)

        build.build_many(specs, target, on_built=built)
    if out is not None:
        deploy.export(specs, target, out)  # from the cache just filled
        console.print(f"manifest: {out / deploy.MANIFEST}")


@app.command()
def build(
    target: Annotated[Target, typer.Option(help="Target to build for.")],
    spec: SpecOption = None,
    model_preset: PresetOption = None,
    dtype: PresetDTypeOption = DType.bf16,
    arch: ArchOption = None,
    mcpu: McpuOption = None,
) -> None:
    """Compile modules into the cache ($TVMFLASH_CACHE_DIR), so first calls do not wait."""
    from rich.console import Console

    specs, _ = _select_specs(spec, model_preset, dtype)
    _build_specs(Console(), specs, _target(target, arch, mcpu), None)


@app.command()
def export(
    target: Annotated[Target, typer.Option(help="Target to build for.")],
    out: Annotated[Path, typer.Option(help="Directory for the libraries and manifest.json.")],
    spec: SpecOption = None,
    model_preset: PresetOption = None,
    dtype: PresetDTypeOption = DType.bf16,
    arch: ArchOption = None,
    mcpu: McpuOption = None,
) -> None:
    """Build modules and export them with a manifest, for tvmflash.load_exported (runtime-only
    deployments: TVM_USE_RUNTIME_LIB=1, no compiler)."""
    from rich.console import Console

    specs, _ = _select_specs(spec, model_preset, dtype)
    _build_specs(Console(), specs, _target(target, arch, mcpu), out)


@app.command()
def tune(
    target: Annotated[Target, typer.Option(help="Target whose schedule knobs to tune.")],
    spec: SpecOption = None,
    model_preset: PresetOption = None,
    dtype: PresetDTypeOption = DType.bf16,
    phase: Annotated[Optional[list[str]], typer.Option(help="forward, backward, decode, decode_long (default: all of a spec's).")] = None,
    trials: Annotated[int, typer.Option(help="New measurements per workload (spec, phase) at most.")] = 16,
    time_budget: Annotated[Optional[float], typer.Option(help="Seconds; no candidate starts after it.")] = None,
    work_dir: Annotated[Optional[Path], typer.Option(
        help="The run's MetaSchedule database and built candidates (resumable). (default: tvmflash-tune/<target>)")] = None,
    seqlen: Annotated[Optional[list[int]], typer.Option(help="Sequence lengths a candidate is timed at.")] = None,
    build_only: Annotated[bool, typer.Option(help="Only build candidates (time them on the target machine).")] = False,
    merge: Annotated[bool, typer.Option(help="Merge the best records into tuning_logs/<target>/.")] = True,
) -> None:
    """Tune schedule knobs: build candidates, time them where the target runs, keep every
    measurement in a MetaSchedule JSON database, merge the best per workload into tuning_logs/."""
    from rich.console import Console

    from tvmflash import tune as t

    console = Console()
    specs, values = _select_specs(spec, model_preset, dtype)
    work_dir = work_dir or Path("tvmflash-tune") / target.value
    with _TuneProgress(console) as progress:
        summary = t.tune(target.value, specs, tuple(phase) if phase else None, trials, time_budget, work_dir,
                         build_only, tuple(seqlen) if seqlen else t.SEQLENS, merge, values, progress)
    _print_tune_summary(console, summary, target.value, work_dir)


class _TuneProgress:
    """A rich progress bar over the tuner's events, with the best time so far."""

    def __init__(self, console):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = console
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), TextColumn("{task.fields[best]}"), console=console)

    def __enter__(self):
        self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        return self.bar.__exit__(*exc)

    def __call__(self, event: str, **info) -> None:
        if event == "start":
            what = "build + time" if info["can_build"] and info["can_time"] else (
                "build only" if info["can_build"] else "time only")
            self.task = self.bar.add_task(f"tuning ({what})", total=info["total"], best="")
            return
        c = info["candidate"]
        label = f"{c.spec.name} {c.phase}"
        if event == "measured":
            best = info["best"]
            self.bar.console.print(f"{label} {_knobs(c.knobs)}: {_ms(info['secs'])} (best {_ms(best.secs)})")
            self.bar.update(self.task, advance=1, best=f"best {label}: {_ms(best.secs)}")
        elif event == "failed":
            self.bar.console.print(f"[red]{label} {_knobs(c.knobs)} failed: {info['error']}[/red]")
        else:
            if event == "skip":
                self.bar.console.print(f"[yellow]{label} {_knobs(c.knobs)}: skipped, {info['reason']}[/yellow]")
            self.bar.update(self.task, advance=1)


def _knobs(knobs: dict) -> str:
    """Knob values, short: per-matmul register tiles (`<kernel>.<matmul>.rows`) shown once."""
    short = {}
    for name, value in sorted(knobs.items()):
        short.setdefault(name.rsplit(".", 1)[-1], set()).add(value)
    return " ".join(f"{name}={'/'.join(map(str, sorted(v)))}" for name, v in short.items())


def _ms(secs) -> str:
    return "failed" if secs is None or secs >= 1e10 else f"{secs * 1e3:.3f} ms"


def _print_tune_summary(console, summary: dict, target: str, work_dir: Path) -> None:
    from rich.table import Table

    table = Table(title=f"best per workload ({work_dir})")
    for column in ("spec", "phase", "time", "knobs"):
        table.add_column(column)
    for key, record in sorted(summary["best"].items()):
        spec_name, phase = key.split("/")
        table.add_row(spec_name, phase, _ms(record.secs) if record.run_secs else "-", _knobs(record.knobs))
    console.print(table)
    counts = ", ".join(f"{summary[k]} {k.replace('_', ' ')}" for k in ("measured", "built", "failed", "not_built",
                                                                      "out_of_time") if summary[k])
    console.print(f"{counts or 'nothing to do'} in {summary['elapsed_s']:.0f} s")
    if summary["not_built"]:
        console.print("build the rest where TVM's compiler is (same command), then time them here")
    elif summary["built"] and not summary["measured"]:
        console.print(f"built; time them on the {target} machine: the same command there, with {work_dir} carried")
    for new, old in summary["merged"]:
        console.print(f"tuning_logs/{target}: {new.spec} {new.phase} {_ms(new.secs)}"
                      + (f" (was {_ms(old.secs)})" if old and old.run_secs else " (new)"))


@app.command()
def plot(results: Annotated[Path, typer.Argument(help="A results JSON written by `tvmflash bench`.")]) -> None:
    """Draw the PNG of a benchmark results JSON (for runs on machines without matplotlib)."""
    from tvmflash.bench import plot_results

    print(plot_results(results))


def _bf16_unit_name(target: dict) -> str | None:
    """What the CPU target's bf16 kernels multiply on ("amx", "avx512_bf16"); None for the
    generic FMA kernels, or where the schedules cannot be imported (TVM runtime only)."""
    from tvmflash import build

    if not build.has_compiler():
        return None
    from tvmflash.schedules.avx512 import bf16_unit

    unit = bf16_unit(target) if build._tuning_kind(target) == "avx512" else None  # the avx512 schedule's
    return unit.name if unit else None


@app.command()
def info() -> None:
    """This machine's targets (CPU features, GPU), TVM (compiler or runtime only), the module
    cache, exported modules, tuning records per target and the model presets."""
    import torch
    from rich.console import Console
    from rich.table import Table

    from tvmflash import build, deploy, tuning
    from tvmflash.bench import machine_info
    from tvmflash.presets import MODEL_PRESETS

    console = Console()
    m = machine_info()
    table = Table(title="machine", show_header=False)
    table.add_row("torch", f"{m['torch']} ({m['torch_threads']} threads)")
    table.add_row("TVM", f"{build._tvm().__version__} ({'compiler' if build.has_compiler() else 'runtime only'})")
    table.add_row("cpu", f"{m['cpu_model']} ({m['cpu_count']} logical cores)")
    table.add_row("cpu features", " ".join(f"{flag}:{'yes' if on else 'no'}" for flag, on in m["cpu_flags"].items()))
    try:
        target = build.cpu_target()
        cpu = build.target_label(target) + (f" (bf16 kernels on {unit})" if (unit := _bf16_unit_name(target)) else "")
    except RuntimeError as err:  # runtime only, nothing exported for this CPU
        cpu = f"none ({err})"
    table.add_row("cpu target", cpu)
    gpu = [f"{torch.cuda.get_device_name(i)} ({build.cuda_target_for_device(i)['arch']})"
           for i in range(torch.cuda.device_count())] if m["cuda_available"] else []
    table.add_row("cuda", ", ".join(gpu) or "no GPU")
    console.print(table)

    cache = build.configured_cache_dir()
    libs = sorted(cache.glob("*.so")) if cache.exists() else []
    table = Table(title=f"module cache {cache}: {len(libs)} modules, "
                        f"{sum(p.stat().st_size for p in libs) / 2**20:.1f} MiB")
    for column in ("spec", "target", "MiB"):
        table.add_column(column)
    for lib in libs:
        spec_name, label, _ = lib.stem.rsplit("-", 2)
        table.add_row(spec_name, label, f"{lib.stat().st_size / 2**20:.1f}")
    console.print(table)
    deploy._load_env()
    if deploy._exported:
        console.print("exported modules: " + ", ".join(f"{s.name} ({label})" for s, _, label in deploy._exported))

    table = Table(title="tuning records (tuning_logs/)")
    for column in ("target", "specs with records"):
        table.add_column(column)
    for kind in ("cuda", "avx512", "host"):
        names = tuning.tuned_spec_names(kind)
        table.add_row(kind, "\n".join(names) if names else "none (schedule defaults)")
    console.print(table)
    table = Table(title="model presets (--model-preset)")
    for column in ("preset", "heads / kv heads / head dim", "variants"):
        table.add_column(column)
    for p in MODEL_PRESETS.values():
        table.add_row(p.name, f"{p.heads} / {p.kv_heads} / {p.head_dim}",
                      ", ".join(f"{k} {v}" for k, v in p.values.items()) or "causal")
    console.print(table)


def main() -> None:
    app(prog_name="tvmflash")
