"""Host CPU schedule (LLVM, AVX2-class x86 or any CPU without a dedicated schedule).

Parallelism is in the kernels themselves (one task per (batch, head, block)); this file maps
each named block of each kernel to a rule from `cpu_rules`. Knobs and their defaults:

    block_q, block_k   generator parameters: query / key rows per tile (algorithmic)
    <matmul>.rows      rows of the register tile of each matmul block
    <matmul>.vecs      vectors per row of that tile

Tuned values for a spec come from `tuning_logs/host/`; these defaults were picked on the 2-core
AVX2 dev machine.
"""
from __future__ import annotations

from .cpu_rules import register_tile, swap_and_vectorize, vectorize_inner
from .knobs import Knobs

DEFAULTS = {"block_q": 64, "block_k": 64}

# block name -> rule, per kernel (see tvmflash/kernels/*.py for the blocks)
PLANS = {
    "forward": {
        "load_qT": swap_and_vectorize, "init_acc": vectorize_inner, "load_k": vectorize_inner,
        "load_v": vectorize_inner, "qk": register_tile, "score": vectorize_inner,
        "rowmax": swap_and_vectorize, "p": vectorize_inner, "rowsum": swap_and_vectorize,
        "pv": register_tile, "store_o": vectorize_inner,
    },
}


def vector_length(target) -> int:
    """fp32 lanes of the target's widest vector unit."""
    feats = str(target.attrs.get("mcpu", "")) + " " + " ".join(str(a) for a in target.attrs.get("mattr", []))
    return 16 if "avx512" in feats or "sapphirerapids" in feats or "skylake-avx512" in feats else 8


def schedule(sch, kernel: str, vl: int, fixed: dict | None = None) -> dict:
    """Schedule `kernel` (a key of PLANS) in place; returns the knob values used."""
    knobs = Knobs(sch, fixed if fixed is not None else None)
    for block, rule in PLANS[kernel].items():
        if rule is register_tile:
            rule(sch, block, knobs, vl)
        else:
            rule(sch, block)
    return knobs.chosen
