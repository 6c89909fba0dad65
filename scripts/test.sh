#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole default test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh ".[test]"
exec .venv/bin/python -m pytest -q "$@"
