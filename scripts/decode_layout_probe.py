"""What the KV cache's layout costs the CUDA decode: the same bytes and the same CTAs, (batch,
kv-head) pairs, read four ways by one kernel (`--kernel`: `decode`, the plan of pages of fewer
than 128 keys, or `decode_long`, that of longer pages), timed interleaved with cuDNN on the dense
padded problem (decode_bench.py's torch side):

- `interleaved, pages of 16`: issue 6's shape, B = 16, H = 32, Hk = 8: a CTA reads 256 of every
  2048 bytes of its pages (the cache puts a key's kv-heads side by side);
- `one kv-head, pages of P`: B = 128, H = 4, Hk = 1, pages of P keys: a CTA reads its pages
  whole (P x 256 contiguous bytes; P = 128 is the interleaved page's 32 KB);
- `interleaved, pages of 256`: the first with pages of 256 keys (256 bytes of 2048 again, but
  along 256 consecutive token rows).

If the contiguous pages read at cuDNN's speed where the interleaved ones do not, CTAs that read
whole token rows (all kv-heads of a batch entry) are the way to close the gap. Measured on the
H200 (2026-12-04, benchmarks/results/cuda-h200-decode-layout-probe.jsonl, 4k-16k, against
cuDNN): on `decode_long` (one CTA an SM, no splits) pages of 16 0.84-0.86x, one kv-head in
pages of 16 (4 KB runs) 0.87x, in pages of 128 (32 KB runs) 0.95-0.97x, interleaved pages of
256 0.98-0.995x; on `decode` (two CTAs an SM, 2 splits) 0.88-0.98x / 0.87-0.97x / 0.91-1.01x /
0.94-1.02x. So what costs is the jump to a new page every 16 keys, whatever the bytes a CTA
takes of each row: whole-row CTAs would read pages of 16 as the 32 KB runs do, a few percent.

    python scripts/decode_layout_probe.py [--kernel decode|decode_long] [--lengths 2048,4096,8192] [--out F.jsonl]
"""
import argparse
import json

import torch

import tvmflash
from decode_bench import D, DTYPE, paged_cache
from tvmflash import ops
from tvmflash.bench import _interleaved_median_ms, machine_info


def main(kernel: str, lengths, out) -> None:
    torch.manual_seed(0)
    ops.DECODE_LONG_PAGE = 1 << 30 if kernel == "decode" else 1  # every page size on one kernel and its knobs
    for length in lengths:
        fns = {}
        for name, batch, heads, heads_k, page in (("interleaved, pages of 16", 16, 32, 8, 16),
                                                  ("one kv-head, pages of 16", 128, 4, 1, 16),
                                                  ("one kv-head, pages of 128", 128, 4, 1, 128),
                                                  ("interleaved, pages of 256", 16, 32, 8, 256)):
            q = torch.randn(batch, 1, heads, D, device="cuda", dtype=DTYPE)
            k, v, table = paged_cache(length, page, "cuda", batch, heads_k)
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
