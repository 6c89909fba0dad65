#!/usr/bin/env bash
# Set up (scripts/setup.sh), lint and type-check, then run the whole default test suite.
# ruff's lint and its formatter (pyproject [tool.ruff]) and mypy --strict (pyproject [tool.mypy]) run first;
# either failing fails the script before any test starts. Extra arguments go to pytest.
#   bash scripts/test.sh            everything (the slowest 25 tests listed at the end, so growth shows)
#   bash scripts/test.sh --quick    the edit-test loop: the tests that start no process (see tests/conftest.py)
# With CI=true, Debian's chromium is installed if missing (for the report.html browser test).
set -euo pipefail
cd "$(dirname "$0")/.."
quick=""
if [[ "${1:-}" == "--quick" ]]; then quick="--quick"; shift; fi
bash scripts/setup.sh ".[test,tune,hf]"  # tune: the sweeps on Ray Tune (tests/test_sweep*.py); hf: users' models and data
.venv/bin/python -m ruff check src tests benchmarks scripts
.venv/bin/python -m ruff format --check src tests benchmarks scripts
.venv/bin/python -m mypy
if [[ -n "$quick" ]]; then
    exec .venv/bin/python -m pytest -q --quick -n 2 --durations=10 "$@"  # in-process tests: one per core
fi
# tests/test_report_html.py opens report.html in headless Chromium (skipped without it): in CI, install
# Debian's package when it is missing; a failed install only skips that test
if [[ "${CI:-}" == "true" ]] && ! command -v chromium >/dev/null 2>&1; then
    sudo=""; [[ "$(id -u)" == 0 ]] || sudo="sudo -n"
    { $sudo apt-get update -qq && $sudo apt-get install -y -qq --no-install-recommends chromium >/dev/null; } \
        || echo "test.sh: could not install chromium; the report.html browser test will be skipped"
fi
# two pytest processes, a test module to each at a time (module fixtures shared), the longest modules first
# (tests/conftest.py): the suite waits on its processes' timeouts and start-ups as much as it computes
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=25 "$@"
