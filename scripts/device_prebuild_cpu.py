"""Build the sapphirerapids (AVX512 + AMX) modules scripts/device_check_cpu.sh needs into
.devcache/cpu/ (or $TVMFLASH_CACHE_DIR), on any machine with the TVM compiler, so the GPU
machine's Xeon needs only TVM's runtime: the specs of tests/test_avx512.py and of the benchmark.

    python scripts/device_prebuild_cpu.py          # one build process a core (TVMFLASH_PREBUILD_JOBS=N)
    python scripts/device_prebuild_cpu.py decode   # only scripts/decode_bench.py's (about a minute)
    python scripts/device_prebuild_cpu.py fp32     # only the fp32 specs (the bf16x3 tests, fp32 benchmarks)
"""
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
os.environ.setdefault("TVMFLASH_CACHE_DIR", str(ROOT / ".devcache" / "cpu"))

from test_avx512 import HIGH_VARIANT_SPEC, MASK_CASES, SPECS, amx_variant_specs  # noqa: E402
from tvmflash import build  # noqa: E402
from tvmflash.bench import write_revision  # noqa: E402
from tvmflash.cpu import torch_thread_launcher  # noqa: E402
from tvmflash.spec import AttentionSpec  # noqa: E402

NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
specs = {AttentionSpec(NAMES[dt], d, causal="bottom_right" if c else "none") for dt, d, c in SPECS}
specs |= {AttentionSpec(NAMES[dt], 64, causal="top_left" if c else "none", mask=kind) for kind, dt, c in MASK_CASES}
specs |= {AttentionSpec("bfloat16", 128, causal="bottom_right"), AttentionSpec("bfloat16", 64)}  # decode, path
specs |= {AttentionSpec(dt, d) for dt in ("float32", "bfloat16") for d in (64, 128)}  # benchmark
specs |= amx_variant_specs() | {HIGH_VARIANT_SPEC}  # the AMX variant, dropout and bf16x3 tests
specs |= {AttentionSpec("bfloat16", d, kv_cache=True) for d in (64, 128)}  # the KV cache decode tests
specs |= {AttentionSpec("bfloat16", 128, causal=causal, variants=variants, kv_cache=True)
          for causal, variants in (("bottom_right", ("window",)), ("none", ("softcap",)), ("none", ("alibi",)))}
sys.path.insert(0, str(ROOT / "scripts"))
from variants_bench import specs as bench_variant_specs  # noqa: E402

specs |= bench_variant_specs()  # scripts/variants_bench.py on the Xeon
from decode_bench import specs as decode_bench_specs  # noqa: E402

specs |= decode_bench_specs()  # scripts/decode_bench.py on the Xeon (flash_attn_with_kvcache)
if sys.argv[1:] == ["decode"]:
    specs = decode_bench_specs()
elif sys.argv[1:] == ["fp32"]:
    specs = {s for s in specs if s.dtype == "float32"}
elif sys.argv[1:]:
    sys.exit(f"usage: {sys.argv[0]} [decode | fp32]")
start = time.time()
build.build_many(specs, build.AVX512_TARGET)
write_revision(build.cache_dir())  # the results' provenance there (bench.machine_info)
torch_thread_launcher(str(build.cache_dir()))  # the OpenMP launcher too (the Xeon may lack a C compiler)
print(f"{len(specs)} specs in {build.cache_dir()} ({time.time() - start:.0f} s)")
