#!/usr/bin/env bash
# The GPU machine's Xeon check of the AVX512/AMX path: tests/test_avx512.py's correctness matrix
# (the test_asm_* build checks need the compiler and run in CI instead), then (BENCH=none skips
# it) the CPU benchmark of issue 4 as JSON under $OUT (or benchmarks/results): the L {1024, 4096}
# grid forward + backward, L=16384 forward, decode (Lq=1). Runs with TVM's runtime only: the
# modules are built beforehand on any machine with the TVM compiler
# (python scripts/device_prebuild_cpu.py -> .devcache/cpu/).
#
#   device run, carry [".tvmbundle/tvm-runtime.tar.xz", ".tvmbundle/prelude.sh", ".devcache/cpu", ".devsite"]:
#   scripts/device_check_cpu.sh [pytest args...]
set -uo pipefail
cd "$(dirname "$0")/.."
. .tvmbundle/prelude.sh
export PYTHONPATH=$PWD/.devsite:$PYTHONPATH
export TVMFLASH_CACHE_DIR=${TVMFLASH_CACHE_DIR:-$PWD/.devcache/cpu}
export TVMFLASH_REVISION=$(cat "$TVMFLASH_CACHE_DIR/REVISION" 2>/dev/null)  # the modules' revision (bench.machine_info)
out=${OUT:-benchmarks/results}
lscpu | grep -E "Model name|^CPU\(s\)|Thread|Core|Socket"
grep -o -E 'amx_[a-z0-9]+|avx512_bf16|avx512_fp16' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
python -m pytest tests/test_avx512.py -k "not asm" -q -p no:cacheprovider --maxfail=10 --durations=5 "$@" 2>&1 | tail -30
status=${PIPESTATUS[0]}
[ "${BENCH:-all}" = none ] && exit $status
python -c "import sys; from tvmflash import bench; bench.cpu_report(sys.argv[1], 'cpu-xeon-16core')" "$out"
CUDA_VISIBLE_DEVICES= python scripts/variants_bench.py "$out"  # window / ALiBi / softcap vs plain, on the Xeon
exit $status
