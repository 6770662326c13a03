#!/usr/bin/env bash
# One prepared GPU session: build for the local arch, run the GPU tests, then the attention, cache
# and engine benchmarks; print one summary and leave everything under RESULTS_DIR.
#
#   bash bench/gpu_check.sh RESULTS_DIR        (total budget: < 8 minutes on an H100/H200)
#
# Needs: an NVIDIA GPU, python3 with torch (CUDA), triton, transformers, pybind11, cmake, ninja,
# nvcc on the PATH. Installs nothing from a registry (GPU machines here have no network).
set -uo pipefail
OUT=${1:?usage: bash bench/gpu_check.sh RESULTS_DIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
t0=$(date +%s)
stamp() { echo "[gpu_check +$(( $(date +%s) - t0 ))s] $*"; }
fail() { echo "gpu_check: FAILED: $*" >&2; exit 1; }

"$PY" - <<'PYEOF' > "$OUT/env.txt" 2>&1 || { cat "$OUT/env.txt"; fail "torch sees no CUDA GPU"; }
import platform, torch, triton, transformers
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
p = torch.cuda.get_device_properties(0)
print(f"gpu={p.name} sm={p.major}{p.minor} mem_gib={p.total_memory / 2**30:.0f}")
print(f"torch={torch.__version__} cuda={torch.version.cuda} triton={triton.__version__} "
      f"transformers={transformers.__version__} python={platform.python_version()}")
PYEOF
cat "$OUT/env.txt"
ARCH=$("$PY" -c "import torch; a, b = torch.cuda.get_device_capability(); print(f'{a}{b}')")

stamp "build (CUDA arch $ARCH only)"
CBK_CUDA=on CBK_CUDA_ARCHS="$ARCH" "$PY" -m pip install --no-build-isolation --no-deps -q -e . \
  > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; fail "the build failed (see $OUT/build.log)"; }
"$PY" -m cb_kernels info | tee "$OUT/info.txt"
grep -q "cuda" <("$PY" -c "import cb_kernels.ops as o; print(o.available_backends())") \
  || fail "the cuda backend is not available after the build (see $OUT/info.txt)"

stamp "GPU tests (pytest -m gpu)"
timeout 240 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest_gpu.txt"
TEST_RC=${PIPESTATUS[0]}

stamp "attention benchmark"
timeout 120 "$PY" bench/bench_attention.py --device cuda --json "$OUT/attention.json" 2>&1 | tee "$OUT/attention.txt"
stamp "cache benchmark"
timeout 60 "$PY" bench/bench_cache.py --device cuda --json "$OUT/cache.json" 2>&1 | tee "$OUT/cache.txt"
stamp "engine benchmark (1B-shaped random Llama, bf16, 128 requests)"
timeout 180 "$PY" bench/bench_engine.py --device cuda --dtype bfloat16 --model-shape llama-1b \
  --num-requests 128 --json "$OUT/engine.json" 2>&1 | tee "$OUT/engine.txt"

stamp "summary"
"$PY" bench/summarize.py "$OUT" | tee "$OUT/summary.md"
stamp "done; GPU tests exit code $TEST_RC"
exit "$TEST_RC"
