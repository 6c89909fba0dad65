#!/usr/bin/env bash
# Create .venv (if missing) and install dtrain with torch pinned to the CPU build
# that these machines carry (a range would pull CUDA wheels). Extra pip arguments
# are passed on, e.g. `scripts/setup.sh ".[test]"`.
set -euo pipefail
cd "$(dirname "$0")/.."
target="${1:-.}"
[ -x .venv/bin/python ] || python3 -m venv .venv
# --no-compile: no bytecode for the thousands of modules of torch, Ray and transformers that nothing imports;
# Python writes it for the ones imported, on first import (a fresh venv: 315 s against 379 s, both while
# the other core ran tests)
.venv/bin/pip install -q --no-compile --disable-pip-version-check "torch==2.13.0" -e "$target"
