#!/usr/bin/env bash
# Create .venv (if missing) and install dtrain with torch pinned to the CPU build
# that these machines carry (a range would pull CUDA wheels). Extra pip arguments
# are passed on, e.g. `scripts/setup.sh ".[test]"`. --no-compile: Python compiles what it imports
# on first use, instead of pip byte-compiling all of torch up front (55 s instead of 86 s on a fresh
# checkout here).
set -euo pipefail
cd "$(dirname "$0")/.."
target="${1:-.}"
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --no-compile --disable-pip-version-check "torch==2.13.0" -e "$target"
