#!/usr/bin/env bash
# One device call for K/V prepared beside the Hopper kernel: build (sm_90a), the bit-equality
# tests of sageattn_wgmma (every SM split), then the SM sweep of the full call. Logs under $OUT.
#   OUT=$OUT bash scripts/device_prepare.sh [pytest -k expression]
set -uo pipefail
OUT=${OUT:-/tmp/sage_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
python3 -m pip install --no-build-isolation --no-deps . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
R=$(pwd); cd /tmp
timeout 240 python3 -m pytest "$R/tests" -q -p no:cacheprovider --import-mode=importlib -rxf -x \
  -k "${1:-wgmma_is_its_chain}" 2>&1 | tee "$OUT/pytest.txt" | grep -vE "^[.sxXF]+( +\[ *[0-9]+%\])?$" | tail -15
timeout ${SWEEP_TIMEOUT:-240} python3 "$R/scripts/prepare_sweep.py" ${SWEEP_ARGS:-} 2>&1 | tee "$OUT/sweep.txt"
