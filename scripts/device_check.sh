#!/usr/bin/env bash
# The one GPU check: run on the device machine from the repo root; logs under $OUT.
# shellcheck disable=SC2317,SC2086  # steps are called through `bash -c`; $QUICK may be empty
usage() {
  cat <<'EOF'
usage: OUT=$OUT bash scripts/device_check.sh [--arch LIST] [--timeout S] [--quick] STEP...

Steps run in the order given. The working tree is built and installed (pip install .) once,
before the first step that needs it. Each step has a time limit; the log ends with one line per
step (exit code, seconds) and the script exits with the first failing step's code.

options
  --arch LIST       TORCH_CUDA_ARCH_LIST of every build (default 9.0a)
  --timeout S       time limit of every step, seconds (default: each step's own)
  --quick           --check, --bench and --ab in their quick forms (hd128, N 1K/4K)
  --no-install      use the build an earlier call installed instead of building the tree
steps
  --info            GPU, driver, `python3 -m sageattention2 info`, the libstdc++ the build links
  --tests [K]       pytest of tests/ from /tmp with --import-mode=importlib (-k K if given;
                    PYTEST_ARGS: more arguments, e.g. "-rP" for the passed tests' output);
                    MiniLM's weights must be there (carry .minilm: tests/minilm.py)
  --check           python -m sageattention2 check: every kernel variant vs its emulation and
                    float64 (the input families against their documented bounds)
  --bench           benchmarks/bench_attention.py, the protocol's speed table ($OUT/bench_attention.md;
                    BENCH_ARGS: more of its arguments, e.g. "--d 256")
  --sanitize        compute-sanitizer memcheck, racecheck, synccheck on scripts/sanitize_kernels.py
                    (racecheck's known ptx::bulk_load report, RACECHECK_KNOWN, does not fail it)
  --sass            scripts/check_sass.py on the installed build
  --ncu "RE ARGS"   Nsight Compute on one launch matching RE of
                    `scripts/profile_attention.py launch ARGS` (repeatable)
  --readme [PART]   README.md's step 1 exactly as written (its bash block up to "# 2. tests") in a
                    copy of the tree without builds, its pip lines served by the wheels in .whl/
                    (the machine is offline): install, then info, check --quick and bench
                    ($OUT/readme_PART.txt, $OUT/readme_results/); PART "install" or "job" runs
                    the lines before the main job or from it on (two calls under 10 minutes).
                    It installs into python3's site-packages: later steps run on that build
  --tune            python -m sageattention2 tune $TUNE_ARGS: the crossover table of this GPU,
                    written where sageattn reads it (later steps use it), copied to
                    $OUT/crossover.json
  --grid            benchmarks/bench_grid.py: one call on 44 shapes vs SDPA's backends ($OUT/grid.md)
  --models          python -m sageattention2 bench --models: whole models, default SDPA vs sageattn ($OUT/models.md,
                    models.png); diffusers comes from the wheels in .whl/ (carried) where the image lacks it
  --parallel KEYS   python -m sageattention2 bench --models KEYS --gpus <every GPU here>: diffusers'
                    context parallelism, native backends against ours ($OUT/parallel.md/png;
                    KEYS space-separated in one argument: "wan flux2k")
  --authors DIR     the authors' SageAttention built from its source in DIR, their sm90 kernel and
                    fused quantizers only, into /tmp/authors, which later --parallel steps put on
                    their path: `bench --gpus` then adds diffusers' `sage` backend on their package
                    to every mode (issue 53's comparison). Carry the source, e.g. .authors/ from
                    `git -C MIRROR archive HEAD csrc sageattention setup.py pyproject.toml
                    README.md | tar -x -C .authors` (thu-ml/SageAttention; session 42: d1a57a5)
  --profile MODEL   scripts/profile_model.py MODEL: a suite model's kernels per forward, default SDPA
                    vs sageattn ($OUT/profile_MODEL.md; repeatable)
  --host            benchmarks/host_overhead.py --tiny: CPU time of short calls vs SDPA ($OUT/host.md)
  --training        issue 51's figures: benchmarks/bench_backward.py ($OUT/backward.md), then
                    bench --models wan flux --train ($OUT/models_train.md; diffusers from .whl/); the
                    tests: --tests "training or finetune" (the fine-tune needs .minilm carried)
  --ab TAR          A/B of two builds: A the tree in TAR (make it before the device call, in the
                    repo root: git archive REV -o base.tar), B the working tree; each is built
                    into its own --target dir, then bench_attention.py --no-sdpa runs A, B, A
                    and one table shows the three runs and B/A (AB_ARGS: more arguments of
                    bench_attention.py, e.g. "--pv-quant none")
EOF
}
set -uo pipefail
OUT=${OUT:-/tmp/sage_out}; mkdir -p "$OUT"
R=$(pwd); QUICK=; STEP_TIMEOUT=; installed=0
export OUT R QUICK PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=9.0a
steps=()
while [ $# -gt 0 ]; do
  case $1 in --arch|--timeout|--ncu|--ab|--profile|--parallel|--authors) [ $# -gt 1 ] || { echo "$1 needs a value" >&2; exit 2; } ;; esac
  case $1 in
    --arch) TORCH_CUDA_ARCH_LIST=$2; shift ;;
    --timeout) STEP_TIMEOUT=$2; shift ;;
    --quick) QUICK=--quick ;;
    --no-install) installed=1 ;;
    --info|--check|--bench|--sanitize|--sass|--tune|--grid|--models|--host|--training) steps+=("${1#--}") ;;
    --tests|--readme) if [ $# -gt 1 ] && [[ $2 != --* ]]; then steps+=("${1#--} $2"); shift; else steps+=("${1#--}"); fi ;;
    --ncu|--ab|--profile|--parallel|--authors) steps+=("${1#--} $2"); shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
  esac
  shift
done
[ ${#steps[@]} -gt 0 ] || { usage >&2; exit 2; }

# Wheels carried in .whl/ (diffusers: the H100 image lacks it) for the tests of the integrations
# and the model suite, installed aside and put on the path of every step.
if ! python3 -c "import diffusers" 2>/dev/null && ls "$R"/.whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$R"/.whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

# Each step_NAME runs in a child bash under `timeout` (see run); from /tmp, `import sageattention2`
# finds the installed package, not the checkout.
step_install() {
  python3 -m pip install --no-build-isolation --no-deps . > "$OUT/install.log" 2>&1 \
    || { tail -30 "$OUT/install.log"; return 1; }
}
step_readme() {  # [PART]: "install" (the lines before the main job), "job" (the main job on), or all
  local part=${1:-all} fresh=/tmp/fresh_tree block=$OUT/readme_block.sh
  local lines=$OUT/readme_$part.sh
  if [ "$part" != job ]; then  # the tree as a fresh clone has it: no carried files, no builds
    rm -rf "$fresh" && mkdir -p "$fresh" \
      && tar -C "$R" --exclude=./.whl --exclude=./.minilm --exclude=./build --exclude='*.egg-info' \
           --exclude='./sageattention2/_C*.so' -cf - . | tar -C "$fresh" -xf - || return 1
  fi
  awk '/^## Install and run/ {on = 1} on && /^```bash/ {code = 1; next}
       code && (/^```/ || /^# 2\. tests/) {exit} code' "$R/README.md" > "$block"
  case $part in
    install) awk '/^python3 -m sageattention2 / {exit} 1' "$block" > "$lines" ;;
    job) awk '/^python3 -m sageattention2 / {on = 1} on' "$block" > "$lines" ;;
    *) cp "$block" "$lines" ;;
  esac
  # As a user pastes it: each line whatever the one before did (the optional MiniLM wheel, 83 MB,
  # cannot travel to this offline machine), in the tree's root, with none of this script's
  # environment (its arch list, jobs, path).
  (cd "$fresh" && env -u TORCH_CUDA_ARCH_LIST -u MAX_JOBS PYTHONPATH= PIP_NO_INDEX=1 \
     PIP_FIND_LINKS="$R/.whl" bash -x "$lines") > "$OUT/readme_$part.txt" 2>&1
  local rc=$?
  [ -d "$fresh/results" ] && cp -r "$fresh/results" "$OUT/readme_results"
  grep -vE "^Requirement already|^  (Building|Preparing)" "$OUT/readme_$part.txt" | cut -c1-220 | tail -60
  return $rc
}
step_info() {
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
  cd /tmp && python3 -m sageattention2 info 2>&1 | tee "$OUT/info.txt" || return 1
  # One libstdc++ per process: a static copy crashed on integer formatting (setup.py says why).
  ldd "$(python3 -c 'import sageattention2._C as c; print(c.__file__)')" | grep -E 'stdc\+\+' \
    || echo "NO shared libstdc++"
}
step_tests() {
  cd /tmp && SAGEATTN_REQUIRE_MINILM=1 python3 -m pytest "$R/tests" -q -p no:cacheprovider --import-mode=importlib -rxf ${PYTEST_ARGS:-} ${1:+-k "$1"} \
    > "$OUT/pytest.txt" 2>&1
  local rc=$?; grep -vE '^[.sxXF]+( +\[ *[0-9]+%\])?$' "$OUT/pytest.txt" | tail -25; return $rc
}
step_check() {
  cd /tmp && python3 -m sageattention2 check $QUICK > "$OUT/check.txt" 2>&1
  local rc=$?; grep -E "FAIL|^check|Error|causal=" "$OUT/check.txt"; return $rc
}
step_bench() {
  cd /tmp && python3 "$R/benchmarks/bench_attention.py" $QUICK ${BENCH_ARGS:-} --out "$OUT/bench_attention.md"
}
# racecheck's report on the Hopper kernel's K-scale bulk copy (ptx::bulk_load) is a known false
# positive (docs/DECISIONS.md#d26): it alone does not fail the step.
RACECHECK_KNOWN=${RACECHECK_KNOWN:-ptx::bulk_load}
export RACECHECK_KNOWN
step_sanitize() {
  local tool log note rc=0
  for tool in memcheck racecheck synccheck; do
    log=$OUT/sanitize_$tool.txt; note=
    if ! (cd /tmp && compute-sanitizer --tool $tool --error-exitcode 1 python3 "$R/scripts/sanitize_kernels.py") > "$log" 2>&1; then
      # A report is the "Race reported" line and its "and ... access at" lines: known when any
      # of them names RACECHECK_KNOWN (the read side is listed first as often as the write side).
      if [ $tool = racecheck ] && grep -q "^sanitize: sageattn_mma" "$log" \
          && ! awk -v known="$RACECHECK_KNOWN" '
               /Race reported/ { if (open && !hit) bad = 1; open = 1; hit = index($0, known) > 0; next }
               open && /and (Read|Write) access/ { if (index($0, known)) hit = 1; next }
               open { if (!hit) bad = 1; open = 0 }
               END { if (open && !hit) bad = 1; exit bad ? 0 : 1 }' "$log"; then
        note=" (only the known $RACECHECK_KNOWN report: not a failure)"
      else
        rc=1
      fi
    fi
    echo "$tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)$note"
    grep -E "^sanitize:|Error" "$log" | cut -c1-200 | sed 's/^/  /'
  done
  return $rc
}
step_sass() {
  cd /tmp && python3 "$R/scripts/check_sass.py" --loops > "$OUT/sass.txt" 2>&1
  local rc=$?
  grep -E "SPILLS|MISSING|MUFU RUN|Error" "$OUT/sass.txt" | head -20
  grep "KV loop" "$OUT/sass.txt" | sort | uniq -c; tail -1 "$OUT/sass.txt"; return $rc
}
step_ncu() {
  local regex=${1%% *} args="" log
  log="$OUT/ncu_$(echo "$1" | tr -c 'A-Za-z0-9_\n-' '_').txt"
  [[ $1 == *" "* ]] && args=${1#* }
  cd /tmp && ncu --clock-control none -k "regex:$regex" --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
    --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
    --metrics "regex:sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    python3 "$R/scripts/profile_attention.py" launch $args > "$log" 2>&1
  local rc=$?
  grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|Compute \(SM\)|Achieved Occupancy|Registers Per|Issue Slots|Eligible Warps|No Eligible|Warp Cycles Per Issued|stalled|pipe_" "$log" \
    | awk '$NF+0 > 0.05 || !/stalled|pipe_/' | head -60
  return $rc
}
step_tune() {  # the table is written class by class: a timeout keeps the classes measured
  # TUNE_ARGS, e.g. "--causal no --base $R/sageattention2/crossover/<gpu>.json": re-measure only
  # the classes a kernel change touched, keeping the others.
  cd /tmp && timeout "${TUNE_SECONDS:-270}" python3 -m sageattention2 tune ${TUNE_ARGS:-} > "$OUT/tune.txt" 2>&1
  local rc=$?; cat "$OUT/tune.txt"
  cp "$(python3 -c 'import torch; from sageattention2 import _crossover as c
print(c.user_dir() / (c.gpu_slug(torch.cuda.get_device_name()) + ".json"))')" "$OUT/crossover.json"
  return $rc
}
step_grid() {
  cd /tmp && python3 "$R/benchmarks/bench_grid.py" $QUICK --out "$OUT/grid.md" > "$OUT/grid.txt" 2>&1
  local rc=$?; tail -3 "$OUT/grid.txt"; return $rc
}
step_models() {
  cd /tmp && python3 -m sageattention2 bench --models --reps 6 --out "$OUT" > "$OUT/models.txt" 2>&1
  local rc=$?; grep -E "^\|" "$OUT/models.txt" | tail -12; tail -2 "$OUT/models.txt"; return $rc
}
step_authors() {
  local src=$1
  [[ $src == /* ]] || src=$R/$src
  rm -rf /tmp/authors_src /tmp/authors && cp -r "$src" /tmp/authors_src || return 1
  # Their sm80 and sm89 extensions are not what an H200 runs (their import is guarded): built,
  # they would triple the build's minutes.
  sed -i -e 's/^    if HAS_SM80 or .*:$/    if False:/' -e 's/^    if HAS_SM89 or .*:$/    if False:/' \
    /tmp/authors_src/setup.py
  (cd /tmp/authors_src && TORCH_CUDA_ARCH_LIST=9.0 EXT_PARALLEL=2 python3 -m pip install --no-build-isolation \
    --no-deps --target /tmp/authors . > "$OUT/authors_install.log" 2>&1) \
    || { tail -30 "$OUT/authors_install.log"; return 1; }
  cd /tmp && PYTHONPATH=/tmp/authors${PYTHONPATH:+:$PYTHONPATH} python3 -c \
    "import importlib.metadata as m, sageattention as s; print('the authors\' sageattention', m.version('sageattention'), s.__file__)"
}
step_parallel() {  # NVLink multicast stays off (the machine's README): NCCL_NVLS_ENABLE=0
  [ -d /tmp/authors ] && export PYTHONPATH=/tmp/authors${PYTHONPATH:+:$PYTHONPATH}
  cd /tmp && NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 python3 -m sageattention2 bench \
    --models $1 --gpus "$(nvidia-smi -L | wc -l)" --reps 5 --out "$OUT" > "$OUT/parallel.txt" 2>&1
  local rc=$?; grep -E "^\||Error" "$OUT/parallel.txt" | tail -40; return $rc
}
step_profile() {
  cd /tmp && python3 "$R/scripts/profile_model.py" "$1" > "$OUT/profile_$1.md" 2>&1
  local rc=$?; cat "$OUT/profile_$1.md"; return $rc
}
step_training() {
  cd /tmp && python3 "$R/benchmarks/bench_backward.py" --out "$OUT/backward.md" > "$OUT/backward.txt" 2>&1
  local rc=$?; tail -6 "$OUT/backward.md"
  python3 -m sageattention2 bench --models wan flux --train --reps 5 --out "$OUT" > "$OUT/models_train.txt" 2>&1 \
    || rc=$?
  grep -E "^\||raised|Error" "$OUT/models_train.txt" | tail -8; return $rc
}
step_host() {
  cd /tmp && python3 "$R/benchmarks/host_overhead.py" --tiny > "$OUT/host.md" 2>&1
  local rc=$?; cat "$OUT/host.md"; return $rc
}
step_ab() {
  local tar=$1 side i=0 runs=()
  [[ $tar == /* ]] || tar=$R/$tar
  rm -rf /tmp/ab_src_A && mkdir -p /tmp/ab_src_A && tar -xf "$tar" -C /tmp/ab_src_A || return 1
  # Both sides build at once: the build is a few long nvcc units, which leave most cores idle.
  for side in A B; do
    src=$R; [ $side = A ] && src=/tmp/ab_src_A
    rm -rf "/tmp/ab_$side"
    (cd "$src" && python3 -m pip install --no-build-isolation --no-deps --target "/tmp/ab_$side" . \
      > "$OUT/ab_install_$side.log" 2>&1) &
  done
  for side in A B; do wait -n || { jobs -p | xargs -r kill; tail -20 "$OUT"/ab_install_*.log; return 1; }; done
  cd /tmp || return 1
  for side in A B A; do
    i=$((i + 1))
    PYTHONPATH=/tmp/ab_$side python3 "$R/benchmarks/bench_attention.py" --no-sdpa $QUICK ${AB_ARGS:-} \
      --out "$OUT/ab_${i}_$side.md" > "$OUT/ab_${i}_$side.txt" 2>&1 || { tail -20 "$OUT/ab_${i}_$side.txt"; return 1; }
    head -1 "$OUT/ab_${i}_$side.txt"
    runs+=("$side=$OUT/ab_${i}_$side.md")
  done
  python3 "$R/benchmarks/timing.py" merge "${runs[@]}" | tee "$OUT/ab.md"
}
export -f step_readme step_install step_info step_tests step_check step_bench step_sanitize step_sass step_ncu step_ab \
  step_tune step_grid step_models step_profile step_host step_parallel step_training step_authors

declare -A LIMIT=([readme]=590 [install]=480 [info]=60 [tests]=420 [check]=300 [bench]=420 [sanitize]=540 [sass]=120
                  [ncu]=240 [ab]=590 [tune]=300 [grid]=300 [models]=300 [profile]=240 [host]=120
                  [parallel]=420 [training]=360 [authors]=420)
summary=(); first_rc=0
run() {  # run NAME [ARG]: one step under its time limit, its exit code and time in the summary
  local name=$1 t0=$SECONDS rc
  echo; echo "=== $* ($(date +%T)) ==="
  timeout "${STEP_TIMEOUT:-${LIMIT[$name]}}" bash -c 'set -o pipefail; step_'"$name"' "$@"' _ "${@:2}"
  rc=$?
  [ $rc = 124 ] && echo "(timed out)"
  summary+=("$(printf '%-40s rc=%-4s %5ss' "$*" "$rc" "$((SECONDS - t0))")")
  [ $first_rc = 0 ] && first_rc=$rc
  return $rc
}
for step in "${steps[@]}"; do
  name=${step%% *}
  if [ $installed = 0 ] && [ "$name" != ab ] && [ "$name" != readme ]; then
    installed=1
    run install || break
  fi
  if [ "$name" = "$step" ]; then run "$name"; else run "$name" "${step#* }"; fi
done
echo; echo "=== summary (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST) ==="
printf '%s\n' "${summary[@]}"
exit $first_rc
