"""How tvmflash's TensorIR kernels map to each target.

`cpu_rules` holds small schedule rules (register-tiled outer products, vectorised reductions,
...) that act on the kernels' named blocks; `host` applies them for the LLVM host target
(AVX2-class CPUs), with every tunable choice a named knob. Kernels (what is computed) live in
`tvmflash.kernels`, tuned knob values in `tuning_logs/`.
"""
