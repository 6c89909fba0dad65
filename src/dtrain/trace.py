"""Timeline events and per-step metrics of a run.

* :class:`MetricsWriter` appends one JSON object per step to
  ``metrics.rank<R>.jsonl``; the launcher merges the ranks' files into the run
  folder's ``metrics.jsonl`` when the run ends (no two processes write one file).
  With ``--tensorboard`` the evaluating rank's writer also writes the rows' scalars
  (:data:`TENSORBOARD_SCALARS`, as ``train/<key>``) and each evaluation's metric
  (``eval/<metric>``) as TensorBoard event files in ``RUN/tensorboard``, through
  torch's ``SummaryWriter`` (the ``tensorboard`` package, imported only then).
* :class:`Tracer` records named spans (Chrome trace "complete" events, one track
  per rank) and writes ``trace.rank<R>.json``; merged into ``trace.json``.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dtrain.errors import ConfigError

__all__ = ["MetricsWriter", "Tracer", "merge_rank_files", "METRIC_FIELDS", "TENSORBOARD_SCALARS",
           "require_tensorboard"]

METRIC_FIELDS = (
    "step", "rank", "loss", "lr", "samples_per_s", "compute_s", "comm_s", "wait_s", "bytes_sent",
)
# a row's keys written as TensorBoard scalars under --tensorboard (those a row holds: loss_scale under fp16,
# b_simple under --noise-scale)
TENSORBOARD_SCALARS = ("loss", "lr", "samples_per_s", "loss_scale", "b_simple")


def require_tensorboard() -> None:
    """Refuse ``--tensorboard`` (a :class:`ConfigError`, before any process starts) where the
    ``tensorboard`` package that torch's ``SummaryWriter`` needs is not installed."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("--tensorboard needs the tensorboard package, which is not installed: "
                          "pip install tensorboard (it comes with dtrain's test extra), or run without it")


class MetricsWriter:
    """Writes this rank's per-step metrics as JSON lines (flushed each step), and after
    :meth:`open_tensorboard` their scalars as TensorBoard events too."""

    def __init__(self, out_dir: str | Path, rank: int) -> None:
        self.path = Path(out_dir) / f"metrics.rank{rank}.jsonl"
        self.rank = rank
        self._f = self.path.open("a")
        self._tb: Any = None  # torch.utils.tensorboard.SummaryWriter, once opened

    def open_tensorboard(self, log_dir: str | Path) -> None:
        """Also write each row's :data:`TENSORBOARD_SCALARS` (and :meth:`scalar`'s) to event files in ``log_dir``."""
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package: imported only here

        self._tb = SummaryWriter(log_dir=str(log_dir), flush_secs=10)

    def write(self, **row: Any) -> None:
        row.setdefault("rank", self.rank)
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()
        if self._tb is not None and "step" in row:
            for key in TENSORBOARD_SCALARS:
                v = row.get(key)
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(f"train/{key}", v, int(row["step"]))

    def scalar(self, tag: str, value: float, step: int) -> None:
        """One more TensorBoard scalar (an evaluation's metric); nothing without :meth:`open_tensorboard`."""
        if self._tb is not None:
            self._tb.add_scalar(tag, value, step)

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()


class Tracer:
    """Collects spans of one rank for a Chrome trace (chrome://tracing, Perfetto)."""

    def __init__(self, rank: int, enabled: bool = True) -> None:
        self.rank = rank
        self.enabled = enabled
        self.events: list[dict[str, Any]] = []
        # wall-clock origin so that tracks of ranks on one machine line up
        self._t0 = time.perf_counter()
        self._wall0 = time.time()

    @contextlib.contextmanager
    def span(self, name: str, tid: int = 0, **args: Any) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, start, time.perf_counter() - start, tid, **args)

    def add(self, name: str, start: float, dur: float, tid: int = 0, **args: Any) -> None:
        if self.enabled:
            self.events.append({
                "name": name, "ph": "X", "pid": self.rank, "tid": tid,
                "ts": (self._wall0 + start - self._t0) * 1e6, "dur": dur * 1e6, "args": args,
            })

    def dump(self, out_dir: str | Path) -> None:
        if self.enabled:
            (Path(out_dir) / f"trace.rank{self.rank}.json").write_text(json.dumps(self.events))


def merge_rank_files(out_dir: str | Path) -> None:
    """Merge ``metrics.rank*.jsonl`` into ``metrics.jsonl`` and ``trace.rank*.json`` into ``trace.json``."""
    out = Path(out_dir)
    rows: list[dict[str, Any]] = []
    for p in sorted(out.glob("metrics.rank*.jsonl")):
        rows += [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
        p.unlink()
    if rows:
        rows.sort(key=lambda r: (r.get("step", 0), r.get("rank", 0)))
        with (out / "metrics.jsonl").open("w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    events: list[dict[str, Any]] = []
    for p in sorted(out.glob("trace.rank*.json")):
        events += json.loads(p.read_text())
        p.unlink()
    if events:
        (out / "trace.json").write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
