"""Which CUDA kernels a spec's module holds: the Hopper (wgmma) kernels on sm_90a where they
take the spec, the mma.sync ones otherwise, and the split-KV decode kernels for a KV cache.
(Here, not in tvmflash.build, so that a change of choice re-keys the cached modules: their
key hashes `schedules/cuda_*.py`. Which forward a call runs is tvmflash.ops' choice.)"""
from __future__ import annotations

from tvmflash.spec import AttentionSpec
from tvmflash.tuning import DECODE_PHASES

from . import cuda_backward, cuda_backward_wgmma, cuda_decode, cuda_forward, cuda_forward_wgmma


def default_knobs(spec: AttentionSpec) -> dict:
    """Every CUDA schedule's default knobs for `spec`."""
    return {**cuda_forward.default_knobs(spec), **cuda_forward_wgmma.default_knobs(spec),
            **cuda_backward.default_knobs(spec), **cuda_backward_wgmma.default_knobs(spec),
            **cuda_decode.default_knobs(spec)}


def kernels(spec: AttentionSpec, arch: str, knobs: dict) -> dict:
    """The module's kernels by function name, for CUDA arch `arch` and the full knob set."""
    if spec.kv_cache:
        appends = (cuda_decode.append_kernel_cuda(spec, spec.dtype), cuda_decode.append_kernel_cuda(spec, "float32"))
        return {**{phase: cuda_decode.decode_kernel_cuda(spec, knobs, phase) for phase in DECODE_PHASES},
                **{f.attrs["global_symbol"]: f for f in appends}}
    out = {**cuda_backward.backward_kernels_cuda(spec, knobs, arch), **forward_kernels(spec, arch, knobs)}
    if knobs["bwd_wgmma"] and cuda_backward_wgmma.supports(spec, arch):
        for name, with_dq in (("backward_dkdv_dq", True), ("backward_dkdv", False)):
            out[name] = cuda_backward_wgmma.dkdv_kernel_wgmma(spec, knobs, with_dq)
        # its dQ accumulator's layout
        out["backward_dq_convert"] = cuda_backward.dq_convert_kernel(spec, cuda_backward_wgmma.dq_acc_layout(spec, knobs))
    return out


def forward_kernels(spec: AttentionSpec, arch: str, knobs: dict) -> dict:
    """The forward kernels by function name: "forward", and "forward_short" for windows where
    "forward" is the warp-specialized loop (tvmflash.ops chooses by the call's window)."""
    if not (knobs["forward_wgmma"] and cuda_forward_wgmma.supports(spec, arch, knobs)):
        return {"forward": cuda_forward.forward_kernel_cuda(spec, knobs)}
    out = {"forward": cuda_forward_wgmma.forward_kernel_wgmma(spec, knobs)}
    if "window" in spec.variants and cuda_forward_wgmma.warp_specialized(knobs):
        lockstep = cuda_forward_wgmma.forward_kernel_wgmma(spec, {**knobs, "wgmma_producer": 0})
        out["forward_short"] = lockstep.with_attr("global_symbol", "forward_short")
    return out

