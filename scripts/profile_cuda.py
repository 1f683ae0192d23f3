"""One CUDA forward (or forward + backward) call of the benchmark grid for a profiler to wrap
(GPU machine):

    ncu --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python scripts/profile_cuda.py [fp16|bf16] [D] [L] [causal] [backward]
"""
import sys

import torch

import tvmflash

args = sys.argv[1:]
dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args[0] if args else "fp16"]
d = int(args[1]) if len(args) > 1 else 128
seqlen = int(args[2]) if len(args) > 2 else 4096
causal, backward = "causal" in args, "backward" in args
q, k, v = (torch.randn(16384 // seqlen, 2048 // d, seqlen, d, device="cuda", dtype=dtype, requires_grad=backward)
           for _ in range(3))
for _ in range(2):  # the second call is the one to look at (the first loads the module)
    out = tvmflash.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if backward:
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
torch.cuda.synchronize()
