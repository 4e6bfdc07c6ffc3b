#!/usr/bin/env bash
# The pure-Python packages motet needs that the device machine's image lacks (its JAX,
# numpy, tokenizers, jinja2, psutil, ml-dtypes and pytest are there), as wheels in .whl/
# for benchmarks/gpu.sh; pinned to the versions this checkout's venv runs.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
pins=$(.venv/bin/pip freeze | grep -i -E '^(trio|outcome|sniffio|gguf|pytest-trio)==')
# shellcheck disable=SC2086
.venv/bin/pip download -q --no-deps --only-binary=:all: -d .whl $pins
ls .whl
