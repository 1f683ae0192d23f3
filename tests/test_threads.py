"""CPU modules run their parallel loops on torch's OpenMP threads (tvmflash/cpu.py), so a
tvmflash call next to torch ops does not oversubscribe the cores."""
import ctypes
import os
import subprocess
import sys

import pytest
import torch

from tvmflash import build
from tvmflash.cpu import torch_thread_launcher
from tvmflash.spec import AttentionSpec


def test_loaded_modules_launch_on_torchs_openmp_pool():
    launcher = torch_thread_launcher(str(build.cache_dir()))
    if launcher is None:
        pytest.skip("torch does not run on libgomp here, or there is no C compiler")
    spec = AttentionSpec("float32", 64)
    build.load_cached(spec)
    module = ctypes.CDLL(str(build.library_path(spec, build.cpu_target())), mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    slot = ctypes.c_void_p.in_dll(module, "__TVMBackendParallelLaunch").value
    assert slot == ctypes.cast(launcher.tvmflash_parallel_launch, ctypes.c_void_p).value


@pytest.mark.parametrize("threads", [1, 3])
def test_results_do_not_depend_on_the_pool_or_thread_count(threads):
    """Same output bits on torch's pool (any thread count) as on TVM's own pool."""
    code = (
        "import torch, tvmflash; torch.set_num_threads({n}); g = torch.Generator().manual_seed(0); "
        "q, k, v = (torch.randn(2, 3, 77, 64, generator=g) for _ in range(3)); "
        "o = tvmflash.scaled_dot_product_attention(q, k, v); "
        "print(o.double().sum().item(), o.abs().max().item())"
    )
    outs = {}
    for pool in ("torch", "tvm"):
        env = {**os.environ, "TVMFLASH_THREADS": pool}
        outs[pool] = subprocess.run([sys.executable, "-c", code.format(n=threads)], env=env, check=True,
                                    capture_output=True, text=True).stdout
    assert outs["torch"] == outs["tvm"] and outs["torch"].strip()


def test_python_threads_calling_at_once_get_their_own_results():
    """Several Python threads run forward + backward at once, each on its own shapes: per-call
    scratch (operand packs, the fused plan's dQ accumulator) is kept per thread, so every
    thread gets exactly what it gets alone."""
    import threading

    import tvmflash

    def run(lq, lk, seed):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(2, 4, lq, 64, generator=g).requires_grad_()
        k, v = (torch.randn(2, 4, lk, 64, generator=g).requires_grad_() for _ in range(2))
        out = tvmflash.scaled_dot_product_attention(q, k, v)
        out.backward(torch.ones_like(out))
        return [x.detach().clone() for x in (out, q.grad, k.grad, v.grad)]

    shapes = [(33, 70, 0), (64, 64, 1), (101, 17, 2), (8, 300, 3)]
    alone = [run(*s) for s in shapes]
    together = [None] * len(shapes)

    def worker(i):
        for _ in range(3):
            together[i] = run(*shapes[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(shapes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a, b in zip(alone, together):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
