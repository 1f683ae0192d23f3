"""Host CPU schedule (LLVM, any x86 CPU without a dedicated schedule; AVX2 or AVX512 lanes).

Parallelism is in the kernels themselves (one task per (batch, head, block)); this file maps the
kernels' named blocks to rules from `cpu_rules`. Every kernel names the same kind of block the
same way, so one table serves the forward and the three backward kernels. Knobs:

    block_q, block_k           generator parameters of the forward: query / key rows per tile
    bwd_block_q, bwd_block_k   the same for the backward kernels
    (the split-KV forward for decode, kernels/decode.py, has no knobs: SPLIT_* below)
    <kernel>.<matmul>.rows     rows of the register tile of each matmul block
    <kernel>.<matmul>.vecs     vectors per row of that tile

Tuned values for a spec come from `tuning_logs/host/`; `DEFAULTS` were picked on the dev box.
"""
from __future__ import annotations

from .cpu_rules import register_tile, swap_and_vectorize, vectorize_calls, vectorize_inner
from .knobs import Knobs

DEFAULTS = {"block_q": 64, "block_k": 64, "bwd_block_q": 64, "bwd_block_k": 64}
SPLIT_MAX_Q = 16  # the split-KV forward serves Lq <= this (decode)
SPLIT_BLOCK_ROWS = 4  # query rows (a kv-head's heads x queries) per task
SPLIT_MAX_KV_HEADS = 8  # kv-heads a task can take, each kv-block's keys for each in turn (ops._task_kv_heads)
SPLIT_AMX_ROWS = 16  # query rows per task of the AMX decode (schedules/amx_decode.py): a tile's
SPLIT_BLOCK_K = 64  # keys per kv-block (the unit of the splits)
SPLIT_TASK_KEYS = 2048  # automatic splits: at most this many keys a task (Xeon, 1k-16k caches)
# O columns a value pass of the split-KV forward keeps in registers, per fp32 lanes of the
# target: 4 rows x 4 zmm of 32 registers, 4 rows x 2 ymm of 16
SPLIT_VALUE_COLS = {16: 64, 8: 16}
# the one-row kernel's: 8 zmm / 4 ymm, as many independent accumulators as the 4-row kernel's
# half (each value row adds to every one of them, so fewer would wait on their own latency:
# dev box (Zen 5), D = 128, compute only: bf16 on vdpbf16ps 1.11-1.21x faster than 4 zmm, fp16
# on FMAs 1.14-1.22x; bf16 on real pages, 2 threads, 1.05-1.13x)
SPLIT_ROW_VALUE_COLS = {16: 128, 8: 32}

RULES = {
    # transposing loads and per-query reductions over S^T tiles
    "load_qT": swap_and_vectorize, "load_doT": swap_and_vectorize,
    "load_kT": swap_and_vectorize, "load_vT": swap_and_vectorize,
    "rowmax": swap_and_vectorize, "rowsum": swap_and_vectorize,
    # matmuls: out[r, c] += a[r, k] * b[k, c]
    "qk": register_tile, "dp": register_tile, "pv": register_tile,
    "dv": register_tile, "dk": register_tile, "dq": register_tile,
    # element-wise
    "load_q": vectorize_inner, "load_do": vectorize_inner, "load_k": vectorize_inner,
    "load_v": vectorize_inner, "init_acc": vectorize_inner, "score": vectorize_inner,
    "p": vectorize_inner, "ds": vectorize_inner, "store_o": vectorize_inner,
    "zero_dq": vectorize_inner, "store_dq": vectorize_inner, "store_dkdv": vectorize_inner,
    "p_drop": vectorize_inner, "philox": vectorize_inner, "dropout": vectorize_calls,
}


def vector_length(target: dict) -> int:
    """fp32 lanes of the widest vector unit of an LLVM target (as a TVM target dict)."""
    text = target.get("mcpu", "") + " " + " ".join(target.get("mattr", []))
    avx512 = ("avx512", "sapphirerapids", "skylake-avx512", "icelake", "cascadelake", "cooperlake",
              "tigerlake", "rocketlake", "graniterapids", "emeraldrapids", "znver4", "znver5")
    return 16 if any(s in text for s in avx512) else 8


def block_names(sch) -> list[str]:
    """Every block of the function `sch` works on, outer before inner."""
    names = []

    def walk(parent):
        for child in sch.get_child_blocks(parent):
            names.append(sch.get(child).name_hint)
            walk(child)

    walk(sch.get_sblock("root"))
    return names


def kernels(spec, target: dict, knobs: dict, pair_dot=None) -> dict:
    """Name -> PrimFunc of every kernel of `spec`'s module (the generic s_tir kernels; the
    split-KV forward with the target's bf16 pair products, `pair_dot`, where it has them)."""
    from ..kernels.backward import backward_delta_kernel, backward_dkdv_kernel, backward_dq_kernel
    from ..kernels.decode import cache_check_kernel, forward_combine_kernel, forward_split_kernel
    from ..kernels.forward import forward_kernel

    def split_kernels(prefix: str) -> dict:
        """The split-KV forward (4 query rows a task; `_row`: one, for a kv-head with a single
        query row, MHA decode, which 4 rows would compute 4 times) and its combine kernel."""
        lanes = vector_length(target)
        return {f"{prefix}{suffix}": kernel.with_attr("global_symbol", f"{prefix}{suffix}") for suffix, kernel in (
            ("", forward_split_kernel(spec, SPLIT_BLOCK_ROWS, SPLIT_BLOCK_K, SPLIT_VALUE_COLS[lanes], pair_dot,
                                      SPLIT_MAX_KV_HEADS)),
            ("_row", forward_split_kernel(spec, 1, SPLIT_BLOCK_K, SPLIT_ROW_VALUE_COLS[lanes], pair_dot,
                                          SPLIT_MAX_KV_HEADS)),
            ("_combine", forward_combine_kernel(spec)))}

    if spec.kv_cache:  # flash_attn_with_kvcache's decode: the split-KV forward on the cache, its checks and writes
        steps = (cache_check_kernel(), *(cache_check_kernel(spec, t) for t in dict.fromkeys((spec.dtype, "float32"))))
        return {**split_kernels("decode"), **{f.attrs["global_symbol"]: f for f in steps}}
    bq, bk = knobs["bwd_block_q"], knobs["bwd_block_k"]
    funcs = {
        "forward": forward_kernel(spec, knobs["block_q"], knobs["block_k"]),
        "backward_delta": backward_delta_kernel(spec, bq),
        "backward_dkdv": backward_dkdv_kernel(spec, bq, bk),
        "backward_dq": backward_dq_kernel(spec, bq, bk),
        "backward_fused": backward_dkdv_kernel(spec, bq, bk, fuse_dq=True),
    }
    if "dropout" not in spec.variants:  # decode (inference) has no dropout
        funcs.update(split_kernels("forward_split"))
    return funcs


def schedule(sch, kernel: str, target: dict, fixed: dict | None = None) -> dict:
    """Schedule function `kernel` of `sch.mod` in place for `target`. `fixed` pins knob values
    (missing ones take their defaults); None samples them (tuning). Returns the knob values used."""
    return apply_rules(sch, kernel, RULES, vector_length(target), fixed)


def apply_rules(sch, kernel: str, rules: dict, vl: int, fixed: dict | None) -> dict:
    """Apply `rules` (block name -> rule) to every block of `kernel`, for `vl` fp32 lanes."""
    sch.work_on(kernel)
    knobs = Knobs(sch, fixed, prefix=f"{kernel}.")
    for block in block_names(sch):
        rule = rules.get(block)
        if rule is register_tile:
            rule(sch, block, knobs, vl)
        elif rule is not None:
            rule(sch, block)
    return knobs.chosen
