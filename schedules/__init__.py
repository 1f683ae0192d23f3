"""How tvmflash's TensorIR kernels map to each target.

`cpu_rules` holds small schedule rules (register-tiled outer products, vectorised reductions,
...) that act on the kernels' named blocks; `host` applies them for the LLVM host target
(AVX2-class CPUs), with every tunable choice a named knob. Kernels (what is computed) live in
`tvmflash.kernels`, tuned knob values in `tuning_logs/`. `avx512` does the same for AVX512
targets and adds the AMX forward for bf16.
"""


def cpu_schedule(target: dict):
    """The schedule module for an LLVM target: `avx512` where it has 16 fp32 lanes, else `host`.
    Each has DEFAULTS (knobs), kernels(spec, target, knobs) and schedule(sch, kernel, target, fixed)."""
    from . import avx512, host

    return avx512 if host.vector_length(target) == avx512.VL else host
