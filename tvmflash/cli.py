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


class DType(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


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
    )
    b.print_table(rows)
    json_path, png_path = b.write_results(rows, out, tag or device.value)
    Console().print(f"results: {json_path}\nplot:    {png_path}")


@app.command()
def plot(results: Annotated[Path, typer.Argument(help="A results JSON written by `tvmflash bench`.")]) -> None:
    """Draw the PNG of a benchmark results JSON (for runs on machines without matplotlib)."""
    from tvmflash.bench import plot_results

    print(plot_results(results))


@app.command()
def info() -> None:
    """Show torch version, threads, relevant CPU features and CUDA availability."""
    import torch
    from rich.console import Console
    from rich.table import Table

    from tvmflash.bench import machine_info

    m = machine_info()
    table = Table(show_header=False, box=None)
    table.add_row("torch", m["torch"])
    table.add_row("torch threads", str(m["torch_threads"]))
    table.add_row("cpu", f"{m['cpu_model']} ({m['cpu_count']} logical cores)")
    for flag, present in m["cpu_flags"].items():
        table.add_row(flag, "[green]yes[/green]" if present else "[red]no[/red]")
    gpu = torch.cuda.get_device_name() if m["cuda_available"] else None
    table.add_row("cuda", f"yes ({gpu})" if gpu else "no")
    Console().print(table)


def main() -> None:
    app(prog_name="tvmflash")
