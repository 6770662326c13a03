#!/usr/bin/env bash
# One prepared GPU session: preflight, build, a short correctness subset, the kernel and engine
# benchmarks, then the full GPU test set; one summary (DIR/summary.md) and plots under DIR.
#
#   bash bench/gpu_check.sh DIR               on the GPU machine (the single entry point)
#   bash bench/gpu_check.sh --rehearse DIR    every stage on the CPU, same commands, smallest sizes
#
# A GPU run and a rehearsal differ in two variables only: DEVICE (cuda | cpu) and SIZES
# (full | smallest); every stage below is one command written once. The rehearsal reuses the
# in-place CPU build, runs the Triton stages under TRITON_INTERPRET=1, runs the same pytest
# commands (which select the `gpu` tests and find them skipped: a collection error still fails),
# and proves the JSON outputs, the summary and the plots. .ci/run runs it on every CI run.
#
# Stages, estimate on the H200 machine (16 cores) / limit (SIGINT at the limit, SIGKILL 5 s later):
#   preflight      versions, tools, nvcc compiles a kernel     10 s /  30 s (python 15 + nvcc 15)
#   build          pip install -e . (sm_90 only)               90 s / 110 s
#   correctness    pytest -m gpu, one case per kernel+engine   35 s /  60 s
#   attention      cb-kernels bench attention --quick          30 s /  40 s
#   cache          cb-kernels bench cache                      15 s /  25 s
#   engine         bench_engine.py llama-1b bf16, 128 req      60 s /  75 s
#   overlap        bench_overlap.py --quick                    20 s /  30 s
#   gpu_tests      pytest -m "gpu and not slow", the rest      60 s /  90 s
#   sanitizer      compute-sanitizer memcheck + racecheck      30 s /  60 s (tests marked slow)
#   summary        summarize.py + plot_results.py               5 s /  10 s
#   total                                                     355 s / 530 s (SIGKILL 5 s after a limit)
# Benchmarks run before the full test set so that a session cut short still leaves numbers. No
# stage stops the others (no `set -e`); the exit code is 0 only when every stage passed.
#
# Needs on the GPU machine: an NVIDIA GPU, python3 with torch (CUDA), triton, transformers, pytest,
# pybind11, setuptools, cmake >= 3.24, ninja, nvcc and a host compiler nvcc accepts. Installs
# nothing from a registry (the GPU machine has no network): pip install --no-build-isolation.
set -uo pipefail

MODE=gpu
if [ "${1-}" = "--rehearse" ]; then MODE=rehearse; shift; fi
DIR=${1:?usage: bash bench/gpu_check.sh [--rehearse] DIR}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
cd "$(dirname "$0")/.."
PY=${PY:-${PYTHON:-python3}}
export PYTHONUNBUFFERED=1
case $MODE in
  gpu)      DEVICE=cuda; SIZES=full ;;
  rehearse) DEVICE=cpu;  SIZES=smallest
            # The Triton stages run interpreted on the CPU; a GPU run compiles them.
            export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES="" ;;
esac

# Everything a stage command takes that depends on the sizes, in one place.
if [ "$SIZES" = full ]; then
  DTYPE=bf16; ENGINE_DTYPE=bfloat16
  ATTN_SIZES=(--quick)
  CACHE_SIZES=()
  ENGINE_SIZES=(--model-shape llama-1b --num-requests 128)
  OVERLAP_SIZES=(--quick)
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
STATUS=()
FAILED=0
note() { STATUS+=("$1: $2"); case $2 in ok*|skipped*) ;; *) FAILED=1 ;; esac; }

# cmake, ninja and pytest may live beside python3 (pip packages of its venv), nvcc in CUDA's folder.
export PATH="$(dirname "$(command -v "$PY")"):$PATH"
if ! command -v nvcc >/dev/null; then
  for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
    [ -x "$d/nvcc" ] && { export PATH="$PATH:$d"; break; }
  done
fi

# ---- preflight: seconds, not minutes; names what is missing --------------------------------
stamp preflight
need() { echo "preflight: MISSING $1: $2"; }   # a requirement of the GPU run
{
timeout -k 2 15 "$PY" - "$MODE" <<'PYEOF' || need python-packages "see the lines above (or the imports took over 15 s)"
import importlib, platform, sys
mode = sys.argv[1]
print(f"python {platform.python_version()} ({sys.executable})")
bad = []
for name in ("torch", "triton", "transformers", "pybind11", "pytest", "setuptools", "psutil"):
    try:
        m = importlib.import_module(name)
        print(f"{name} {getattr(m, '__version__', '?')}")
    except Exception as e:
        print(f"preflight: MISSING python package {name}: {e}")
        bad.append(name)
try:
    import matplotlib
    print(f"matplotlib {matplotlib.__version__}")
except ImportError:
    print("matplotlib: not installed (optional: the plots are skipped)")
if "torch" not in bad:
    import torch
    print(f"torch CUDA {torch.version.cuda}, cuda available: {torch.cuda.is_available()}")
    if mode == "gpu" and not torch.cuda.is_available():
        print("preflight: MISSING a CUDA GPU: torch.cuda.is_available() is False")
        bad.append("cuda")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        print(f"gpu {p.name} sm_{p.major}{p.minor} {p.total_memory / 2**30:.0f} GiB")
sys.exit(1 if bad else 0)
PYEOF
if command -v cmake >/dev/null; then
  cv=$(cmake --version | head -1 | grep -oE '[0-9]+\.[0-9]+(\.[0-9]+)?' | head -1)
  echo "cmake $cv"
  printf '3.24\n%s\n' "$cv" | sort -V -C || need cmake ">= 3.24 needed, found $cv"
else need cmake "not on PATH (pip install cmake, or the system's)"; fi
if command -v ninja >/dev/null; then echo "ninja $(ninja --version)"; else need ninja "not on PATH"; fi
if command -v nvcc >/dev/null; then
  echo "$(nvcc --version | tail -1)"
  # The host compiler check is a real compile: nvcc rejects a gcc newer than it supports.
  tmp=$(mktemp -d)
  printf '__global__ void k(float *x) { x[threadIdx.x] += 1.f; }\n' > "$tmp/k.cu"
  if out=$(timeout 15 nvcc -c "$tmp/k.cu" -o "$tmp/k.o" 2>&1); then
    echo "host compiler: $(${CUDAHOSTCXX:-gcc} --version 2>&1 | head -1), accepted by nvcc"
  else
    need host-compiler "nvcc could not compile a kernel with $(${CUDAHOSTCXX:-gcc} --version 2>&1 | head -1): ${out:0:300}"
  fi
  rm -rf "$tmp"
else need nvcc "not on PATH nor in /usr/local/cuda*/bin"; fi
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv,noheader 2>&1
else need nvidia-smi "not on PATH"; fi
if command -v compute-sanitizer >/dev/null; then
  echo "compute-sanitizer: $(compute-sanitizer --version 2>&1 | tail -1)"
else echo "compute-sanitizer: not on PATH (optional: its tests skip)"; fi
if "$PY" -m pip --version >/dev/null 2>&1; then echo "$("$PY" -m pip --version)"
else echo "pip: not available (the build falls back to setup.py build_ext --inplace)"; fi
} 2>&1 | tee "$DIR/env.txt"
mapfile -t MISSING < <(grep '^preflight: MISSING' "$DIR/env.txt")
if [ ${#MISSING[@]} -gt 0 ]; then
  if [ "$MODE" = gpu ]; then
    echo "gpu_check: FAILED in preflight after $(( $(date +%s) - t0 )) s; missing:" >&2
    printf '  %s\n' "${MISSING[@]}" >&2
    exit 1
  fi
  note preflight "ok (rehearsal; the GPU run would stop here: ${#MISSING[@]} missing, see env.txt)"
else
  note preflight ok
fi

# ---- the stages --------------------------------------------------------------------------------
run_stage() {   # name limit_s command...: one stage, its output also in DIR/name.txt
  local name=$1 limit=$2; shift 2
  stamp "$name (limit ${limit}s)"
  # A shell function (build, pytest_, summary) runs in a child bash, so timeout can signal it.
  if declare -F "$1" >/dev/null; then set -- bash -c '"$@"' "$1" "$@"; fi
  timeout -s INT -k 5 "$limit" "$@" 2>&1 | tee "$DIR/$name.txt"
  local rc=${PIPESTATUS[0]}
  case $rc in
    0) note "$name" ok ;;
    124|137) note "$name" "TIMED OUT after ${limit}s (the last lines of $name.txt say where)" ;;
    *) note "$name" "FAILED (exit $rc)" ;;
  esac
  return 0
}

# pytest with SIGINT restored to KeyboardInterrupt (a shell may start it ignored), so a stage
# stopped at its limit still prints pytest's summary; -v names each test as it starts.
pytest_() {
  "$PY" -c 'import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler)
import pytest; sys.exit(pytest.main(sys.argv[1:]))' -v -p no:cacheprovider -rfEs "$@"
}

cpu_only_fallback() {   # command...: after a failed CUDA build, build CPU-only so the Triton
  [ "${CBK_CUDA-}" = on ] || return 1     # paths still run; the stage still reports the failure
  echo "build: the CUDA build FAILED (above); building CPU-only so the Triton paths still run"
  CBK_CUDA=off "$@"
  return 1
}

build() {
  local arch=""
  [ "$DEVICE" = cuda ] && arch=$("$PY" -c "import torch; a, b = torch.cuda.get_device_capability(); print(f'{a}{b}')")
  if [ "$DEVICE" = cuda ]; then
    export CBK_CUDA=on CBK_CUDA_ARCHS="$arch" CBK_BUILD_JOBS="$(nproc)"
  else
    export CBK_CUDA=off CBK_BUILD_JOBS="${CBK_BUILD_JOBS:-1}"
  fi
  local install=("$PY" -m pip install --no-build-isolation --no-deps -e .)
  # The rehearsal proves pip takes these arguments here (metadata only) and reuses the build.
  [ "$SIZES" = smallest ] && install+=(--dry-run)
  if "$PY" -m pip --version >/dev/null 2>&1; then
    echo "build: ${install[*]} (CBK_CUDA=$CBK_CUDA CBK_CUDA_ARCHS=${CBK_CUDA_ARCHS-})"
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
  "$PY" -m cb_kernels info || return 1
  "$PY" -c "import cb_kernels, cb_kernels.ops as o; print('cb_kernels from', cb_kernels.__file__);
print('available backends:', ' '.join(o.available_backends()))"
}
export PY DEVICE SIZES DIR
export -f pytest_ build cpu_only_fallback
run_stage build 110 build
if [ "$DEVICE" = cuda ] && ! grep -q "available backends:.* cuda" "$DIR/build.txt"; then
  note backends "no 'cuda' backend after the build (see build.txt): a CPU-only build"
fi

# One case of every kernel (CUDA and Triton attention, write_kv, copy_blocks, swap_blocks) and of
# the engine with graphs; the full set below deselects them.
SUBSET=(
  "tests/ops/test_paged_attention_triton.py::test_gpu_backends_match_reference[decode-bf16-gqa8-d128-cuda]"
  "tests/ops/test_paged_attention_triton.py::test_gpu_backends_match_reference[decode-bf16-gqa8-d128-triton]"
  "tests/ops/test_paged_attention_triton.py::test_gpu_backends_match_reference[mixed-fp16-d64-bs8-cuda]"
  "tests/ops/test_paged_attention_triton.py::test_gpu_backends_match_reference[mixed-fp16-d64-bs8-triton]"
  "tests/ops/test_paged_attention.py::test_matches_reference[cuda-softcap-5]"
  "tests/ops/test_write_kv.py::test_write_kv_gpu_matches_reference[cuda-bf16-prefill-63-awkward]"
  "tests/ops/test_copy_blocks.py::test_copy_blocks_gpu_matches_reference[bf16-packed]"
  "tests/ops/test_swap_blocks.py::test_swap_gpu_stream_handle_and_pageable_fallback"
  "tests/engine/test_offload_gpu.py::test_cuda_graphs_match_eager_gpu"
)
DESELECT=()
for t in "${SUBSET[@]}"; do DESELECT+=(--deselect "$t"); done

run_stage correctness 60 pytest_ -m gpu --durations=5 "${SUBSET[@]}"
run_stage attention 40 "$PY" -m cb_kernels bench attention --device "$DEVICE" --dtype "$DTYPE" \
  "${ATTN_SIZES[@]}" --json "$DIR/attention.json"
run_stage cache 25 "$PY" -m cb_kernels bench cache --device "$DEVICE" --dtype "$DTYPE" \
  "${CACHE_SIZES[@]}" --json "$DIR/cache"
run_stage engine 75 "$PY" bench/bench_engine.py --device "$DEVICE" --dtype "$ENGINE_DTYPE" \
  "${ENGINE_SIZES[@]}" --skip hf_tuned --json "$DIR/engine.json"
run_stage overlap 30 "$PY" bench/bench_overlap.py --device "$DEVICE" --dtype "$ENGINE_DTYPE" \
  "${OVERLAP_SIZES[@]}" --json "$DIR/overlap.json"
run_stage gpu_tests 90 pytest_ -m "gpu and not slow" --durations=15 "${DESELECT[@]}" tests
# compute-sanitizer runs each tool in a fresh process (torch's start-up under the tool dominates).
run_stage sanitizer 60 pytest_ -m "gpu and slow" --durations=5 tests/ops/test_cuda_sanitizer.py

# ---- summary and plots ---------------------------------------------------------------------
summary() {
  local ok=0
  for f in attention.json cache.swap_blocks.json cache.copy_blocks.json cache.write_kv.json \
           engine.json overlap.json; do
    if ! "$PY" -c "import json, sys; d = json.load(open(sys.argv[1])); assert d.get('rows') or d.get('results'), 'no rows'" \
        "$DIR/$f"; then echo "summary: $f is missing or has no rows"; ok=1; fi
  done
  "$PY" bench/summarize.py "$DIR" > "$DIR/tables.md" || ok=1
  if "$PY" -c "import matplotlib" 2>/dev/null; then
    MPLBACKEND=Agg "$PY" bench/plot_results.py --attention "$DIR/attention.json" \
      --engine "$DIR/engine.json" --out "$DIR/plots" || ok=1
  else
    echo "plots: skipped, matplotlib is not installed (pip install -e \".[bench]\")"
  fi
  return $ok
}
export -f summary
run_stage summary 10 summary
{
  echo "## gpu_check ($MODE, device $DEVICE, sizes $SIZES) $(grep -m1 '^gpu ' "$DIR/env.txt" || true)"
  echo
  grep -E '^(python|torch|triton|transformers) ' "$DIR/env.txt" | sed 's/^/    /'
  echo
  for s in ${STATUS[@]+"${STATUS[@]}"}; do echo "- $s"; done
  echo
  cat "$DIR/tables.md" 2>/dev/null
} > "$DIR/summary.md"
sed -n '1,/^$/p;/^- /p' "$DIR/summary.md" | grep -v '^    ' | head -40
stamp "done in $(( $(date +%s) - t0 )) s: $([ "$FAILED" = 0 ] && echo 'every stage passed' || echo 'FAILED (see above)'); results in $DIR"
exit "$FAILED"
