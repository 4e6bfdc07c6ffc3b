#!/usr/bin/env bash
# The packages motet needs that the device machine's image lacks (its JAX, numpy,
# tokenizers, jinja2, psutil, ml-dtypes, safetensors, pytest and pytest-xdist are there),
# as wheels in .whl/ for benchmarks/gpu.sh: the versions this checkout's venv runs, built
# for that machine's Python 3.12 on x86-64 (llguidance is the one compiled wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
pins=$(.venv/bin/pip freeze | grep -i -E '^(trio|outcome|sniffio|gguf|pytest-trio|llguidance)==')
platforms=()
for p in manylinux_2_17 manylinux2014 manylinux_2_28 manylinux_2_31 manylinux_2_34; do
  platforms+=(--platform "${p}_x86_64")
done
# shellcheck disable=SC2086
.venv/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl $pins
ls .whl
