#!/usr/bin/env bash
# One GPU call while the Hopper kernel is being developed: build for sm_90a only, then the smoke
# check (accuracy grid + timing table). Logs under $OUT.
#   bash scripts/device_wgmma.sh [smoke_wgmma.py args]
set -uo pipefail
OUT=${OUT:-/tmp/sage_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
start=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps -v . > "$OUT/install.log" 2>&1
rc=$?
echo "install rc=$rc in $(( $(date +%s) - start )) s"
if [ $rc -ne 0 ]; then grep -E "error|Error" "$OUT/install.log" | head -40; exit $rc; fi
REPO=$(pwd)
cd /tmp
timeout 400 python3 "$REPO/scripts/smoke_wgmma.py" "$@" 2>&1 | tee "$OUT/smoke.txt"
# SANITIZE="synccheck racecheck ..." adds compute-sanitizer runs of the small-shape script.
for tool in ${SANITIZE:-}; do
  timeout 300 compute-sanitizer --tool $tool python3 "$REPO/scripts/sanitize_kernels.py" > "$OUT/sanitize_$tool.txt" 2>&1
  echo "compute-sanitizer $tool:"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|SYNCCHECK|variants ran" "$OUT/sanitize_$tool.txt" | head -5
done
