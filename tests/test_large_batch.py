"""Large-batch rules (:mod:`dtrain.optim.large_batch`): lr scaling, gradual warmup, batch schedules, and the
optimizers made for large batches, from the formulas up to ``dtrain run``.

Oracles: the formulas of :mod:`dtrain.optim.large_batch`'s docstring written out by hand here (not by calling the
functions under test): ``lr(t) = lr x k x warmup(t) x schedule(t)`` with ``k = B(t) / base_batch``, Goyal et
al.'s ``warmup(t) = (1 + (k - 1) t / W) / k`` for ``k > 1`` and ``(t + 1) / W`` for ``k = 1``; an epoch of ``n``
samples over ``s`` shards at global batch ``B`` has ``(n // s) // (B // s)`` steps. A run interrupted by
``--max-steps`` inside a scheduled epoch and resumed to the end equals the uninterrupted run (same losses and
rates at every step, same final parameters; dp without compression is deterministic, so to the bit).
"""

from __future__ import annotations

import math

import pytest
import torch
from _helpers import dtrain_cli, mean_losses, read_metrics, read_summary

from dtrain.checkpoint import read_checkpoint
from dtrain.config.schema import RunConfig
from dtrain.errors import ConfigError
from dtrain.job.validate import validate
from dtrain.optim.large_batch import BatchPlan, parse_batch_schedule, scaling_factor, warmup_factor
from dtrain.trace import MetricsWriter, Tracer
from dtrain.training.context import TrainContext

DIGITS_TRAIN = 1437  # scikit-learn's digits, the 80% dtrain trains on (checked below)


def _run(*args: str):
    return dtrain_cli("run", *args, "--no-progress", "--no-trace", "--timeout-s", "60", timeout=180)


def _ctx(tmp_path, **kw) -> TrainContext:
    cfg = validate(RunConfig.make(**kw))
    return TrainContext(
        cfg, 0, cfg.num_processes, tmp_path, cfg.load_data(), MetricsWriter(tmp_path, 0), Tracer(0, enabled=False)
    )


def _steps(batch: int, shards: int, samples: int = DIGITS_TRAIN) -> int:
    return (samples // shards) // (batch // shards)


# ---------------------------------------------------------------------- 1. scaling, warmup, their composition


def test_scaling_factor_linear_sqrt_none():
    assert scaling_factor("linear", 256, 64) == 4.0
    assert scaling_factor("sqrt", 256, 64) == 2.0
    assert scaling_factor("none", 256, 64) == 1.0
    assert scaling_factor("linear", 32, 64) == 0.5
    assert scaling_factor("sqrt", 128, 64) == pytest.approx(math.sqrt(2), rel=1e-15)
    assert scaling_factor("linear", 64, 64) == scaling_factor("sqrt", 64, 64) == 1.0
    with pytest.raises(ValueError, match="'cubic'"):
        scaling_factor("cubic", 128, 64)


@pytest.mark.parametrize("k, w", [(4.0, 10), (2.0, 5), (8.0, 3), (math.sqrt(2), 7)])
def test_goyal_warmup_starts_at_the_unscaled_rate_and_rises_linearly_to_the_scaled_one(k, w):
    f = [warmup_factor(t, w, k) for t in range(w + 3)]
    assert f[0] == pytest.approx(1 / k, rel=1e-12)  # the rate k x lr x f starts at the unscaled lr
    assert f[w:] == [1.0, 1.0, 1.0]  # the scaled rate from step W on
    rises = [(f[t + 1] - f[t]) * k for t in range(w)]  # of the rate, in units of lr: constant, (k - 1) / W
    assert rises == pytest.approx([(k - 1) / w] * w, rel=1e-9)
    assert all(0 < x < 1 for x in f[:w])


@pytest.mark.parametrize("k", [1.0, 0.5])
def test_warmup_without_scaling_ramps_from_near_zero(k):
    w = 4
    assert [warmup_factor(t, w, k) for t in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert [warmup_factor(t, 0, k) for t in range(3)] == [1.0, 1.0, 1.0]  # no warmup


def test_lr_multiplier_composes_scaling_warmup_and_cosine_over_a_batch_schedule(tmp_path):
    ctx = _ctx(
        tmp_path,
        workers=2,
        epochs=2,
        batch_schedule="0:32,1:64",
        lr_scaling="linear",
        base_batch=16,
        warmup_steps=10,
        lr_schedule="cosine",
        lr=0.05,
    )
    assert len(ctx.data.train) == DIGITS_TRAIN and ctx.cfg.batch_size == 32
    e0, e1 = _steps(32, 2), _steps(64, 2)
    assert (e0, e1) == (44, 22)
    total = e0 + e1
    assert ctx.total_steps(2) == total
    opt = torch.optim.SGD(ctx.make_model().parameters(), lr=0.05)
    for t in range(total):
        k = (32 if t < e0 else 64) / 16
        warm = (1 + (k - 1) * t / 10) / k if t < 10 else 1.0
        cos = 0.5 * (1 + math.cos(math.pi * t / total))
        assert ctx.lr_multiplier(t, total) == pytest.approx(k * warm * cos, rel=1e-12), t
        ctx.schedule_lr(opt, t, total)  # from the group's initial rate, not compounding
        assert opt.param_groups[0]["lr"] == pytest.approx(0.05 * k * warm * cos, rel=1e-12), t
    assert ctx.lr_multiplier(0, total) == pytest.approx(1.0)  # Goyal: the first step at the unscaled rate


def test_lr_multiplier_sqrt_scaling_with_warmup_epochs_and_no_scaling_ramp(tmp_path):
    ctx = _ctx(tmp_path, workers=2, epochs=2, batch_schedule="0:32,1:128", lr_scaling="sqrt", warmup_epochs=0.5)
    e0 = _steps(32, 2)
    assert ctx.learning_rate.warmup_steps == round(0.5 * e0) == 22
    total = ctx.total_steps(2)
    for t in range(total):
        k = math.sqrt((32 if t < e0 else 128) / 32)  # base: the run's first batch
        warm = (t + 1) / 22 if t < 22 else 1.0  # k = 1 during the warmup: the ramp from near zero
        assert ctx.lr_multiplier(t, total) == pytest.approx(k * warm, rel=1e-12), t
    assert ctx.lr_multiplier(e0, total) == pytest.approx(2.0)
    plain = _ctx(tmp_path, workers=2, epochs=1, batch_size=64)
    assert not plain.learning_rate.changes and plain.lr_multiplier(3, 10) == 1.0


# ---------------------------------------------------------------------- 2. bad input is refused, naming it


@pytest.mark.parametrize(
    "spec, names",
    [
        ("0:256,5:128", ["'0:256,5:128'", "not increasing", "128"]),
        ("0:64,3:128,2:256", ["'0:64,3:128,2:256'", "epochs must increase", "2 follows 3"]),
        ("0:64,3:64", ["'0:64,3:64'", "not increasing"]),
        ("1:64,3:128", ["'1:64,3:128'", "epoch 0"]),
        ("0-256", ["'0-256'", "EPOCH:BATCH"]),
        ("0:64,2:x", ["'2:x'", "EPOCH:BATCH"]),
        ("0:0", ["'0:0'", "batch >= 1"]),
    ],
)
def test_parse_batch_schedule_refuses_bad_schedules(spec, names):
    with pytest.raises(ConfigError) as e:
        parse_batch_schedule(spec)
    assert all(n in str(e.value) for n in names), str(e.value)
    with pytest.raises(ConfigError) as e:
        validate(RunConfig.make(batch_schedule=spec))
    assert names[0] in str(e.value), str(e.value)


def test_parse_batch_schedule_and_the_first_batch():
    assert parse_batch_schedule("0:64, 2:128,5:512") == [(0, 64), (2, 128), (5, 512)]
    assert RunConfig.make(batch_schedule="0:32,2:128", batch_size=999).batch_size == 32


@pytest.mark.parametrize(
    "kw, names",
    [
        (dict(workers=4, batch_schedule="0:64,2:66"), ["66", "4 workers", "epoch 2"]),
        (dict(workers=4, batch_schedule="0:64,1:2048"), ["2048", "larger than the training set", f"{DIGITS_TRAIN}"]),
        (dict(workers=4, batch_size=2048), ["2048", "larger than the training set"]),
        (dict(warmup_steps=5, warmup_epochs=1.0), ["warmup_steps (5)", "warmup_epochs (1)", "not both"]),
        (dict(optimizer="rmsprop"), ["'rmsprop'"]),
        (dict(precision="fp8"), ["'fp8'", "fp32, bf16, fp16"]),
        (dict(lr_scaling="cubic"), ["'cubic'", "none, linear, sqrt"]),
        (dict(strategy="ps", workers=2, batch_schedule="auto"), ["batch_schedule"]),
        (dict(workers=1, batch_schedule="auto"), ["batch_schedule auto", "2 or more workers"]),
        (dict(workers=2, shard="optimizer", batch_schedule="auto"), ["batch_schedule auto", "no --shard"]),
        (dict(strategy="ps", workers=2, noise_scale=True), ["noise_scale", "--strategy dp"]),
        (dict(strategy="local_sgd", workers=2, noise_scale=True), ["noise_scale", "--strategy dp"]),
        (dict(workers=1, noise_scale=True), ["noise_scale", "2 or more workers"]),
        (dict(warmup_steps=-1), ["warmup_steps", "-1"]),
        (dict(workers=2, auto_every=5), ["--auto-every 5", "--batch-schedule auto"]),
        (dict(workers=2, auto_rule="time"), ["--auto-rule time", "--batch-schedule auto"]),
        (dict(workers=2, batch_schedule="auto", auto_rule="fast"), ["auto_rule 'fast'", "noise, time"]),
        (dict(workers=2, batch_schedule="auto", auto_every=-1), ["auto_every", "-1"]),
    ],
    ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else None,
)
def test_validate_refuses_bad_large_batch_options(kw, names):
    with pytest.raises(ConfigError) as e:
        validate(RunConfig.make(**kw))
    assert all(n in str(e.value) for n in names), str(e.value)


def test_validate_accepts_what_it_should():
    validate(RunConfig.make(workers=4, batch_schedule="0:64,2:128,3:1024"))
    validate(RunConfig.make(workers=2, batch_schedule="auto"))
    validate(RunConfig.make(workers=2, noise_scale=True, warmup_epochs=0.5, lr_scaling="sqrt", base_batch=256))
    for opt in ("adamw", "lars", "lamb"):
        validate(RunConfig.make(optimizer=opt))


# ---------------------------------------------------------------------- 3. the batch plan


@pytest.mark.parametrize(
    "schedule, epochs, shards, batches",
    [
        ("0:32,1:64,2:128", 3, 2, [32, 64, 128]),
        ("0:32,2:128", 5, 2, [32, 32, 128, 128, 128]),
        ("0:48,1:96", 3, 3, [48, 96, 96]),
        ("0:64,1:1436", 2, 4, [64, 1436]),
        ("", 2, 4, [64, 64]),
    ],
)
def test_batch_plan_steps_total_and_locate_round_trip(schedule, epochs, shards, batches):
    plan = BatchPlan.of(64, schedule, DIGITS_TRAIN, epochs)
    assert plan.batches == batches
    want = [_steps(b, shards) for b in batches]
    assert [plan.steps_in(e, shards) for e in range(epochs)] == want
    assert plan.total(shards) == sum(want)
    assert plan.batch(epochs + 3) == batches[-1]
    seen = []
    for s in range(plan.total(shards)):
        e, i = plan.locate(s, shards)
        assert 0 <= i < want[e], (s, e, i)
        assert sum(want[:e]) + i == s
        seen.append((e, i))
    assert seen == [(e, i) for e in range(epochs) for i in range(want[e])]  # every batch once, in order
    assert plan.locate(plan.total(shards), shards) == (epochs, 0)  # after the last step: past the last epoch


def test_batch_plan_auto_changes_later_epochs_only():
    plan = BatchPlan.of(64, "auto", DIGITS_TRAIN, 4)
    assert plan.auto and plan.batches == [64] * 4
    plan.set_from(2, 256)
    assert plan.batches == [64, 64, 256, 256]
    assert plan.locate(2 * _steps(64, 2), 2) == (2, 0)


def _walk_by_hand(plan: BatchPlan, shards: int) -> list[tuple[int, int, int]]:
    """``(epoch, batch index, samples of a shard before it)`` of every step, drawing one batch at a time: a batch
    of the size in force at its step while it fits the shard's ``n // shards`` samples, else the next epoch."""
    n, out, step = DIGITS_TRAIN // shards, [], 0
    for e in range(plan.epochs):
        taken = i = 0
        while taken + plan.batch_at(step) // shards <= n:
            out.append((e, i, taken))
            taken, step, i = taken + plan.batch_at(step) // shards, step + 1, i + 1
    return out


@pytest.mark.parametrize(
    "changes, shards",
    [
        ([], 4),
        ([(10, 32), (20, 64)], 4),  # inside the first epoch
        ([(89, 32), (100, 128)], 4),  # at the first epoch's end (89 steps at 16), then inside the second
        ([(3, 32), (4, 64), (5, 128), (6, 256)], 2),  # every step
        ([(150, 48)], 3),
        ([(30, 56), (110, 112)], 7),  # 205 samples a shard: 102 steps at 14, then 56 in the second epoch
    ],
)
def test_a_plan_deciding_inside_epochs_locates_every_step_as_drawing_them_one_by_one(changes, shards):
    plan = BatchPlan.of({3: 24, 7: 14}.get(shards, 16), "auto", DIGITS_TRAIN, 3, every=1)
    for step, batch in changes:
        plan.change(step, batch)
    want = _walk_by_hand(plan, shards)
    assert plan.total(shards) == len(want)
    assert [plan.steps_in(e, shards) for e in range(3)] == [sum(1 for w in want if w[0] == e) for e in range(3)]
    for step, (e, i, taken) in enumerate(want):
        assert plan.locate(step, shards) == (e, i), step
        assert plan.offset(e, i, shards) == taken, step
    for e in range(3):  # an epoch's batch: its first step's
        assert plan.batch(e, shards) == plan.batch_at(want.index((e, 0, 0)))
    assert plan.locate(len(want), shards) == (3, 0)  # after the last step: past the last epoch
    if changes:  # the batch of a step is the latest change at or before it
        assert plan.batch_at(changes[0][0] - 1) == plan.batches[0] and plan.batch_at(changes[-1][0]) == changes[-1][1]
        with pytest.raises(ValueError, match="follows one at step"):
            plan.change(changes[-1][0], 512)


def test_the_growing_loader_draws_each_batch_at_the_plans_latest_size_and_resumes_on_its_cuts(tmp_path):
    ctx = _ctx(tmp_path, workers=2, epochs=2, batch_size=16, batch_schedule="auto", auto_every=1)
    plan = ctx.batches.plan
    whole = ctx.loader(0, 2, 0).batch_sampler.order  # the epoch's permutation of shard 0
    drawn, sizes = [], {3: 32, 5: 64}
    for step, (_, y) in enumerate(ctx.loader(0, 2, 0)):
        drawn.append(y)
        if step + 1 in sizes:  # decided after the step: the next draw takes it
            plan.change(step + 1, sizes[step + 1])
    assert [len(y) for y in drawn[:7]] == [8, 8, 8, 16, 16, 32, 32]
    assert len(drawn) == plan.steps_in(0, 2) == 5 + (DIGITS_TRAIN // 2 - 56) // 32
    labels = ctx.data.train.tensors[1]  # consecutive slices of the one permutation
    assert torch.equal(torch.cat(drawn), labels[whole[: sum(len(y) for y in drawn)]])
    assert plan.offset(0, 5, 2) == 3 * 8 + 2 * 16
    later = list(ctx.loader(0, 2, 0, start_batch=5))  # a resume after the step-5 decision: past 3 x 8 + 2 x 16
    assert [len(y) for _, y in later] == [len(y) for y in drawn[5:]]
    assert all(torch.equal(a, b) for (_, a), b in zip(later, drawn[5:]))


def test_the_loader_cuts_each_epoch_as_the_plan_counts(tmp_path):
    ctx = _ctx(tmp_path, workers=2, epochs=3, batch_schedule="0:32,1:64,2:128")
    for epoch, b in enumerate([32, 64, 128]):
        batches = [y for _, y in ctx.loader(0, 2, epoch)]
        assert len(batches) == ctx.batches.plan.steps_in(epoch, 2) == ctx.steps_per_epoch(2, epoch)
        assert {len(y) for y in batches} == {b // 2}
        later = [y for _, y in ctx.loader(0, 2, epoch, start_batch=5)]  # a resume skips the first 5
        assert len(later) == len(batches) - 5 and all(torch.equal(a, c) for a, c in zip(later, batches[5:]))


# ---------------------------------------------------------------------- 4. and 5. dtrain run with a batch schedule

SCHEDULE = [32, 64, 128]
RUN = [
    "--workers",
    "2",
    "--model",
    "cnn",
    "--dataset",
    "digits",
    "--epochs",
    "3",
    "--lr",
    "0.05",
    "--batch-schedule",
    "0:32,1:64,2:128",
    "--lr-scaling",
    "linear",
    "--warmup-steps",
    "5",
]
PER_EPOCH = [_steps(b, 2) for b in SCHEDULE]  # 44, 22, 11
STOP = PER_EPOCH[0] + 6  # inside the second (batch-64) epoch


def _expected_lr(step: int) -> float:
    """lr x (B / 32) x warmup (W = 5; k = 1 while warming up, so the (t + 1) / W ramp), constant schedule."""
    epoch = 0 if step < PER_EPOCH[0] else 1 if step < PER_EPOCH[0] + PER_EPOCH[1] else 2
    k = SCHEDULE[epoch] / 32
    warm = (1 + (k - 1) * step / 5) / k if k > 1 else (step + 1) / 5
    return 0.05 * k * (warm if step < 5 else 1.0)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("lb") / "straight"
    p = _run(*RUN, "--checkpoint-every", "1000", "--out", str(out))  # the only checkpoint: the final one
    assert p.returncode == 0, p.stderr[-3000:]
    return out


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_a_scheduled_run_follows_the_plan_and_the_lr_rules(straight):
    rows = read_metrics(straight)
    assert PER_EPOCH == [44, 22, 11]
    total = sum(PER_EPOCH)
    for rank in (0, 1):
        mine = sorted((r for r in rows if r["rank"] == rank), key=lambda r: r["step"])
        assert [r["step"] for r in mine] == list(range(total)), rank
        assert [sum(1 for r in mine if r["epoch"] == e) for e in range(3)] == PER_EPOCH, rank
        for r in mine:
            assert r["lr"] == pytest.approx(_expected_lr(r["step"]), rel=1e-9), (rank, r["step"], r["lr"])
    by_step = {r["step"]: r["lr"] for r in rows if r["rank"] == 0}
    assert by_step[0] == pytest.approx(0.01) and by_step[4] == pytest.approx(0.05)
    assert by_step[44] == pytest.approx(0.1) and by_step[66] == pytest.approx(0.2)  # the batch doubled, so did lr
    s = read_summary(straight)
    assert s["steps"] == total == BatchPlan.of(32, "0:32,1:64,2:128", DIGITS_TRAIN, 3).total(2)
    assert [h["step"] for h in s["metric_history"]] == [44, 66, 77]  # an evaluation at each epoch's end
    assert s["metric"] > 0.5


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_a_run_stopped_inside_a_scheduled_epoch_resumes_to_the_uninterrupted_result(straight, tmp_path):
    cut, resumed = tmp_path / "cut", tmp_path / "resumed"
    p = _run(*RUN, "--max-steps", str(STOP), "--checkpoint-every", str(STOP), "--out", str(cut))
    assert p.returncode == 0, p.stderr[-3000:]
    ckpt = cut / "checkpoints" / f"step_{STOP:06d}"
    info = read_checkpoint(ckpt)["info"]
    assert (info["step"], info["epoch"], info["batch"]) == (STOP, 1, 6)  # from the plan, not step // steps_per_epoch
    assert info["run"]["batch_schedule"] == "0:32,1:64,2:128" and "max_steps" not in info["run"]

    # what --max-steps does to the resume rule: the length may change, the schedule may not
    base = RunConfig.make(
        workers=2, epochs=3, lr=0.05, batch_schedule="0:32,1:64,2:128", lr_scaling="linear", warmup_steps=5
    )
    validate(base.replace(resume=str(cut)))
    with pytest.raises(ConfigError, match="batch_schedule") as e:
        validate(base.replace(resume=str(cut), batch_schedule="0:32,1:64,2:256"))
    assert "cannot resume" in str(e.value)
    with pytest.raises(ConfigError, match="nothing is left"):
        validate(base.replace(resume=str(cut), max_steps=STOP))

    p = _run(*RUN, "--checkpoint-every", "1000", "--resume", str(cut), "--out", str(resumed))
    assert p.returncode == 0, p.stderr[-3000:]
    total = sum(PER_EPOCH)
    s = read_summary(resumed)
    assert s["start_step"] == STOP and s["steps"] == total - STOP
    a = {(r["rank"], r["step"]): r for r in read_metrics(straight)}
    b = {(r["rank"], r["step"]): r for r in read_metrics(resumed)}
    assert sorted(b) == [(rank, t) for rank in (0, 1) for t in range(STOP, total)]
    for key, r in b.items():
        assert (r["epoch"], r["lr"]) == (a[key]["epoch"], a[key]["lr"]), key
        assert abs(r["loss"] - a[key]["loss"]) <= 1e-6, (key, r["loss"], a[key]["loss"])
    ma = read_checkpoint(straight / "checkpoints" / f"step_{total:06d}")["model"]
    mb = read_checkpoint(resumed / "checkpoints" / f"step_{total:06d}")["model"]
    assert ma.keys() == mb.keys()
    assert max(float((ma[k] - mb[k]).abs().max()) for k in ma) <= 1e-6
    assert s["metric"] == read_summary(straight)["metric"]
    assert s["final_loss"] == pytest.approx(read_summary(straight)["final_loss"], abs=1e-6)


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_a_fixed_batch_run_resumed_at_new_batches_trains_as_the_scheduled_one(straight, tmp_path):
    """``--resume CKPT --batch-size B'`` goes on from the checkpoint's sample at B' (what PBT's explore does):
    a 32-batch run cut after its first epoch, resumed at 64, that one cut after the second and resumed at 128,
    trains step for step as the uninterrupted ``--batch-schedule 0:32,1:64,2:128`` run (same epochs, rates by
    the linear rule against the first batch, losses)."""
    fixed = [a for a in RUN if a not in ("--batch-schedule", "0:32,1:64,2:128")]
    cuts = [PER_EPOCH[0], PER_EPOCH[0] + PER_EPOCH[1], sum(PER_EPOCH)]
    prev, outs = None, []
    for i, (batch, stop) in enumerate(zip(SCHEDULE, cuts)):
        out = tmp_path / f"b{batch}"
        more = ["--resume", str(prev)] if prev else []
        p = _run(
            *fixed,
            "--batch-size",
            str(batch),
            "--max-steps",
            str(stop),
            "--checkpoint-every",
            "1000",
            *more,
            "--out",
            str(out),
        )
        assert p.returncode == 0, (batch, p.stderr[-3000:])
        s = read_summary(out)
        start = s.get("start_step", 0)  # a resumed run's summary names its first step
        assert (start, start + s["steps"]) == ((cuts[i - 1] if i else 0), stop), batch
        prev = out
        outs.append(out)
    info = read_checkpoint(prev / "checkpoints" / f"step_{cuts[-1]:06d}")["info"]
    assert info["batches"] == {"first": 32, "changes": [[cuts[0], 64], [cuts[1], 128]]}
    a = {(r["rank"], r["step"]): r for r in read_metrics(straight)}
    b = {(r["rank"], r["step"]): r for out in outs for r in read_metrics(out)}
    assert sorted(b) == sorted(a)
    for key, r in b.items():
        assert r["epoch"] == a[key]["epoch"], key
        assert r["lr"] == pytest.approx(a[key]["lr"], rel=1e-12), key
        assert abs(r["loss"] - a[key]["loss"]) <= 1e-6, (key, r["loss"], a[key]["loss"])

    base = RunConfig.make(workers=2, epochs=3, lr=0.05, lr_scaling="linear", warmup_steps=5)
    validate(base.replace(resume=str(outs[0]), batch_size=96))  # any fixed batch
    with pytest.raises(ConfigError, match="batch_schedule"):  # a schedule still belongs to its checkpoint
        validate(base.replace(resume=str(outs[0]), batch_schedule="0:64,2:128"))
    with pytest.raises(ConfigError, match="not both"):  # dp reshards, but not while the batch changes too
        validate(base.replace(resume=str(outs[0]), batch_size=64, workers=1))


# ---------------------------------------------------------------------- 6. the large-batch optimizers from the CLI


# The optimizers run on 2 workers (one intra-op thread each): dp's averaged gradient gives the one-worker losses
# at the same global batch, and one worker's two threads cost several times the CPU on a busy 2-core machine.


def _falls(out, n: int) -> tuple[float, float]:
    losses = [v for _, v in sorted(mean_losses(out).items())]
    return sum(losses[:n]) / n, sum(losses[-n:]) / n


def _groups(out, step: int) -> list[dict]:
    return list(read_checkpoint(out / "checkpoints" / f"step_{step:06d}")["optimizer"]["param_groups"])


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_lars_trains_the_cnn_on_two_workers(tmp_path):
    out = tmp_path / "lars"
    # LARS moves each layer by lr x trust coefficient (0.001) of its norm per step: its lr is 100x SGD's
    p = _run(
        "--workers",
        "2",
        "--optimizer",
        "lars",
        "--lr",
        "5",
        "--warmup-steps",
        "10",
        "--batch-size",
        "64",
        "--epochs",
        "2",
        "--max-steps",
        "40",
        "--checkpoint-every",
        "1000",
        "--out",
        str(out),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    first, last = _falls(out, 8)
    assert last < first - 0.3, (first, last)
    g = _groups(out, 40)
    assert g[0]["trust_coefficient"] == pytest.approx(0.001) and g[0]["momentum"] == pytest.approx(0.9)


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_lamb_trains_a_tiny_gpt(tmp_path):
    out = tmp_path / "lamb"
    p = _run(
        "--workers",
        "2",
        "--model",
        "gpt-tiny",
        "--dataset",
        "pytext",
        "--layers",
        "1",
        "--d-model",
        "32",
        "--heads",
        "2",
        "--seq-len",
        "32",
        "--batch-size",
        "16",
        "--optimizer",
        "lamb",
        "--lr",
        "0.01",
        "--max-steps",
        "15",
        "--eval-samples",
        "32",
        "--checkpoint-every",
        "1000",
        "--out",
        str(out),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    first, last = _falls(out, 4)
    assert last < first - 0.2, (first, last)
    g = _groups(out, 15)
    assert "exclude" in g[0] and "betas" in g[0] and "amsgrad" not in g[0]  # LAMB's group, not Adam's
    assert math.isfinite(read_summary(out)["val_loss"])


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_adamw_trains_the_cnn(tmp_path):
    out = tmp_path / "adamw"
    p = _run(
        "--workers",
        "2",
        "--optimizer",
        "adamw",
        "--lr",
        "0.003",
        "--weight-decay",
        "0.01",
        "--batch-size",
        "64",
        "--max-steps",
        "20",
        "--checkpoint-every",
        "1000",
        "--out",
        str(out),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    first, last = _falls(out, 4)
    assert last < first - 0.2, (first, last)
    g = _groups(out, 20)
    assert g[0]["decoupled_weight_decay"] is True and g[0]["weight_decay"] == pytest.approx(0.01)
