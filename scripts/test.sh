#!/usr/bin/env bash
# Set up (scripts/setup.sh), lint and type-check, then run the whole default test suite.
# ruff (pyproject [tool.ruff]) and mypy --strict (pyproject [tool.mypy]) run first;
# either failing fails the script before any test starts. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh ".[test]"
.venv/bin/python -m ruff check src tests benchmarks scripts
.venv/bin/python -m mypy
exec .venv/bin/python -m pytest -q "$@"
