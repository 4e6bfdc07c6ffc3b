#!/usr/bin/env bash
# The GPU check of issue 15, for a device machine with JAX, CUDA and pytest installed and
# no network (see docs/performance.md): the packages it lacks from .whl/, the model tests
# on the GPU, then benchmarks/gpu.py. What it prints also lands in $OUT.
#
#   here, once:  bash benchmarks/gpu_wheels.sh      (trio, gguf, ... as wheels into .whl/)
#   there:       bash benchmarks/gpu.sh tests       (carry .whl; at most 5 minutes)
#                bash benchmarks/gpu.sh bench       (at most 8 minutes)
# Two calls, since one device command may run 10 minutes at most; no part: both.
#
# motet runs from the checkout (PYTHONPATH), without its native CPU kernels: on a GPU the
# quantized products are XLA's, dequantizing inside the jitted step.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/motet-gpu}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "gpu.sh: no wheels in .whl/ (run benchmarks/gpu_wheels.sh here first)" >&2; exit 1; }
export PYTHONPATH="/tmp/site:$PWD"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import jax; print("jax", jax.__version__, jax.devices())'; } 2>&1 | tee "$OUT/device.txt"
part="${1:-all}"
if [[ $part == tests || $part == all ]]; then
  # The model tests, float32 products at full precision: the goldens' tolerances are
  # float32's. The checkout is not installed, so the native CPU kernels are not built.
  JAX_DEFAULT_MATMUL_PRECISION=highest timeout 290 python3 -m pytest -q -p no:cacheprovider \
    -m "not slow and not subprocess and not browser" -k "not native_kernel_is_built" \
    tests/test_golden_models.py tests/test_gguf_moe.py tests/test_quant.py tests/test_quantized_experts.py \
    tests/test_kv_consistency.py tests/test_sampling.py 2>&1 | tee "$OUT/tests.txt"
fi
if [[ $part == bench || $part == all ]]; then
  # The benchmark at JAX's default precision, as a user's engine runs.
  timeout 470 python3 benchmarks/gpu.py --repeats 1 --json "$OUT/gpu.json" 2>&1 | tee "$OUT/bench.txt"
fi
