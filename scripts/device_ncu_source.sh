#!/usr/bin/env bash
# Nsight Compute per-instruction view of one Hopper-kernel launch (B4 H32 N D, default 4096 128):
# warp-stall samples per SASS instruction, to see which instructions the time waits on.
#   bash scripts/device_ncu_source.sh [N] [D] [causal]     (logs under $OUT, suffixed N_D[_causal];
#                                                           NO_INSTALL=1 keeps the installed build)
set -uo pipefail
OUT=${OUT:-/tmp/sage_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0a
if [ -z "${NO_INSTALL:-}" ]; then
  python3 -m pip install --no-build-isolation --no-deps . > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
fi
R=$(pwd); cd /tmp
tag=$(echo "${*:-4096 128}" | tr ' ' '_')
timeout 300 ncu --clock-control none -k regex:attention_wgmma --launch-skip 3 --launch-count 1 \
  --section SourceCounters --section WarpStateStats --section SchedulerStats -o /tmp/prof_$tag -f \
  python3 "$R/scripts/profile_wgmma.py" "$@" > "$OUT/ncu_run_$tag.txt" 2>&1
ncu --import /tmp/prof_$tag.ncu-rep --page details > "$OUT/ncu_details_$tag.txt" 2>&1
ncu --import /tmp/prof_$tag.ncu-rep --page source --print-source sass --csv > "$OUT/ncu_source_$tag.csv" 2>&1
grep -E "Duration|Issue|Eligible|Active Warps|Stall|stall" "$OUT/ncu_details_$tag.txt" | head -40
wc -l "$OUT/ncu_source_$tag.csv"; head -3 "$OUT/ncu_source_$tag.csv" | cut -c1-600
