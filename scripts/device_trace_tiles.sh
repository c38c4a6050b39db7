#!/usr/bin/env bash
# Per-tile phase timings of the Hopper kernel's KV loop for one or more builds (device machine):
# each side's tree (A: base.tar, B: the working tree, X: X.tar, as in ab_builds.sh) is copied,
# traced by scripts/make_tile_traced_kernel.py, built, installed, and scripts/trace_wgmma_tiles.py
# runs on it. The traced builds write no LSE: reinstall before anything else. Logs under $OUT.
#   SIDES="A B" bash scripts/device_trace_tiles.sh 4096,128,0 4096,64,0
set -uo pipefail
OUT=${OUT:-/tmp/sage_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0a
R=$(pwd)
for side in ${SIDES:-B}; do
  src=/tmp/tile_trace_$side; rm -rf "$src" && mkdir -p "$src"
  if [ "$side" = B ]; then
    (cd "$R" && tar -cf - --exclude=./build --exclude='./*.tar' .) | tar -xf - -C "$src"
  else
    tarball=base.tar; [ "$side" != A ] && tarball=$side.tar
    tar -xf "$R/$tarball" -C "$src"
  fi
  python3 "$R/scripts/make_tile_traced_kernel.py" "$src/csrc/attention_wgmma_kernel.cuh" || exit 1
  t0=$SECONDS
  (cd "$src" && rm -rf build && python3 -m pip install --no-build-isolation --no-deps . > "$OUT/install_tiles_$side.log" 2>&1) \
    || { tail -20 "$OUT/install_tiles_$side.log"; exit 1; }
  echo "== side $side (build $((SECONDS - t0)) s)" | tee -a "$OUT/trace_tiles.txt"
  (cd /tmp && timeout 120 python3 "$R/scripts/trace_wgmma_tiles.py" "$@" 2>&1 | tee -a "$OUT/trace_tiles.txt")
done
