#!/usr/bin/env bash
# A/B of builds of the extension on the device, kernel alone (attention_wgmma, ANCHORS protocol
# B4 H32 fp16): side A is the tree in base.tar (make it with `git archive <rev> -o base.tar` in
# the repo root), B the working tree, any other side X the tree in X.tar (more variants in one
# device call, e.g. SIDES="A B C"). Default A, B, A to see drift. Logs under $OUT.
#   bash scripts/ab_builds.sh    (BENCH=preprocess: benchmarks/bench_preprocess.py instead;
#                                 BENCH=mma: attention_mma INT8 + FP16 PV alone, ab_mma_kernel.py;
#                                 a list, e.g. BENCH="kernel mma", runs each on every build;
#                                 AB_N="1024 4096": the kernel table at those lengths only)
set -uo pipefail
OUT=${OUT:-/tmp/sage_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0a
R=$(pwd)
bench() {
  for b in ${BENCH:-kernel}; do BENCH=$b bench_one "$1"; done
}
bench_one() {
  if [ "${BENCH:-kernel}" = preprocess ]; then
    (cd /tmp && echo "build $1" && python3 "$R/benchmarks/bench_preprocess.py" --lengths 1024 4096)
    return
  fi
  if [ "${BENCH:-kernel}" = mma ]; then
    (cd /tmp && python3 "$R/scripts/ab_mma_kernel.py" "$1")
    return
  fi
  (cd /tmp && python3 - "$1" <<'PY'
import os
import sys
import torch
from triton.testing import do_bench
from sageattention2 import ops
cells = []
for d in (128, 64):
    for n in map(int, os.environ.get("AB_N", "1024 4096 16384").split()):
        q, k, v = (torch.randn(4, 32, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
        st = ops.smoothing_stats(None, k, v, False)
        # Builds from before per-tile V scales (quantize_kv with 4 outputs) take per-channel ones.
        per_tile = "v_tile_scale" in ops.QuantizedKV._fields
        kq = ops.quantize_kv(k, v, st.k_mean, None, None if per_tile else st.v_scale, None, ops.WGMMA_BLOCK_K,
                             "int8", 1.0)
        vs = kq.v_tile_scale if per_tile else st.v_scale
        for causal in (False, True):
            f = lambda: ops.attention_wgmma(q, kq.k_quant, kq.k_scale, kq.v_fp8, vs, None, None, n,
                                            d ** -0.5, causal, False, False)
            t = sorted(do_bench(f, warmup=25, rep=150, return_mode="median") for _ in range(3))[1]
            cells.append(f"{4 * 4 * 32 * n * n * d / (2 if causal else 1) / t / 1e9:.0f}")
        del q, k, v, kq
        torch.cuda.empty_cache()
print(f"| {sys.argv[1]} | " + " | ".join(cells) + " |", flush=True)
PY
  )
}
echo "| build | 128 1K | 1K c | 4K | 4K c | 16K | 16K c | 64 1K | 1K c | 4K | 4K c | 16K | 16K c |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
# Each side is built once into a wheel; ROUNDS=n (default 1) then installs and benches the sides
# in turn n times, so that drift of the shared machine falls on every side alike.
for side in $(echo ${SIDES:-A B A} | tr ' ' '\n' | awk '!seen[$0]++'); do
  src=$R
  if [ $side != B ]; then
    tarball=base.tar; [ $side != A ] && tarball=$side.tar
    src=/tmp/side_$side; rm -rf "$src" && mkdir -p "$src" && tar -xf "$tarball" -C "$src"
  fi
  t0=$SECONDS
  rm -rf "/tmp/wheel_$side"
  (cd "$src" && rm -rf build && python3 -m pip wheel --no-build-isolation --no-deps -w "/tmp/wheel_$side" . \
    > "$OUT/install_$side.log" 2>&1) || { tail -20 "$OUT/install_$side.log"; exit 1; }
  echo "build $side: $((SECONDS - t0)) s" >&2
done
for round in $(seq ${ROUNDS:-1}); do
  for side in ${SIDES:-A B A}; do
    python3 -m pip install --force-reinstall --no-deps /tmp/wheel_$side/*.whl > "$OUT/reinstall_$side.log" 2>&1 \
      || { tail -20 "$OUT/reinstall_$side.log"; exit 1; }
    bench "$side"
  done
done
