#!/usr/bin/env bash
# Nsight Compute summaries (speed of light, memory, occupancy, warp states, pipes) of one launch
# per kernel regex of sageattn calls (scripts/profile_calls.py): every pipe's active cycles and every
# stall reason, to see which unit bounds a kernel. Logs under $OUT.
#   bash scripts/device_ncu.sh "KERNEL_REGEX ARGS..." ["KERNEL_REGEX ARGS..." ...]
#   e.g. bash scripts/device_ncu.sh "quantize_kv 4096" "attention_mma --mma 4096"
set -uo pipefail
OUT=${OUT:-/tmp/sage_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
R=$(pwd)
if [ -z "${NO_INSTALL:-}" ]; then
  python3 -m pip install --no-build-isolation --no-deps . > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
fi
cd /tmp
i=0
for spec in "$@"; do
  set -- $spec
  regex=$1; shift
  i=$((i + 1))
  echo "=== $regex $* ==="
  timeout 240 ncu --clock-control none -k "regex:$regex" --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
    --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
    --metrics "regex:sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio",sm__inst_executed_pipe_tensor_op_imma.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,dram__bytes_write.sum \
    python3 "$R/scripts/profile_calls.py" "$@" > "$OUT/ncu_$i.txt" 2>&1
  grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Achieved Occupancy|Theoretical Occupancy|Registers Per|Issue Slots|Eligible Warps|Active Warps Per|No Eligible|Warp Cycles Per Issued|pipe_|dram__|Block Limit|L1/TEX Hit|L2 Hit|Mem Busy|Max Bandwidth|Executed Ipc|stalled" "$OUT/ncu_$i.txt" | head -90
done
