"""Does the cache layout's head interleave cost bandwidth? Same bytes, Hk=8 vs Hk=1."""
import torch, tvmflash
from tvmflash.bench import _interleaved_median_ms
copy = None
for L in (8192, 32768):
    fns = {}
    for (B, H, HK) in ((16, 32, 8), (128, 4, 1)):
        for page in (16, 256):
            q = torch.randn(B, 1, H, 128, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(B * L // page, page, HK, 128, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            t = torch.randperm(B * L // page, device="cuda").view(B, -1).int()
            for splits in (0, 2, 4, 8):
                fns[f"B{B} Hk{HK} page{page} splits{splits}"] = (lambda q, k, v, t, s: lambda: tvmflash.flash_attn_with_kvcache(
                    q, k, v, cache_seqlens=L, block_table=t, num_splits=s))(q, k, v, t, splits)
    ms = _interleaved_median_ms(fns, rounds=3, iters=10, device="cuda")
    nbytes = 2 * 16 * 8 * L * 128 * 2
    for name, t in ms.items():
        print(f"L={L} {name}: {t * 1e3:.0f} us, {nbytes / t / 1e9:.2f} TB/s", flush=True)
