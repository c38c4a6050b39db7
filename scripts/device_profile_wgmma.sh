#!/usr/bin/env bash
# Build (sm_90a), quick accuracy/timing smoke of the Hopper kernel, then Nsight Compute on one
# launch (B4 H32 N4096 D128): speed of light, scheduler and the stall reasons. Logs under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/sage_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0a
python3 -m pip install --no-build-isolation --no-deps . > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
R=$(pwd); cd /tmp
timeout 300 python3 "$R/scripts/smoke_wgmma.py" "$@" 2>&1 | tee "$OUT/smoke.txt" | tail -12
timeout 200 ncu --clock-control none -k regex:attention_wgmma --launch-skip 3 --launch-count 1 \
  --section SpeedOfLight --section SchedulerStats --section ComputeWorkloadAnalysis \
  --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio,smsp__inst_executed.sum,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active \
  python3 "$R/scripts/profile_wgmma.py" 4096 128 > "$OUT/ncu.txt" 2>&1
grep -E "Duration|Issue Slots|Eligible|stalled|inst_executed|gmma|Tensor" "$OUT/ncu.txt" | awk '$NF+0 > 0.05 || !/stalled/' | head -40
