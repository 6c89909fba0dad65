"""The engine behind :func:`~dtrain.pipeline.schedules.simulate` and :func:`~dtrain.pipeline.schedules.validate`.

Private. It reads :mod:`dtrain.pipeline.actions`' ``Schedule`` and ``Action`` and raises :class:`Invalid`,
which the public functions turn into ``ScheduleError``; so the import goes one way, from ``schedules`` to here.

Three passes over a :class:`~dtrain.pipeline.actions.Schedule`:

1. :func:`check_structure` -- every action on its stage's rank with an id in range, no action
   twice, every micro-batch with a forward and a backward on every stage.
2. :func:`play` -- a discrete-event play of the compute actions: each rank runs its list in
   order; an action starts when the rank's previous action ended and its dependencies ended
   (plus ``comm`` for one on another rank). A sweep that moves no rank while actions remain is
   a deadlock, reported with every rank's blocked action and what it waits for.
3. :func:`check_messages` -- with sends and receives in the lists: every send has its receive,
   each receive comes before the compute that needs it and each send after the compute that
   makes it, and a play with non-blocking sends and blocking receives ends.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from dtrain.pipeline.actions import Action, Schedule

__all__ = ["Durations", "Invalid", "PlayedSchedule", "check_structure", "play", "check_messages"]

COMPUTE = ("F", "B", "I", "W", "U")
# a comm action -> (message kind, offset from its stage to the peer stage, True if it sends)
_COMM = {"SF": ("F", 1, True), "RF": ("F", -1, False), "SB": ("B", -1, True), "RB": ("B", 1, False)}

Key = tuple[int, str, int | None]  # (stage, op, micro-batch) of an action
Message = tuple[str, int, int]  # (kind "F" or "B", sending stage, micro-batch)


class Invalid(Exception):
    """A schedule that cannot run; the message names the rank, the action and the cause."""


@dataclass(frozen=True)
class PlayedSchedule:
    """What :func:`~dtrain.pipeline.schedules.simulate` found (times in the units of ``tf`` / ``tb``).

    Attributes:
        makespan: when the last action ends (the first starts at 0).
        busy: per rank, the time spent computing.
        idle: per rank, ``makespan - busy``.
        bubble: ``sum(idle) / (ranks * makespan)``, the idle share of the ranks' time.
        peak_in_flight: per virtual stage, the most micro-batches forwarded but not yet backwarded
            (their activations are held); released by B, or by W where the backward is split.
        starts: per rank, ``(compute action, start, end)`` in execution order.
    """

    makespan: float
    busy: tuple[float, ...]
    idle: tuple[float, ...]
    bubble: float
    peak_in_flight: tuple[int, ...]
    starts: tuple[tuple[tuple[Action, float, float], ...], ...]


def _key(a: Action) -> Key:
    return (a.stage, a.op, a.mb)


def _twin(a: Action, stage: int, op: str, mb: int | None = None) -> Action:
    """An action like ``a`` with another stage and op (and micro-batch): its text names what is missing."""
    return Action(stage, op, a.mb if mb is None else mb)


def _deferred(s: Schedule, mb: int | None) -> bool:
    """Whether ``mb`` is a 2bw id of the previous batch (its forward ran in the previous call)."""
    return s.name == "2bw" and mb is not None and mb < 0


def _check_action(s: Schedule, rank: int, a: Action) -> None:
    if not 0 <= a.stage < s.stages:
        raise Invalid(f"rank {rank}: {a}: stage {a.stage} is out of range (the schedule has {s.stages} stages)")
    if s.stage_rank(a.stage) != rank:
        raise Invalid(f"rank {rank}: {a}: stage {a.stage} lives on rank {s.stage_rank(a.stage)}, not on rank {rank}")
    if a.mb is None:
        return
    low = -s.microbatches if s.name == "2bw" and a.op not in ("F", "SF", "RF") else 0
    if not low <= a.mb < s.microbatches:
        what = "2bw's deferred backwards" if low else "ids"
        raise Invalid(
            f"rank {rank}: {a}: micro-batch {a.mb} is out of range ({what} run {low} .. "
            f"{s.microbatches - 1} for {s.microbatches} micro-batches)"
        )
    if a.op in _COMM:
        kind, step, _ = _COMM[a.op]
        if not 0 <= a.stage + step < s.stages:
            raise Invalid(f"rank {rank}: {a}: stage {a.stage} has no {'next' if step > 0 else 'previous'} stage")


def check_structure(s: Schedule) -> dict[Key, int]:
    """Check every action on its own; return the rank of each compute action.

    Raises:
        Invalid: an action off its stage's rank, an id out of range, an action twice, a
            micro-batch without its forward or backward on a stage, a split backward without
            its other half.
    """
    if len(s.actions) != s.ranks:
        raise Invalid(f"the schedule has {s.ranks} ranks but {len(s.actions)} action lists")
    owner: dict[Key, int] = {}
    for rank, acts in enumerate(s.actions):
        seen: set[Key] = set()
        for a in acts:
            _check_action(s, rank, a)
            k = _key(a)
            if k in seen:
                raise Invalid(f"rank {rank}: {a}: duplicated (the action appears twice)")
            seen.add(k)
            if a.op in COMPUTE:
                owner[k] = rank
    for stage in range(s.stages):
        rank = s.stage_rank(stage)
        for mb in range(s.microbatches):
            _check_microbatch(s, owner, rank, stage, mb)
    return owner


def _check_microbatch(s: Schedule, owner: dict[Key, int], rank: int, stage: int, mb: int) -> None:
    def has(op: str, m: int) -> bool:
        return (stage, op, m) in owner

    if not has("F", mb):
        raise Invalid(f"rank {rank}: {stage}F{mb}: missing (micro-batch {mb} has no forward on stage {stage})")
    ids = (mb, mb - s.microbatches) if s.name == "2bw" else (mb,)
    found = [(op, m) for m in ids for op in ("B", "I") if has(op, m)]
    if not found:
        raise Invalid(f"rank {rank}: {stage}B{mb}: missing (micro-batch {mb} has no backward on stage {stage})")
    if len(found) > 1:
        (op1, m1), (op2, m2) = found[:2]
        raise Invalid(
            f"rank {rank}: {stage}{op2}{m2}: micro-batch {mb} already has {stage}{op1}{m1} on stage {stage} "
            f"(one backward per micro-batch and stage)"
        )
    for m in ids:
        if has("I", m) and not has("W", m):
            raise Invalid(f"rank {rank}: {stage}I{m}: its weight backward {stage}W{m} is missing")
        if has("W", m) and not has("I", m):
            raise Invalid(f"rank {rank}: {stage}W{m}: its input backward {stage}I{m} is missing")


def _deps(s: Schedule, owner: dict[Key, int], a: Action) -> list[Key]:
    """The compute actions ``a`` waits for (those of this call's lists)."""
    if a.op == "F":
        return [(a.stage - 1, "F", a.mb)] if a.stage > 0 else []
    if a.op == "W":
        return [(a.stage, "I", a.mb)]
    if a.op not in ("B", "I"):
        return []
    out: list[Key] = [] if _deferred(s, a.mb) else [(a.stage, "F", a.mb)]
    if a.stage < s.stages - 1:
        nxt = [(a.stage + 1, op, a.mb) for op in ("B", "I") if (a.stage + 1, op, a.mb) in owner]
        if nxt:
            out.append(nxt[0])
        elif not _deferred(s, a.mb):  # 2bw: the next stage ran it in the previous call
            out.append((a.stage + 1, "B", a.mb))
    return out


Durations = float | Sequence[float]  # one for every virtual stage, or one per virtual stage


def _duration(op: str, stage: int, tf: Sequence[float], tb: Sequence[float], tw: Sequence[float]) -> float:
    return {"F": tf[stage], "B": tb[stage], "I": tb[stage] - tw[stage], "W": tw[stage]}.get(op, 0.0)


def play(
    s: Schedule, owner: dict[Key, int], tf: Sequence[float], tb: Sequence[float], tw: Sequence[float], comm: float
) -> PlayedSchedule:
    """Play the compute actions of ``s`` (``owner`` from :func:`check_structure`; ``tf``, ``tb``, ``tw`` one per
    virtual stage); see the module docstring.

    Raises:
        Invalid: a deadlock, naming every rank's blocked action and what it waits for.
    """
    lists = [[a for a in acts if a.op in COMPUTE] for acts in s.actions]
    deps = {_key(a): _deps(s, owner, a) for acts in lists for a in acts}
    ends: dict[Key, float] = {}
    clock = [0.0] * s.ranks
    pos = [0] * s.ranks
    starts: list[list[tuple[Action, float, float]]] = [[] for _ in range(s.ranks)]
    moved = True
    while moved:
        moved = False
        for r, acts in enumerate(lists):
            while pos[r] < len(acts):
                a = acts[pos[r]]
                need = deps[_key(a)]
                if any(d not in ends for d in need):
                    break
                t0 = max([clock[r]] + [ends[d] + (comm if owner.get(d, r) != r else 0.0) for d in need])
                clock[r] = t0 + _duration(a.op, a.stage, tf, tb, tw)
                ends[_key(a)] = clock[r]
                starts[r].append((a, t0, clock[r]))
                pos[r] += 1
                moved = True
    if any(pos[r] < len(acts) for r, acts in enumerate(lists)):
        raise Invalid(_deadlock(s, lists, pos, deps, ends, owner))
    makespan = max(clock, default=0.0)
    busy = tuple(sum(t1 - t0 for _, t0, t1 in st) for st in starts)
    idle = tuple(makespan - b for b in busy)
    bubble = sum(idle) / (s.ranks * makespan) if makespan > 0 else 0.0
    return PlayedSchedule(makespan, busy, idle, bubble, _peaks(s), tuple(tuple(st) for st in starts))


def _deadlock(
    s: Schedule,
    lists: list[list[Action]],
    pos: list[int],
    deps: dict[Key, list[Key]],
    ends: dict[Key, float],
    owner: dict[Key, int],
) -> str:
    parts = []
    for r, acts in enumerate(lists):
        if pos[r] < len(acts):
            a = acts[pos[r]]
            waits = []
            for st, op, mb in deps[_key(a)]:
                if (st, op, mb) not in ends:
                    q = owner.get((st, op, mb))
                    where = "no rank's list" if q is None else "later in its own list" if q == r else f"rank {q}"
                    waits.append(f"{_twin(a, st, op, mb)} ({where})")
            parts.append(f"rank {r} waits at {a} for {', '.join(waits)}")
    return "deadlock: " + "; ".join(parts)


def _peaks(s: Schedule) -> tuple[int, ...]:
    """Per virtual stage, the most micro-batches forwarded and not yet backwarded, in list order."""
    peaks = [0] * s.stages
    for acts in s.actions:
        mine = [a for a in acts if a.op in ("F", "B", "W")]
        for stage in {a.stage for a in mine}:
            held = sum(1 for a in mine if a.stage == stage and a.op != "F" and _deferred(s, a.mb))
            top = held
            for a in mine:
                if a.stage == stage:
                    held += 1 if a.op == "F" else -1
                    top = max(top, held)
            peaks[stage] = top
    return tuple(peaks)


def _message(a: Action) -> Message:
    """The message a comm action sends or receives."""
    kind, step, sends = _COMM[a.op]
    assert a.mb is not None  # Action allows None only for U
    return (kind, a.stage if sends else a.stage + step, a.mb)


def _peer(a: Action) -> Action:
    """The comm action on the other side of ``a``'s message."""
    kind, step, sends = _COMM[a.op]
    return _twin(a, a.stage + step, ("R" if sends else "S") + kind)


def check_messages(s: Schedule) -> None:
    """Check the sends and receives of a lowered schedule (see the module docstring).

    For 2bw a receive ``RB(s, j)`` with ``j < 0`` and no ``SB(s+1, j)`` in the call takes the
    message the previous call sent as ``SB(s+1, M+j)``; such a send is then received in the next call.

    Raises:
        Invalid: an unmatched or duplicated send or receive, a receive after the compute that
            needs it or a send before the compute that makes it, a message-order deadlock.
    """
    _check_order(s)
    sends: Counter[Message] = Counter()
    recvs: Counter[Message] = Counter()
    for acts in s.actions:
        for a in acts:
            if a.op in _COMM:
                (sends if _COMM[a.op][2] else recvs)[_message(a)] += 1
    ready = _match(s, sends, recvs)
    pos = [0] * s.ranks
    moved = True
    while moved:
        moved = False
        for r, acts in enumerate(s.actions):
            while pos[r] < len(acts):
                a = acts[pos[r]]
                if a.op in _COMM and _COMM[a.op][2]:
                    ready.add(_message(a))
                elif a.op in _COMM and _message(a) not in ready:
                    break
                pos[r] += 1
                moved = True
    stuck = [(r, acts[pos[r]], _peer(acts[pos[r]])) for r, acts in enumerate(s.actions) if pos[r] < len(acts)]
    if stuck:
        waits = [f"rank {r} blocks at {a} waiting for {p} from rank {s.stage_rank(p.stage)}" for r, a, p in stuck]
        raise Invalid("message-order deadlock: " + "; ".join(waits))


def _match(s: Schedule, sends: Counter[Message], recvs: Counter[Message]) -> set[Message]:
    """Pair sends with receives; return the messages a previous call already delivered (2bw)."""
    early: set[Message] = set()
    for rank, acts in enumerate(s.actions):
        for a in acts:
            if a.op not in _COMM:
                continue
            msg = _message(a)
            kind, stage, mb = msg
            if (sends if _COMM[a.op][2] else recvs)[msg] > 1:
                raise Invalid(f"rank {rank}: {a}: duplicated (the message is sent or received twice)")
            if (recvs if _COMM[a.op][2] else sends)[msg]:
                continue
            if s.name == "2bw" and kind == "B":
                late = (kind, stage, mb + s.microbatches)
                if not _COMM[a.op][2] and mb < 0 and sends[late] and not recvs[late]:
                    early.add(msg)  # the previous call sent it as id M + mb
                    continue
                early_id = (kind, stage, mb - s.microbatches)
                if _COMM[a.op][2] and mb >= 0 and recvs[early_id] and not sends[early_id]:
                    continue  # the next call receives it as id mb - M
            peer = _peer(a)
            raise Invalid(f"rank {rank}: {a}: no matching {peer} on rank {s.stage_rank(peer.stage)}")
    return early


def _check_order(s: Schedule) -> None:
    """Each receive before the compute that needs it; each send after the compute that makes it."""
    for rank, acts in enumerate(s.actions):
        done: set[Key] = set()
        for a in acts:
            if a.op in ("F", "B", "I"):
                fwd = a.op == "F"
                nb = a.stage - 1 if fwd else a.stage + 1
                if 0 <= nb < s.stages and s.stage_rank(nb) != rank:
                    recv = _twin(a, a.stage, "RF" if fwd else "RB")
                    if _key(recv) not in done:
                        what = "activation" if fwd else "gradient"
                        raise Invalid(
                            f"rank {rank}: {a}: needs {recv} earlier in the list (the {what} comes from "
                            f"rank {s.stage_rank(nb)})"
                        )
            elif a.op in ("SF", "SB"):
                made = [_twin(a, a.stage, op) for op in (("F",) if a.op == "SF" else ("B", "I"))]
                if not any(_key(m) in done for m in made):
                    raise Invalid(f"rank {rank}: {a}: sends before {made[0]} computed it")
            done.add(_key(a))
