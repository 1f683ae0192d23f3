"""Where a decode call's time goes besides its kernel: flash_attn_with_kvcache (bf16 B=16,
H=32, Hk=8, D=128, Lq=1, shuffled pages of 16) timed whole, with its kernel replaced by a no-op
(the host path: validation, plan lookup, output allocation), and its kernel alone, called with
the plan's arguments (the FFI call and, on a CPU, the thread pool's launch), interleaved in one
process on the GPU (or, without one, the CPU). On a CPU also the call with its indices checked
by numpy on the host (a block table with strided rows takes that path) instead of the decode
module's `decode_check`. Then steps that write: one new token a sequence appended (and,
q and the token rotated by bf16 tables) in the decode module's `decode_append`, and the
same through torch ops (a block table with strided rows takes that path). `--iters 1` times
each call right after another one's kernel, in the caches that emptied (a decode loop's
state); the default 50 back-to-back calls keep them warm.

    python scripts/decode_host_probe.py [--lengths 16,1024] [--iters 50] [--out F.jsonl]
"""
import argparse
import dataclasses
import json

import torch

import tvmflash
from decode_bench import B, D, DTYPE, H, HK, paged_cache
from tvmflash import ops
from tvmflash.bench import _interleaved_median_ms, machine_info


def main(lengths, iters: int, out_path) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    for length in lengths:
        q = torch.randn(B, 1, H, D, device=device, dtype=DTYPE)
        k, v, table = paged_cache(length, 16, device)
        ops._decode_plans.clear()
        call = lambda: tvmflash.flash_attn_with_kvcache(q, k, v, cache_seqlens=length, block_table=table)  # noqa: E731
        strided = torch.empty(B, 2 * table.shape[1], dtype=table.dtype, device=device)[:, ::2]
        strided.copy_(table)
        call()
        (key, plan), = ops._decode_plans.items()
        kernel, combine, tail, scratch = plan.kernel, plan.combine, plan.tail, plan.scratch
        idle = dataclasses.replace(plan, kernel=lambda *args: None, combine=None)
        zeros = torch.zeros(B, dtype=torch.int32, device=device)
        out = torch.empty(B, 1, H, D, device=device, dtype=DTYPE)
        lse = torch.empty(B, H, 1, device=device)
        qh, out_bhld = q.transpose(1, 2), out.transpose(1, 2)

        def host_path():
            ops._decode_plans[key] = idle
            try:
                call()
            finally:
                ops._decode_plans[key] = plan

        def kernel_alone():
            kernel(qh, k, v, table, zeros, zeros, length, scratch[0], scratch[1], out_bhld, lse, *scratch[2:],
                   D ** -0.5, *tail)
            if combine is not None:
                combine(*scratch[:2], out_bhld, lse)

        fns = {"call": call, "host path": host_path, "kernel alone": kernel_alone}
        if device == "cpu":
            fns["call, numpy index check"] = lambda: tvmflash.flash_attn_with_kvcache(
                q, k, v, cache_seqlens=length, block_table=strided)
        # steps that append at the last position (the same keys as `call`), natively or in torch ops
        lengths = torch.full((B,), length - 1, dtype=torch.int32, device=device)
        new_k, new_v = (torch.randn(B, 1, HK, D, device=device, dtype=DTYPE) for _ in range(2))
        cos, sin = (torch.rand(length + 16, D // 2, device=device).to(DTYPE) for _ in range(2))
        for how, pages in (("", table), (", torch ops", strided)):
            fns[f"call + append{how}"] = lambda pages=pages: tvmflash.flash_attn_with_kvcache(  # noqa: E731
                q, k, v, new_k, new_v, cache_seqlens=lengths, block_table=pages)
            fns[f"call + append + rotary{how}"] = lambda pages=pages: tvmflash.flash_attn_with_kvcache(  # noqa: E731
                q, k, v, new_k, new_v, cos, sin, cache_seqlens=lengths, block_table=pages)
        ms = _interleaved_median_ms(fns, rounds=7 if iters > 1 else 41, iters=iters, device=device)
        row = {"device": device, "length": length, "us": {n: round(t * 1e3, 1) for n, t in ms.items()},
               "threads": torch.get_num_threads(), "iters": iters}
        print(json.dumps(row), flush=True)
        if out_path:
            with open(out_path, "a") as f:
                info = machine_info(device)
                f.write(json.dumps({**row, "machine": info.get("gpu", info["cpu_model"])}) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="16,1024")
    parser.add_argument("--iters", type=int, default=50, help="back-to-back calls a sample (1: cold caches)")
    parser.add_argument("--out")
    args = parser.parse_args()
    main([int(x) for x in args.lengths.split(",")], args.iters, args.out)
