"""What the KV cache's layout costs the CUDA decode: the same bytes and the same CTAs, (batch,
kv-head) pairs, read in the layouts of `LAYOUTS` by one kernel (`--kernel`: `decode`, the plan of
pages of fewer than 128 keys, or `decode_long`, that of longer pages), timed interleaved with
cuDNN on the dense padded problem (decode_bench.py's torch side):

- `interleaved, pages of P`: issue 6's shape, B = 16, H = 32, Hk = 8: a CTA reads 256 of every
  2048 bytes of its pages (the cache puts a key's kv-heads side by side); `in order`: the pages
  of each sequence consecutive, the addresses a contiguous cache's; `shuffled within N MB`: the
  pages shuffled only within runs of that much memory;
- `one kv-head, pages of P`: B = 128, H = 4, Hk = 1: a CTA reads its pages whole (P x 256
  contiguous bytes; P = 128 is the interleaved page of 16's 32 KB).

Measured on the H200 (2026-12-04, decode_long: one CTA an SM, 128-key tiles, no splits; against
cuDNN at 4k / 16k; read off the run's output, whose file was lost: the rows of
benchmarks/results/cuda-h200-decode-layout-probe.jsonl are an earlier run of four layouts):
pages of 16 shuffled 0.83 / 0.86x, in order 0.83 / 0.85x, shuffled within 2 MB or 32 MB 0.82 /
0.85x; one kv-head in pages of 16 0.84 / 0.88x, of 128 0.93 / 0.96x; interleaved pages of 32
0.85 / 0.86x, 64 0.91 / 0.96x, 128 0.95 / 0.98x, 256 0.96 / 0.995x, 256 in order 0.97 / 1.0x.
On `decode` (two CTAs an SM, 2 splits) every layout 0.94-0.96x at 16k. So the gap of pages of
16 is not where the bytes lie (in order they are a contiguous cache's addresses, and shuffling
costs nothing): it grows with the pages a tile spans, the same kernel code reading the same
addresses, so it is a cost per page inside the kernel, which one CTA an SM cannot hide. The
suspect (not yet measured): the page-table load of each 16 keys, looked up one tile ahead, which
reaches a new 32-byte sector of the table every 128 keys in pages of 16 (every 2048 in pages of
256).

    python scripts/decode_layout_probe.py [--kernel decode|decode_long] [--lengths 2048,4096,8192] [--out F.jsonl]
"""
import argparse
import json

import torch

import tvmflash
from decode_bench import D, DTYPE, paged_cache
from tvmflash import ops
from tvmflash.bench import _interleaved_median_ms, machine_info


# (name, batch, heads, kv-heads, page, shuffle_within: 0 all pages shuffled, 1 in order, else
# shuffled within runs of that many pages; an interleaved page of 16 keys is 32 KB)
LAYOUTS = (("interleaved, pages of 16", 16, 32, 8, 16, 0),
           ("interleaved, pages of 16 in order", 16, 32, 8, 16, 1),
           ("interleaved, pages of 16 shuffled within 2 MB", 16, 32, 8, 16, 64),
           ("interleaved, pages of 16 shuffled within 32 MB", 16, 32, 8, 16, 1024),
           ("one kv-head, pages of 16", 128, 4, 1, 16, 0),
           ("one kv-head, pages of 128", 128, 4, 1, 128, 0),
           ("interleaved, pages of 32", 16, 32, 8, 32, 0),
           ("interleaved, pages of 64", 16, 32, 8, 64, 0),
           ("interleaved, pages of 128", 16, 32, 8, 128, 0),
           ("interleaved, pages of 256", 16, 32, 8, 256, 0),
           ("interleaved, pages of 256 in order", 16, 32, 8, 256, 1))


def main(kernel: str, lengths, out) -> None:
    torch.manual_seed(0)
    ops.DECODE_LONG_PAGE = 1 << 30 if kernel == "decode" else 1  # every page size on one kernel and its knobs
    for length in lengths:
        fns = {}
        for name, batch, heads, heads_k, page, within in LAYOUTS:
            q = torch.randn(batch, 1, heads, D, device="cuda", dtype=DTYPE)
            k, v, table = paged_cache(length, page, "cuda", batch, heads_k, within)
            fns[name] = (lambda q, k, v, t: lambda: tvmflash.flash_attn_with_kvcache(
                q, k, v, cache_seqlens=length, block_table=t))(q, k, v, table)
            fns[name]()
        q = torch.randn(16, 32, 1, D, device="cuda", dtype=DTYPE)
        kd, vd = (torch.randn(16, 8, length, D, device="cuda", dtype=DTYPE) for _ in range(2))

        def cudnn():
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, kd, vd, enable_gqa=True)
        fns["cudnn dense"] = cudnn
        ms = _interleaved_median_ms(fns, rounds=7, iters=20, device="cuda")
        row = {"kernel": kernel, "length": length, "us": {n: round(t * 1e3, 2) for n, t in ms.items()},
               "vs_cudnn": {n: round(ms["cudnn dense"] / t, 3) for n, t in ms.items()}}
        print(json.dumps(row), flush=True)
        if out:
            with open(out, "a") as f:
                f.write(json.dumps({**row, "gpu": machine_info("cuda").get("gpu")}) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", choices=("decode", "decode_long"), default="decode")
    parser.add_argument("--lengths", default="2048,4096,8192")
    parser.add_argument("--out")
    args = parser.parse_args()
    main(args.kernel, [int(x) for x in args.lengths.split(",")], args.out)
