"""benchmarks/pipeline_bubble.py runs end to end at its smallest size (speed is the benchmark's, not a test's)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.procs  # every test here starts processes

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
bench = importlib.import_module("pipeline_bubble")


def test_the_bubble_benchmark_reports_each_schedule_beside_its_closed_form(tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    assert bench.main(["--quick", "--microbatches", "2,4", "--schedules", "1f1b,interleaved", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["schedule"], r["microbatches"]) for r in rows] == [
        ("1f1b", 2),
        ("interleaved", 2),
        ("1f1b", 4),
        ("interleaved", 4),
    ]
    for r in rows:
        assert 0.0 <= r["bubble"] <= 1.0 and r["step_s"] > 0 and len(r["per_rank"]) == 2
    closed = {(r["schedule"], r["microbatches"]): r["closed_form"] for r in rows}
    assert closed[("1f1b", 2)] == 1 / 3 and closed[("interleaved", 4)] == 1 / 9  # (P-1)/(M+P-1), (P-1)/(vM+P-1)
