"""Pipeline schedules as data: for each rank, the ordered list of actions it runs in one call.

An :class:`~dtrain.pipeline.actions.Action` (``"1F3"``: stage 1, forward, micro-batch 3) and a
:class:`~dtrain.pipeline.actions.Schedule` (one action list per rank) are defined in
:mod:`dtrain.pipeline.actions`, with the table of ops; this module makes and checks them. The executor
(:mod:`dtrain.pipeline.executor`) runs any valid list, so a new schedule is a new list,
not new executor code. How to use the pieces:

1. :func:`generate` builds the compute actions (F, B) of a named schedule (:data:`GENERATORS`).
2. :func:`with_comms` lowers it: a receive before and a send after each compute action whose
   neighbouring stage lives on another rank.
3. :func:`simulate` plays it in time (durations ``tf``, ``tb``), :func:`grid` prints
   that play rank by time slot, :func:`validate` checks everything that can be checked
   without running it (:mod:`dtrain.pipeline._simulate` is the engine).
4. :meth:`Schedule.text` / :func:`parse_schedule` write and read one line per rank.

Example::

    >>> s = generate("1f1b", ranks=2, microbatches=3)
    >>> print(s.text())
    rank 0: 0F0 0F1 0B0 0F2 0B1 0B2
    rank 1: 1F0 1B0 1F1 1B1 1F2 1B2
    >>> print(grid(s))
    rank 0: F0 F1 .  B0 F2 B1 .  B2
    rank 1: .  F0 B0 F1 B1 F2 B2 .
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from fractions import Fraction
from math import gcd

from dtrain.pipeline._simulate import Durations, Invalid, PlayedSchedule, check_messages, check_structure, play
from dtrain.pipeline.actions import COMM_OPS, OPS, Action, Schedule, ScheduleError

__all__ = [
    "OPS",
    "COMM_OPS",
    "GENERATORS",
    "ScheduleError",
    "Action",
    "Schedule",
    "PlayedSchedule",
    "parse_schedule",
    "grid",
    "generate",
    "flush_actions",
    "with_comms",
    "simulate",
    "validate",
    "bubble_closed_form",
    "peak_in_flight_bound",
]

_RANK_RE = re.compile(r"rank\s+(\d+)\s*:(.*)")


def grid(schedule: Schedule, tf: float = 1.0, tb: float = 1.0) -> str:
    """A rank-by-time table of :func:`simulate` ``(schedule, tf, tb)``.

    One row per rank, one column per time slot (the largest slot that divides ``tf`` and
    ``tb``, so a B of ``tb = 2 * tf`` fills two columns); a cell is ``"F3"`` / ``"B3"``
    (``"F3.1"``: chunk 1, when ``chunks > 1``) or ``"."`` when the rank is idle.
    """
    result = simulate(schedule, tf, tb)
    slot = _slot(tf, tb)
    rows = [["."] * round(result.makespan / slot) for _ in range(schedule.ranks)]
    for r, played in enumerate(result.starts):
        for a, t0, t1 in played:
            chunk = f".{a.stage // schedule.ranks}" if schedule.chunks > 1 else ""
            cell = f"{a.op}{'' if a.mb is None else a.mb}{chunk}"
            for col in range(round(t0 / slot), round(t1 / slot)):
                rows[r][col] = cell
    width = max((len(c) for row in rows for c in row), default=1)
    return "\n".join(f"rank {r}: " + " ".join(c.ljust(width) for c in row).rstrip() for r, row in enumerate(rows))


def _slot(tf: float, tb: float) -> float:
    """The largest time that divides both durations (as fractions with denominators up to 64)."""
    if tf <= 0 or tb <= 0:
        raise ScheduleError(f"grid: tf and tb must be > 0, got tf={tf}, tb={tb}")
    a, b = Fraction(tf).limit_denominator(64), Fraction(tb).limit_denominator(64)
    den = a.denominator * b.denominator // gcd(a.denominator, b.denominator)
    return gcd(int(a * den), int(b * den)) / den


def parse_schedule(
    text: str, name: str = "custom", ranks: int | None = None, microbatches: int | None = None, chunks: int = 1
) -> Schedule:
    """Read :meth:`Schedule.text` back: lines ``"rank R: <action> <action> ..."`` (blank lines skipped).

    Args:
        text: the lines; every rank ``0 .. ranks-1`` once, in any order.
        name: the schedule's name (default: ``"custom"``; ``"2bw"`` allows negative ids).
        ranks: P (default: the number of rank lines).
        microbatches: M (default: one more than the largest id, or the most negative id's size).
        chunks: virtual stages per rank (default: 1).

    Raises:
        ScheduleError: a line that is not ``rank R: ...``, a rank twice or missing, a bad action.
    """
    lists: dict[int, tuple[Action, ...]] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        m = _RANK_RE.fullmatch(line.strip())
        if m is None:
            raise ScheduleError(f"schedule line {line!r}: expected 'rank <r>: <action> <action> ...'")
        r = int(m.group(1))
        if r in lists:
            raise ScheduleError(f"rank {r}: listed twice")
        try:
            lists[r] = tuple(Action.parse(t) for t in m.group(2).split())
        except ScheduleError as e:
            raise ScheduleError(f"rank {r}: {e}") from None
    n = len(lists) if ranks is None else ranks
    missing = [r for r in range(n) if r not in lists]
    extra = [r for r in lists if not 0 <= r < n]
    if missing or extra:
        raise ScheduleError(f"schedule of {n} ranks: rank lines missing for {missing}, out of range: {extra}")
    if microbatches is None:
        ids = [a.mb for acts in lists.values() for a in acts if a.mb is not None]
        microbatches = max([1] + [i + 1 for i in ids if i >= 0] + [-i for i in ids if i < 0])
    return Schedule(name, n, microbatches, chunks, tuple(lists[r] for r in range(n)))


# ---------------------------------------------------------------------------- generators

Lists = list[list[Action]]


def _gpipe(p: int, m: int, v: int) -> Lists:
    """GPipe (Huang et al. 2019): every forward, then every backward, both in micro-batch order 0..M-1.

    The backwards run oldest first (the order the forwards came in) rather than autograd's
    newest first: both give the same bubble and the same peak of M held activations, and the
    increasing order lets the last stage start on micro-batch 0 as soon as its forwards end.
    """
    return [[Action(s, "F", i) for i in range(m)] + [Action(s, "B", i) for i in range(m)] for s in range(p)]


def _one_f_one_b(p: int, m: int, v: int) -> Lists:
    """1F1B: PipeDream-Flush (Narayanan et al. 2021, ICML) / DAPPLE (Fan et al. 2021, PPoPP).

    Stage ``s`` warms up with ``w = min(P-1-s, M)`` forwards, then alternates ``F(w+i), B(i)``
    for ``i < M-w``, then cools down with the remaining backwards: at most ``min(M, P-s)``
    activations held, against GPipe's M, for the same bubble ``(P-1)/(M+P-1)``.
    """
    out: Lists = []
    for s in range(p):
        w = min(p - 1 - s, m)
        acts = [Action(s, "F", i) for i in range(w)]
        for i in range(m - w):
            acts += [Action(s, "F", w + i), Action(s, "B", i)]
        out.append(acts + [Action(s, "B", i) for i in range(m - w, m)])
    return out


def _interleaved(p: int, m: int, v: int) -> Lists:
    """Interleaved 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
    Clusters Using Megatron-LM", SC21).

    Rank ``r`` holds the ``v`` chunks ``r, r+P, ..., r+(v-1)P``. Its ``v*M`` forwards go in groups:
    micro-batches ``kP .. kP+P-1`` through chunk 0, the same ones through chunk 1, ... chunk v-1,
    then the next ``P`` micro-batches; the backwards go through the same groups with the chunks
    in reverse (v-1 .. 0). Rank ``r`` warms up with ``(P-r-1)*2 + (v-1)*P`` forwards (at most
    ``v*M``), then alternates one forward and one backward, then runs the remaining backwards.
    The bubble shrinks ``v`` times: ``(P-1)/(v*M+P-1)`` of the time. Needs ``M % P == 0``.
    """
    total, group = v * m, p * v

    def act(r: int, k: int, op: str) -> Action:  # rank r's k-th forward or backward
        chunk = (k % group) // p
        if op == "B":
            chunk = v - 1 - chunk
        return Action(chunk * p + r, op, (k // group) * p + k % p)

    out: Lists = []
    for r in range(p):
        warm = min((p - r - 1) * 2 + (v - 1) * p, total)
        acts = [act(r, k, "F") for k in range(warm)]
        for i in range(total - warm):
            acts += [act(r, warm + i, "F"), act(r, i, "B")]
        out.append(acts + [act(r, k, "B") for k in range(total - warm, total)])
    return out


def _two_bw(p: int, m: int, v: int) -> Lists:
    """PipeDream-2BW (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training", ICML).

    No flush: stage ``s`` (``w = min(P-1-s, M)``) runs ``F(i), B(i-w)`` for ``i < M``. The last
    ``w`` backwards of a batch run in the next call, as ids ``-w .. -1`` (the previous batch's
    micro-batch ``M + id``), on the weight version their forward used (two versions are stashed).
    Every call is the same steady state; :func:`flush_actions` ends training.
    """
    out: Lists = []
    for s in range(p):
        w = min(p - 1 - s, m)
        out.append([a for i in range(m) for a in (Action(s, "F", i), Action(s, "B", i - w))])
    return out


GENERATORS: dict[str, Callable[[int, int, int], Lists]] = {
    "gpipe": _gpipe,
    "1f1b": _one_f_one_b,
    "interleaved": _interleaved,
    "2bw": _two_bw,
}


def _check_args(name: str, ranks: int, microbatches: int, chunks: int) -> None:
    if name not in GENERATORS:
        raise ScheduleError(f"schedule {name!r} is not known; choose one of: {', '.join(GENERATORS)}")
    for what, value in (("ranks", ranks), ("microbatches", microbatches), ("chunks", chunks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"schedule {name!r}: {what} must be an int >= 1, got {value!r}")
    if name == "interleaved" and chunks < 2:
        raise ScheduleError(f"schedule 'interleaved': chunks must be >= 2 (virtual stages per rank), got {chunks}")
    if name != "interleaved" and chunks != 1:
        raise ScheduleError(
            f"schedule {name!r}: chunks must be 1 (only 'interleaved' has virtual stages), got {chunks}"
        )


def generate(name: str, ranks: int, microbatches: int, chunks: int = 1) -> Schedule:
    """The compute actions (F and B) of a named schedule; lower them with :func:`with_comms`.

    Args:
        name: a key of :data:`GENERATORS`: ``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"2bw"``.
        ranks: P.
        microbatches: M per call; ``"interleaved"`` needs a multiple of P.
        chunks: virtual stages per rank: 1, or at least 2 for ``"interleaved"`` (default: 1).

    Raises:
        ScheduleError: an unknown name, a count below 1, chunks other than 1 outside interleaved,
            interleaved with fewer than 2 chunks or M not a multiple of P.
    """
    _check_args(name, ranks, microbatches, chunks)
    if name == "interleaved" and microbatches % ranks:
        raise ScheduleError(
            f"schedule 'interleaved': microbatches ({microbatches}) must be a multiple of ranks "
            f"({ranks}); micro-batches go through the chunks in groups of {ranks}"
        )
    return Schedule(name, ranks, microbatches, chunks, tuple(map(tuple, GENERATORS[name](ranks, microbatches, chunks))))


def flush_actions(schedule: Schedule) -> tuple[tuple[Action, ...], ...]:
    """2bw: per rank, the backwards deferred from the last call (ids ``-w .. -1`` in order).

    Run them once at the end of training to finish the last batch. For a lowered schedule (one
    with comm actions) the backwards come lowered too, with their receives and sends. Other
    schedules defer nothing: ``()``.
    """
    if schedule.name != "2bw":
        return ()
    deferred = [
        [a for a in acts if a.mb is not None and a.mb < 0 and a.op in ("B", "I", "W")] for acts in schedule.actions
    ]
    if _has_comms(schedule):
        deferred = [_lower(schedule, r, acts) for r, acts in enumerate(deferred)]
    return tuple(tuple(acts) for acts in deferred)


# ---------------------------------------------------------------------------- lowering


def _has_comms(schedule: Schedule) -> bool:
    return any(a.op in COMM_OPS for acts in schedule.actions for a in acts)


def _lower(schedule: Schedule, rank: int, acts: Sequence[Action]) -> list[Action]:
    def remote(stage: int) -> bool:
        return 0 <= stage < schedule.stages and schedule.stage_rank(stage) != rank

    out: list[Action] = []
    for a in acts:
        fwd, bwd = a.op == "F", a.op in ("B", "I")
        if (fwd and remote(a.stage - 1)) or (bwd and remote(a.stage + 1)):
            out.append(Action(a.stage, "RF" if fwd else "RB", a.mb))
        out.append(a)
        if (fwd and remote(a.stage + 1)) or (bwd and remote(a.stage - 1)):
            out.append(Action(a.stage, "SF" if fwd else "SB", a.mb))
    return out


def with_comms(schedule: Schedule) -> Schedule:
    """Lower ``schedule``: insert its sends and receives (a schedule that has some is returned as it is).

    For each F whose previous stage lives on another rank, an RF right before it; whose next stage
    does, an SF right after it. For each B or I whose next stage lives on another rank, an RB
    right before it; whose previous stage does, an SB right after it. W communicates nothing.
    A comm action carries the stage that runs it: ``SF(s, m)`` is received as ``RF(s+1, m)``,
    ``SB(s, m)`` as ``RB(s-1, m)``.
    """
    if _has_comms(schedule):
        return schedule
    lowered = tuple(tuple(_lower(schedule, r, acts)) for r, acts in enumerate(schedule.actions))
    return Schedule(schedule.name, schedule.ranks, schedule.microbatches, schedule.chunks, lowered)


# ---------------------------------------------------------------------------- simulation and checks


def simulate(
    schedule: Schedule, tf: Durations = 1.0, tb: Durations = 1.0, tw: Durations = 0.0, comm: float = 0.0
) -> PlayedSchedule:
    """Play the compute actions of ``schedule`` in time (comm actions are left out of the timing).

    Each rank runs its list strictly in order; an action starts when the rank's previous action
    ended and its dependencies ended (plus ``comm`` for a dependency on another rank):

    * ``F(s, m)`` needs ``F(s-1, m)``;
    * ``B(s, m)`` or ``I(s, m)`` needs ``F(s, m)`` and the next stage's ``B`` or ``I(s+1, m)``;
    * ``W(s, m)`` needs ``I(s, m)``;
    * 2bw, ids below 0: the forward ran in the previous call, and ``B(s+1, m)`` counts as done
      unless this call's lists hold it.

    Durations are per action on one virtual stage: F ``tf``, B ``tb``, I ``tb - tw``, W ``tw``, U 0;
    each is one number for every stage, or a sequence with one per virtual stage (unequal stages).

    Raises:
        ScheduleError: an action on a rank that does not hold its stage, an id out of range, an
            action twice, a micro-batch without its F or B on a stage, a deadlock (every blocked
            rank's action and what it waits for), or a negative duration.
    """
    n = schedule.stages
    lengths = sorted({len(x) for x in (tf, tb, tw) if not isinstance(x, (int, float))} - {n})
    if lengths:
        raise ScheduleError(f"simulate: per-stage durations need one per virtual stage ({n}); got {lengths}")
    f, b, w = ([float(x)] * n if isinstance(x, (int, float)) else list(x) for x in (tf, tb, tw))
    if min(min(f), min(b), min(w), min(bk - wk for bk, wk in zip(b, w, strict=True)), comm) < 0:
        raise ScheduleError(
            f"simulate: durations must be >= 0 with tw <= tb; got tf={tf}, tb={tb}, tw={tw}, comm={comm}"
        )
    try:
        return play(schedule, check_structure(schedule), f, b, w, comm)
    except Invalid as e:
        raise ScheduleError(f"schedule {schedule.name!r}: {e}") from None


def validate(schedule: Schedule) -> None:
    """Check ``schedule`` without running it: :func:`simulate`'s checks, and for a lowered schedule
    also its messages.

    With comm actions: every send has its receive on the peer's rank (SF/RF, SB/RB); each
    receive comes before the compute that needs it and each send after the compute that makes
    it; and playing sends as non-blocking and receives as blocking, in list order, every rank
    gets to its end (no message-order deadlock).

    Raises:
        ScheduleError: the first problem found, naming the rank, the action and the cause.
    """
    simulate(schedule)
    if _has_comms(schedule):
        try:
            check_messages(schedule)
        except Invalid as e:
            raise ScheduleError(f"schedule {schedule.name!r}: {e}") from None


def bubble_closed_form(name: str, ranks: int, microbatches: int, chunks: int = 1) -> float:
    """The idle share of the ranks' time, ``sum(idle) / (ranks * makespan)``, with ``tf == tb``.

    gpipe and 1f1b: ``(P-1)/(M+P-1)``; interleaved: ``(P-1)/(v*M+P-1)`` (Narayanan et al. 2021,
    SC21: the bubble's time is ``(P-1)/v`` of a stage's time per micro-batch). 2bw: ``0.0``, the
    steady-state figure of a pipeline without flushes (one call's own ramp is left out, as the
    previous call's deferred backwards fill it in a long run).
    """
    _check_args(name, ranks, microbatches, chunks)
    if name == "2bw":
        return 0.0
    return (ranks - 1) / (chunks * microbatches + ranks - 1)


def peak_in_flight_bound(name: str, ranks: int, microbatches: int, stage: int, chunks: int = 1) -> int:
    """The most micro-batches stage ``stage`` holds forwarded but not yet backwarded (its activations).

    gpipe: ``M``; 1f1b: ``min(M, P - stage)``; 2bw: ``min(M + 1, P - stage)`` (counting the previous
    batch's deferred micro-batches, held at the start of a call); interleaved: the forwards that
    virtual stage ``stage`` (chunk ``c`` on rank ``r``) runs before its first backward, which is
    the rank's backward number ``(v-1-c)*P`` (chunks go backwards in reverse), preceded by the
    warm-up ``w = min((P-r-1)*2 + (v-1)*P, v*M)`` forwards and one forward per earlier backward.
    """
    _check_args(name, ranks, microbatches, chunks)
    if not 0 <= stage < ranks * chunks:
        raise ScheduleError(f"schedule {name!r}: stage {stage} is out of range (0 .. {ranks * chunks - 1})")
    p, m, v = ranks, microbatches, chunks
    if name == "gpipe":
        return m
    if name == "1f1b":
        return min(m, p - stage)
    if name == "2bw":
        return min(m + 1, p - stage)
    r, c = stage % p, stage // p
    warm = min((p - r - 1) * 2 + (v - 1) * p, v * m)
    last = min(warm + (v - 1 - c) * p, v * m - 1)  # the last forward before chunk c's first backward
    return sum(1 for k in range(last + 1) if (k % (p * v)) // p == c)
