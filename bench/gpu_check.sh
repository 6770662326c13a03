#!/usr/bin/env bash
# One prepared GPU session: build for the local arch, run the kernel (paged_attention, cache ops)
# and engine benchmarks, then the GPU tests; print one summary and leave everything under RESULTS_DIR.
#
#   bash bench/gpu_check.sh RESULTS_DIR        (total budget: < 8 minutes on an H100/H200)
#
# Needs: an NVIDIA GPU, python3 with torch (CUDA), triton, transformers, pybind11, cmake, ninja,
# nvcc on the PATH. Installs nothing from a registry (GPU machines here have no network).
# Benchmarks run before the tests so that a session cut short still leaves numbers. No stage
# stops the others (no `set -e`): each runs under its own timeout, and the summary always prints.
# Expected stage times on an H200 (16 cores), estimates: build 60-120 s, attention 30-60 s,
# cache 20-40 s, engine 60-120 s, tests 60-150 s.
set -uo pipefail
OUT=${1:?usage: bash bench/gpu_check.sh RESULTS_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
t0=$(date +%s)
stamp() { echo "[gpu_check +$(( $(date +%s) - t0 ))s] $*"; }
STATUS=()
# cmake and ninja may live beside python3 (pip packages of its venv), nvcc in the CUDA folder.
export PATH="$(dirname "$(command -v "$PY")"):$PATH"
if ! command -v nvcc >/dev/null; then
  for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
    [ -x "$d/nvcc" ] && { export PATH="$PATH:$d"; break; }
  done
fi
note() { STATUS+=("$1: $2"); }

"$PY" - <<'PYEOF' > "$OUT/env.txt" 2>&1
import platform, torch, triton, transformers
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
p = torch.cuda.get_device_properties(0)
print(f"gpu={p.name} sm={p.major}{p.minor} mem_gib={p.total_memory / 2**30:.0f}")
print(f"torch={torch.__version__} cuda={torch.version.cuda} triton={triton.__version__} "
      f"transformers={transformers.__version__} python={platform.python_version()}")
PYEOF
ENV_RC=$?
{ nvcc --version 2>&1 | tail -1; cmake --version 2>&1 | head -1; echo "ninja $(ninja --version 2>&1)"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv,noheader 2>&1; } \
  >> "$OUT/env.txt"
cat "$OUT/env.txt"
if [ "$ENV_RC" -ne 0 ]; then
  echo "gpu_check: FAILED: torch sees no CUDA GPU (see $OUT/env.txt); nothing else can run" >&2
  exit 1
fi
ARCH=$("$PY" -c "import torch; a, b = torch.cuda.get_device_capability(); print(f'{a}{b}')")

stamp "build (CUDA arch $ARCH only)"
# build_ext --inplace, not pip install -e: no pip, no build isolation, and every command below
# runs from this checkout, which then imports its own cb_kernels.
if CBK_CUDA=on CBK_CUDA_ARCHS="$ARCH" timeout 420 "$PY" setup.py build_ext --inplace -t build/gpu \
    > "$OUT/build.log" 2>&1; then
  note build "ok (CUDA)"
else
  tail -40 "$OUT/build.log"
  echo "gpu_check: the CUDA build failed (see $OUT/build.log); building CPU-only so the Triton" \
       "paths still run" >&2
  note build "CUDA build FAILED, CPU-only fallback"
  CBK_CUDA=off timeout 300 "$PY" setup.py build_ext --inplace -t build/cpu \
    > "$OUT/build_cpu.log" 2>&1 || note build "CUDA and CPU builds FAILED (see build*.log)"
fi
"$PY" -m cb_kernels info 2>&1 | tee "$OUT/info.txt"
BACKENDS=$("$PY" -c "import cb_kernels.ops as o; print(' '.join(o.available_backends()))" 2>&1)
echo "available backends: $BACKENDS" | tee -a "$OUT/info.txt"
case " $BACKENDS " in *" cuda "*) ;; *) note backends "no 'cuda' backend ($BACKENDS)";; esac

run_stage() {   # name timeout_s command...: one stage, its output in $OUT/name.txt
  local name=$1 limit=$2; shift 2
  stamp "$name"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
  local rc=${PIPESTATUS[0]}
  case $rc in
    0) note "$name" ok ;;
    124|137) note "$name" "TIMED OUT after ${limit}s" ;;
    *) note "$name" "FAILED (exit $rc)" ;;
  esac
  return 0
}

run_stage attention 120 "$PY" bench/bench_paged_attention.py --device cuda --quick --json "$OUT/attention.json"
run_stage swap_blocks 50 "$PY" bench/bench_swap_blocks.py --device cuda --json "$OUT/swap_blocks.json"
run_stage copy_blocks 20 "$PY" bench/bench_copy_blocks.py --device cuda --json "$OUT/copy_blocks.json"
run_stage write_kv 20 "$PY" bench/bench_write_kv.py --device cuda --json "$OUT/write_kv.json"
run_stage engine 180 "$PY" bench/bench_engine.py --device cuda --dtype bfloat16 \
  --model-shape llama-1b --num-requests 128 --skip hf_tuned --json "$OUT/engine.json"
run_stage overlap 120 "$PY" bench/bench_overlap.py --device cuda --quick --json "$OUT/overlap.json"

# Tests compile many Triton specialisations (CPU-bound): spread them over 4 workers when
# pytest-xdist is installed.
XDIST=()
"$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 4)
run_stage pytest_gpu 210 "$PY" -m pytest -q -m gpu -p no:cacheprovider ${XDIST[@]+"${XDIST[@]}"} \
  --durations=15 -rfEs tests
TEST_RC=0
case "${STATUS[*]-}" in *"pytest_gpu: ok"*) ;; *) TEST_RC=1 ;; esac

stamp "summary"
{
  echo "## gpu_check $(head -1 "$OUT/env.txt")"
  echo
  for s in ${STATUS[@]+"${STATUS[@]}"}; do echo "- $s"; done
  echo
  "$PY" bench/summarize.py "$OUT" 2>&1
} | tee "$OUT/summary.md"
stamp "done; GPU tests exit code $TEST_RC"
exit "$TEST_RC"
