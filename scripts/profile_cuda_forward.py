"""One CUDA forward launch of the benchmark grid for a profiler to wrap (GPU machine):

    ncu --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python scripts/profile_cuda_forward.py [fp16|bf16] [D] [L] [causal]
"""
import sys

import torch

import tvmflash

dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[sys.argv[1] if len(sys.argv) > 1 else "fp16"]
d = int(sys.argv[2]) if len(sys.argv) > 2 else 128
seqlen = int(sys.argv[3]) if len(sys.argv) > 3 else 4096
causal = len(sys.argv) > 4 and sys.argv[4] == "causal"
q, k, v = (torch.randn(16384 // seqlen, 2048 // d, seqlen, d, device="cuda", dtype=dtype) for _ in range(3))
for _ in range(2):  # the second launch is the one to look at (the first loads the module)
    tvmflash.scaled_dot_product_attention(q, k, v, is_causal=causal)
torch.cuda.synchronize()
