#!/usr/bin/env bash
# Per-item phase timings of the Hopper kernel (device machine): traces the kernel header in place
# (scripts/make_traced_kernel.py), builds, runs scripts/trace_wgmma.py. The traced build writes no
# LSE: reinstall before anything else. Args: N,D,causal specs, e.g. 1024,128,0 4096,128,1.
set -uo pipefail
OUT=${OUT:-/tmp/sage_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0a
R=$(pwd)
python3 scripts/make_traced_kernel.py csrc/attention_wgmma_kernel.cuh || exit 1
python3 -m pip install --no-build-isolation --no-deps . > "$OUT/install_trace.log" 2>&1 || { tail -20 "$OUT/install_trace.log"; exit 1; }
cd /tmp && python3 "$R/scripts/trace_wgmma.py" "$@" 2>&1 | tee "$OUT/trace.txt"
