"""Calls for a profiler to wrap (GPU machine): one CUDA forward (or forward + backward) of the
benchmark grid, or (`decode L`) one call each of issue 6's decode at L keys in NVTX ranges:
ours on shuffled pages of 16 and 256 (scripts/decode_bench.py's cache) and torch's cuDNN SDPA
on the dense cache.

    ncu --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python scripts/profile_cuda.py [fp16|bf16] [D] [L] [causal] [backward]
    ncu --nvtx --nvtx-include "ours_p16/" --nvtx-include "ours_p256/" --nvtx-include "cudnn/" \\
        --section SpeedOfLight ... python scripts/profile_cuda.py decode 16384
"""
import sys

import torch

import tvmflash


def forward(args: list) -> None:
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


def decode(length: int) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from decode_bench import B, D, DTYPE, H, HK, paged_cache

    q = torch.randn(B, 1, H, D, device="cuda", dtype=DTYPE)
    calls = {}
    for page in (16, 256):
        k, v, table = paged_cache(length, page, "cuda")
        calls[f"ours_p{page}"] = lambda k=k, v=v, table=table: tvmflash.flash_attn_with_kvcache(
            q, k, v, cache_seqlens=length, block_table=table)
    dense_k, dense_v = (torch.randn(B, HK, length, D, device="cuda", dtype=DTYPE) for _ in range(2))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), dense_k, dense_v, enable_gqa=True)
    calls["cudnn"] = cudnn
    for call in calls.values():  # module loads, cuDNN's plan
        call()
    torch.cuda.synchronize()
    for name, call in calls.items():
        torch.cuda.nvtx.range_push(name)
        call()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()


if __name__ == "__main__":
    if sys.argv[1:2] == ["decode"]:
        decode(int(sys.argv[2]) if len(sys.argv) > 2 else 16384)
    else:
        forward(sys.argv[1:])
