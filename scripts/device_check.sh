#!/usr/bin/env bash
# The GPU machine's check: CUDA correctness tests, then (BENCH=fwd|all, default all; BENCH=none
# skips it) the GPU benchmark grid (DESIGN.md protocol) as JSON under $OUT (or benchmarks/results),
# with BENCH=all also the variants' costs (scripts/variants_bench.py). Runs with TVM's runtime only: the
# modules are built beforehand on any machine with nvcc (scripts/device_prebuild.py) into
# .devcache/, which travels with the tree, as do .devsite/ (pure-Python deps) and .tvmbundle/.
#
#   device run, carry [".tvmbundle/tvm-runtime.tar.xz", ".tvmbundle/prelude.sh", ".devcache", ".devsite"]:
#   scripts/device_check.sh [pytest args...]
#
# Carry .devexport too (`tvmflash export --target cuda --spec bf16:d128:causal --out .devexport` here)
# and the runtime-only test runs those exported modules; with TUNE_ARGS set (e.g. "--spec
# bf16:d128:causal --work-dir .devtune", a work directory built here with --build-only and
# carried), `tvmflash tune --target cuda $TUNE_ARGS --no-merge` times it and its database comes
# back in $OUT (merge it here: the same tune command).
set -uo pipefail
cd "$(dirname "$0")/.."
. .tvmbundle/prelude.sh
export PYTHONPATH=$PWD/.devsite:$PYTHONPATH
export TVMFLASH_CACHE_DIR=${TVMFLASH_CACHE_DIR:-$PWD/.devcache}
export TVMFLASH_REVISION=$(cat "$TVMFLASH_CACHE_DIR/REVISION" 2>/dev/null)  # the modules' revision (bench.machine_info)
[ -d .devexport ] && export TVMFLASH_TEST_EXPORTED=$PWD/.devexport
out=${OUT:-benchmarks/results}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -m pytest tests/test_cuda.py -q -p no:cacheprovider --maxfail=10 --durations=5 "$@" 2>&1 | tail -40
status=${PIPESTATUS[0]}
if [ -n "${TUNE_ARGS:-}" ]; then
  python -m tvmflash tune --target cuda $TUNE_ARGS --no-merge 2>&1 | tail -30
  work=$(echo "$TUNE_ARGS" | sed -n 's/.*--work-dir \([^ ]*\).*/\1/p')
  mkdir -p "$out/tune" && cp "$work"/database_*.json "$work"/history.jsonl "$out/tune/"
fi
[ "${BENCH:-all}" = none ] && exit $status
python - "$out" "${BENCH:-all}" <<'PY'
import sys
from tvmflash import bench
backward = sys.argv[2] != "fwd"
rows = bench.run(device="cuda", dtypes=["fp16", "bf16"], seqlens=[1024, 4096, 16384], head_dims=[64, 128],
                 causal=(False, True), backward=backward, rounds=5)
bench.print_table(rows)
print(bench.write_results(rows, sys.argv[1], bench.cuda_tag() + ("" if backward else "-forward"))[0])
if backward:  # the other head dims: reported, no bar
    rows = bench.run(device="cuda", dtypes=["fp16"], seqlens=[4096], head_dims=[32, 96, 192, 256],
                     causal=(False, True), backward=True, rounds=5)
    bench.print_table(rows)
    print(bench.write_results(rows, sys.argv[1], bench.cuda_tag() + "-headdims")[0])
PY
[ "${BENCH:-all}" = all ] && python scripts/variants_bench.py "$out"  # window / ALiBi / softcap vs plain
exit $status
