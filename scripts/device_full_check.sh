#!/usr/bin/env bash
# One device call after a kernel change: build (sm_90a), the full GPU pytest, the Hopper smoke
# table, then (PROFILE_PRE=1) Nsight Compute on the preprocessing launches. Logs under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/sage_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
python3 -m pip install --no-build-isolation --no-deps . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
R=$(pwd); cd /tmp
timeout 400 python3 -m pytest "$R/tests" -q -p no:cacheprovider --import-mode=importlib -rxf -x 2>&1 \
  | tee "$OUT/pytest.txt" | grep -vE "^[.sxXF]+( +\[ *[0-9]+%\])?$" | tail -15
timeout 200 python3 "$R/scripts/smoke_wgmma.py" --quick 2>&1 | tee "$OUT/smoke.txt" | grep -E "worst|^\|"
if [ "${PROFILE_PRE:-0}" = 1 ]; then
  for n in 1024 4096; do
    timeout 120 ncu --clock-control none -k 'regex:quantize_kv|smoothing_stats' --launch-skip 3 --launch-count 3 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
      python3 "$R/scripts/profile_calls.py" $n > "$OUT/ncu_pre_$n.txt" 2>&1
    grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit" "$OUT/ncu_pre_$n.txt" | head -40
  done
fi
