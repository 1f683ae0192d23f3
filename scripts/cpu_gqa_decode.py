"""Decode on dense K/V on the CPU (scaled_dot_product_attention / flash_attn_func with one
query) against torch SDPA in the same process, and against our own kernel with tasks of
several kv-heads (`ops.DENSE_KV_HEAD_GROUPS` on, as the KV cache's tasks take them), to show
what those do on each layout: SDPA's (B, Hk, L, D), where a kv-head's rows are contiguous
already, and flash-attn's (B, L, Hk, D), where a key's kv-heads lie together as in the cache.

    python scripts/cpu_gqa_decode.py [--out F.jsonl]   # on the Xeon with device_check_cpu.sh's setup

Shapes: a Llama-style one (B=1, H=32, Hk=4, L=8192; fp32 and bf16) and issue 6's decode shape
(B=16, H=32, Hk=8, L 1k and 4k; bf16); D=128.
"""
import argparse
import json

import torch

import tvmflash
from tvmflash import ops
from tvmflash.bench import _interleaved_median_ms, machine_info  # the benchmark's protocol: interleaved medians

SHAPES = [(torch.float32, 1, 32, 4, 8192), (torch.bfloat16, 1, 32, 4, 8192),
          (torch.bfloat16, 16, 32, 8, 1024), (torch.bfloat16, 16, 32, 8, 4096)]
D = 128


def kv_head_groups(call):
    """`call` with the CPU split-KV tasks on dense K/V taking kv-heads as the cache's do."""
    def run():
        chosen, ops.DENSE_KV_HEAD_GROUPS = ops.DENSE_KV_HEAD_GROUPS, True
        try:
            return call()
        finally:
            ops.DENSE_KV_HEAD_GROUPS = chosen
    return run


def main(out) -> None:
    torch.manual_seed(0)
    for dtype, B, H, HK, L in SHAPES:
        q = torch.randn(B, H, 1, D, dtype=dtype)
        k, v = (torch.randn(B, HK, L, D, dtype=dtype) for _ in range(2))
        # the same values in flash-attn's layout: (B, L, Hk, D) contiguous
        qf, kf, vf = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        sdpa = lambda: tvmflash.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
        flash = lambda: tvmflash.flash_attn_func(qf, kf, vf)  # noqa: E731
        calls = {"ours sdpa": sdpa, "ours sdpa kv-head groups": kv_head_groups(sdpa),
                 "ours flash": flash, "ours flash kv-head groups": kv_head_groups(flash),
                 "torch": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)}
        for call in calls.values():
            call()  # first use: load (or build) the module
        ms = _interleaved_median_ms(calls, rounds=7, iters=10, device="cpu")
        row = {"dtype": str(dtype).split(".")[1], "B": B, "H": H, "Hk": HK, "L": L, "D": D,
               "threads": torch.get_num_threads(), "ms": ms,
               "vs_torch": {name: ms["torch"] / t for name, t in ms.items() if name != "torch"}}
        print(json.dumps(row), flush=True)
        if out:
            with open(out, "a") as f:
                f.write(json.dumps({**row, "cpu": machine_info("cpu")["cpu_model"]}) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="append the rows to this JSON-lines file")
    main(parser.parse_args().out)
