"""Consistency policies without processes: scripted events, fake arrival orders, fake clocks."""

import random

import pytest

from dtrain.config.schema import RunConfig
from dtrain.errors import ConfigError
from dtrain.job.validate import validate
from dtrain.param_server.consistency import (
    ASP,
    BSP,
    POLICIES,
    SSP,
    Apply,
    Backup,
    Drop,
    PolicyViolation,
    Release,
    SoftSync,
    StalenessAwareLR,
    parse_consistency,
    run_script,
    simulate,
)

# ---------------------------------------------------------------------- specs


@pytest.mark.parametrize(
    "text,kind,arg",
    [
        ("bsp", "bsp", 0),
        ("asp", "asp", 0),
        ("ssp:3", "ssp", 3),
        ("SSP:0", "ssp", 0),
        ("softsync:2", "softsync", 2),
        ("backup:1", "backup", 1),
        (" ssp : 4 ", "ssp", 4),
    ],
)
def test_parse(text, kind, arg):
    spec = parse_consistency(text)
    assert (spec.kind, spec.arg) == (kind, arg)
    assert parse_consistency(str(spec)) == spec


@pytest.mark.parametrize(
    "text,words",
    [
        ("ssp", "needs an integer"),
        ("bsp:2", "takes no argument"),
        ("ssp:-1", ">= 0"),
        ("softsync:0", "k >= 1"),
        ("backup:-1", "b >= 0"),
        ("hogwild", "unknown consistency"),
        ("ssp:x", "cannot read"),
    ],
)
def test_parse_errors_say_what_to_write(text, words):
    with pytest.raises(ConfigError, match=words):
        parse_consistency(text)


def test_staleness_lr_needs_an_async_policy():
    with pytest.raises(ConfigError, match="asynchronous"):
        parse_consistency("bsp", staleness_lr=True)
    spec = parse_consistency("asp", staleness_lr=True)
    assert isinstance(spec.build(), StalenessAwareLR) and str(spec) == "asp+staleness_lr"


def test_every_registered_policy_is_reachable_from_the_cli():
    from dtrain.cli import build_parser, config_from_args

    for name, (_, takes_arg) in POLICIES.items():
        spec = f"{name}:1" if takes_arg else name
        ns = build_parser().parse_args(["run", "--strategy", "ps", "--servers", "2", "--consistency", spec])
        cfg = validate(config_from_args(ns))
        assert parse_consistency(cfg.options.consistency).kind == name
    with pytest.raises(ConfigError, match="unknown consistency"):
        validate(RunConfig.make(strategy="ps", consistency="nope"))


def test_backup_needs_more_workers_than_backups():
    with pytest.raises(ConfigError, match="needs more than 2 workers"):
        Backup(2).start([0, 1])
    with pytest.raises(ConfigError, match="needs more than 4 workers"):
        parse_consistency("backup:4").check_workers(4)
    assert parse_consistency("backup:3").check_workers(4).arg == 3


# ---------------------------------------------------------------------- scripted schedules


def _script(spec, text):
    return run_script(parse_consistency(spec).build(), text)


def test_bsp_schedule():
    assert _script(
        "bsp",
        "w0 pull; w1 pull; w2 pull; w0 push; w1 push; w2 push; w1 push; w0 push; w2 finish; "
        "w0 push; w1 push; w0 finish; w1 finish",
    ) == [
        "w0 pull -> release w0@0",
        "w1 pull -> release w1@0",
        "w2 pull -> release w2@0",
        "w0 push -> -",
        "w1 push -> -",
        "w2 push -> apply[w0c1,w1c1,w2c1]@0, release w0@1, release w1@1, release w2@1",
        "w1 push -> -",
        "w0 push -> -",
        # a finished worker no longer holds the step up
        "w2 finish -> apply[w1c2,w0c2]@1, release w1@2, release w0@2",
        "w0 push -> -",
        "w1 push -> apply[w0c3,w1c3]@2, release w0@3, release w1@3",
        "w0 finish -> -",
        "w1 finish -> -",
    ]


def test_asp_schedule():
    assert _script("asp", "w0 pull; w1 pull; w0 push; w0 push; w1 push; w0 finish; w1 push; w1 finish") == [
        "w0 pull -> release w0@0",
        "w1 pull -> release w1@0",
        "w0 push -> apply[w0c1]@0, release w0@1 lag1",
        "w0 push -> apply[w0c2]@1, release w0@2 lag2",
        "w1 push -> apply[w1c1]@2, release w1@3",
        "w0 finish -> -",
        "w1 push -> apply[w1c2]@3, release w1@4",
        "w1 finish -> -",
    ]


def test_ssp_schedule_and_lost_worker():
    assert _script(
        "ssp:1", "w0 pull; w1 pull; w0 push; w0 push; w1 push; w0 push; w1 push; w1 lost; w0 push; w0 finish"
    ) == [
        "w0 pull -> release w0@0",
        "w0 pull -> release w0@0".replace("w0", "w1"),
        "w0 push -> apply[w0c1]@0, release w0@1 lag1",
        "w0 push -> apply[w0c2]@1",  # two clocks ahead of w1: blocked
        "w1 push -> apply[w1c1]@2, release w0@3 lag1, release w1@3",
        "w0 push -> apply[w0c3]@3",
        "w1 push -> apply[w1c2]@4, release w0@5 lag1, release w1@5",
        "w1 lost -> -",
        "w0 push -> apply[w0c4]@5, release w0@6",  # the clock table no longer has w1
        "w0 finish -> -",
    ]


def test_softsync_schedule_flushes_at_the_end():
    assert _script(
        "softsync:2", "w0 pull; w1 pull; w0 push; w0 push; w1 push; w0 push; w1 push; w0 finish; w1 push; w1 finish"
    ) == [
        "w0 pull -> release w0@0",
        "w1 pull -> release w1@0",
        "w0 push -> release w0@0 lag1",
        "w0 push -> apply[w0c1,w0c2]@0, release w0@1 lag2",
        "w1 push -> release w1@1",
        "w0 push -> apply[w1c1,w0c3]@1, release w0@2 lag2",
        "w1 push -> release w1@2",
        "w0 finish -> -",
        "w1 push -> apply[w1c2,w1c3]@2, release w1@3",
        "w1 finish -> -",
    ]
    # an odd gradient left when the last worker leaves is applied, not lost
    assert _script("softsync:2", "w0 pull; w0 push; w0 finish")[-1] == "w0 finish -> apply[w0c1]@0"


def test_backup_schedule():
    assert _script(
        "backup:1",
        "w0 pull; w1 pull; w2 pull; w0 push; w1 push; w2 push; w0 push; w2 push; "
        "w1 push; w0 finish; w1 finish; w2 finish",
    ) == [
        "w0 pull -> release w0@0",
        "w1 pull -> release w1@0",
        "w2 pull -> release w2@0",
        "w0 push -> -",
        "w1 push -> apply[w0c1,w1c1]@0, release w0@1 lag1, release w1@1 lag1",
        "w2 push -> drop w2c1@1, release w2@1",
        "w0 push -> -",
        "w2 push -> apply[w0c2,w2c2]@1, release w0@2 lag1, release w2@2 lag1",
        "w1 push -> drop w1c2@2, release w1@2",
        "w0 finish -> -",
        "w1 finish -> -",
        "w2 finish -> -",
    ]


def test_staleness_lr_schedule():
    assert _script("asp", "w0 pull")  # plain spec still builds
    p = parse_consistency("asp", staleness_lr=True).build()
    assert run_script(p, "w0 pull; w1 pull; w2 pull; w0 push; w1 push; w2 push; w0 push")[3:] == [
        "w0 push -> apply[w0c1]@0, release w0@1 lag1",
        "w1 push -> apply[w1c1]@1, release w1@2 lag1",
        "w2 push -> apply[w2c1]@2x0.5, release w2@3",  # staleness 2: half the rate
        "w0 push -> apply[w0c2]@3x0.5, release w0@4 lag1",
    ]


# ---------------------------------------------------------------------- protocol checks


@pytest.mark.parametrize("spec", ["bsp", "asp", "ssp:2", "softsync:2", "backup:1"])
def test_out_of_protocol_events_are_rejected_without_changing_state(spec):
    p = parse_consistency(spec).build().start([0, 1, 2])
    with pytest.raises(PolicyViolation, match="before its first pull"):
        p.push(0, 1, 0)
    p.pull(0)
    with pytest.raises(PolicyViolation, match="first pull twice"):
        p.pull(0)
    with pytest.raises(PolicyViolation, match="unknown worker 7"):
        p.push(7, 1, 0)
    with pytest.raises(PolicyViolation, match="sent clock 3, expected 1"):
        p.push(0, 3, 0)
    with pytest.raises(PolicyViolation, match="read version 5"):
        p.push(0, 1, 5)
    assert p.clock == {0: 0, 1: 0, 2: 0} and p.version == 0 and not p.buffer
    p.push(0, 1, 0)
    if 0 in p.waiting:
        with pytest.raises(PolicyViolation, match="pushed again before it was released"):
            p.push(0, 2, 0)
        with pytest.raises(PolicyViolation, match="finished while waiting"):
            p.leave(0)
    p.pull(1)
    p.leave(1, lost=True)
    with pytest.raises(PolicyViolation, match="already left"):
        p.push(1, 1, 0)
    with pytest.raises(PolicyViolation, match="left twice"):
        p.leave(1)


def test_bsp_does_not_tolerate_a_lost_worker_but_the_others_do():
    assert not BSP.tolerates_loss
    assert all(cls.tolerates_loss for cls in (ASP, SSP, SoftSync, Backup))


# ---------------------------------------------------------------------- SSP: blocks exactly at s + 1


@pytest.mark.parametrize("s", [0, 1, 2, 5])
def test_ssp_blocks_exactly_when_s_plus_one_ahead(s):
    p = SSP(s).start([0, 1, 2])
    for w in (0, 1, 2):
        p.pull(w)
    # worker 0 runs alone: released after clocks 1..s, blocked at clock s + 1
    for c in range(1, s + 1):
        acts = p.push(0, c, p.last_read[0])
        assert [a for a in acts if isinstance(a, Release)] == [Release(0, c, c)]
    acts = p.push(0, s + 1, p.last_read[0])
    assert not any(isinstance(a, Release) for a in acts) and 0 in p.waiting
    assert not p.may_proceed(0)
    # one slow worker catching up is not enough; the slowest one is
    acts = p.push(1, 1, p.last_read[1])
    assert [a.worker for a in acts if isinstance(a, Release)] == ([1] if s >= 1 else [])
    acts = p.push(2, 1, p.last_read[2])
    assert sorted(a.worker for a in acts if isinstance(a, Release)) == ([0, 2] if s >= 1 else [0, 1, 2])
    assert next(a for a in acts if isinstance(a, Release) and a.worker == 0).clock_lag == s


@pytest.mark.parametrize("s", [0, 1, 3])
@pytest.mark.parametrize("seed", range(5))
def test_ssp_random_arrivals_invariant(s, seed):
    """After every event: released readers are at most s ahead; a waiting worker is blocked
    only if it is more than s ahead (so it is released the moment it is not)."""
    rng = random.Random(seed)
    p = SSP(s).start(range(4))
    for w in range(4):
        p.pull(w)
    for _ in range(300):
        ready = [w for w in p.active if w not in p.waiting]
        if not ready:
            raise AssertionError(f"deadlock: all waiting, clocks {p.clock}")
        w = rng.choice(ready)
        for a in p.push(w, p.clock[w] + 1, p.last_read[w]):
            if isinstance(a, Release):
                assert a.clock_lag <= s
        m = p.min_clock()
        for v in p.waiting:
            assert p.clock[v] - m == s + 1  # blocked exactly one clock past the bound
        for v in p.active - p.waiting:
            assert p.clock[v] - m <= s


# ---------------------------------------------------------------------- backup workers


@pytest.mark.parametrize("workers,b", [(3, 1), (4, 1), (5, 2), (6, 3)])
@pytest.mark.parametrize("seed", range(4))
def test_backup_drops_exactly_b_per_step_and_never_a_gradient_twice(workers, b, seed):
    """Fake arrival orders: each step every worker pushes once, in a random order."""
    rng = random.Random(seed)
    p = Backup(b).start(range(workers))
    for w in range(workers):
        p.pull(w)
    seen: list[tuple[int, int]] = []
    for step in range(12):
        order = rng.sample(range(workers), workers)
        applied, dropped = [], []
        for w in order:
            for a in p.push(w, p.clock[w] + 1, p.last_read[w]):
                if isinstance(a, Apply):
                    assert a.version == step and all(x.read == step for x in a.arrivals)
                    applied += [(x.worker, x.clock) for x in a.arrivals]
                elif isinstance(a, Drop):
                    assert a.arrival.read == step and a.version == step + 1
                    dropped.append((a.arrival.worker, a.arrival.clock))
        assert len(applied) == workers - b and len(dropped) == b
        # the first N arrivals are applied, the b late ones dropped
        assert [w for w, _ in applied] == order[: workers - b]
        assert [w for w, _ in dropped] == order[workers - b :]
        seen += applied + dropped
        assert p.version == step + 1 and not p.waiting
    assert len(seen) == len(set(seen)) == 12 * workers


@pytest.mark.parametrize("seed", range(4))
def test_backup_with_random_compute_times_applies_each_gradient_at_most_once(seed):
    rng = random.Random(seed)
    slow = {w: rng.choice([1.0, 1.0, 1.5, 4.0]) for w in range(5)}
    r = simulate(Backup(2), lambda w, c: slow[w] * rng.uniform(0.8, 1.2), range(5), 20)
    applied = [(a.worker, a.clock) for x in r.applies for a in x.arrivals]
    dropped = [(d.arrival.worker, d.arrival.clock) for d in r.drops]
    assert len(applied) + len(dropped) == len(set(applied) | set(dropped)) == 5 * 20
    for x in r.applies:
        assert all(s == 0 for s in x.staleness)  # only gradients of the current step are applied
        assert len(x.arrivals) <= 3


# ---------------------------------------------------------------------- soft-sync, asp


@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("seed", range(3))
def test_softsync_applies_after_every_k_arrivals(k, seed):
    rng = random.Random(seed)
    p = SoftSync(k).start(range(4))
    for w in range(4):
        p.pull(w)
    arrivals = []
    for n in range(1, 41):
        w = rng.randrange(4)
        assert p.may_proceed(w)  # soft-sync never makes a worker wait
        acts = p.push(w, p.clock[w] + 1, p.last_read[w])
        arrivals.append((w, p.clock[w]))
        applies = [a for a in acts if isinstance(a, Apply)]
        if n % k == 0:
            assert len(applies) == 1
            assert [(a.worker, a.clock) for a in applies[0].arrivals] == arrivals[n - k :]
        else:
            assert not applies
        assert acts[-1] == Release(w, p.version, acts[-1].clock_lag)


def test_asp_nobody_waits_and_staleness_counts_updates_in_between():
    r = simulate(ASP(), lambda w, c: 1.0 + 0.37 * w, range(4), 10)
    assert all(v == 0.0 for v in r.wait.values())
    assert len(r.applies) == 40
    assert r.time == pytest.approx(10 * (1.0 + 0.37 * 3))
    reads = {}
    version = 0
    for _, a in r.actions:
        if isinstance(a, Apply):
            (x,) = a.arrivals
            assert a.version == version and a.staleness == (version - reads[x.worker],)
            version += 1
        elif isinstance(a, Release):
            reads[a.worker] = a.version


def test_bsp_waits_for_the_straggler_and_asp_backup_do_not():
    """Fake clock: one worker 4x slower. BSP's time is set by it; ASP and backup:1 are not held up."""
    slow = lambda w, c: 4.0 if w == 3 else 1.0  # noqa: E731
    bsp = simulate(BSP(), slow, range(4), 10)
    assert bsp.time == 40.0 and bsp.wait[0] == 30.0 and len(bsp.applies) == 10
    asp = simulate(ASP(), slow, range(4), 10)
    assert asp.wait[0] == 0.0 and asp.gradients[0] == 10
    backup = simulate(Backup(1), slow, range(4), 10)
    # the three fast workers finish their 10 steps at time 10, never waiting for worker 3
    assert max(backup.wait[w] for w in range(3)) == 0.0
    fast_done = max(t for t, a in backup.actions if isinstance(a, Release) and a.worker < 3)
    assert fast_done == 10.0


def test_ssp_bounds_waiting_between_bsp_and_asp():
    slow = lambda w, c: 2.0 if w == 0 else 1.0  # noqa: E731
    waits = {s: simulate(SSP(s), slow, range(3), 12).wait[1] for s in (0, 2, 100)}
    assert waits[0] > waits[2] > waits[100] == 0.0
    assert simulate(SSP(0), slow, range(3), 12).time == simulate(BSP(), slow, range(3), 12).time


@pytest.mark.parametrize("s", [0, 1, 3])
@pytest.mark.parametrize("workers", [2, 4])
def test_ssp_staleness_in_updates_stays_within_2s_plus_1_times_the_others(s, workers):
    """SSP bounds the clock lag by s; in updates, a gradient can miss at most (2s + 1) pushes of
    each other worker (they may be s behind at the read and s + 1 ahead at the apply)."""
    for seed in range(10):
        rng = random.Random(seed)
        speed = {w: rng.choice([1, 2, 5, 10]) for w in range(workers)}
        r = simulate(SSP(s), lambda w, c: speed[w] * rng.uniform(0.5, 1.5), range(workers), 25)
        assert max(max(a.staleness) for a in r.applies) <= (2 * s + 1) * (workers - 1)
        assert max(x.clock_lag for x in r.releases) <= s
