"""x86 AVX512 schedule (Sapphire Rapids class: 32 zmm registers; bf16 on AMX tiles where the
target has them, else on avx512_bf16's `vdpbf16ps`).

Which kernels a module holds depends on the target and spec: bf16 with a head dim that is a
multiple of 32 on an AMX target gets the bf16 forward and backward (`amx_forward.py`,
`amx_backward.py`: hand-mapped, as the CUDA kernels are) plus their K/V packing kernels; on an
avx512_bf16 CPU without AMX (BF16_DOT_CPUS: Zen 4 / 5) the same kernels with their
products on `vdpbf16ps` register blocks (`bf16_unit`); everything else (fp32, fp16 converted to
fp32, other head dims) runs the generic s_tir kernels on zmm FMAs. The rules come from `cpu_rules`, as for the host schedule; only the
vector length, the extra AMX-side blocks and the knob defaults differ. Knobs (names as in
`host.py`, values for a spec tuned into `tuning_logs/avx512/`):

    block_q, block_k           forward generator parameters (AMX: multiples of 32 dividing AMX_KV_PAD)
    long_block_q               the AMX forward's block_q for long keys (`forward_long`, see AMX_LONG_KV_BYTES)
    bf16x3_block_q, bf16x3_block_k, bf16x3_long_block_q, bf16x3_bwd_block_q, bf16x3_bwd_block_k
                               the same for fp32 specs' bf16x3 forward and backward
                               (`forward_bf16x3`, `backward_bf16x3_*`: torch's float32 matmul
                               precision "high")
    bwd_block_q, bwd_block_k   the backward's
    <kernel>.<matmul>.rows     register-tile rows of each FMA matmul block
    <kernel>.<matmul>.vecs     zmm vectors per register-tile row
"""
from __future__ import annotations

from . import host
from .cpu_rules import vectorize_inner

VL = 16
AMX_CPUS = ("sapphirerapids", "emeraldrapids", "graniterapids", "diamondrapids")
# CPUs whose split-KV decode takes its bf16 products on `vdpbf16ps` (kernels/decode.PairDot):
# Zen 5 (dev box, compute only 1.2-1.8x faster than the FMA kernel). Not Sapphire Rapids: there
# the decode benchmark ran 16-18% slower at 1k with them (Xeon, 2026-12-02; on the dev box's Intel
# AMX core a zmm vdpbf16ps issues once every 2 cycles, FMAs twice a cycle); other CPUs unmeasured
PAIR_DOT_CPUS = ("znver5",)
# avx512_bf16 without AMX, AMD: their bf16 forward and backward run the AMX kernels' code with
# each tile product on `vdpbf16ps` (amx.PAIR_DOTS; Zen 4 / 5 issue it as fast as a zmm FMA, two
# fp32 products a lane). Zen 5 dev box, 2 threads, same process: forward 3.8-4.7x torch SDPA,
# backward 2.3-2.8x, where the generic kernels' fp32 FMAs gave 2.1x / 1.3-1.4x. Not Intel's
# Cooper Lake: on the Xeon (Emerald Rapids) the same modules ran 0.22-0.30x torch forward, a fifth
# of the AMX kernels' speed (`vdpbf16ps` issues once every 2 cycles there, half the FMAs' rate;
# benchmarks/results/cpu-xeon-16core-bf16-units-ab.jsonl), so Intel CPUs without AMX keep the
# FMA kernels. A target can still ask for pair dots by naming +avx512bf16 in its mattr.
BF16_DOT_CPUS = ("znver4", "znver5")
AMX_KV_PAD = 256  # packed K / V^T rows per (batch, kv-head) are a multiple of this (block_k
# up to 256: each kv block's P.V loads and stores the O^T tiles once, so longer blocks spend
# fewer tile loads a score; Xeon, bf16 D = 128, L = 1024: 256-key blocks 1.05-1.12x faster than
# 128; D = 64 keeps 128, within 3%)
# A kv-head's K and V^T packs of at least this many bytes do not stay in a core's L2 (2 MB on
# SPR) next to a task's tiles, so each q-block streams them from L3 again: those calls run
# `forward_long`, whose q-blocks of `long_block_q` rows read them a quarter as often. (Xeon,
# bf16, 256-key blocks, same process: L = 2048 D = 128 (1 MiB) 1.07-1.11x faster with 256-row
# q-blocks, L = 4096 1.09-1.13x; below, 64 rows are as fast or faster: L = 1024 D = 64 1.06x.)
AMX_LONG_KV_BYTES = 1 << 20
# The bf16x3 forward (fp32 under precision "high") takes its long-key kernel from this many keys
# (its packs are 3x the bf16 ones, and its tiles 3x the work a byte). Xeon, same process, kernel
# against kernel, the long one's time over the short one's: 0.94 / 0.98 at 4096 keys (D 64 /
# 128), 0.99 / 1.02 at 2048, 1.02 / 1.04 at 1024 (results/cpu-xeon-16core-fp32-high-long-kernel.jsonl)
AMX_BF16X3_LONG_KEYS = 4096
SPLIT_SEGMENTS = 3  # an fp32 operand's bf16 segments in the bf16x3 forward ([hi | hi | lo]: amx.split_bf16)
AMX_LONG_MIN_QUERIES = 256  # fewer queries (chunked prefill on a long cache) would mostly fill
# `forward_long`'s q-blocks with padding rows, whose tile work costs as much as real ones

# 32 zmm registers: register tiles of up to 8 x 2 (or 4 x 4) accumulators
DEFAULTS = {
    "block_q": 64, "block_k": 64, "long_block_q": 256, "bwd_block_q": 64, "bwd_block_k": 64,
    # bf16x3 (fp32 under precision "high"): Xeon, same process, fwd+bwd against 64 x 64 backward
    # blocks: 64 x 128 1.17x / 1.07x at D=128 L=4096 / 1024, 1.11x / 1.08x at D=64; 128 x 128,
    # 64 x 256, 32 x 128 within 4% of it (benchmarks/results/cpu-xeon-16core-fp32-high-blocks-ab.jsonl)
    "bf16x3_block_q": 64, "bf16x3_block_k": 128, "bf16x3_long_block_q": 256, "bf16x3_bwd_block_q": 64,
    "bf16x3_bwd_block_k": 128,
    **{f"{k}.{m}.rows": 8 for k, m in (("forward", "qk"), ("forward", "pv"), ("backward_dq", "qk"),
                                      ("backward_dq", "dp"), ("backward_dq", "dq"))},
    **{f"{k}.{m}.rows": 8 for k in ("backward_dkdv", "backward_fused") for m in ("qk", "dp", "dv", "dk", "dq")},
}


RULES = {
    **host.RULES,
    # AMX forward: K's padded copy (P's pack, pack_p, is written in vectors; the transposing
    # packs, Q's VNNI pairs once per task and V^T, gather words in their own vector code:
    # amx.word_column)
    "pack_k": vectorize_inner,
    # AMX backward: operand packs per call (the per-step ones are written in vectors, the
    # transposing ones as the forward's)
    "pack_kv": vectorize_inner, "pack_qq": vectorize_inner,
}


def has_amx(target: dict) -> bool:
    return target.get("mcpu") in AMX_CPUS or "+amx-bf16" in target.get("mattr", [])


def bf16_unit(target: dict):
    """What the bf16 forward and backward kernels' GEMMs run on for `target`: AMX tiles, else
    `vdpbf16ps` on CPUs with avx512_bf16 (BF16_DOT_CPUS), else None (the generic kernels'
    fp32 FMAs)."""
    from .amx import PAIR_DOTS, TILES

    if has_amx(target):
        return TILES
    if target.get("mcpu") in BF16_DOT_CPUS or "+avx512bf16" in target.get("mattr", []):
        return PAIR_DOTS
    return None


def bf16x3_unit(target: dict):
    """What an fp32 spec's bf16x3 forward runs on for `target` (None: the module has none):
    AMX tiles, or `vdpbf16ps` where the target names +avx512bf16 (the test and A/B target
    AVX512_BF16_TARGET). Not on Zen hosts: pair dots take three products where an FMA takes one
    of the two, so their fp32 FMAs are as fast."""
    from .amx import PAIR_DOTS, TILES

    if has_amx(target):
        return TILES
    return PAIR_DOTS if "+avx512bf16" in target.get("mattr", []) else None


def takes_pair_dots(target: dict) -> bool:
    """Whether the split-KV decode's bf16 products run on `vdpbf16ps` (PAIR_DOT_CPUS)."""
    return target.get("mcpu") in PAIR_DOT_CPUS


def kernels(spec, target: dict, knobs: dict) -> dict:
    """Name -> PrimFunc of every kernel of `spec`'s module for `target`."""
    from .amx_backward import backward_amx_kernel, backward_amx_pack_kernel
    from .amx_decode import decode_amx_kernel
    from .amx import PAIR_DOT
    from .amx_forward import amx_supported, bf16x3_supported, forward_amx_kernel, forward_amx_pack_kernel

    funcs = host.kernels(spec, target, knobs, PAIR_DOT if takes_pair_dots(target) else None)
    if has_amx(target) and amx_supported(spec):  # the split-KV forward of more rows a kv-head
        for split in ("decode", "forward_split"):
            if split in funcs:
                funcs[f"{split}_tiles"] = decode_amx_kernel(spec, f"{split}_tiles")
    unit = bf16_unit(target)
    if unit is not None and amx_supported(spec) and not spec.kv_cache:
        funcs["forward"] = forward_amx_kernel(spec, knobs["block_q"], knobs["block_k"], AMX_KV_PAD, unit=unit)
        if knobs["long_block_q"] != knobs["block_q"]:
            funcs["forward_long"] = forward_amx_kernel(spec, knobs["long_block_q"], knobs["block_k"], AMX_KV_PAD,
                                                       "forward_long", unit)
        funcs["forward_pack"] = forward_amx_pack_kernel(spec, AMX_KV_PAD)
        funcs["forward_pack_vt"] = forward_amx_pack_kernel(spec, AMX_KV_PAD, with_k=False)
        for plan in ("fused", "dkdv", "dq"):
            funcs[f"backward_{plan}"] = backward_amx_kernel(spec, knobs["bwd_block_q"], knobs["bwd_block_k"], plan,
                                                            unit)
        funcs["backward_pack"] = backward_amx_pack_kernel(spec, AMX_KV_PAD)
    unit = bf16x3_unit(target)
    if unit is not None and bf16x3_supported(spec):
        bq, bk, long_bq = (knobs[f"bf16x3_{k}"] for k in ("block_q", "block_k", "long_block_q"))
        funcs["forward_bf16x3"] = forward_amx_kernel(spec, bq, bk, AMX_KV_PAD, "forward_bf16x3", unit)
        if long_bq != bq:
            funcs["forward_bf16x3_long"] = forward_amx_kernel(spec, long_bq, bk, AMX_KV_PAD, "forward_bf16x3_long", unit)
        funcs["forward_pack_bf16x3"] = forward_amx_pack_kernel(spec, AMX_KV_PAD, block_k=bk)
        bq, bk = knobs["bf16x3_bwd_block_q"], knobs["bf16x3_bwd_block_k"]
        for plan in ("fused", "dkdv", "dq"):
            funcs[f"backward_bf16x3_{plan}"] = backward_amx_kernel(spec, bq, bk, plan, unit, "backward_bf16x3")
        funcs["backward_pack_bf16x3"] = backward_amx_pack_kernel(spec, AMX_KV_PAD, bq, bk)
    return funcs


def schedule(sch, kernel: str, target: dict, fixed: dict | None = None) -> dict:
    """As host.schedule, with this file's rules and 16 lanes."""
    return host.apply_rules(sch, kernel, RULES, VL, fixed)
