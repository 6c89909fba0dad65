"""Pipeline schedules as data: generated lists against expected text, the simulator against the
closed forms, text round trips, lowering with sends and receives, and every bad schedule as a
ScheduleError naming the rank and the action. Pure: no processes, no torch.distributed."""

from __future__ import annotations

import re

import pytest

from dtrain.pipeline.schedules import (
    OPS,
    Action,
    Schedule,
    ScheduleError,
    bubble_closed_form,
    flush_actions,
    generate,
    grid,
    parse_schedule,
    peak_in_flight_bound,
    simulate,
    validate,
    with_comms,
)

FLAT = [(name, p, m, 1) for name in ("gpipe", "1f1b", "2bw") for p in range(1, 7) for m in range(1, 13)]
INTERLEAVED = [("interleaved", p, m, v) for v in (2, 3) for p in range(1, 7) for m in range(p, 13, p)]
ALL = FLAT + INTERLEAVED


def _ids(case: tuple[str, int, int, int]) -> str:
    name, p, m, v = case
    return f"{name}-P{p}-M{m}" + (f"-v{v}" if v > 1 else "")


def _schedule(case: tuple[str, int, int, int]) -> Schedule:
    name, p, m, v = case
    return generate(name, p, m, v)


def _raises(text: str, rank: int, action: str, cause: str, name: str = "custom") -> None:
    """``validate(parse_schedule(text))`` raises a ScheduleError naming ``rank``, ``action`` and ``cause``."""
    with pytest.raises(ScheduleError) as info:
        validate(parse_schedule(text, name=name))
    msg = str(info.value)
    assert f"rank {rank}" in msg and action in msg and re.search(cause, msg), msg


# ---------------------------------------------------------------------------- actions and text


@pytest.mark.parametrize("text", ["1F3", "0B-2", "2SF3", "2RB0", "1U", "3I0", "3W11", "10RF-4", "0SB7"])
def test_action_text_round_trip(text: str) -> None:
    a = Action.parse(text)
    assert str(a) == text
    assert Action.parse(str(a)) == a


def test_action_fields() -> None:
    assert Action.parse("0B-2") == Action(0, "B", -2)
    assert Action.parse("2SF3") == Action(2, "SF", 3)
    assert Action.parse("1U") == Action(1, "U") and Action(1, "U").mb is None
    assert {Action.parse(f"0{op}{'' if op == 'U' else 0}").op for op in OPS} == set(OPS)


@pytest.mark.parametrize("text", ["1U3", "1F", "F3", "1Q3", "1F3x", "", "-1F0", "1F+3"])
def test_action_bad_text(text: str) -> None:
    with pytest.raises(ScheduleError, match="action"):
        Action.parse(text)


@pytest.mark.parametrize("case", ALL, ids=_ids)
def test_text_round_trip(case: tuple[str, int, int, int]) -> None:
    s = _schedule(case)
    for sched in (s, with_comms(s)):
        assert parse_schedule(sched.text(), sched.name, sched.ranks, sched.microbatches, sched.chunks) == sched
        # ranks and micro-batches are read off the text when not given
        assert parse_schedule(sched.text(), sched.name, chunks=sched.chunks) == sched


def test_parse_errors() -> None:
    with pytest.raises(ScheduleError, match="rank 1: action 'x'"):
        parse_schedule("rank 0: 0F0 0B0\nrank 1: 1F0 x")
    with pytest.raises(ScheduleError, match="expected 'rank"):
        parse_schedule("0F0 0B0")
    with pytest.raises(ScheduleError, match="rank 0: listed twice"):
        parse_schedule("rank 0: 0F0\nrank 0: 0B0")
    with pytest.raises(ScheduleError, match=r"missing for \[1\]"):
        parse_schedule("rank 0: 0F0 0B0\nrank 2: 2F0 2B0")
    with pytest.raises(ScheduleError, match=r"missing for \[1\]"):
        parse_schedule("rank 0: 0F0 0B0", ranks=2)


# ---------------------------------------------------------------------------- generators: expected text


def test_expected_text() -> None:
    assert generate("gpipe", 2, 3).text() == "rank 0: 0F0 0F1 0F2 0B0 0B1 0B2\nrank 1: 1F0 1F1 1F2 1B0 1B1 1B2"
    assert generate("1f1b", 3, 4).text() == (
        "rank 0: 0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3\n"
        "rank 1: 1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3\n"
        "rank 2: 2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3"
    )
    # M < P: the warm-up is capped at M and 1F1B becomes GPipe on the first stages
    assert generate("1f1b", 3, 1).text() == "rank 0: 0F0 0B0\nrank 1: 1F0 1B0\nrank 2: 2F0 2B0"
    # interleaved, P=2 v=2 M=4: rank 0 warms up with (2-0-1)*2 + (2-1)*2 = 4 forwards, rank 1 with 2;
    # micro-batches go in groups of P=2 through chunk 0 then chunk 1 (stage 2 / 3), backwards chunk 1 first
    assert generate("interleaved", 2, 4, 2).text() == (
        "rank 0: 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3\n"
        "rank 1: 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"
    )
    # 2bw: stage s defers w = P-1-s backwards into the next call (negative ids)
    assert generate("2bw", 3, 4).text() == (
        "rank 0: 0F0 0B-2 0F1 0B-1 0F2 0B0 0F3 0B1\n"
        "rank 1: 1F0 1B-1 1F1 1B0 1F2 1B1 1F3 1B2\n"
        "rank 2: 2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3"
    )


def test_schedule_placement() -> None:
    s = generate("interleaved", 3, 3, 2)
    assert s.stages == 6
    assert [s.stage_rank(st) for st in range(6)] == [0, 1, 2, 0, 1, 2]
    assert s.rank_stages(1) == [1, 4]
    flat = generate("1f1b", 4, 4)
    assert [flat.stage_rank(st) for st in range(4)] == [0, 1, 2, 3] and flat.rank_stages(2) == [2]


@pytest.mark.parametrize(
    "args, match",
    [
        (("pipedream", 2, 2), "not known; choose one of: gpipe, 1f1b, interleaved, 2bw"),
        (("gpipe", 0, 2), "ranks must be an int >= 1"),
        (("1f1b", 2, 0), "microbatches must be an int >= 1"),
        (("interleaved", 2, 2, 0), "chunks must be an int >= 1"),
        (("gpipe", 2, 2, 2), "chunks must be 1"),
        (("2bw", 2, 2, 3), "chunks must be 1"),
        (("interleaved", 2, 2, 1), "chunks must be >= 2"),
        (("interleaved", 2, 3, 2), r"microbatches \(3\) must be a multiple of ranks \(2\)"),
    ],
)
def test_generate_errors(args: tuple[str, int, int, int], match: str) -> None:
    with pytest.raises(ScheduleError, match=match):
        generate(*args)
    assert issubclass(ScheduleError, ValueError)


# ---------------------------------------------------------------------------- simulation against closed forms


@pytest.mark.parametrize("case", ALL, ids=_ids)
def test_every_microbatch_forward_then_backward_once(case: tuple[str, int, int, int]) -> None:
    s = _schedule(case)
    name, p, m, v = case
    result = simulate(s)  # raises on a deadlock
    ops: dict[tuple[int, int], list[tuple[str, float, float]]] = {}
    for played in result.starts:
        for a, t0, t1 in played:
            assert a.mb is not None
            mb = a.mb % m if name == "2bw" else a.mb  # 2bw: id -j is the previous batch's M - j
            ops.setdefault((a.stage, mb), []).append((a.op, t0, t1))
    assert set(ops) == {(st, mb) for st in range(p * v) for mb in range(m)}
    for (st, mb), got in ops.items():
        assert sorted(op for op, _, _ in got) == ["B", "F"], (st, mb, got)
        if name != "2bw" or not any(a == Action(st, "B", mb - m) for acts in s.actions for a in acts):
            (_, f0, f1), (_, b0, _) = sorted(got, key=lambda x: x[0] != "F")
            assert b0 >= f1  # the backward starts after its forward ended


@pytest.mark.parametrize("case", [c for c in ALL if c[0] != "2bw"], ids=_ids)
def test_bubble_equals_closed_form(case: tuple[str, int, int, int]) -> None:
    """With tf == tb the simulated bubble is the closed form, exactly.

    The unit: tf and tb are per action on one *virtual* stage. A rank of the interleaved schedule
    holds v chunks of 1/v of a plain stage's layers, so to compare with GPipe or 1F1B on the same
    model one would take tf = tb = 1/v. The bubble, sum(idle) / (P * makespan), is a ratio of times
    and does not change when every duration is scaled, so tf = tb = 1 gives the same figure, and
    with integer times the float division is exact: each rank idles (P-1)(tf+tb) while it is busy
    v*M*(tf+tb), so the share is (P-1)/(v*M+P-1) (Narayanan et al. 2021: the bubble is (P-1)/v of
    a plain stage's forward and backward). With tf = tb = 1/v the figure agrees up to rounding.
    """
    name, p, m, v = case
    s = _schedule(case)
    expected = bubble_closed_form(name, p, m, v)
    assert simulate(s, tf=1.0, tb=1.0).bubble == expected
    assert simulate(s, tf=1 / v, tb=1 / v).bubble == pytest.approx(expected, rel=1e-12, abs=1e-15)
    result = simulate(s, tf=1.0, tb=1.0)
    assert result.makespan == 2 * (v * m + p - 1)
    assert all(b == 2 * v * m for b in result.busy)
    assert result.idle == tuple(result.makespan - b for b in result.busy)


@pytest.mark.parametrize("case", ALL, ids=_ids)
def test_peak_in_flight(case: tuple[str, int, int, int]) -> None:
    name, p, m, v = case
    peaks = simulate(_schedule(case)).peak_in_flight
    assert len(peaks) == p * v
    for stage, peak in enumerate(peaks):
        assert peak == peak_in_flight_bound(name, p, m, stage, v)
        if name == "gpipe":
            assert peak == m
        if name == "1f1b":
            assert peak == min(m, p - stage)


def test_closed_form_values() -> None:
    assert bubble_closed_form("gpipe", 4, 8) == 3 / 11
    assert bubble_closed_form("1f1b", 4, 8) == 3 / 11
    assert bubble_closed_form("interleaved", 4, 8, 2) == 3 / 19
    assert bubble_closed_form("2bw", 4, 8) == 0.0
    assert peak_in_flight_bound("2bw", 4, 8, 0) == 4 and peak_in_flight_bound("2bw", 4, 2, 0) == 3
    with pytest.raises(ScheduleError, match="stage 4 is out of range"):
        peak_in_flight_bound("1f1b", 4, 8, 4)
    with pytest.raises(ScheduleError, match="not known"):
        bubble_closed_form("zb", 4, 8)


def test_simulate_durations_and_comm() -> None:
    # P=2, M=1: F on rank 0, message, F on rank 1, B on rank 1, message, B on rank 0
    r = simulate(generate("gpipe", 2, 1), tf=1.0, tb=2.0, comm=0.5)
    assert r.makespan == 1 + 0.5 + 1 + 2 + 0.5 + 2
    assert r.busy == (3.0, 3.0)
    assert r.starts[1] == ((Action(1, "F", 0), 1.5, 2.5), (Action(1, "B", 0), 2.5, 4.5))
    # a split backward: I takes tb - tw, W takes tw and needs I; U takes no time
    split = parse_schedule("rank 0: 0F0 0I0 0W0 0U\nrank 1: 1F0 1I0 1W0 1U")
    r = simulate(split, tf=1.0, tb=2.0, tw=0.5)
    assert [(str(a), t0, t1) for a, t0, t1 in r.starts[0]] == [
        ("0F0", 0, 1),
        ("0I0", 3.5, 5),
        ("0W0", 5, 5.5),
        ("0U", 5.5, 5.5),
    ]
    assert r.makespan == 5.5
    with pytest.raises(ScheduleError, match="durations must be >= 0"):
        simulate(split, tb=1.0, tw=2.0)


def test_simulate_unequal_stages() -> None:
    # gpipe, P = 2, M = 2, stage 1 three times stage 0: the slow stage paces the steady part,
    # sum(tf + tb) + (M - 1) max(tf + tb) = 12 + 9
    r = simulate(generate("gpipe", 2, 2), tf=[1.0, 3.0], tb=[2.0, 6.0])
    assert r.makespan == 21
    assert r.busy == (6.0, 18.0)
    # a sequence of one value is the scalar; each schedule, interleaved too (one per virtual stage)
    for name, p, m, v in [("gpipe", 3, 4, 1), ("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2)]:
        sch = generate(name, p, m, v)
        same = simulate(sch, tf=[1.5] * sch.stages, tb=[2.5] * sch.stages, comm=0.25)
        assert same == simulate(sch, tf=1.5, tb=2.5, comm=0.25)
    with pytest.raises(ScheduleError, match="one per virtual stage \\(4\\); got \\[2\\]"):
        simulate(generate("interleaved", 2, 2, 2), tf=[1.0, 1.0])
    with pytest.raises(ScheduleError, match="durations must be >= 0"):
        simulate(generate("gpipe", 2, 2), tb=[1.0, -1.0])


# ---------------------------------------------------------------------------- 2bw


@pytest.mark.parametrize("case", [c for c in FLAT if c[0] == "2bw"], ids=_ids)
def test_2bw_steady_state(case: tuple[str, int, int, int]) -> None:
    _, p, m, _ = case
    s = _schedule(case)
    for st, acts in enumerate(s.actions):
        assert sum(a.op == "F" for a in acts) == m and sum(a.op == "B" for a in acts) == m
        w = min(p - 1 - st, m)
        assert [a.mb for a in acts if a.op == "B"] == list(range(-w, m - w))
    deferred = [[Action(st, "B", j) for j in range(-min(p - 1 - st, m), 0)] for st in range(p)]
    assert flush_actions(s) == tuple(map(tuple, deferred))


@pytest.mark.parametrize("p, m", [(p, m) for p in range(2, 7) for m in range(p, 13)])
def test_2bw_call_is_shorter_than_1f1b(p: int, m: int) -> None:
    # tf=1, tb=2: a 2bw call takes 3M + P - 1 (its only ramp is the first forwards; the deferred
    # backwards fill the cool-down), 1F1B takes 3(M + P - 1): e.g. P=2 M=2 7 vs 9, P=4 M=8 27 vs 33,
    # P=6 M=12 41 vs 51 -- 2(P-1) shorter.
    two_bw = simulate(generate("2bw", p, m), tf=1.0, tb=2.0).makespan
    one_f_one_b = simulate(generate("1f1b", p, m), tf=1.0, tb=2.0).makespan
    assert two_bw == 3 * m + p - 1 and one_f_one_b == 3 * (m + p - 1)
    assert two_bw < one_f_one_b


def test_flush_actions() -> None:
    assert flush_actions(generate("1f1b", 3, 4)) == ()
    lowered = flush_actions(with_comms(generate("2bw", 3, 4)))
    assert [" ".join(map(str, acts)) for acts in lowered] == ["0RB-2 0B-2 0RB-1 0B-1", "1RB-1 1B-1 1SB-1", ""]


def test_negative_ids_only_in_2bw() -> None:
    text = "rank 0: 0F0 0B-1 0F1 0B0\nrank 1: 1F0 1B0 1F1 1B1"
    validate(parse_schedule(text, name="2bw"))
    _raises(text, 0, "0B-1", "out of range")


# ---------------------------------------------------------------------------- lowering


def test_with_comms_placement() -> None:
    s = with_comms(generate("1f1b", 2, 2))
    assert s.text() == ("rank 0: 0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0B1\nrank 1: 1RF0 1F0 1B0 1SB0 1RF1 1F1 1B1 1SB1")
    assert with_comms(s) is s  # already lowered
    assert with_comms(generate("1f1b", 1, 3)) == generate("1f1b", 1, 3)  # one rank: nothing to send
    # interleaved on one rank: every neighbour is local
    assert with_comms(generate("interleaved", 1, 2, 2)) == generate("interleaved", 1, 2, 2)


@pytest.mark.parametrize("case", ALL, ids=_ids)
def test_with_comms_validates(case: tuple[str, int, int, int]) -> None:
    s = _schedule(case)
    validate(s)
    lowered = with_comms(s)
    validate(lowered)
    name, p, m, v = case
    count = {op: sum(a.op == op for acts in lowered.actions for a in acts) for op in ("SF", "RF", "SB", "RB")}
    links = p * v - 1 if p > 1 else 0  # adjacent stages on different ranks
    assert count == {"SF": links * m, "RF": links * m, "SB": links * m, "RB": links * m}
    compute = [a for acts in lowered.actions for a in acts if a.op in ("F", "B")]
    assert compute == [a for acts in s.actions for a in acts]


def test_with_comms_split_backward() -> None:
    s = with_comms(parse_schedule("rank 0: 0F0 0I0 0W0\nrank 1: 1F0 1I0 1W0"))
    assert s.text() == "rank 0: 0F0 0SF0 0RB0 0I0 0W0\nrank 1: 1RF0 1F0 1I0 1SB0 1W0"
    validate(s)


# ---------------------------------------------------------------------------- bad schedules


def test_backward_before_forward() -> None:
    _raises("rank 0: 0B0 0F0", 0, "0B0", "deadlock.*0F0")


def test_cyclic_wait_between_two_ranks() -> None:
    # rank 0 waits at 0B0 for 1B0, which comes after 1F1 on rank 1, which waits for 0F1 after 0B0
    _raises("rank 0: 0F0 0B0 0F1 0B1\nrank 1: 1F1 1B1 1F0 1B0", 0, "0B0", "deadlock.*rank 1 waits at 1F1 for 0F1")


def test_message_order_deadlock() -> None:
    # both ranks receive before they send: each blocks on the other
    _raises(
        "rank 0: 0RB0 0F0 0SF0 0B0\nrank 1: 1RF0 1F0 1B0 1SB0",
        0,
        "0RB0",
        "message-order deadlock.*rank 1 blocks at 1RF0 waiting for 0SF0 from rank 0",
    )


def test_recv_without_send() -> None:
    _raises("rank 0: 0F0 0SF0 0RB0 0B0\nrank 1: 1RF0 1F0 1B0", 0, "0RB0", "no matching 1SB0 on rank 1")
    _raises("rank 0: 0F0 0SF0 0RB0 0B0 0SB0\nrank 1: 1RF0 1F0 1B0 1SB0", 0, "0SB0", "no previous stage")


def test_comm_order() -> None:
    _raises("rank 0: 0F0 0SF0 0B0 0RB0\nrank 1: 1RF0 1F0 1B0 1SB0", 0, "0B0", "needs 0RB0 earlier")
    _raises("rank 0: 0SF0 0F0 0RB0 0B0\nrank 1: 1RF0 1F0 1B0 1SB0", 0, "0SF0", "sends before 0F0")
    _raises("rank 0: 0F0 0SF0 0RB0 0B0\nrank 1: 1F0 1RF0 1B0 1SB0", 1, "1F0", "needs 1RF0 earlier")


@pytest.mark.parametrize(
    "text, rank, action, cause",
    [
        ("rank 0: 0F0 0B0\nrank 1: 1F0 1B0 1B0", 1, "1B0", "duplicated"),
        ("rank 0: 0F0 0B0\nrank 1: 0F1 1B0", 1, "0F1", "lives on rank 0"),
        ("rank 0: 0F0 0B0\nrank 1: 1F0", 1, "1B0", "missing"),
        ("rank 0: 0F0 0B0 0F1\nrank 1: 1F0 1B0 1F1 1B1", 0, "0B1", "no backward"),
        ("rank 0: 0F0 0B0\nrank 1: 1F0 1B0 3F0", 1, "3F0", "out of range"),
        ("rank 0: 0F0 0I0 0B0", 0, "0I0", "already has 0B0"),
        ("rank 0: 0F0 0I0", 0, "0I0", "0W0 is missing"),
        ("rank 0: 0F0 0W0 0B0", 0, "0W0", "0I0 is missing"),
    ],
)
def test_structural_errors(text: str, rank: int, action: str, cause: str) -> None:
    _raises(text, rank, action, cause)


def test_schedule_construction_errors() -> None:
    with pytest.raises(ScheduleError, match="2 ranks need 2 action lists"):
        Schedule("custom", 2, 1, 1, ((Action(0, "F", 0),),))
    with pytest.raises(ScheduleError, match="microbatches must be an int >= 1"):
        Schedule("custom", 1, 0, 1, ((),))
    with pytest.raises(ScheduleError, match="unknown op"):
        Action(0, "X", 0)


# ---------------------------------------------------------------------------- printer


def test_grid() -> None:
    assert grid(generate("1f1b", 2, 3)) == ("rank 0: F0 F1 .  B0 F2 B1 .  B2\nrank 1: .  F0 B0 F1 B1 F2 B2 .")
    # tb = 2 tf: a backward fills two slots
    assert grid(generate("gpipe", 2, 1), tf=1.0, tb=2.0) == "rank 0: F0 .  .  .  B0 B0\nrank 1: .  F0 B0 B0 .  ."
    rows = grid(generate("interleaved", 2, 2, 2)).splitlines()
    assert rows[0].split()[:4] == ["rank", "0:", "F0.0", "F1.0"] and "B0.1" in rows[0]
    assert len(rows) == 2
