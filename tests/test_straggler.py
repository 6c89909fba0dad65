"""The emulated straggler (dtrain.training.slowdown.Straggler) on a fake clock, and how a run's processes get theirs."""

from pathlib import Path

import pytest
from _helpers import FakeClock

from dtrain.config.schema import RunConfig
from dtrain.errors import ConfigError
from dtrain.job.run import TrainContext
from dtrain.training.slowdown import Straggler


def test_each_step_lasts_factor_times_the_median_of_the_window():
    clock = FakeClock()
    s = Straggler(4.0, window=50, sleep=clock.sleep)
    assert s.stretch(0.030) == pytest.approx(0.090)  # the first step is its own reference: (4 - 1) x 0.030
    for c in (0.010, 0.012, 0.011, 0.009):  # after a slow first step (lazy initialisation), normal ones
        s.stretch(c)
    assert s.reference_s == pytest.approx(0.011)  # the median, not the mean (0.0144) the first step inflates
    # own work + sleep = 4 x the reference whatever the step's own work, which varies with contention
    for c, ref in ((0.011, 0.011), (0.005, 0.011), (0.020, 0.011), (0.012, 0.011)):  # one outlier moves no median
        t0 = clock.now
        clock.now += c  # the step works
        slept = s.stretch(c)
        assert s.reference_s == pytest.approx(ref)
        assert slept == pytest.approx(4 * ref - c)
        assert clock.now - t0 == pytest.approx(4 * ref)
    assert s.stretch(0.080) == 0.0  # a step slower than 4x the reference is not slowed further
    assert len(clock.sleeps) == 5 + 4


def test_the_reference_follows_the_last_steps_only():
    s = Straggler(2.0, window=3, sleep=lambda _: None)
    for c in (0.010, 0.010, 0.010, 0.030, 0.030):
        s.stretch(c)
    assert s.reference_s == pytest.approx(0.030)  # the window holds 0.010, 0.030, 0.030


def test_the_old_rule_would_follow_contention_and_this_one_does_not():
    """A straggler whose own work halves for a step (it had the CPU to itself) is still slowed by the factor."""
    clock = FakeClock()
    s = Straggler(4.0, sleep=clock.sleep)
    for _ in range(3):
        s.stretch(0.020)  # contended
    assert s.stretch(0.010) == pytest.approx(0.070)  # (4 - 1) x 0.010 would be 0.030: a 2x straggler


def test_no_slowdown_never_sleeps():
    clock = FakeClock()
    s = Straggler(1.0, sleep=clock.sleep)
    assert not s.active
    assert [s.stretch(c) for c in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6)] == [0.0] * 6
    assert clock.sleeps == [] and s.reference_s is None


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"factor": 0.5}, "factor must be >= 1"),
        ({"factor": 4.0, "window": 0}, "window must be >= 1"),
    ],
)
def test_bad_settings_are_refused(kw, words):
    with pytest.raises(ConfigError, match=words):
        Straggler(**kw)


def _ctx(rank, straggler):
    cfg = RunConfig(workers=3, straggler=straggler, progress=False)
    return TrainContext(cfg=cfg, rank=rank, world_size=3, out_dir=Path("."), data=None, metrics=None, tracer=None)


def test_a_run_slows_the_straggler_rank_and_an_emulated_slow_host(monkeypatch):
    monkeypatch.delenv("DTRAIN_SLOWDOWN", raising=False)
    assert _ctx(2, "2:4").straggler().factor == 4.0
    assert _ctx(1, "2:4").straggler().factor == 1.0
    assert _ctx(1, "").straggler().factor == 1.0
    monkeypatch.setenv("DTRAIN_SLOWDOWN", "3")  # dtrain cluster up --slow HOST:3 gives its workers this
    assert _ctx(1, "").straggler().factor == 3.0
    assert _ctx(2, "2:4").straggler().factor == 12.0
    monkeypatch.setenv("DTRAIN_SLOWDOWN", "0.5")
    with pytest.raises(ConfigError, match="DTRAIN_SLOWDOWN must be >= 1"):
        _ctx(1, "").straggler()


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_every_worker_slowed_keeps_a_steady_step(tmp_path):
    """Three dp workers all 10x slower (as every host of ``dtrain cluster up --slow``): each waits for the others'
    sleep in its backward's allreduce. Counted as its own work, that wait made its next sleeps 10x longer and the
    steps grew without bound (0.38 s to 3 s in 40 steps); the waits are not own work, so the step settles."""
    import os
    import statistics

    from _helpers import dtrain_cli, read_metrics

    out = tmp_path / "run"
    p = dtrain_cli(
        "run",
        "--workers",
        "3",
        "--max-steps",
        "40",
        "--no-progress",
        "--no-trace",
        "--out",
        str(out),
        env={**os.environ, "DTRAIN_SLOWDOWN": "10"},
        timeout=110,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    steps = [r["step_s"] for r in read_metrics(out) if r["rank"] == 0]
    early, late = statistics.median(steps[3:13]), statistics.median(steps[-10:])
    assert late < 2 * early, f"steps grew from {early * 1e3:.1f} ms to {late * 1e3:.1f} ms"
