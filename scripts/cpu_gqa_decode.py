"""GQA decode on the CPU against torch SDPA in the same process: H=32 query heads over Hk=4
kv-heads, one query, an 8192-key cache, D=128 (a Llama-style shape), fp32 and bf16.

    python scripts/cpu_gqa_decode.py    # on the Xeon with device_check_cpu.sh's setup
"""
import torch

import tvmflash
from tvmflash.bench import _interleaved_median_ms  # the benchmark's protocol: interleaved medians


if __name__ == "__main__":
    torch.manual_seed(0)
    B, H, HK, L, D = 1, 32, 4, 8192, 128
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(B, H, 1, D, dtype=dtype)
        k, v = (torch.randn(B, HK, L, D, dtype=dtype) for _ in range(2))
        calls = {"ours": lambda: tvmflash.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                 "torch": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)}
        for call in calls.values():
            call()  # first use: load (or build) the module
        ms = _interleaved_median_ms(calls, rounds=5, iters=10, device="cpu")
        ours, theirs = ms["ours"], ms["torch"]
        print(f"{dtype} GQA {H}/{HK} decode L{L} D{D}: ours {ours:.3f} ms, torch {theirs:.3f} ms, "
              f"ratio {theirs / ours:.2f}x ({torch.get_num_threads()} threads)")
