"""Timeline events and per-step metrics of a run.

* :class:`MetricsWriter` appends one JSON object per step to this rank's metrics
  file; the launcher merges the ranks' files into the run folder's metrics rows when
  the run ends (no two processes write one file; the names: :mod:`dtrain.rundir.files`).
  With ``--tensorboard`` the evaluating rank's writer also writes the rows' scalars
  (:data:`TENSORBOARD_SCALARS`, as ``train/<key>``) and each evaluation's metric
  (``eval/<metric>``) as TensorBoard event files in ``RUN/tensorboard``, through
  torch's ``SummaryWriter`` (the ``tensorboard`` package, imported only then).
* :class:`Tracer` records named spans (Chrome trace "complete" events, one process
  per rank, a track per thread) and point-to-point messages with flow arrows, and
  writes ``trace.rank<R>.json``; :func:`merge_traces` merges them into ``trace.json``,
  each rank's events shifted by the clock offset that :func:`align_clock` measured
  (a ping exchange with rank 0 before training), the offsets and their error bounds
  in the trace's ``otherData``. ``--trace-steps A-B`` keeps steps A..B only; without
  it a rank stops recording at :data:`MAX_EVENTS` events (stated in ``otherData``).
  Library code records through :func:`current` / :func:`span` (the process's tracer,
  set by :func:`activate`), so a collective traces itself wherever it is called from.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dtrain.errors import ConfigError
from dtrain.rundir.files import METRICS, RANK_METRICS, rank_metrics, read_jsonl

__all__ = [
    "MetricsWriter",
    "Tracer",
    "merge_rank_files",
    "merge_traces",
    "METRIC_FIELDS",
    "TENSORBOARD_SCALARS",
    "require_tensorboard",
    "align_clock",
    "activate",
    "current",
    "span",
    "flow_id",
    "parse_trace_steps",
]

MAX_EVENTS = 100_000  # per rank, without --trace-steps: a long run's trace stays under ~20 MB a rank
MSG_TID = 100  # the first "messages" track
TAG_CLOCK = 0x7A11  # the clock pings' tag


def parse_trace_steps(text: str) -> tuple[int, int] | None:
    """``--trace-steps`` "A-B" (or "A": one step) -> (A, B), inclusive; "" -> None (all steps)."""
    if not text:
        return None
    first, sep, last = text.partition("-")
    try:
        a, b = int(first), int(last) if sep else int(first)
    except ValueError:
        raise ConfigError(f"--trace-steps takes FIRST-LAST (steps, e.g. 20-40), got {text!r}") from None
    if a < 0 or b < a:
        raise ConfigError(f"--trace-steps {text!r}: need 0 <= FIRST <= LAST")
    return a, b


METRIC_FIELDS = (
    "step",
    "rank",
    "loss",
    "lr",
    "samples_per_s",
    "compute_s",
    "comm_s",
    "wait_s",
    "bytes_sent",
)
# a row's keys written as TensorBoard scalars under --tensorboard (those a row holds: loss_scale under fp16,
# b_simple under --noise-scale)
TENSORBOARD_SCALARS = ("loss", "lr", "samples_per_s", "loss_scale", "b_simple")


def require_tensorboard() -> None:
    """Refuse ``--tensorboard`` (a :class:`ConfigError`, before any process starts) where the
    ``tensorboard`` package that torch's ``SummaryWriter`` needs is not installed."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "--tensorboard needs the tensorboard package, which is not installed: "
            "pip install tensorboard (it comes with dtrain's test extra), or run without it"
        )


class MetricsWriter:
    """Writes this rank's per-step metrics as JSON lines (flushed each step), and after
    :meth:`open_tensorboard` their scalars as TensorBoard events too."""

    def __init__(self, out_dir: str | Path, rank: int) -> None:
        self.path = Path(out_dir) / rank_metrics(rank)
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
    """Collects the timeline of one rank for a Chrome trace (chrome://tracing, Perfetto).

    Spans ("complete" events, ``ph: X``) go on the calling thread's track: the main thread's is
    tid 0 (steps, forward, backward, optimizer, waits), a pipeline's actions are put on tid 1, and
    each other thread gets its own (data parallelism's communication thread: tid 2). Point-to-point
    messages (:meth:`message`, recorded by :class:`~dtrain.comm.transport.TorchTransport`) are
    spans from posting to completion on "messages" tracks, one lane per overlap, and carry a flow
    id (``bind_id`` with ``flow_out`` on the send, ``flow_in`` on the receive: Chrome's flow
    events, drawn as arrows) that both ends compute alike: the group, the two global ranks, the
    tag and the message's number on that channel (messages of one channel arrive in order).

    Args:
        rank: this process's global rank (the trace's pid).
        enabled: record at all (``--no-trace``: nothing, not even counting).
        steps: record only the steps ``first..last`` (inclusive; ``--trace-steps``); None: all
            steps and what comes before the first one.
        max_events: stop recording after this many events (the rest of the run is not traced,
            stated in the trace's metadata), so that a long run's trace stays bounded.
    """

    def __init__(
        self, rank: int, enabled: bool = True, steps: tuple[int, int] | None = None, max_events: int = MAX_EVENTS
    ) -> None:
        self.rank = rank
        self.enabled = enabled
        self.steps = steps
        self.max_events = max_events
        self.events: list[dict[str, Any]] = []
        self.step = -1  # the step in progress (the loop sets it through at_step)
        self.truncated_at: int | None = None  # the step at which max_events was reached
        self.clock: dict[str, float] = {"offset_s": 0.0, "error_s": 0.0, "rounds": 0}
        self._channels: dict[tuple[str, int, int, int], int] = {}
        self._threads: dict[int, int] = {threading.main_thread().ident or 0: 0}
        self._lock = threading.Lock()
        # wall-clock origin so that tracks of ranks on one machine line up
        self._t0 = time.perf_counter()
        self._wall0 = time.time()

    @property
    def recording(self) -> bool:
        """Whether events are kept now (enabled, under the cap, inside ``steps``)."""
        if not self.enabled or self.truncated_at is not None:
            return False
        return self.steps is None or self.steps[0] <= self.step <= self.steps[1]

    def at_step(self, step: int) -> None:
        """The loop starts ``step``: recording follows ``steps``."""
        self.step = step

    def now(self) -> float:
        """This rank's trace clock in seconds (wall time, advancing with ``time.perf_counter``)."""
        return self._wall0 + time.perf_counter() - self._t0

    def _tid(self) -> int:
        ident = threading.get_ident()
        tid = self._threads.get(ident)
        if tid is None:
            with self._lock:
                tid = self._threads.setdefault(ident, len(self._threads) + 1)  # 2, 3, ...: tid 1 is the pipeline's
        return tid

    @contextlib.contextmanager
    def span(self, name: str, tid: int | None = None, **args: Any) -> Iterator[None]:
        if not self.recording:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, start, time.perf_counter() - start, tid, **args)

    def add(self, name: str, start: float, dur: float, tid: int | None = None, **args: Any) -> None:
        """A span that began at ``start`` (a ``time.perf_counter()`` reading) and lasted ``dur`` seconds."""
        if self.recording:
            self._keep(
                {
                    "name": name,
                    "ph": "X",
                    "pid": self.rank,
                    "tid": self._tid() if tid is None else tid,
                    "ts": (self._wall0 + start - self._t0) * 1e6,
                    "dur": dur * 1e6,
                    "args": args,
                }
            )

    def _keep(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        if len(self.events) >= self.max_events:
            self.truncated_at = self.step

    def channel(self, group: str, src: int, dst: int, tag: int) -> str:
        """The flow key of the next message from global rank ``src`` to ``dst`` with ``tag`` in ``group``;
        counted whether or not the tracer records, so that both ends number a channel alike."""
        k = (group, src, dst, tag)
        n = self._channels.get(k, 0)
        self._channels[k] = n + 1
        return f"{group}:{src}>{dst}:{tag}#{n}"

    def message(self, op: str, peer: int, key: str, start: float, nbytes: int) -> None:
        """A point-to-point message to or from global rank ``peer``, posted at ``start``
        (``time.perf_counter()``) and complete now; ``op`` is "send" or "recv"."""
        if not self.recording:
            return
        end = time.perf_counter()
        arrow = "→" if op == "send" else "←"
        self._keep(
            {
                "name": f"{op} {arrow} {peer}",
                "ph": "X",
                "pid": self.rank,
                "tid": "msg",
                "ts": (self._wall0 + start - self._t0) * 1e6,
                "dur": (end - start) * 1e6,
                "bind_id": flow_id(key),
                "flow_out" if op == "send" else "flow_in": True,
                "args": {"peer": peer, "bytes": nbytes, "msg": key, "step": self.step},
            }
        )

    def dump(self, out_dir: str | Path) -> None:
        if self.enabled:
            data = {
                "rank": self.rank,
                "events": _lanes(self.events),
                "clock": self.clock,
                "truncated_at_step": self.truncated_at,
                "steps": list(self.steps) if self.steps else None,
            }
            final = Path(out_dir) / f"trace.rank{self.rank}.json"  # whole or absent: a worker killed while it
            tmp = final.with_suffix(f".tmp{os.getpid()}")  # writes leaves no half file for the merge
            tmp.write_text(json.dumps(data))
            os.replace(tmp, final)


def flow_id(key: str) -> int:
    """A message's flow id: 52 bits of a hash of its key (both ends hash the same key)."""
    return int(hashlib.blake2b(key.encode(), digest_size=8).hexdigest()[:13], 16)


def _lanes(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Put message spans (tid "msg") on tracks 100, 101, ...: a span goes on the first track free
    at its start, so that no two spans of a track overlap (trace viewers nest spans of a track)."""
    ends: list[float] = []
    for e in sorted((e for e in events if e["tid"] == "msg"), key=lambda e: e["ts"]):
        lane = next((i for i, end in enumerate(ends) if end <= e["ts"]), len(ends))
        if lane == len(ends):
            ends.append(0.0)
        ends[lane] = e["ts"] + e["dur"]
        e["tid"] = MSG_TID + lane
    return events


def align_clock(tracer: Tracer, timeout_s: float, rounds: int = 8) -> None:
    """Measure this rank's trace-clock offset from rank 0's by a ping exchange (NTP's estimate).

    Every rank but 0 sends its clock reading ``t0`` to rank 0, which answers with its own ``T``;
    back at ``t1``, the offset is ``T - (t0 + t1) / 2``, wrong by at most half the round trip
    ``(t1 - t0) / 2`` (the stated error). Of ``rounds`` pings the one with the shortest round trip
    counts. Every process of the job calls it once, before training (a collective of sorts).
    """
    import datetime

    import torch
    import torch.distributed as dist

    if not tracer.enabled or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    me, world = dist.get_rank(), dist.get_world_size()
    limit = datetime.timedelta(seconds=timeout_s)
    pg = dist.group.WORLD
    assert pg is not None
    buf = torch.zeros(1, dtype=torch.float64)
    if me == 0:
        for r in range(1, world):
            for _ in range(rounds):
                pg.recv([buf], r, TAG_CLOCK).wait(limit)
                buf[0] = tracer.now()
                pg.send([buf], r, TAG_CLOCK).wait(limit)
        tracer.clock = {"offset_s": 0.0, "error_s": 0.0, "rounds": rounds}
        return
    best: tuple[float, float] | None = None
    for _ in range(rounds):
        t0 = tracer.now()
        buf[0] = t0
        pg.send([buf], 0, TAG_CLOCK).wait(limit)
        pg.recv([buf], 0, TAG_CLOCK).wait(limit)
        t1 = tracer.now()
        if best is None or t1 - t0 < best[0]:
            best = (t1 - t0, float(buf[0]) - (t0 + t1) / 2)
    assert best is not None
    tracer.clock = {"offset_s": best[1], "error_s": best[0] / 2, "rounds": rounds}


_active: Tracer | None = None


def activate(tracer: Tracer | None) -> None:
    """Make ``tracer`` this process's (what transports and collectives record into); None: none."""
    global _active
    _active = tracer if tracer is not None and tracer.enabled else None


def current() -> Tracer | None:
    """This process's enabled tracer (recording or not), or None."""
    return _active


def span(name: str, **args: Any) -> contextlib.AbstractContextManager[None]:
    """A span on this process's tracer, or nothing when there is none (for library code)."""
    t = _active
    return t.span(name, **args) if t is not None and t.recording else contextlib.nullcontext()


def _load_rank(p: Path) -> dict[str, Any]:
    data = json.loads(p.read_text())
    return {"events": data} if isinstance(data, list) else dict(data)  # a list: an older rank file


def merge_traces(out_dir: Path) -> None:
    """Merge ``trace.rank*.json`` into ``trace.json``: each rank's events shifted by its clock
    offset, track names, and the alignment in ``otherData``."""
    events: list[dict[str, Any]] = []
    meta: dict[str, Any] = {
        "clock": "offsets from a ping exchange with rank 0 (NTP's estimate); error <= half the shortest round trip",
        "clock_offset_us": {},
        "clock_error_us": {},
    }
    for p in sorted(out_dir.glob("trace.rank*.json")):
        try:
            data = _load_rank(p)
        except ValueError as bad:  # not JSON (written by an older dtrain that a kill cut short): left on disk
            meta.setdefault("unreadable", {})[p.name] = str(bad)
            continue
        p.unlink()
        rank = data.get("rank", int(p.name[len("trace.rank") : -len(".json")]))
        clock = data.get("clock") or {}
        off = float(clock.get("offset_s", 0.0)) * 1e6
        meta["clock_offset_us"][str(rank)] = round(off, 3)
        meta["clock_error_us"][str(rank)] = round(float(clock.get("error_s", 0.0)) * 1e6, 3)
        if data.get("truncated_at_step") is not None:
            meta.setdefault("truncated_at_step", {})[str(rank)] = data["truncated_at_step"]
        if data.get("steps"):
            meta["trace_steps"] = data["steps"]
        tids = set()
        for e in data["events"]:
            e["ts"] += off
            tids.add(e.get("tid", 0))
            events.append(e)
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        for tid in sorted(tids, key=str):
            events.append(
                {"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": _track_name(tid)}}
            )
    if events:
        errors = list(meta["clock_error_us"].values())
        meta["clock_error_max_us"] = max(errors) if errors else 0.0
        _match_flows(events, meta, windowed="trace_steps" in meta or "truncated_at_step" in meta)
        (out_dir / "trace.json").write_text(
            json.dumps({"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta})
        )


def _match_flows(events: list[dict[str, Any]], meta: dict[str, Any], windowed: bool) -> None:
    """Count the messages with one end only (``unmatched_messages``): none in a whole trace.
    In a trace of some steps (or cut at the cap) a message that crosses the window's edge has one
    end outside it: its arrow is dropped (``messages_cut_at_window_edge``)."""
    out = {e["bind_id"] for e in events if e.get("flow_out")}
    into = {e["bind_id"] for e in events if e.get("flow_in")}
    alone = [
        e
        for e in events
        if ("flow_out" in e and e["bind_id"] not in into) or ("flow_in" in e and e["bind_id"] not in out)
    ]
    if windowed:
        for e in alone:
            for k in ("bind_id", "flow_in", "flow_out"):
                e.pop(k, None)
        meta["messages_cut_at_window_edge"] = len(alone)
        alone = []
    meta["messages"] = len(out & into)
    meta["unmatched_messages"] = len(alone)


def _track_name(tid: Any) -> str:
    if tid == 0:
        return "main (compute, waits)"
    if tid == 1:
        return "pipeline actions"
    if isinstance(tid, int) and tid >= MSG_TID:
        return f"messages {tid - MSG_TID}"
    return f"thread {tid} (communication)"


def merge_rank_files(out_dir: str | Path) -> None:
    """Merge the ranks' metrics files into the run's metrics rows and ``trace.rank*.json`` into ``trace.json``."""
    out = Path(out_dir)
    rows: list[dict[str, Any]] = []
    for p in sorted(out.glob(RANK_METRICS)):
        rows += read_jsonl(p)
        p.unlink()
    if rows:
        rows.sort(key=lambda r: (r.get("step", 0), r.get("rank", 0)))
        with (out / METRICS).open("w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    merge_traces(out)
