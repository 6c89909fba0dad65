"""The files of a run folder, by name, and their readers and writers.

A finished run folder holds (``dtrain run --out DIR``; the default ``runs/<timestamp>-<strategy>``):

* :data:`CONFIG` -- the resolved configuration (TOML: ``dtrain run DIR/config.toml`` runs it again);
* :data:`METRICS` -- the metrics rows, one JSON object a line, one a step and rank (each rank writes
  its own :func:`rank_metrics` file while it trains; they are merged when the run ends);
* :data:`EVALS` -- one row an evaluation (metric, value, step, epoch, train_s), written as the run goes
  (a sweep's trials read it live);
* :data:`SUMMARY` -- the summary (JSON), written last: a folder with one is a finished run.

Only the names here are spelled out; every reader and writer elsewhere asks this module.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from dtrain.errors import DTrainError

__all__ = [
    "SUMMARY",
    "METRICS",
    "EVALS",
    "CONFIG",
    "RANK_METRICS",
    "rank_metrics",
    "read_jsonl",
    "iter_metrics",
    "read_metrics",
    "has_metrics",
    "read_summary",
    "write_summary",
    "is_finished",
    "is_run",
]

SUMMARY = "summary.json"
METRICS = "metrics.jsonl"
EVALS = "evals.jsonl"
CONFIG = "config.toml"
RANK_METRICS = "metrics.rank*.jsonl"  # the ranks' own files (a glob)


def rank_metrics(rank: int) -> str:
    """The file rank ``rank`` writes its metrics rows to while the run trains."""
    return f"metrics.rank{rank}.jsonl"


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file (blank lines skipped)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def iter_metrics(folder: str | Path) -> Iterator[dict[str, Any]]:
    """The metrics rows of a run folder, one at a time (none when it has no metrics)."""
    path = Path(folder) / METRICS
    if not path.is_file():
        return
    for line in path.read_text().splitlines():
        if line.strip():
            yield json.loads(line)


def read_metrics(folder: str | Path) -> list[dict[str, Any]]:
    """The metrics rows of a run folder (``[]`` when it has none)."""
    return list(iter_metrics(folder))


def has_metrics(folder: str | Path) -> bool:
    return (Path(folder) / METRICS).is_file()


def is_finished(folder: str | Path) -> bool:
    """Whether the folder holds a finished run (its summary)."""
    return (Path(folder) / SUMMARY).is_file()


def is_run(folder: str | Path) -> bool:
    """Whether the folder holds a run, finished or not (its configuration)."""
    return (Path(folder) / CONFIG).is_file()


def read_summary(folder: str | Path) -> dict[str, Any]:
    """A finished run's summary (DTrainError naming the folder when it has none)."""
    path = Path(folder) / SUMMARY
    if not path.is_file():
        raise DTrainError(f"{folder} is not a finished run folder (no {SUMMARY})")
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def write_summary(folder: str | Path, summary: Mapping[str, Any]) -> Path:
    """Write the run's summary (indented JSON) and return its path."""
    path = Path(folder) / SUMMARY
    path.write_text(json.dumps(summary, indent=2) + "\n")
    return path
