#!/usr/bin/env bash
# One device call after a change to the warp-level kernel (issue 3): build (sm_90a), the GPU
# pytest, bench_mma_variants.py --quick, compute-sanitizer memcheck on every variant's small
# shapes. Logs under $OUT.   bash scripts/device_mma_check.sh [pytest -k expression]
set -uo pipefail
OUT=${OUT:-/tmp/sage_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
R=$(pwd)
step() { echo "=== $* ($(date +%T)) ==="; }
step install
python3 -m pip install --no-build-isolation --no-deps . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
cd /tmp
step pytest
timeout "${PYTEST_S:-300}" python3 -m pytest "$R/tests" -q -p no:cacheprovider --import-mode=importlib -rxf \
  ${1:+-k "$1"} 2>&1 | tee "$OUT/pytest.txt" | grep -vE "^[.sxXF]+( +\[ *[0-9]+%\])?$" | tail -25
step bench
(cd "$R/benchmarks" && timeout "${BENCH_S:-170}" python3 bench_mma_variants.py --quick 2>&1 | tee "$OUT/bench.txt")
step memcheck
timeout 90 compute-sanitizer --tool memcheck python3 "$R/scripts/sanitize_kernels.py" > "$OUT/memcheck.txt" 2>&1
grep -E "ERROR SUMMARY|variants ran" "$OUT/memcheck.txt"
step done
