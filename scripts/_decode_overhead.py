import time, torch, tvmflash
from tvmflash import ops, interface as I
B, H, HK, D, L = 16, 32, 8, 128, 1024
q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
k = torch.randn(B * L // 16, 16, HK, D, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
t = torch.randperm(B * L // 16, device="cuda").view(B, -1).int()
f = lambda: tvmflash.flash_attn_with_kvcache(q, k, v, cache_seqlens=L, block_table=t)
f()
qh = q.transpose(1, 2)
z = I._zeros_int32(q.device).expand(B)
spec, _ = ops._decode_spec(q.dtype, D, False, (-1, -1), False, False)
def timeit(name, fn, n=2000):
    for _ in range(20): fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n): fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    print(f"{name}: host {(t1 - t0) / n * 1e6:.2f} us", flush=True)
timeit("whole call", f)
timeit("ops.decode_kv_cache", lambda: ops.decode_kv_cache(qh, k, v, t, z, z, L, D ** -0.5, False, (-1, -1), 0.0, None, 0))
timeit("_decode_spec", lambda: ops._decode_spec(q.dtype, D, False, (-1, -1), False, False))
timeit("current_stream", lambda: torch.cuda.current_stream(q.device))
timeit("empty+transpose", lambda: torch.empty((B, 1, H, D), dtype=q.dtype, device=q.device).transpose(1, 2))
timeit("_kernels", lambda: ops._kernels(spec, q.device))
def stream():
    with ops._on_stream(q.device):
        pass
timeit("_on_stream", stream)
timeit("expand zeros", lambda: I._zeros_int32(q.device).expand(B))
timeit("checks", lambda: (I._check_window((-1, -1), False), I._check_softcap(0.0), I._check_alibi(None, qh, B), I._scale(None, D, "s")))
timeit("_check_tensor x3", lambda: [I._check_tensor("q", x, 4, "") for x in (q, k, v)])
timeit("q.is_cuda etc", lambda: (q.is_cuda, q.dtype != torch.float32, k.shape[2], q.shape, q.device))
