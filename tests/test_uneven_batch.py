"""A global batch that does not divide over the workers : ``batch // workers`` per
worker, the effective batch printed; the run, its summary and the planner use the same rule."""

from __future__ import annotations

import pytest
from _helpers import dtrain_cli, read_metrics, read_summary
from test_planner import spec, tiny

from dtrain.config.schema import RunConfig
from dtrain.errors import ConfigError
from dtrain.job.validate import validate
from dtrain.perfmodel import plan
from dtrain.workloads.batch import batch_note, split_batch

LINE = "global batch 63 (21 per worker x 3; --batch-size 64 does not divide over 3 workers)"


@pytest.mark.parametrize(
    "batch, shards, per, effective",
    [
        (64, 3, 21, 63),
        (64, 4, 16, 64),
        (64, 1, 64, 64),
        (10, 4, 2, 8),
        (3, 3, 1, 3),
        (7, 5, 1, 5),
    ],
)
def test_split_rounds_down_to_a_multiple_of_the_shards(batch, shards, per, effective):
    assert split_batch(batch, shards) == (per, effective)
    assert (batch_note(batch, shards) == "") == (effective == batch)


def test_the_note_names_the_effective_batch():
    assert batch_note(64, 3) == LINE


def test_config_accepts_a_batch_that_does_not_divide():
    cfg = validate(RunConfig.make(workers=3))
    assert cfg.batch_size == 64 and cfg.global_batch == 63
    assert validate(RunConfig.make(workers=4, batch_size=66)).global_batch == 64
    assert validate(RunConfig.make(strategy="ps", workers=3)).global_batch == 63  # the servers take no batch
    with pytest.raises(ConfigError, match="at least workers"):
        validate(RunConfig.make(workers=3, batch_size=2))


def test_planner_ranks_ps_with_three_workers():
    model, sample = tiny()  # a global batch of 64
    p = plan(model, sample, spec("1gbit", 1e-4), measure=False, exact_only=True)
    ps = p.find("ps bsp 1 server")
    assert ps is not None and ps.strategy.workers == 3, [r for _, r in p.rejected]
    assert 21 in p.profiles  # profiled at the per-worker batch a run would use
    assert not any(s.workers == 3 for s, _ in p.rejected)


@pytest.mark.procs
def test_run_with_three_workers_trains_63_a_step(tmp_path):
    out = tmp_path / "w3"
    p = dtrain_cli(
        "run", "--workers", "3", "--epochs", "1", "--max-steps", "4", "--out", str(out), "--no-progress", timeout=300
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stderr.count(LINE) == 1
    s = read_summary(out)
    assert s["workers"] == 3 and s["steps"] == 4 and s["global_batch"] == 63
    # samples/s counts the samples trained on: 63 a step (train_s is rounded to the millisecond)
    assert s["samples_per_s"] * s["train_s"] == pytest.approx(63 * 4, rel=0.02)
    rows = read_metrics(out)
    assert {r["rank"] for r in rows} == {0, 1, 2} and len(rows) == 12
