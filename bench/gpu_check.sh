#!/usr/bin/env bash
# One prepared GPU session: preflight, build, import, a short correctness subset, the kernel and
# engine benchmarks, then the GPU tests (runner/ and engine/, then ops/); one bundle in DIR.
#
#   bash bench/gpu_check.sh "$OUT/gpu_check"     on the GPU machine (DIR under $OUT: it comes back)
#   bash bench/gpu_check.sh --only tests_ops,attention --limit tests_ops=200 "$OUT/gpu_check"
#                                               the second try: chosen stages on the existing build
#   bash bench/gpu_check.sh --rehearse DIR       every stage on the CPU, same commands, smallest sizes
#   bash bench/gpu_check.sh --plan               the stages, estimates and limits; their sum
# Options: --sanitize adds the compute-sanitizer stage (memcheck + racecheck, ~2 min, outside the
# default budget); --limit STAGE=S overrides one stage's limit (repeatable).
#
# DIR holds three files, refreshed after every stage and every 10 s during one (the device returns
# at most 8 files): summary.md (verdict, time and test counts per stage, the first lines of each
# failure, every benchmark's table), results.json (every stage and every benchmark row: the
# benchmarks rewrite their JSON after each row, so a stage killed at its limit keeps what it
# finished) and logs.tar.gz (every stage's log, env.txt, the benchmark JSON, the plots). The work
# folder itself is outside DIR (GPU_CHECK_WORK, default a fresh folder under /tmp).
#
# A GPU run and a rehearsal differ in two variables only: DEVICE (cuda | cpu) and SIZES
# (full | smallest); every stage is one command written once. The rehearsal reuses the in-place
# CPU build, runs the Triton stages under TRITON_INTERPRET=1, runs the same pytest commands
# (which select the `gpu` tests and find them skipped: a collection error still fails), and
# proves the JSON, the bundle and the plots, under 3x the limits below (two shared CPU cores).
# .ci/run runs it on every CI run.
#
# Stages: estimate on the H200 machine (16 cores; guessed: the script has not run on a GPU yet)
# and limit, kill grace included (SIGINT 2 s before the limit, SIGKILL at it). The sum of the
# limits, 420 s, leaves room in one 15-minute lease (the start takes 1-2 min) for a second,
# targeted run with --only.
#   stage          what                                                 estimate / limit
#   preflight      versions, tools; cold torch/triton/transformers        15 s /  50 s
#                  import and CUDA init (45 s), nvcc compiles a kernel
#                  beside it; a timeout or a missing tool is a warning
#   build          pip -v --no-index --no-build-isolation install -e .    75 s / 180 s
#                  (cmake + nvcc, sm_90 only on Hopper; CBK_CUDA_ARCHS)
#   import         import cb_kernels._C, cb-kernels info, the backends      6 s /  15 s
#   correctness    pytest: one case of every kernel and of the engine      15 s /  25 s
#                  with graphs (cold Triton compiles)
#   attention      cb-kernels bench attention --quick                      12 s /  20 s
#   cache          cb-kernels bench cache --quick                           6 s /  10 s
#   engine         bench_engine.py llama-1b bf16, 64 short requests,      18 s /  25 s
#                  against padded generate
#   overlap        bench_overlap.py --quick, one repeat                    10 s /  15 s
#   tests_engine   pytest -m "gpu and not slow": runner/, engine/, rest    20 s /  30 s
#   tests_ops      pytest -m "gpu and not slow": ops/ (4 workers)          30 s /  40 s
#   report         plots (matplotlib)                                       3 s /  10 s
#   total                                                                 210 s / 420 s
#   sanitizer      (--sanitize) compute-sanitizer memcheck + racecheck    120 s / 150 s
# The tests run 4 pytest-xdist workers where it is installed (the Triton compiles run in
# parallel) and a per-test timeout where pytest-timeout is (a hung test fails, the rest runs).
# Benchmarks run before the GPU test set so that a session cut short still leaves numbers. No
# stage stops the others (no `set -e`); the exit code is 0 only when every stage passed.
#
# Needs on the GPU machine: an NVIDIA GPU, python3 with torch (CUDA), triton, transformers, pytest,
# pybind11, setuptools, wheel, cmake >= 3.24, ninja, nvcc and a host compiler nvcc accepts.
# Installs nothing from a registry (the GPU machine has no network).
set -uo pipefail

STAGES=(preflight build import correctness attention cache engine overlap tests_engine tests_ops report)
declare -A LIMIT=([preflight]=50 [build]=180 [import]=15 [correctness]=25 [attention]=20 [cache]=10
                  [engine]=25 [overlap]=15 [tests_engine]=30 [tests_ops]=40 [report]=10 [sanitizer]=150)
declare -A ESTIMATE=([preflight]=15 [build]=75 [import]=6 [correctness]=15 [attention]=12 [cache]=6
                     [engine]=18 [overlap]=10 [tests_engine]=20 [tests_ops]=30 [report]=3 [sanitizer]=120)
BUDGET=420
GRACE=2

MODE=gpu ONLY="" SANITIZE=0 PLAN=0 SET_LIMITS=""
while [ $# -gt 0 ]; do
  case $1 in
    --rehearse) MODE=rehearse ;;
    --sanitize) SANITIZE=1 ;;
    --plan) PLAN=1 ;;
    --only) ONLY=${2:?--only needs STAGE[,STAGE]}; shift ;;
    --limit) [[ ${2-} =~ ^([a-z_]+)=([0-9]+)$ ]] && [ -n "${LIMIT[${BASH_REMATCH[1]}]-}" ] \
               && [ "${BASH_REMATCH[2]}" -gt "$GRACE" ] \
               || { echo "gpu_check: --limit needs STAGE=SECONDS (a known stage, over $GRACE s), got '${2-}'" >&2; exit 2; }
             LIMIT[${BASH_REMATCH[1]}]=${BASH_REMATCH[2]}; SET_LIMITS+=" ${BASH_REMATCH[1]} "; shift ;;
    -*) echo "gpu_check: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
  shift
done
[ "$SANITIZE" = 1 ] && STAGES+=(sanitizer)
# The rehearsal proves commands, not speed: two shared CPU cores run the imports, the Triton
# interpreter and the collections slower than the GPU machine's 16, so its default limits are 3x.
if [ "$MODE" = rehearse ] && [ "$PLAN" = 0 ]; then
  for s in "${!LIMIT[@]}"; do [[ $SET_LIMITS == *" $s "* ]] || LIMIT[$s]=$((LIMIT[$s] * 3)); done
fi
if [ -n "$ONLY" ]; then
  for s in ${ONLY//,/ }; do
    [ -n "${LIMIT[$s]-}" ] || { echo "gpu_check: --only: no stage '$s' (stages: ${!LIMIT[*]})" >&2; exit 2; }
  done
fi
selected() { [ -z "$ONLY" ] || [[ ",$ONLY," == *",$1,"* ]]; }

if [ "$PLAN" = 1 ]; then
  total=0
  for s in "${STAGES[@]}"; do
    printf '%-13s estimate %4d s  limit %4d s\n' "$s" "${ESTIMATE[$s]}" "${LIMIT[$s]}"
    [ "$s" = sanitizer ] || total=$((total + LIMIT[$s]))
  done
  echo "total of the default stages' limits: $total s (budget $BUDGET s)"
  [ "$total" -le "$BUDGET" ]
  exit
fi

DIR=${1:?usage: bash bench/gpu_check.sh [--rehearse] [--only STAGE,...] [--limit STAGE=S] [--sanitize] DIR}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
cd "$(dirname "$0")/.."
PY=${PY:-${PYTHON:-python3}}
WORK=${GPU_CHECK_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")}
mkdir -p "$WORK/logs" "$WORK/json"
rm -f "$WORK/stages.tsv" "$WORK/current" "$DIR"/{summary.md,results.json,logs.tar.gz}
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
case $MODE in
  gpu)      DEVICE=cuda; SIZES=full; WORKERS=4 ;;
  rehearse) DEVICE=cpu;  SIZES=smallest; WORKERS=1
            # The Triton stages run interpreted on the CPU; a GPU run compiles them.
            export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES="" ;;
esac

# Everything a stage command takes that depends on the sizes, in one place.
if [ "$SIZES" = full ]; then
  DTYPE=bf16; ENGINE_DTYPE=bfloat16
  ATTN_SIZES=(--quick)
  CACHE_SIZES=(--quick)
  ENGINE_SIZES=(--model-shape llama-1b --num-requests 64 --quick)
  OVERLAP_SIZES=(--quick --repeats 1)
else
  DTYPE=fp32; ENGINE_DTYPE=float32
  ATTN_SIZES=(--quick --threads 1 --reps 1 --copy-mib 1 --heads 2 --kv-heads 1 --head-dim 16
              --only "decode b1 ctx512" --backends cpu triton)
  CACHE_SIZES=(--quick --repeats 1 --num-kv-heads 1 --head-dim 16)
  ENGINE_SIZES=(--model-shape tiny --num-requests 4 --quick)
  OVERLAP_SIZES=(--quick --requests 2 --repeats 1)
fi

t0=$(date +%s)
stamp() { echo "[gpu_check $MODE +$(( $(date +%s) - t0 ))s] $*"; }
FAILED=0

# cmake, ninja and pytest may live beside python3 (pip packages of its venv), nvcc in CUDA's folder.
export PATH="$(dirname "$(command -v "$PY")"):$PATH"
if ! command -v nvcc >/dev/null; then
  for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
    [ -x "$d/nvcc" ] && { export PATH="$PATH:$d"; break; }
  done
fi

refresh() {   # the bundle: summary.md and results.json, then the tarball of the work folder
  "$PY" bench/gpu_check_report.py "$WORK" "$DIR" "$MODE" 2>>"$WORK/report_errors.txt"
  # Exit 1 is "a file changed as it was read" (a stage's log growing): the archive is whole.
  tar -czf "$DIR/logs.tar.gz.tmp" -C "$WORK" --warning=no-file-changed --exclude='*.tmp' \
    --exclude=ticker.stop . 2>>"$WORK/report_errors.txt"
  [ $? -le 1 ] && mv "$DIR/logs.tar.gz.tmp" "$DIR/logs.tar.gz"
}

ticker() {    # during a stage: the bundle every 10 s (a run killed outright keeps what it had)
  local n=0
  while [ ! -e "$WORK/ticker.stop" ]; do
    sleep 1
    n=$((n + 1))
    [ $((n % 10)) = 0 ] && refresh
  done
}
# Stopped through a flag, not a signal: a refresh it is in keeps writing, then it ends.
stop_ticker() { [ -n "$TICKER" ] && { touch "$WORK/ticker.stop"; wait "$TICKER" 2>/dev/null; }; TICKER=""; }

STAGE_PID="" TICKER=""
stop_all() {   # SIGINT/SIGTERM to the script: stop the stage, keep what it finished, write the bundle
  stop_ticker
  if [ -n "$STAGE_PID" ]; then kill -TERM "$STAGE_PID" 2>/dev/null; wait "$STAGE_PID" 2>/dev/null; fi
  stamp "stopped by a signal"
  refresh
  exit 130
}
trap stop_all INT TERM

run_stage() {   # name command...: one stage under its limit; its output also in WORK/logs/name.txt
  local name=$1 limit=${LIMIT[$1]} start rc verdict; shift
  if ! selected "$name"; then return 0; fi
  stamp "$name (limit ${limit}s)"
  start=$(date +%s)
  echo "$name $start $limit ${ESTIMATE[$name]}" > "$WORK/current"
  # A shell function (build, pytest_, report) runs in a child bash, so timeout can signal it.
  if declare -F "$1" >/dev/null; then set -- bash -c '"$@"' "$1" "$@"; fi
  timeout -s INT -k "$GRACE" $((limit - GRACE)) "$@" > >(tee "$WORK/logs/$name.txt") 2>&1 &
  STAGE_PID=$!
  rm -f "$WORK/ticker.stop"
  ticker &
  TICKER=$!
  wait "$STAGE_PID"; rc=$?
  STAGE_PID=""
  stop_ticker
  case $rc in
    0) verdict=ok ;;
    124|137) verdict="TIMED OUT at ${limit}s (its log's last lines say where)" ;;
    *) verdict="FAILED (exit $rc)" ;;
  esac
  case $verdict in ok*) ;; *) FAILED=1 ;; esac
  sleep 0.2   # tee's last lines
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$verdict" $(( $(date +%s) - start )) "$limit" \
    "${ESTIMATE[$name]}" >> "$WORK/stages.tsv"
  rm -f "$WORK/current"
  refresh
}

# ---- preflight: names what is missing; only warnings, nothing here stops the run --------------
preflight() {   # the checks' output also goes to WORK/env.txt (the bundle reads the versions there)
  preflight_checks 2>&1 | tee "$WORK/env.txt"
  # On the CPU the rehearsal expects the GPU's absence; on the GPU a MISSING line fails the stage.
  if [ "$MODE" = gpu ] && grep -q '^preflight: MISSING' "$WORK/env.txt"; then return 1; fi
  return 0
}

preflight_checks() {
  local tmp nvcc_pid=""
  tmp=$(mktemp -d)
  if command -v nvcc >/dev/null; then   # the host compiler check is a real compile, beside python
    printf '__global__ void k(float *x) { x[threadIdx.x] += 1.f; }\n' > "$tmp/k.cu"
    ( timeout 40 nvcc -c "$tmp/k.cu" -o "$tmp/k.o" > "$tmp/nvcc.txt" 2>&1; echo $? > "$tmp/nvcc.rc" ) &
    nvcc_pid=$!
  fi
  timeout -k 2 45 "$PY" - "$MODE" <<'PYEOF' || echo "preflight: WARNING python check exited $? (124: its imports and CUDA init took over 45 s)"
import importlib, platform, sys
mode = sys.argv[1]
print(f"python {platform.python_version()} ({sys.executable})")
for name in ("torch", "triton", "transformers", "pybind11", "pytest", "setuptools", "wheel", "psutil"):
    try:
        m = importlib.import_module(name)
        print(f"{name} {getattr(m, '__version__', '?')}")
    except Exception as e:
        print(f"preflight: MISSING python package {name}: {e}")
for name in ("xdist", "pytest_timeout", "matplotlib"):
    try:
        importlib.import_module(name)
        print(f"{name}: installed")
    except ImportError:
        print(f"preflight: WARNING {name} is not installed (optional)")
try:
    import torch
    print(f"cuda {torch.version.cuda}, available: {torch.cuda.is_available()}")
    if mode == "gpu" and not torch.cuda.is_available():
        print("preflight: MISSING a CUDA GPU: torch.cuda.is_available() is False")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        print(f"gpu {p.name} sm_{p.major}{p.minor} {p.total_memory / 2**30:.0f} GiB")
except Exception as e:
    print(f"preflight: MISSING a working torch: {e}")
PYEOF
  if command -v cmake >/dev/null; then
    local cv
    cv=$(cmake --version | head -1 | grep -oE '[0-9]+\.[0-9]+(\.[0-9]+)?' | head -1)
    echo "cmake $cv"
    printf '3.24\n%s\n' "$cv" | sort -V -C || echo "preflight: MISSING cmake >= 3.24, found $cv"
  else echo "preflight: MISSING cmake (not on PATH)"; fi
  if command -v ninja >/dev/null; then echo "ninja $(ninja --version)"; else echo "preflight: MISSING ninja (not on PATH)"; fi
  if [ -n "$nvcc_pid" ]; then
    echo "nvcc $(nvcc --version | tail -1)"
    wait "$nvcc_pid"
    if [ "$(cat "$tmp/nvcc.rc")" = 0 ]; then
      echo "host compiler: $(${CUDAHOSTCXX:-gcc} --version 2>&1 | head -1), accepted by nvcc"
    else
      echo "preflight: MISSING a host compiler nvcc accepts: $(head -c 300 "$tmp/nvcc.txt")"
    fi
  else echo "preflight: MISSING nvcc (not on PATH nor in /usr/local/cuda*/bin)"; fi
  rm -rf "$tmp"
  if command -v nvidia-smi >/dev/null; then
    timeout 10 nvidia-smi --query-gpu=name,driver_version,compute_cap,clocks.sm,memory.used --format=csv,noheader 2>&1
  else echo "preflight: WARNING nvidia-smi is not on PATH (nothing needs it)"; fi
  if command -v compute-sanitizer >/dev/null; then
    echo "compute-sanitizer: $(compute-sanitizer --version 2>&1 | tail -1)"
  else echo "compute-sanitizer: not on PATH (the --sanitize stage's tests skip)"; fi
  echo "$("$PY" -m pip --version 2>&1)"
}

# pytest with SIGINT restored to KeyboardInterrupt (a shell may start it ignored), so a stage
# stopped at its limit still prints pytest's summary; -v names each test as it ends.
pytest_() {
  local extra=()
  "$PY" -c "import xdist" 2>/dev/null && [ "$PYTEST_WORKERS" -gt 0 ] && extra+=(-n "$PYTEST_WORKERS")
  "$PY" -c "import pytest_timeout" 2>/dev/null && extra+=(--timeout 20)
  "$PY" -c 'import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler)
import pytest; sys.exit(pytest.main(sys.argv[1:]))' -v -p no:cacheprovider -rfEs "${extra[@]}" "$@"
}

cpu_only_fallback() {   # command...: after a failed CUDA build, build CPU-only so the Triton
  [ "${CBK_CUDA-}" = on ] || return 1     # paths still run; the stage still reports the failure
  echo "build: the CUDA build FAILED (above); building CPU-only so the Triton paths still run"
  CBK_CUDA=off "$@"
  return 1
}

build() {
  if [ "$DEVICE" = cuda ]; then
    local cap
    cap=$(timeout 10 nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1)
    # Hopper (9.x) builds sm_90 alone: half the nvcc time of the default "80;90".
    if [ -z "${CBK_CUDA_ARCHS-}" ] && [ "${cap%%.*}" = 9 ]; then export CBK_CUDA_ARCHS=90; fi
    export CBK_CUDA=on CBK_BUILD_JOBS="$(nproc)"
  else
    export CBK_CUDA=off CBK_BUILD_JOBS="${CBK_BUILD_JOBS:-1}"
  fi
  local install=("$PY" -m pip install -v --no-index --no-build-isolation --no-deps -e .)
  # The rehearsal proves pip takes these arguments here (metadata only) and reuses the build.
  [ "$SIZES" = smallest ] && install+=(--dry-run)
  if "$PY" -m pip --version >/dev/null 2>&1; then
    echo "build: ${install[*]} (CBK_CUDA=$CBK_CUDA CBK_CUDA_ARCHS=${CBK_CUDA_ARCHS-default})"
    "${install[@]}" || cpu_only_fallback "${install[@]}" || return 1
  else
    echo "build: no pip here, setup.py build_ext --inplace instead"
    [ "$SIZES" = smallest ] || "$PY" setup.py build_ext --inplace \
      || cpu_only_fallback "$PY" setup.py build_ext --inplace || return 1
  fi
  if [ "$SIZES" = smallest ] && ! "$PY" -c "import cb_kernels._C" 2>/dev/null; then
    echo "build: no existing build to reuse, building in place (CPU only)"
    "$PY" setup.py build_ext --inplace || return 1
  fi
}

import_check() {
  "$PY" -c "import cb_kernels._C" || { echo "import: no compiled module; run the build stage"; return 1; }
  "$PY" -m cb_kernels info || return 1
  "$PY" -c "import cb_kernels, cb_kernels.ops as o; print('cb_kernels from', cb_kernels.__file__)
print('available backends:', ' '.join(o.available_backends()))" | tee "$WORK/backends.txt"
  if [ "$DEVICE" = cuda ] && ! grep -q "available backends:.* cuda" "$WORK/backends.txt"; then
    echo "import: no 'cuda' backend: a CPU-only build (see the build log)"
    return 1
  fi
}

report() {
  local ok=0
  "$PY" bench/summarize.py "$WORK/json" > "$WORK/tables.md" || ok=1
  if "$PY" -c "import matplotlib" 2>/dev/null; then
    local args=()
    [ -f "$WORK/json/attention.json" ] && args+=(--attention "$WORK/json/attention.json")
    [ -f "$WORK/json/engine.json" ] && args+=(--engine "$WORK/json/engine.json")
    if [ ${#args[@]} -gt 0 ]; then MPLBACKEND=Agg "$PY" bench/plot_results.py "${args[@]}" --out "$WORK/plots" || ok=1
    else echo "plots: no attention or engine JSON to draw"; ok=1; fi
  else
    echo "plots: skipped, matplotlib is not installed (pip install -e \".[bench]\")"
  fi
  return $ok
}

export PY DEVICE SIZES MODE WORK PYTEST_WORKERS=0
export -f pytest_ build cpu_only_fallback import_check report preflight preflight_checks

# One case of every kernel (CUDA and Triton attention, sinks, write_kv, copy_blocks, swap_blocks),
# of the engine with graphs, and issue 27's sleep / AdamW step / wake_up (the KV pool's memory
# comes back); the test stages below deselect them.
SUBSET=(
  "tests/ops/test_paged_attention_triton.py::test_gpu_backends_match_reference[decode-bf16-gqa8-d128-cuda]"
  "tests/ops/test_paged_attention_triton.py::test_gpu_backends_match_reference[decode-bf16-gqa8-d128-triton]"
  "tests/ops/test_paged_attention_triton.py::test_gpu_backends_match_reference[mixed-fp16-d64-bs8-cuda]"
  "tests/ops/test_paged_attention_triton.py::test_gpu_backends_match_reference[mixed-fp16-d64-bs8-triton]"
  "tests/ops/test_paged_attention.py::test_matches_reference[cuda-softcap-5]"
  "tests/ops/test_paged_attention_sinks.py::test_sinks_match_reference[triton-gpu-long-decode-2100-large-sinks]"
  "tests/ops/test_write_kv.py::test_write_kv_gpu_matches_reference[cuda-bf16-prefill-63-awkward]"
  "tests/ops/test_copy_blocks.py::test_copy_blocks_gpu_matches_reference[bf16-packed]"
  "tests/ops/test_swap_blocks.py::test_swap_gpu_stream_handle_and_pageable_fallback"
  "tests/engine/test_offload_gpu.py::test_cuda_graphs_match_eager_gpu"
  "tests/engine/test_rl_gpu.py::test_sleep_frees_the_pool_adamw_step_wake_up_exact_gpu"
)
DESELECT=()
for t in "${SUBSET[@]}"; do DESELECT+=(--deselect "$t"); done

[ -n "$ONLY" ] && stamp "only: $ONLY (limits: $(for s in ${ONLY//,/ }; do printf '%s=%s ' "$s" "${LIMIT[$s]}"; done))"
stamp "bundle: $DIR (work folder $WORK)"
run_stage preflight preflight
run_stage build build
run_stage import import_check
run_stage correctness pytest_ -m gpu --durations=5 "${SUBSET[@]}"
run_stage attention "$PY" -m cb_kernels bench attention --device "$DEVICE" --dtype "$DTYPE" \
  "${ATTN_SIZES[@]}" --json "$WORK/json/attention.json"
run_stage cache "$PY" -m cb_kernels bench cache --device "$DEVICE" --dtype "$DTYPE" \
  "${CACHE_SIZES[@]}" --json "$WORK/json/cache"
# Against padded generate; transformers' generate_batch is left out (tens of seconds on the CPU).
run_stage engine "$PY" bench/bench_engine.py --device "$DEVICE" --dtype "$ENGINE_DTYPE" \
  "${ENGINE_SIZES[@]}" --skip hf_default,hf_tuned --json "$WORK/json/engine.json"
run_stage overlap "$PY" bench/bench_overlap.py --device "$DEVICE" --dtype "$ENGINE_DTYPE" \
  "${OVERLAP_SIZES[@]}" --json "$WORK/json/overlap.json"
# What the graphs and the sync-free steps prove comes first; the kernels' case matrix after it.
PYTEST_WORKERS=$WORKERS
run_stage tests_engine pytest_ -m "gpu and not slow" --durations=10 "${DESELECT[@]}" \
  tests/runner tests/engine tests --ignore=tests/ops
run_stage tests_ops pytest_ -m "gpu and not slow" --durations=10 "${DESELECT[@]}" tests/ops
run_stage report report
# compute-sanitizer runs each tool in a fresh process (torch's start-up under the tool dominates).
PYTEST_WORKERS=0
[ "$SANITIZE" = 1 ] && run_stage sanitizer pytest_ -m "gpu and slow" --durations=5 \
  tests/ops/test_cuda_sanitizer.py

sed -n '1,/^$/p;/^| /p' "$DIR/summary.md" | head -30
stamp "done in $(( $(date +%s) - t0 )) s: $([ "$FAILED" = 0 ] && echo 'every stage passed' || echo 'FAILED (see above)'); bundle in $DIR"
exit "$FAILED"
