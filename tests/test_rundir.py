"""The run folder's files are named, read and written in one place (dtrain.rundir): its readers and writers,
and no path-like string outside it that spells one of the names."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from dtrain.errors import DTrainError
from dtrain.rundir import files

ROOT = Path(__file__).resolve().parents[1]
NAMES = re.compile(r"summary\.json|metrics\.jsonl|metrics\.rank|evals\.jsonl|config\.toml")


def test_the_readers_and_writers(tmp_path: Path) -> None:
    assert files.read_metrics(tmp_path) == [] and not files.has_metrics(tmp_path)
    with pytest.raises(DTrainError, match=f"{tmp_path} is not a finished run folder"):
        files.read_summary(tmp_path)
    rows = [{"step": 0, "rank": 0, "loss": 2.0}, {"step": 0, "rank": 1, "loss": 2.1}]
    (tmp_path / files.METRICS).write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert files.read_metrics(tmp_path) == rows == list(files.iter_metrics(tmp_path))
    assert files.write_summary(tmp_path, {"steps": 3}) == tmp_path / files.SUMMARY
    assert files.read_summary(tmp_path) == {"steps": 3} and files.is_finished(tmp_path)
    assert not files.is_run(tmp_path) and files.rank_metrics(2) == "metrics.rank2.jsonl"
    assert Path(files.rank_metrics(7)).match(files.RANK_METRICS)


def _path_like_strings(path: Path) -> list[tuple[int, str]]:
    """String literals (and f-string pieces) without spaces that name a run folder's file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and " " not in node.value.strip():
            if NAMES.search(node.value):
                out.append((node.lineno, node.value))
    return out


def test_no_code_outside_rundir_spells_a_run_folder_file() -> None:
    """The code (not its prose: docstrings and messages with spaces) of every other package and of the
    benchmarks asks dtrain.rundir.files for the names."""
    found = []
    for path in sorted([*(ROOT / "src" / "dtrain").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py")]):
        if "rundir" not in path.parts:
            found += [f"{path.relative_to(ROOT)}:{line}: {text!r}" for line, text in _path_like_strings(path)]
    assert not found, "\n".join(found)


def test_the_check_sees_a_spelled_name(tmp_path: Path) -> None:
    planted = tmp_path / "x.py"
    planted.write_text('p = out / "metrics.jsonl"\nq = f"metrics.rank{r}.jsonl"\nhelp = "the summary.json holds"\n')
    assert [line for line, _ in _path_like_strings(planted)] == [1, 2]
