#!/usr/bin/env bash
# The GPU check of issues 15 and 19, for a device machine with JAX, CUDA and pytest
# installed and no network (see docs/performance.md), in one call of at most ~9 minutes:
# the packages it lacks from .whl/, the model tests on the GPU, the decode step against
# the memory roofline (benchmarks/gpu_roofline.py), then the Engine on real files
# (benchmarks/gpu.py). What it prints lands in $OUT too.
#
#   here, once:  bash benchmarks/gpu_wheels.sh      (trio, gguf, llguidance, ... into .whl/)
#   there:       bash benchmarks/gpu.sh [tests|roofline|bench|all]   (carry .whl)
#
# motet runs from the checkout (PYTHONPATH), without its native CPU kernels: on a GPU the
# quantized products are XLA's, dequantizing inside the jitted step.
#
# On an H200 (2026-12-04) the parts took: the tests 96 s; the roofline with every path and
# prefill about 3.5 minutes (--impls gather,ragged --prefill 0: about 1.5); the Engine more
# than 2 minutes a format (its file is written there first, ~20 s). Each part has its own
# limit (TESTS_S, ROOFLINE_S, BENCH_S) so one call ends inside the lease's 10 minutes;
# with a machine's start the whole lease was 15 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/motet-gpu}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "gpu.sh: no wheels in .whl/ (run benchmarks/gpu_wheels.sh here first)" >&2; exit 1; }
export PYTHONPATH="/tmp/site:$PWD"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c 'import jax; print("jax", jax.__version__, jax.devices())'; } 2>&1 | tee "$OUT/device.txt"
part="${1:-all}"
if [[ $part == tests || $part == all ]]; then
  # The model tests, float32 products at full precision (the goldens' tolerances are
  # float32's), 6 processes sharing the GPU: none may take 75% of its memory up front.
  XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_DEFAULT_MATMUL_PRECISION=highest timeout "${TESTS_S:-170}" \
    $PY -m pytest -q -p no:cacheprovider -n "${TEST_PROCS:-6}" \
    -m "not slow and not subprocess and not browser" -k "not native_kernel_is_built" \
    tests/test_golden_models.py tests/test_gguf_moe.py tests/test_quant.py tests/test_quantized_experts.py \
    tests/test_kv_consistency.py tests/test_sampling.py tests/test_kv_quant.py tests/test_attention_paths.py 2>&1 | tee "$OUT/tests.txt"
fi
if [[ $part == roofline || $part == all ]]; then
  timeout "${ROOFLINE_S:-210}" $PY benchmarks/gpu_roofline.py --json "$OUT/roofline.json" \
    ${ROOFLINE_ARGS:-} 2>&1 | tee "$OUT/roofline.txt"
fi
if [[ $part == bench || $part == all ]]; then
  # The Engine at JAX's default precision, as a user's engine runs.
  timeout "${BENCH_S:-150}" $PY benchmarks/gpu.py --repeats 1 --json "$OUT/gpu.json" ${BENCH_ARGS:-} \
    2>&1 | tee "$OUT/bench.txt"
fi
