"""Which CUDA kernels a spec's module holds, and which forward a call runs: the Hopper (wgmma)
kernels on sm_90a where they take the spec, the mma.sync ones otherwise, and the split-KV
decode kernel for a KV cache. (Here, not in tvmflash.build, so that a change of choice re-keys
the cached modules: their key hashes `schedules/cuda_*.py`. The schedules are imported inside
the functions: the runtime-only deployment calls `forward_name` without TVM's compiler.)"""
from __future__ import annotations

from tvmflash.spec import AttentionSpec

# A sliding window whose q-blocks see at most this many keys on either side together (left +
# right) walks a few K/V tiles a q-block; those run the lockstep wgmma forward ("forward_short"),
# whose CTAs start sooner than the warp-specialized one's (mbarrier rings, register hand-over).
# Crossover measured on the H200 (scripts/variants_bench.py, "window walks").
SHORT_WALK_KEYS = 1024


def default_knobs(spec: AttentionSpec) -> dict:
    """Every CUDA schedule's default knobs for `spec`."""
    from . import cuda_backward, cuda_backward_wgmma, cuda_decode, cuda_forward, cuda_forward_wgmma

    return {**cuda_forward.default_knobs(spec), **cuda_forward_wgmma.default_knobs(spec),
            **cuda_backward.default_knobs(spec), **cuda_backward_wgmma.default_knobs(spec), **cuda_decode.DEFAULTS}


def kernels(spec: AttentionSpec, arch: str, knobs: dict) -> dict:
    """The module's kernels by function name, for CUDA arch `arch` and the full knob set."""
    from . import cuda_backward, cuda_backward_wgmma, cuda_decode

    if spec.kv_cache:
        return {"decode": cuda_decode.decode_kernel_cuda(spec, knobs)}
    out = {**cuda_backward.backward_kernels_cuda(spec, knobs, arch), **forward_kernels(spec, arch, knobs)}
    if knobs["bwd_wgmma"] and cuda_backward_wgmma.supports(spec, arch):
        for name, with_dq in (("backward_dkdv_dq", True), ("backward_dkdv", False)):
            out[name] = cuda_backward_wgmma.dkdv_kernel_wgmma(spec, knobs, with_dq)
        # its dQ accumulator's layout
        out["backward_dq_convert"] = cuda_backward.dq_convert_kernel(spec, cuda_backward_wgmma.dq_acc_layout(spec, knobs))
    return out


def forward_kernels(spec: AttentionSpec, arch: str, knobs: dict) -> dict:
    """The forward kernels by function name: "forward", and "forward_short" for windows where
    "forward" is the warp-specialized loop."""
    from . import cuda_forward, cuda_forward_wgmma

    if not (knobs["forward_wgmma"] and cuda_forward_wgmma.supports(spec, arch, knobs)):
        return {"forward": cuda_forward.forward_kernel_cuda(spec, knobs)}
    out = {"forward": cuda_forward_wgmma.forward_kernel_wgmma(spec, knobs)}
    if "window" in spec.variants and cuda_forward_wgmma.warp_specialized(knobs):
        lockstep = cuda_forward_wgmma.forward_kernel_wgmma(spec, {**knobs, "wgmma_producer": 0})
        out["forward_short"] = lockstep.with_attr("global_symbol", "forward_short")
    return out


def forward_name(kernels: dict, window: tuple) -> str:
    """The forward kernel a call with sliding window `window` = (left, right) (-1: unbounded)
    runs: "forward_short" where the module has it and the window is short, else "forward"."""
    left, right = window
    if "forward_short" in kernels and 0 <= left and 0 <= right and left + right <= SHORT_WALK_KEYS:
        return "forward_short"
    return "forward"
