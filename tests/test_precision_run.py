"""``dtrain run --precision bf16 | fp16`` end to end, and :class:`dtrain.optim.precision.LossScaler` alone.

- LossScaler in one process (growth after ``growth_interval`` clean steps, backoff, another rank's verdict
  obeyed, the collapse naming the step and the scale) and in two gloo processes where one rank always
  overflows: both stop at the same step with the same scale.
- An overflow only one rank sees (``extra.inject_overflow = "RANK:STEP"``) is skipped on every rank that shares
  the step (dp: both replicas; pipeline: both stages), the scale halves everywhere, and the dp replicas stay
  identical: the trajectory is the same whichever rank overflowed.
- A run whose every step overflows (``--lr 1e30``: after the first update the weights are inf in fp16) stops
  with LossScaleCollapsed on both ranks, at the step and scale the backoff schedule gives.
- dp's gradients travel in 16 bits: the ring's closed form at 2 bytes an element, half of fp32's. ddp reports the
  16-bit bytes its comm hook sends.
- Every strategy trains in bf16 / fp16 (the loss falls; no overflow after the first steps); hybrid (4 processes)
  is marked slow.
- What fp16 cannot do is refused before any process starts, naming the option.

Every run is ``python -m dtrain.cli run`` with a hard timeout; a run's folder is shared by the tests that read it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import spawn
from _helpers import dtrain_cli, mean_losses, read_metrics, read_summary

from dtrain.errors import ConfigError
from dtrain.job.validate import validate
from dtrain.optim.precision import LossScaleCollapsed, LossScaler, Precision

BASE = ["--epochs", "1", "--no-progress", "--no-trace", "--timeout-s", "60", "--optimizer", "adam", "--lr", "0.003"]
# the default model and data, cnn on digits: Adam at 0.01 for 20 steps (about the first ten are a plateau) leaves
# the last three steps' loss at 0.51-0.72 of the first three's and 58-78% test accuracy, what 0.003 gave in 30
CNN = [*BASE, "--lr", "0.01", "--batch-size", "32", "--max-steps", "20"]
# 12 steps, the fewest the learning test counts: the last three at 0.75 of the first three's loss
GPT = [
    *BASE,
    "--model",
    "gpt-tiny",
    "--dataset",
    "pytext",
    "--seq-len",
    "16",
    "--batch-size",
    "8",
    "--eval-samples",
    "16",
    "--max-steps",
    "12",
]
PIPE = ["--strategy", "pipeline", "--workers", "2", "--microbatches", "2"]

# name -> (flags, inject_overflow or ""); each runs once, when a test first needs it
RUNS: dict[str, tuple[list[str], str]] = {
    "dp bf16": ([*CNN, "--workers", "2", "--precision", "bf16"], ""),
    "dp fp16": ([*CNN, "--workers", "2", "--precision", "fp16"], ""),
    "dp fp16, rank 1 overflows at step 3": ([*CNN, "--workers", "2", "--precision", "fp16"], "1:3"),
    "dp fp16, rank 0 overflows at step 3": ([*CNN, "--workers", "2", "--precision", "fp16"], "0:3"),
    "pipeline fp16, stage 1 overflows at step 3": ([*CNN, *PIPE, "--precision", "fp16"], "1:3"),
    "pipeline bf16": ([*GPT, *PIPE, "--precision", "bf16"], ""),
    "ddp fp16": ([*CNN, "--strategy", "ddp", "--workers", "2", "--precision", "fp16"], ""),
    "ps fp16": ([*CNN, "--strategy", "ps", "--servers", "1", "--workers", "2", "--precision", "fp16"], ""),
    "tensor fp16": ([*GPT, "--strategy", "tensor", "--workers", "2", "--precision", "fp16"], ""),
    "hybrid fp16": (
        [*GPT, "--strategy", "hybrid", "--workers", "4", "--dp", "2", "--tp", "2", "--precision", "fp16"],
        "",
    ),
    "local_sgd bf16": ([*CNN, "--strategy", "local_sgd", "--workers", "2", "--period", "4", "--precision", "bf16"], ""),
    "dp --shard parameters fp16": ([*CNN, "--workers", "2", "--shard", "parameters", "--precision", "fp16"], ""),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            flags, inject = RUNS[name]
            root = tmp_path_factory.mktemp("precision")
            config: list[str] = []
            if inject:
                (root / "inject.toml").write_text(f'[extra]\ninject_overflow = "{inject}"\n')
                config = [str(root / "inject.toml")]
            out = root / "run"
            p = dtrain_cli("run", *config, *flags, "--out", str(out), timeout=240)
            assert p.returncode == 0, (name, p.stderr[-3000:])
            done[name] = out
        return done[name]

    return get


def _rows(out: Path) -> dict[int, list[dict[str, Any]]]:
    """Each rank's metrics rows, in step order."""
    by: dict[int, list[dict[str, Any]]] = {}
    for r in sorted(read_metrics(out), key=lambda r: r["step"]):
        by.setdefault(r["rank"], []).append(r)
    return by


# ------------------------------------------------------------------------------------------ LossScaler alone


def _backward(scaler: LossScaler, w: torch.nn.Parameter, bad: bool = False) -> None:
    w.grad = None
    scaler.scale_loss((w * torch.tensor([1.0, 2.0])).sum()).backward()  # d/dw = [1, 2] times the scale
    if bad:
        w.grad[0] = math.inf


def test_loss_scaler_grows_backs_off_obeys_the_agreement_and_collapses():
    w = torch.nn.Parameter(torch.zeros(2))
    verdicts: list[list[int]] = []  # what the other ranks say, per step (popped): [] = nobody else overflowed

    def agree(bad: bool) -> list[int]:
        others = verdicts.pop(0) if verdicts else []
        return sorted({0, *others} if bad else set(others))

    s = LossScaler([w], agree, rank=0, init_scale=8.0, growth_interval=3, min_scale=1.0)
    scales, step = [], 0
    for _ in range(3):  # clean steps: the gradients come back unscaled; x2 after the third
        _backward(s, w)
        assert s.unscale(step) == []
        assert w.grad.tolist() == [1.0, 2.0]
        scales.append(s.loss_scale)
        s.advance()
        step += 1
    assert scales == [8.0, 8.0, 8.0] and s.loss_scale == 16.0
    _backward(s, w, bad=True)  # an overflow here: skipped, x0.5, and the growth count starts again
    assert s.unscale(step) == [0]
    s.advance()
    step += 1
    assert s.loss_scale == 8.0
    verdicts.append([1])  # clean here, but rank 1 overflowed: the agreed verdict moves this scale too
    _backward(s, w)
    assert s.unscale(step) == [1] and s.overflowed == [1]
    s.advance()
    step += 1
    assert s.loss_scale == 4.0
    for _ in range(2):  # two clean steps since the last overflow: no growth yet
        _backward(s, w)
        assert s.unscale(step) == []
        s.advance()
        step += 1
    assert s.loss_scale == 4.0
    for expected in (2.0, 1.0):  # overflow after overflow down to min_scale...
        _backward(s, w, bad=True)
        assert s.unscale(step) == [0]
        s.advance()
        step += 1
        assert s.loss_scale == expected
    _backward(s, w, bad=True)  # ...and one more at the minimum: the run cannot go on
    with pytest.raises(LossScaleCollapsed) as e:
        s.unscale(step)
    assert (e.value.rank, e.value.step, e.value.scale) == (0, 9, 1.0)
    assert "step 9" in str(e.value) and "loss scale already at 1 " in str(e.value), str(e.value)


def test_loss_scaler_of_a_whole_step_engine_which_scales_its_own_loss():
    # a pipeline / tensor / hybrid engine multiplies its loss by loss_scale and never calls scale_loss
    w = torch.nn.Parameter(torch.zeros(2))
    s = LossScaler([w], lambda bad: [0] if bad else [], rank=0, init_scale=4.0, growth_interval=1)
    for step, want in enumerate((4.0, 8.0)):
        assert s.loss_scale == want
        ((w * torch.tensor([1.0, 2.0])).sum() * s.loss_scale).backward()
        assert s.unscale(step) == [] and w.grad.tolist() == [1.0, 2.0]
        s.advance()
        w.grad = None
    assert s.loss_scale == 16.0


def test_precision_names_and_the_wire():
    assert Precision("fp16").dtype == torch.float16 and Precision("fp16").scales_loss
    assert Precision("bf16").dtype == torch.bfloat16 and not Precision("bf16").scales_loss
    assert Precision("fp32").dtype is None
    assert [Precision(p).wire("none") for p in ("fp32", "bf16", "fp16")] == ["none", "bf16", "fp16"]
    assert Precision("fp16").wire("powersgd:2") == "powersgd:2"  # a named compressor wins
    with pytest.raises(ValueError, match="'fp8'"):
        Precision("fp8")


def _always_overflows_on_rank_1(rank: int, world: int) -> dict[str, Any]:
    from dtrain.optim.guard import flagged_ranks

    w = torch.nn.Parameter(torch.zeros(2))
    s = LossScaler([w], flagged_ranks, rank=rank)  # the defaults: 2**16, down to min_scale 1
    seen: list[tuple[float, list[int]]] = []
    for step in range(40):
        _backward(s, w, bad=rank == 1)
        try:
            seen.append((s.loss_scale, s.unscale(step)))
        except LossScaleCollapsed as e:
            return {"step": e.step, "scale": e.scale, "message": str(e), "seen": seen}
        s.advance()
    return {"step": None, "seen": seen}


@pytest.mark.procs
def test_loss_scale_collapse_is_agreed_by_two_gloo_processes():
    outs = spawn(_always_overflows_on_rank_1, 2, timeout=90)
    assert all(o.status == "ok" for o in outs), [(o.status, o.error) for o in outs]
    r0, r1 = (o.value for o in outs)
    # 16 backoffs from 2**16 reach 1; the 17th overflow (step 16) cannot back off: both ranks stop there
    want = [(2.0 ** (16 - k), [1]) for k in range(16)]
    for rank, r in ((0, r0), (1, r1)):
        assert (r["step"], r["scale"]) == (16, 1.0), r
        assert [(a, list(b)) for a, b in r["seen"]] == want, r["seen"]
        assert f"rank {rank}: fp16 loss scaling collapsed at step 16" in r["message"], r["message"]
        assert "rank(s) [1]" in r["message"] and "already at 1 " in r["message"], r["message"]


# ------------------------------------------------------------------------- an overflow one rank sees


def _assert_skipped_everywhere(out: Path, step: int, culprit: int, ranks: int) -> dict[int, list[dict[str, Any]]]:
    rows = _rows(out)
    assert sorted(rows) == list(range(ranks))
    for rank, rr in rows.items():
        assert [r["step"] for r in rr] == list(range(len(rr))), rank
        assert [r["step"] for r in rr if r.get("overflow")] == [step], (rank, rr)
        assert [r["step"] for r in rr if r.get("skipped")] == [step], (rank, rr)
        assert rr[step]["overflow"] == [culprit]
        # the scale in force at each step: 2**16 up to the overflow, halved on every rank after it
        assert [r["loss_scale"] for r in rr] == [65536.0] * (step + 1) + [32768.0] * (len(rr) - step - 1), rank
        assert all(math.isfinite(r["loss"]) for r in rr), rank
    s = read_summary(out)
    assert s["precision"] == "fp16" and s["overflow_steps"] == 1
    return rows


@pytest.mark.procs
def test_dp_an_overflow_on_one_rank_is_skipped_by_both_and_the_replicas_stay_identical(runs):
    clean = _rows(runs("dp fp16"))
    a = _assert_skipped_everywhere(runs("dp fp16, rank 1 overflows at step 3"), 3, culprit=1, ranks=2)
    b = _assert_skipped_everywhere(runs("dp fp16, rank 0 overflows at step 3"), 3, culprit=0, ranks=2)
    for rank in (0, 1):
        la, lb, lc = ([r["loss"] for r in x[rank]] for x in (a, b, clean))
        assert la[:4] == pytest.approx(lc[:4], rel=1e-6), rank  # the same run until the skipped step
        # the skip changed the trajectory (step 3's update is missing from both) ...
        assert abs(la[5] - lc[5]) > 1e-4 * abs(lc[5]), (rank, la, lc)
        # ... and whichever rank overflowed, each rank's model afterwards is the same: had only the overflowing
        # rank skipped, rank 0 would hold a model with step 3's update in one run and without it in the other
        assert la == pytest.approx(lb, rel=1e-6), (rank, la, lb)
    sa = read_summary(runs("dp fp16, rank 1 overflows at step 3"))
    sb = read_summary(runs("dp fp16, rank 0 overflows at step 3"))
    assert sa["metric"] == sb["metric"]  # rank 0's final model, evaluated


@pytest.mark.procs
def test_pipeline_both_stages_skip_an_overflow_only_the_last_stage_sees(runs):
    rows = _assert_skipped_everywhere(runs("pipeline fp16, stage 1 overflows at step 3"), 3, culprit=1, ranks=2)
    assert [r["stage"] for r in rows[1]] == [1] * len(rows[1])


@pytest.mark.procs
def test_every_step_overflowing_collapses_the_loss_scale_on_both_ranks(tmp_path):
    # one update at lr 1e30 leaves weights that are inf in fp16: from then on every step overflows
    out = tmp_path / "collapse"
    p = dtrain_cli(
        "run",
        *CNN,
        "--workers",
        "2",
        "--precision",
        "fp16",
        "--lr",
        "1e30",
        "--max-steps",
        "30",
        "--out",
        str(out),
        timeout=240,
    )
    assert p.returncode != 0
    assert "LossScaleCollapsed" in p.stderr and "collapsed at step 17" in p.stderr, p.stderr[-3000:]
    for rank in (0, 1):  # each rank stopped by itself, at the same step and scale
        err = (out / f"error.rank{rank}.txt").read_text()
        assert (
            f"rank {rank}: fp16 loss scaling collapsed at step 17: the gradients overflowed (inf/nan, on "
            "rank(s) [0, 1]) with the loss scale already at 1 (minimum 1)"
        ) in err, err[-2000:]
    rows = _rows(out)
    for rank, rr in rows.items():  # step 0 applied; 1..16 skipped with the scale halving each time
        assert [r["step"] for r in rr] == list(range(17)), rank
        assert "overflow" not in rr[0] and math.isfinite(rr[0]["loss"])
        assert [r["loss_scale"] for r in rr[1:]] == [2.0 ** (16 - k) for k in range(16)], rank
        assert all(r["overflow"] == [0, 1] and r["skipped"] for r in rr[1:]), rank


# ------------------------------------------------------------------------------------ bytes on the wire


def _cnn_parameters() -> int:
    from dtrain.workloads.data import load_dataset
    from dtrain.workloads.models import build_model

    ds = load_dataset("digits")
    return sum(p.numel() for p in build_model("cnn", tuple(ds.input_shape), ds.num_classes).parameters())


@pytest.mark.procs
def test_dp_gradients_travel_in_16_bits(runs):
    # dp's ring all-reduce sends 2 (P-1)/P elements per parameter a step: 2 bytes each in bf16 / fp16, half of
    # fp32's 4 (fp32's count is the engine's, checked in tests/test_data_parallel_dist.py; no run spent on it here)
    n, world = _cnn_parameters(), 2
    fp32 = 2 * (world - 1) / world * n * 4
    for name in ("dp bf16", "dp fp16"):
        s = read_summary(runs(name))
        assert s["bytes_sent_per_step"] == pytest.approx(fp32 / 2, rel=0.01), (name, s["bytes_sent_per_step"], fp32)
        assert {r["bytes_sent"] for r in read_metrics(runs(name))} == {int(fp32 / 2)}, name


@pytest.mark.procs
def test_ddp_reports_the_16_bit_bytes_its_comm_hook_sends(runs):
    rows = read_metrics(runs("ddp fp16"))
    assert {r["bytes_sent"] for r in rows} == {int(2 * (2 - 1) / 2 * _cnn_parameters() * 2)}


# ------------------------------------------------------------------------------- every strategy learns


LEARNS = {  # run name -> the step an injected overflow may add to the first steps' (None: no injection)
    "dp bf16": None,
    "dp fp16": None,
    "ddp fp16": None,
    "ps fp16": None,
    "pipeline fp16, stage 1 overflows at step 3": 3,
    "pipeline bf16": None,
    "tensor fp16": None,
    "local_sgd bf16": None,
    "dp --shard parameters fp16": None,
}


@pytest.mark.procs
@pytest.mark.parametrize(
    "name",
    [
        *LEARNS,
        pytest.param("hybrid fp16", marks=pytest.mark.slow),  # 4 processes; the engine is tensor fp16's
    ],
)
def test_each_strategy_learns_in_16_bits(runs, name):
    out = runs(name)
    precision = "fp16" if "fp16" in name else "bf16"
    s = read_summary(out)
    assert s["precision"] == precision
    rows = read_metrics(out)
    assert all(math.isfinite(r["loss"]) for r in rows if not r.get("skipped")), name
    injected = LEARNS.get(name)
    if precision == "bf16":  # no loss scaling, nothing skipped
        assert "overflow_steps" not in s
        assert not any("loss_scale" in r or r.get("overflow") or r.get("skipped") for r in rows), name
    else:  # overflows at most while the scale settles in the first steps (and at an injected one)
        bad = {r["step"] for r in rows if r.get("overflow")} - {injected}
        assert all(step < 3 for step in bad), (name, sorted(bad))
        assert all(r["loss_scale"] >= 2.0**13 for r in rows), name
        per_rank = {}  # ps and local_sgd decide per rank; the summary has the most any rank skipped
        for r in rows:
            per_rank[r["rank"]] = per_rank.get(r["rank"], 0) + bool(r.get("overflow"))
        assert s["overflow_steps"] == max(per_rank.values()), (name, per_rank)
    losses = mean_losses(out)
    steps = sorted(losses)
    assert steps == list(range(len(steps))) and len(steps) >= 12, (name, steps)
    first = sum(losses[k] for k in steps[:3]) / 3
    last = sum(losses[k] for k in steps[-3:]) / 3
    assert last < 0.9 * first, (name, first, last, losses)
    if s["metric_name"] == "test_accuracy":
        assert s["metric"] > 0.3, (name, s["metric"])  # chance: 0.1
    else:
        assert s["metric"] < first, (name, s["metric"], first)  # validation loss below the first training loss


# ------------------------------------------------------------------------------------- refused up front


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--compression", "topk:0.01"], "--precision fp16 with --compression topk:0.01"),
        (["--overlap", "forward"], "--precision fp16 cannot skip an overflowing step under --overlap forward"),
        (
            ["--strategy", "pipeline", "--schedule", "2bw", "--microbatches", "2"],
            "--precision fp16 with --schedule 2bw",
        ),
        (
            [
                "--strategy",
                "hybrid",
                "--workers",
                "4",
                "--dp",
                "2",
                "--tp",
                "2",
                "--model",
                "gpt-tiny",
                "--dataset",
                "pytext",
                "--seq-len",
                "16",
                "--compression",
                "topk:0.01",
            ],
            "--precision fp16 with --compression topk:0.01",
        ),
    ],
)
def test_what_fp16_cannot_skip_is_refused_naming_the_option(flags, message):
    from dtrain.cli import build_parser, config_from_args

    ns = build_parser().parse_args(["run", *CNN, "--workers", "2", "--precision", "fp16", *flags])
    with pytest.raises(ConfigError) as e:
        validate(config_from_args(ns))  # what dtrain.job.run.run checks before any process starts
    assert message in str(e.value), str(e.value)
    ns = build_parser().parse_args(["run", *CNN, "--workers", "2", "--precision", "bf16", *flags])
    validate(config_from_args(ns))  # bf16 neither scales nor skips: the same options are fine


def test_an_unknown_precision_is_refused_naming_it(capsys):
    from dtrain.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--precision", "fp8"])
    assert "invalid choice: 'fp8'" in capsys.readouterr().err
    from dtrain.config.schema import RunConfig

    with pytest.raises(ConfigError, match="fp8"):
        validate(RunConfig.make(precision="fp8", workers=2))  # a TOML file's value
