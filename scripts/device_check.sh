#!/usr/bin/env bash
# One call on the GPU machine: install exactly as the README says, print `info`, run the GPU
# tests and the benchmarks. Logs go to $OUT (the device tool brings them back).
#   bash scripts/device_check.sh [pytest -k expression]
set -uo pipefail
OUT=${OUT:-/tmp/sage_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
PY=python3

step() { echo; echo "=== $* ==="; }

step "GPU"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"

step "install"
start=$(date +%s)
$PY -m pip install --no-build-isolation --no-deps -v . > "$OUT/install.log" 2>&1
rc=$?
echo "pip install rc=$rc in $(( $(date +%s) - start )) s"
if [ $rc -ne 0 ]; then grep -E "error|Error" "$OUT/install.log" | head -40; exit $rc; fi
REPO=$(pwd)
cd /tmp  # from here `import sageattention2` finds the installed package, not the checkout

step "one libstdc++ per process (a static copy crashed on integer formatting: see setup.py)"
ldd "$($PY -c "import sageattention2._C as c; print(c.__file__)")" | grep -E "stdc\+\+" || echo "NO shared libstdc++ dependency"
$PY "$REPO/scripts/repro_errors.py"

step "info"
$PY -m sageattention2 info 2>&1 | tee "$OUT/info.txt"

step "GPU tests"
K=${1:-}
$PY -m pytest "$REPO/tests" -q -p no:cacheprovider --import-mode=importlib ${K:+-k "$K"} 2>&1 \
  | tee "$OUT/pytest.txt" | tail -40
test_rc=${PIPESTATUS[0]}

step "benchmarks"
(cd "$REPO/benchmarks" && $PY bench_preprocess.py 2>&1 | tee "$OUT/bench_preprocess.txt")
(cd "$REPO/benchmarks" && $PY bench_attention.py --out "$OUT/bench_attention.md" 2>&1 | tee "$OUT/bench_attention.txt")
exit $test_rc
