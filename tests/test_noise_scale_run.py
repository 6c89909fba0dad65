"""``dtrain run --noise-scale`` and ``--batch-schedule auto`` (dp): the logged estimates against the same
quantities computed in this process from the same shards, and the auto schedule's decisions against the
rule applied to the logged noise scale. The estimator itself is checked in tests/test_noise_scale.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _helpers import dtrain_cli, read_metrics, read_summary
from torch.utils.data import DataLoader, DistributedSampler

from dtrain.training.noise_scale import estimate, next_batch
from dtrain.workloads.data import load_dataset
from dtrain.workloads.models import build_model, task_loss

pytestmark = pytest.mark.procs  # every test here starts processes

COMMON = ["--no-progress", "--no-trace", "--workers", "2", "--noise-scale"]


def _shard_gradients(batch: int, world: int) -> list[torch.Tensor]:
    """Each worker's flattened gradient of the first step, as ``dtrain run`` (seed 0) computes it."""
    ds = load_dataset("digits", seed=0)
    out = []
    for rank in range(world):
        torch.manual_seed(0)
        model = build_model("cnn", tuple(ds.input_shape), ds.num_classes)
        sampler: DistributedSampler = DistributedSampler(
            ds.train, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True
        )
        sampler.set_epoch(0)
        x, y = next(iter(DataLoader(ds.train, batch_size=batch // world, sampler=sampler, drop_last=True)))
        task_loss(model(x), y).backward()
        out.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double())
    return out


@pytest.fixture(scope="module")
def beta_runs(tmp_path_factory) -> dict[str | None, Path]:
    """Two steps at batch 32 with ``--noise-beta`` 0, 0.5 and the default 0.99 (None): one run each, read by
    the first-step test (the default's step 0) and the noise-beta test (all three)."""
    root = tmp_path_factory.mktemp("beta")
    outs = {}
    for beta in ("0", "0.5", None):
        out = root / f"beta{beta}"
        p = dtrain_cli(
            "run",
            *COMMON,
            "--batch-size",
            "32",
            "--max-steps",
            "2",
            "--out",
            str(out),
            *(["--noise-beta", beta] if beta else []),
        )
        assert p.returncode == 0, p.stderr[-3000:]
        outs[beta] = out
    return outs


def test_the_first_step_logs_the_estimators_of_its_own_shards(beta_runs):
    rows = [r for r in read_metrics(beta_runs[None]) if r["step"] == 0]
    assert len(rows) == 2
    g = _shard_gradients(32, 2)
    small = float(sum(x.pow(2).sum() for x in g)) / 2
    big = float(((g[0] + g[1]) / 2).pow(2).sum())
    g2, s = estimate(small, big, 16, 32)
    for r in rows:  # one step of a bias-corrected average is the step's own estimate, on every rank alike
        assert r["batch"] == 32
        assert r["noise_g2"] == pytest.approx(g2, rel=1e-4)
        assert r["noise_trace"] == pytest.approx(s, rel=1e-4)
        assert r["b_simple"] == pytest.approx(s / g2, rel=1e-4)


def test_noise_beta_sets_the_memory_of_the_logged_averages(beta_runs):
    """Two steps logged with ``--noise-beta`` 0 (each step's own estimate), 0.5 and the default 0.99: the same
    data and model, so the same two estimates e0, e1; the second step logs ``(beta e0 + e1) / (beta + 1)``."""
    rows = {beta: {r["step"]: r for r in read_metrics(out) if r["rank"] == 0} for beta, out in beta_runs.items()}
    for key in ("noise_g2", "noise_trace"):
        e0, e1 = rows["0"][0][key], rows["0"][1][key]
        assert rows["0.5"][0][key] == pytest.approx(e0, rel=1e-9) and rows[None][0][key] == pytest.approx(e0, rel=1e-9)
        assert rows["0.5"][1][key] == pytest.approx((0.5 * e0 + e1) / 1.5, rel=1e-6)
        assert rows[None][1][key] == pytest.approx((0.99 * e0 + e1) / 1.99, rel=1e-6)
        assert abs(e1 / e0 - 1) > 1e-3  # the two steps differ, so the weights are seen


# per-epoch auto from batch 8 over 3 epochs: the CNN's noise scale (about 20 samples) doubles the batch after
# epoch 0 and keeps it after epoch 1 (20 < 2 x 16), so both outcomes of the rule are decided. A checkpoint every
# 100 steps: step 200 lies inside the grown epoch 1 (epoch 0 is 179 steps at 8), where the resume test restarts.
AUTO = [*COMMON, "--batch-size", "8", "--epochs", "3", "--batch-schedule", "auto", "--lr-scaling", "linear"]


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("auto") / "auto"
    p = dtrain_cli("run", *AUTO, "--checkpoint-every", "100", "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    return out


def test_auto_doubles_the_batch_where_the_noise_scale_exceeds_twice_it(auto_run):
    out = auto_run
    s = read_summary(out)
    decisions = s["batch_decisions"]
    assert [d["epoch"] for d in decisions] == [0, 1, 2]
    rows = sorted((r for r in read_metrics(out) if r["rank"] == 0), key=lambda r: r["step"])
    for d in decisions[1:]:
        last = [r for r in rows if r["epoch"] == d["epoch"] - 1][-1]  # the noise scale at the epoch's end
        assert d["b_simple"] == pytest.approx(last["b_simple"], rel=1e-9)
        assert d["batch"] == next_batch(last["batch"], last["b_simple"], maximum=1437 // 4 // 2 * 2, multiple=2)
        epoch_rows = [r for r in rows if r["epoch"] == d["epoch"]]
        assert {r["batch"] for r in epoch_rows} == {d["batch"]}
        assert len(epoch_rows) == (1437 // 2) // (d["batch"] // 2)  # the epoch's steps at its batch
        assert all(r["lr"] == pytest.approx(0.05 * d["batch"] / 8) for r in epoch_rows)  # linear scaling follows
    assert decisions[-1]["batch"] > 8, decisions  # the CNN's noise scale is far above 8 samples: it grew
    assert s["steps"] == len(rows)


def test_auto_every_n_steps_with_the_time_rule_grows_the_batch_inside_an_epoch_as_the_rule_says(tmp_path):
    """``--auto-every 5 --auto-rule time``: after every 5th step the rule, applied to that step's logged noise scale
    and the step cost all ranks agreed (``step_fixed_s``, ``sample_s``), gives the next step's batch; the batch
    changes inside the first epoch, the rate follows linear scaling, and the step count is the plan's."""
    out = tmp_path / "time"
    auto = ["--batch-schedule", "auto", "--auto-every", "5", "--auto-rule", "time", "--max-batch", "64"]
    p = dtrain_cli(
        "run", *COMMON, "--batch-size", "8", "--epochs", "2", *auto, "--lr-scaling", "linear", "--out", str(out)
    )
    assert p.returncode == 0, p.stderr[-3000:]
    s = read_summary(out)
    rows = sorted((r for r in read_metrics(out) if r["rank"] == 0), key=lambda r: r["step"])
    other = sorted((r for r in read_metrics(out) if r["rank"] == 1), key=lambda r: r["step"])
    assert [r["batch"] for r in rows] == [r["batch"] for r in other]  # both ranks drew the same sizes
    assert [r["step_fixed_s"] for r in rows if "step_fixed_s" in r] == [
        r["step_fixed_s"] for r in other if "step_fixed_s" in r
    ]
    decided = 0
    for r, nxt in zip(rows, rows[1:]):
        if (r["step"] + 1) % 5 or "step_fixed_s" not in r:
            assert nxt["batch"] == r["batch"], r["step"]  # no decision here
            continue
        ratio = r["step_fixed_s"] / (r["sample_s"] * (r["batch"] // 2))
        want = next_batch(r["batch"], r["b_simple"], maximum=64, multiple=2, ratio=ratio)
        assert nxt["batch"] == want, (r["step"], r["b_simple"], ratio)
        decided += 1
    assert decided >= 10
    # the decisions that took effect (one after the last step is the next epoch's size, which no step ran at)
    changes = [d for d in s["batch_decisions"] if 0 < d["step"] < s["steps"]]
    assert changes and [d["batch"] for d in changes] == sorted({r["batch"] for r in rows})[1:]
    first_epoch = [r["batch"] for r in rows if r["epoch"] == 0]
    assert len(set(first_epoch)) > 1, "the batch grew inside the first epoch"
    assert all(r["lr"] == pytest.approx(0.05 * r["batch"] / 8) for r in rows)  # linear scaling follows
    assert s["steps"] == len(rows)
    for epoch in (0, 1):  # each epoch is one pass over the shard, cut into the sizes in force, drop_last
        used = sum(r["batch"] // 2 for r in rows if r["epoch"] == epoch)
        last = [r for r in rows if r["epoch"] == epoch][-1]
        then = [d["batch"] for d in s["batch_decisions"] if d["step"] <= last["step"] + 1][-1]  # the next size
        assert used <= 1437 // 2 < used + then // 2, (epoch, used, then)
    shown = dtrain_cli("report", str(out))  # the report lists each change at its step
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert all(f"batch step {d['step']:<4} {d['batch']}" in shown.stdout for d in changes), shown.stdout


def _full_and_resumed(tmp_path, flags: list[str], *, stop: int, every: int):
    """Run ``flags`` through; then stopped after ``stop`` steps (checkpoints every ``every``) and resumed to the
    end. Returns the two run folders (whole, resumed), after checking the resumed run starts at ``stop``."""
    full, part, resumed = tmp_path / "full", tmp_path / "part", tmp_path / "resumed"
    assert dtrain_cli("run", *flags, "--out", str(full)).returncode == 0
    p = dtrain_cli("run", *flags, "--max-steps", str(stop), "--checkpoint-every", str(every), "--out", str(part))
    assert p.returncode == 0, p.stderr[-3000:]
    p = dtrain_cli("run", *flags, "--resume", str(part), "--out", str(resumed))
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = read_summary(full), read_summary(resumed)
    assert b["start_step"] == stop and a["steps"] == stop + b["steps"]
    return full, resumed


def test_an_auto_every_run_resumed_between_its_decisions_ends_as_the_uninterrupted_one(tmp_path):
    """The checkpoint holds the plan's changes: a run stopped inside an epoch whose batch grew at a step (not at
    the epoch's start) resumes on the same cuts of the data, makes the same decisions and ends on the same model."""
    # 70 of the 106 steps: the batch grows at steps 10 and 30, the stop at 45 falls between decisions, and the
    # resumed part decides again (50, 60) and crosses the end of epoch 0 (step 62) on the plan's changed cuts
    flags = [
        *COMMON,
        "--batch-size",
        "8",
        "--epochs",
        "2",
        "--batch-schedule",
        "auto",
        "--auto-every",
        "10",
        "--max-steps",
        "70",
    ]
    full, resumed = _full_and_resumed(tmp_path, flags, stop=45, every=15)
    a, b = read_summary(full), read_summary(resumed)
    grown = [d["step"] for d in a["batch_decisions"] if d["step"] > 0]
    assert grown and grown[0] < 45, a["batch_decisions"]  # the batch grew inside epoch 0, before the stop
    assert a["batch_decisions"] == b["batch_decisions"]
    rows_a = {r["step"]: r for r in read_metrics(full) if r["rank"] == 0}
    rows_b = {r["step"]: r for r in read_metrics(resumed) if r["rank"] == 0}
    assert all(
        rows_b[k]["batch"] == rows_a[k]["batch"] and rows_b[k]["loss"] == pytest.approx(rows_a[k]["loss"], rel=1e-6)
        for k in rows_b
    )
    assert b["metric"] == pytest.approx(a["metric"], abs=1e-12)
    assert b["final_loss"] == pytest.approx(a["final_loss"], rel=1e-6)


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--strategy", "ps", "--servers", "1", "--batch-schedule", "auto"], "batch_schedule auto"),
        (["--workers", "1", "--batch-schedule", "auto"], "batch_schedule auto"),
        (["--shard", "optimizer", "--noise-scale"], "noise_scale"),
        (["--overlap", "forward", "--noise-scale"], "--overlap forward"),
        (["--noise-scale", "--noise-beta", "1"], "noise_beta must be in [0, 1), got 1"),
        (["--noise-beta", "0.9"], "add --noise-scale or --batch-schedule auto"),
    ],
)
def test_bad_noise_scale_input_is_refused_before_any_process_starts(tmp_path, flags, needle):
    p = dtrain_cli("run", "--no-progress", "--workers", "2", *flags, "--out", str(tmp_path / "x"))
    assert p.returncode != 0
    assert needle in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "x" / "metrics.jsonl").exists()


def test_an_auto_run_resumed_mid_epoch_ends_as_the_uninterrupted_one(auto_run, tmp_path):
    """The checkpoint holds the batch plan, the decisions and the noise scale's averages: a run restarted from
    its step-200 checkpoint, inside the grown epoch, makes the same decisions and ends on the same model. (A run
    stopped by ``--max-steps`` and resumed is the auto-every test's.)"""
    resumed = tmp_path / "resumed"
    p = dtrain_cli("run", *AUTO, "--resume", str(auto_run / "checkpoints" / "step_000200"), "--out", str(resumed))
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = read_summary(auto_run), read_summary(resumed)
    assert b["start_step"] == 200 and a["steps"] == 200 + b["steps"]
    assert [d["batch"] for d in a["batch_decisions"]] == [d["batch"] for d in b["batch_decisions"]]
    assert a["batch_decisions"][1]["batch"] > 8  # step 200 is inside an epoch whose batch grew
    assert b["metric"] == pytest.approx(a["metric"], abs=1e-12)
    assert b["final_loss"] == pytest.approx(a["final_loss"], rel=1e-6)
