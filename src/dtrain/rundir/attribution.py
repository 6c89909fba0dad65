"""Straggler and bottleneck attribution: which rank the others waited for, and what bounds a step.

Pure functions over a run's metrics rows (:func:`dtrain.rundir.files.read_metrics`: one row per
step per rank, with the engine's ``compute_s``, ``comm_s``, ``wait_s`` and the loop's ``step_s``;
any of them may be missing or null, as in rows of older runs or of engines that cannot tell).

Definitions, and what they rest on:

1. **Own work** of a rank in a step (:func:`own_s`): where the row's ``compute_s``, ``comm_s``
   and ``wait_s`` add up to its ``step_s`` (within 1%: the engine split the whole step, as the
   parameter server's, hybrid and gossip engines do), its ``compute_s``. Otherwise the step's time
   less its exchange, ``step_s - max(wait_s, comm_s)``, and never less than ``compute_s``: such
   engines time their compute spans (forward and backward) and miss work done outside them --
   bookkeeping, the optimizer, and ``--straggler``'s sleep after backward (data parallelism's
   ``compute_s`` never sees it); the step's time does. The larger of the two, not their sum: dp's
   buckets are reduced while the end of backward waits (``comm_s`` within ``wait_s``); a pipeline
   stage reports no ``comm_s`` (its blocked sends count as its own work). Without ``step_s``:
   ``compute_s``.
2. **Last to arrive** (:func:`arrivals`): in a synchronous step (dp's allreduce, a bsp parameter
   server's reply, which comes once every worker pushed, a pipeline's receives) a rank's
   ``wait_s`` is the time from its own arrival to the last rank's, plus what the exchange costs
   once all are there. So the rank that waited least arrived last, another rank ``o`` waited
   ``wait_s[o] - wait_s[last]`` for it, and it was late by the smallest of those (its gap to the
   next-latest arrival). All of the others' waiting is charged to the last one: the exchange
   could not finish before it came. A step where fewer than two ranks report ``wait_s``, or whose
   waits are all within 1 us, has no last arrival (local SGD's steps, ddp's rows). In steps that
   do not synchronise (asynchronous parameter servers or gossip) a small ``wait_s`` means little.
3. **Over the run** (:func:`attribute`, after ``skip`` warm-up steps): a rank is ranked by the
   time the others spent waiting for it, given as a share of their step time; its own work is its
   median over the steps, relative to the median of the other ranks' medians (with two ranks, the
   other rank: the median of all would be the mean of the two and halve the contrast).
4. **Bound**: a rank's step splits into its own work (*compute*), the time it waited for a later
   rank (*wait*: ``wait_s - wait_s[last]``; a pipeline's bubble is waiting too) and the rest
   (*communication*: the exchange itself); a step is bound by the largest of the three summed over
   its ranks, the run by the largest over all steps.
5. **Straggler**: the rank the others waited for most, named only if it was last in at least half
   of the steps, kept them waiting at least 10% of the step and its own work is at least twice the
   others' median -- so a rank behind a slow link (waited for, its own work the others') is not
   named. Contention alone can make a rank that much slower (ranks sharing cores with other jobs),
   so a rank named at about 2x may be one the machine slowed; an injected ``--straggler R:F`` shows
   as more than ``F``, because the emulation stretches work that includes dp's in-backward exchange
   and a pipeline stage's receives, which this measure leaves out of the other ranks' own work.

Example::

    rows = read_metrics("RUN")  # dtrain.rundir.files
    print(attribute(rows).line)
    # rank 1 made the others wait 41% of the step; it computes 3.9x slower than the median of the
    # others (last in 14 of 14 steps); steps are wait-bound (compute 31%, communication 14%, wait 55%)
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Arrival", "RankBlame", "Attribution", "own_s", "step_time", "arrivals", "attribute"]

Row = Mapping[str, Any]
KINDS = ("compute", "communication", "wait")
TIE_S = 1e-6  # waits closer than this: nobody arrived last
STRAGGLER_LAST = 0.5  # last in at least this share of the steps
STRAGGLER_WAIT = 0.10  # ... kept the others waiting at least this share of their step
STRAGGLER_OWN = 2.0  # ... and its own work is at least this many times the others' median


def _num(row: Row, key: str) -> float | None:
    v = row.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def own_s(row: Row) -> float:
    """A rank's own work in a step: ``compute_s`` where compute, communication and waits add up to the
    step, else ``max(compute_s, step_s - max(wait_s, comm_s))`` (definition 1)."""
    compute = _num(row, "compute_s") or 0.0
    step = _num(row, "step_s")
    if step is None:
        return compute
    wait, comm = _num(row, "wait_s") or 0.0, _num(row, "comm_s") or 0.0
    if abs(compute + wait + comm - step) <= 0.01 * step:  # the engine split the whole step
        return compute
    return max(compute, step - max(wait, comm))


def step_time(row: Row) -> float:
    """The row's step seconds: ``step_s``; where a row lacks it, ``compute_s`` plus a pipeline stage's
    ``idle_s``, or else plus ``max(wait_s, comm_s)`` (an estimate: the exchange either overlaps the
    waits or follows the compute)."""
    step = _num(row, "step_s")
    if step is not None:
        return step
    compute, idle = _num(row, "compute_s") or 0.0, _num(row, "idle_s")
    if idle is not None:
        return compute + idle
    return compute + max(_num(row, "wait_s") or 0.0, _num(row, "comm_s") or 0.0)


@dataclass(frozen=True)
class Arrival:
    """One step's last arrival (definition 2).

    Attributes:
        step: the step index.
        last: the rank that arrived last (None: no rank can be told).
        late_s: how much later than the next-latest rank it arrived.
        waited_s: the seconds the other ranks waited for it, summed over them.
        step_s: the step's time: the longest of its ranks' (in a synchronous step they differ by
            where each one's step begins and ends, not by how long the step lasts).
        ranks: ranks in the step.
        waits: seconds each rank waited for a later one (0 for the last).
    """

    step: int
    last: int | None
    late_s: float
    waited_s: float
    step_s: float
    ranks: int
    waits: dict[int, float] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "last": self.last,
            "late_s": round(self.late_s, 6),
            "waited_s": round(self.waited_s, 6),
            "step_s": round(self.step_s, 6),
        }


def _arrival(step: int, rows: list[Row]) -> Arrival:
    t = max(step_time(r) for r in rows)
    waits = {int(r.get("rank", 0)): w for r in rows if (w := _num(r, "wait_s")) is not None}
    if len(waits) < 2 or max(waits.values()) - min(waits.values()) < TIE_S:
        return Arrival(step, None, 0.0, 0.0, t, len(rows))
    last = min(waits, key=lambda k: (waits[k], k))
    behind = {k: w - waits[last] for k, w in waits.items()}
    others = [v for k, v in behind.items() if k != last]
    return Arrival(step, last, min(others), sum(others), t, len(rows), behind)


def _by_step(rows: Iterable[Row]) -> dict[int, list[Row]]:
    steps: dict[int, list[Row]] = defaultdict(list)
    for r in rows:
        if "step" in r:
            steps[int(r["step"])].append(r)
    return dict(sorted(steps.items()))


def arrivals(rows: Iterable[Row]) -> list[Arrival]:
    """Per step (in order), which rank arrived last and by how much (definition 2)."""
    return [_arrival(s, rs) for s, rs in _by_step(rows).items()]


@dataclass(frozen=True)
class RankBlame:
    """One rank over the run: how long the others waited for it, and its own work.

    Attributes:
        rank: the rank.
        last_steps: steps it arrived last in.
        waited_s: seconds the others waited for it, summed over them and the steps.
        waited: that as a share of the others' step time (0.41: 41% of the step).
        own_s: its median own work per step.
        own_ratio: ``own_s`` over the median of the other ranks' (1.0 when alone).
    """

    rank: int
    last_steps: int
    waited_s: float
    waited: float
    own_s: float
    own_ratio: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "last_steps": self.last_steps,
            "waited_s": round(self.waited_s, 6),
            "waited": round(self.waited, 4),
            "own_s": round(self.own_s, 6),
            "own_ratio": round(self.own_ratio, 3),
        }


@dataclass(frozen=True)
class Attribution:
    """A run's attribution (:func:`attribute`).

    Attributes:
        steps: the steps looked at (after the warm-up); ``timed``: those with a last arrival.
        ranks: every rank, the one the others waited for most first.
        straggler: the rank named a straggler (definition 5), or None.
        bound: "compute", "communication" or "wait": the largest share of the step over the run.
        shares: each kind's share of the ranks' step time over the run.
        bound_steps: steps bound by each kind.
        worst: the steps whose last arrival kept the others waiting longest (at most 5).
    """

    steps: int
    timed: int
    ranks: list[RankBlame]
    straggler: int | None
    bound: str
    shares: dict[str, float]
    bound_steps: dict[str, int]
    worst: list[Arrival]

    @property
    def line(self) -> str:
        """One line for a terminal (what ``dtrain run`` prints at the end)."""
        shares = ", ".join(f"{k} {self.shares[k]:.0%}" for k in KINDS)
        tail = f"steps are {self.bound}-bound ({shares})"
        if len(self.ranks) < 2:
            return f"one rank, nobody waits; {tail}"
        if self.timed == 0:
            return f"no rank's arrival can be told (the rows carry no differing wait_s); {tail}"
        top = self.ranks[0]
        if self.straggler is not None:
            return (
                f"rank {top.rank} made the others wait {top.waited:.0%} of the step; it computes "
                f"{top.own_ratio:.1f}x slower than the median of the others (last in {top.last_steps} of "
                f"{self.timed} steps); {tail}"
            )
        return (
            f"no straggler: rank {top.rank} kept the others waiting most, {top.waited:.0%} of the step "
            f"(last in {top.last_steps} of {self.timed} steps; its own work {top.own_ratio:.1f}x the median of "
            f"the others); {tail}"
        )

    def to_dict(self) -> dict[str, Any]:
        """The form the run's summary holds (its ``attribution``)."""
        return {
            "line": self.line,
            "straggler": self.straggler,
            "steps": self.steps,
            "timed_steps": self.timed,
            "ranks": [r.to_dict() for r in self.ranks],
            "bound": self.bound,
            "shares": {k: round(v, 4) for k, v in self.shares.items()},
            "bound_steps": self.bound_steps,
            "worst_steps": [a.to_dict() for a in self.worst],
        }


def _split(rows: list[Row], arrival: Arrival) -> dict[str, float]:
    """The step's seconds by kind, summed over its ranks (definition 4)."""
    out = dict.fromkeys(KINDS, 0.0)
    for r in rows:
        t, own = step_time(r), own_s(r)
        wait = min(arrival.waits.get(int(r.get("rank", 0)), 0.0), max(0.0, t - own))
        out["compute"] += own
        out["wait"] += wait
        out["communication"] += max(0.0, t - own - wait)
    return out


def _blame(ranks: list[int], timed: list[Arrival], own: dict[int, list[float]]) -> list[RankBlame]:
    waited = dict.fromkeys(ranks, 0.0)
    last = dict.fromkeys(ranks, 0)
    others_time = sum((a.ranks - 1) * a.step_s for a in timed)
    for a in timed:
        assert a.last is not None
        waited[a.last] = waited.get(a.last, 0.0) + a.waited_s
        last[a.last] = last.get(a.last, 0) + 1
    med = {k: statistics.median(own[k]) if own.get(k) else 0.0 for k in ranks}
    out = []
    for k in ranks:
        rest = statistics.median([med[o] for o in ranks if o != k]) if len(ranks) > 1 else med[k]
        ratio = med[k] / rest if rest > 0 else 1.0
        out.append(RankBlame(k, last[k], waited[k], waited[k] / others_time if others_time > 0 else 0.0, med[k], ratio))
    return sorted(out, key=lambda b: (-b.waited_s, -b.own_ratio, b.rank))


def attribute(rows: Iterable[Row], *, skip: int = 1) -> Attribution:
    """Attribute a run's waiting and step time (definitions 3-5 of the module's docstring).

    Args:
        rows: the run's metrics rows (every rank's).
        skip: leading steps left out as warm-up (lazy initialisation, a pipeline's shape exchange);
            none when the run has at most ``skip + 1`` steps.
    """
    steps = _by_step(rows)
    if len(steps) > skip + 1:
        steps = dict(list(steps.items())[skip:])
    ranks = sorted({int(r.get("rank", 0)) for rs in steps.values() for r in rs})
    found = [_arrival(s, rs) for s, rs in steps.items()]
    timed = [a for a in found if a.last is not None]
    own: dict[int, list[float]] = defaultdict(list)
    totals = dict.fromkeys(KINDS, 0.0)
    bound_steps = dict.fromkeys(KINDS, 0)
    for a, rs in zip(found, steps.values()):
        for r in rs:
            own[int(r.get("rank", 0))].append(own_s(r))
        split = _split(rs, a)
        bound_steps[max(KINDS, key=lambda k: split[k])] += 1
        for k in KINDS:
            totals[k] += split[k]
    whole = sum(totals.values())
    shares = {k: totals[k] / whole if whole > 0 else 0.0 for k in KINDS}
    blame = _blame(ranks, timed, own)
    top = blame[0] if blame else None
    straggler = (
        top.rank
        if top is not None
        and len(ranks) > 1
        and timed
        and top.last_steps >= STRAGGLER_LAST * len(timed)
        and top.waited >= STRAGGLER_WAIT
        and top.own_ratio >= STRAGGLER_OWN
        else None
    )
    worst = sorted(timed, key=lambda a: (-a.waited_s, a.step))[:5]
    return Attribution(
        len(found), len(timed), blame, straggler, max(KINDS, key=lambda k: shares[k]), shares, bound_steps, worst
    )
