#!/usr/bin/env bash
# Pipe utilisation and warp stall reasons of one Hopper-kernel launch per shape (kernel alone,
# scripts/profile_wgmma.py), to see which unit bounds the KV loop. Logs under $OUT.
#   bash scripts/device_ncu_pipes.sh "4096 128" "4096 64" ...   (NO_INSTALL=1 to keep the build)
set -uo pipefail
OUT=${OUT:-/tmp/sage_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0a
R=$(pwd)
if [ -z "${NO_INSTALL:-}" ]; then
  python3 -m pip install --no-build-isolation --no-deps . > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
fi
cd /tmp
i=0
for spec in "$@"; do
  i=$((i + 1))
  echo "=== $spec"
  timeout 240 ncu --clock-control none -k regex:attention_wgmma --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats --section WarpStateStats \
    --section InstructionStats \
    --metrics "regex:sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active,regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,sm__cycles_elapsed.avg,smsp__inst_executed.sum" \
    python3 "$R/scripts/profile_wgmma.py" $spec > "$OUT/ncu_pipes_$i.txt" 2>&1
  grep -E "Duration|Issue Slots|Eligible|No Eligible|Active Warps|cycles_elapsed|inst_executed.sum|pipe_|stalled" "$OUT/ncu_pipes_$i.txt" \
    | awk '!/pct_of_peak|ratio/ || $NF+0 >= 0.05' | head -80
done
