"""Build the CUDA modules scripts/device_check.sh needs into .devcache/ (or $TVMFLASH_CACHE_DIR),
on any machine with the TVM compiler and nvcc, so the GPU machine needs only TVM's runtime.

    python scripts/device_prebuild.py [NAME_PART ...]   # only specs whose name holds one of them

Specs build in parallel, one process a core (TVMFLASH_PREBUILD_JOBS=N to change;
`build.build_many`): each is a single-threaded compile and an nvcc run, ~10 s.
"""
import itertools
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TVMFLASH_CACHE_DIR", str(ROOT / ".devcache"))

from tvmflash import build  # noqa: E402
from tvmflash.bench import write_revision  # noqa: E402
from tvmflash.spec import AttentionSpec  # noqa: E402
specs = set()
for dt, d, c in itertools.product(["float16", "bfloat16"], [32, 64, 96, 128, 192, 256], ["none", "bottom_right", "top_left"]):
    specs.add(AttentionSpec(dt, d, causal=c))
specs.add(AttentionSpec("float16", 80, causal="bottom_right"))
for mask, c in itertools.product(["bool", "additive"], ["none", "top_left"]):
    specs.add(AttentionSpec("float16", 64, causal=c, mask=mask))
sys.path.insert(0, str(ROOT / "tests"))
from test_cuda import cuda_flex_specs, cuda_kvcache_specs, cuda_variant_specs, cuda_varlen_specs  # noqa: E402

specs.update(cuda_variant_specs())
specs.update(cuda_varlen_specs())
specs.update(cuda_kvcache_specs())
specs.update(cuda_flex_specs())
sys.path.insert(0, str(ROOT / "scripts"))
from variants_bench import specs as bench_variant_specs  # noqa: E402

specs.update(bench_variant_specs())
from flex_bench import specs as flex_bench_specs  # noqa: E402

specs.update(flex_bench_specs())
from varlen_bench import specs as varlen_bench_specs  # noqa: E402

specs.update(varlen_bench_specs())
from decode_bench import specs as decode_bench_specs  # noqa: E402

specs.update(decode_bench_specs())
if len(sys.argv) > 1:
    specs = {s for s in specs if any(part in s.name for part in sys.argv[1:])}
start = time.time()
build.build_many(specs, build.cuda_target("sm_90a"))
write_revision(build.cache_dir())  # the results' provenance there (bench.machine_info)
print(f"{len(specs)} specs in {build.cache_dir()} ({time.time() - start:.0f} s)")
