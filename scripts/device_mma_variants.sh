#!/usr/bin/env bash
# One device call for the warp-level kernel's variants (issue 3): build for sm_90a, the ops
# against their emulation (scripts/smoke_mma_variants.py), compute-sanitizer memcheck/racecheck on
# small shapes of every variant, then (unless --no-bench) bench_mma_variants.py. Logs under $OUT.
#   bash scripts/device_mma_variants.sh [--no-bench] [pytest -k expression | all]
set -uo pipefail
OUT=${OUT:-/tmp/sage_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
BENCH=1
if [ "${1:-}" = "--no-bench" ]; then BENCH=0; shift; fi
K=${1:-}
REPO=$(pwd)
step() { echo; echo "=== $* ($(date +%T)) ==="; }

step "install"
python3 -m pip install --no-build-isolation --no-deps . > "$OUT/install.log" 2>&1 || { tail -40 "$OUT/install.log"; exit 1; }
cd /tmp
step "smoke: variants vs emulation"
python3 "$REPO/scripts/smoke_mma_variants.py" 2>&1 | tee "$OUT/smoke_mma_variants.txt" | tail -60
if [ -n "$K" ]; then
  step "pytest -k $K"
  [ "$K" = all ] && K=""
  python3 -m pytest "$REPO/tests" -q -p no:cacheprovider --import-mode=importlib -rxf ${K:+-k "$K"} -s 2>&1 \
    | tee "$OUT/pytest.txt" | grep -vE "^[.sxXF]+( +\[ *[0-9]+%\])?$" | tail -80
fi
step "compute-sanitizer"
for tool in memcheck racecheck; do
  compute-sanitizer --tool $tool python3 "$REPO/scripts/sanitize_kernels.py" > "$OUT/sanitize_$tool.txt" 2>&1
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|variants ran" "$OUT/sanitize_$tool.txt"
done
if [ $BENCH = 1 ]; then
  step "bench"
  (cd "$REPO/benchmarks" && python3 bench_mma_variants.py --quick --out "$OUT/bench_mma_variants.md" 2>&1 | tail -12)
fi
