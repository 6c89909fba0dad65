"""Faults end in recovery or a clear error: the numerics guard, safe run folders.

Real ``dtrain run`` processes with hard timeouts, each asserting the exit status, the time to
exit and the message; injected faults come from tests/_faults.py (an inf gradient in one
parameter on one rank at one step, the loss staying finite).
"""

from __future__ import annotations

import os
import re
import time
from datetime import datetime
from pathlib import Path

import pytest
import torch
from _helpers import dtrain_cli, read_metrics, read_summary

from dtrain.checkpoint import list_checkpoints
from dtrain.config.schema import RunConfig
from dtrain.errors import ConfigError, NonFiniteError
from dtrain.job.validate import validate
from dtrain.optim.guard import NonFiniteGuard, first_nonfinite
from dtrain.workloads.models import build_model

TESTS = Path(__file__).resolve().parent
QUICK = ["--workers", "2", "--epochs", "1", "--no-progress", "--no-trace", "--timeout-s", "30"]
CNN_PARAMS = [n for n, _ in build_model("cnn").named_parameters()]
STOPPED = re.compile(r"rank (\d+) at step (\d+): non-finite .*?parameter '([\w.]+)'")


def _cli(*args: str, inf: str = "", timeout: float = 90) -> tuple[object, float]:
    """``dtrain run ARGS`` (with ``inf`` = "RANK:STEP:PARAM" injected); (process, seconds to exit)."""
    env = dict(os.environ)
    if inf:
        env.update(
            DTRAIN_STRATEGY_MODULES="_faults",
            DTRAIN_TEST_INF=inf,
            PYTHONPATH=os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")]),
        )
    t0 = time.monotonic()
    p = dtrain_cli("run", *args, timeout=timeout, env=env)
    return p, time.monotonic() - t0


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


# ---------------------------------------------------------------------- the guard, in one process


def _cnn_with_grads() -> torch.nn.Module:
    m = build_model("cnn")
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    return m


def test_first_nonfinite_names_the_first_parameter_in_model_order():
    m = _cnn_with_grads()
    named = list(m.named_parameters())
    assert first_nonfinite(named) is None
    dict(named)["8.weight"].grad[0, 0] = float("inf")
    dict(named)["2.bias"].grad[1] = float("nan")
    assert first_nonfinite(named) == ("2.bias", "nan", 2)
    dict(named)["2.bias"].grad[1] = 0.0
    assert first_nonfinite(named) == ("8.weight", "inf", 1)
    dict(named)["8.weight"].grad.fill_(1.0)
    dict(named)["0.weight"].grad.fill_(1e30)  # finite elements, a 2-norm beyond float32
    assert first_nonfinite(named) == ("0.weight", "norm overflow", 1)
    assert first_nonfinite([(n, torch.nn.Parameter(torch.zeros(2))) for n in "ab"]) is None  # no gradients


def test_guard_stops_at_once_or_after_its_budget_of_agreed_skips():
    m = _cnn_with_grads()
    stop = NonFiniteGuard(m.named_parameters(), rank=3)
    assert stop.check(0, 2.3)
    with pytest.raises(NonFiniteError, match=r"rank 3 at step 1: non-finite loss nan .*--skip-nonfinite N"):
        stop.check(1, float("nan"))
    votes: list[bool] = []

    def agree(bad: bool) -> list[int]:  # rank 3 and a peer, rank 0, that found step 4 bad
        votes.append(bad)
        return sorted({3} if bad else set()) + ([0] if len(votes) == 3 else [])

    skip = NonFiniteGuard(m.named_parameters(), rank=3, budget=2, agree=agree)
    assert skip.check(0, 2.3)
    dict(m.named_parameters())["6.weight"].grad[0, 0] = float("inf")
    assert not skip.check(1, 2.2)  # skipped: 1 of 2
    dict(m.named_parameters())["6.weight"].grad.fill_(1.0)
    assert not skip.check(2, 2.1)  # this rank's step is fine, rank 0's is not: skipped too, 2 of 2
    with pytest.raises(NonFiniteError) as e:
        skip.check(3, float("inf"))
    assert e.value.step == 3 and e.value.parameter is None and "2 such step(s) skipped" in str(e.value)
    assert votes == [False, True, False, True] and skip.skipped == 3
    with pytest.raises(ValueError, match="agree"):
        NonFiniteGuard(m.named_parameters(), rank=0, budget=1)


# ---------------------------------------------------------------------- F1: non-finite steps, real runs


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_a_diverging_run_stops_at_the_first_nonfinite_step_and_keeps_its_good_checkpoints(tmp_path):
    """F1: `--lr 1e6` used to finish with exit 0 and final_loss NaN."""
    out = tmp_path / "r"
    p, wall = _cli(*QUICK, "--lr", "1e6", "--max-steps", "20", "--checkpoint-every", "2", "--out", str(out))
    assert p.returncode == 2, p.stderr[-3000:]
    assert wall < 60, wall
    assert "Traceback" not in p.stderr
    m = STOPPED.search(p.stderr)
    assert m, p.stderr[-3000:]
    rank, step, param = int(m.group(1)), int(m.group(2)), m.group(3)
    assert rank in (0, 1) and 0 < step < 20 and param in CNN_PARAMS
    rows = read_metrics(out)
    assert max(r["step"] for r in rows if r["rank"] == rank) == step - 1  # the bad step left no row
    assert all(_finite(r["loss"]) for r in rows)
    assert not (out / "summary.json").exists()
    saved = [s for s, _, ok in list_checkpoints(out / "checkpoints") if ok]
    assert saved and max(saved) <= step  # step_N holds steps 0..N-1: nothing of the bad step


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_skip_nonfinite_skips_the_step_on_every_data_parallel_rank(tmp_path):
    out = tmp_path / "dp"
    p, wall = _cli(*QUICK, "--max-steps", "8", "--skip-nonfinite", "1", "--out", str(out), inf="1:3:6.weight")
    assert p.returncode == 0, p.stderr[-3000:]
    assert wall < 60, wall
    assert "rank 1 at step 3: non-finite gradient (inf) in parameter '6.weight'" in p.stderr
    skipped = sorted((r["rank"], r["step"]) for r in read_metrics(out) if r.get("skipped"))
    assert skipped == [(0, 3), (1, 3)]  # the averaged gradient is inf on both ranks: neither steps
    s = read_summary(out)
    assert s["steps"] == 8 and _finite(s["final_loss"]) and s["test_accuracy"] is not None


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_a_parameter_server_worker_skips_its_push_then_stops_naming_the_parameter(tmp_path):
    """A finite loss, an inf gradient on worker rank 2 only, at steps 3 and 5, one skip allowed: its own
    check skips step 3 (no push; under bsp the servers wait for its next gradient, no hang, no skip
    elsewhere) and stops the run at step 5."""
    out = tmp_path / "ps"
    p, wall = _cli(
        *QUICK, "--strategy", "ps", "--max-steps", "8", "--skip-nonfinite", "1", "--out", str(out), inf="2:3+5:6.weight"
    )
    assert p.returncode == 2, p.stderr[-3000:]
    assert wall < 60, wall
    assert "rank 2 at step 3: non-finite gradient (inf) in parameter '6.weight'" in p.stderr  # skipped
    assert "rank 2 at step 5: non-finite gradient (inf) in parameter '6.weight' (the first; loss " in p.stderr
    assert "1 such step(s) skipped already (--skip-nonfinite 1)" in p.stderr
    assert "rank 1 at step" not in p.stderr
    rows = read_metrics(out)
    assert sorted((r["rank"], r["step"]) for r in rows if r.get("skipped")) == [(2, 3)]
    assert max(r["step"] for r in rows if r["rank"] == 2) == 4  # went on after the skip, stopped before 5


@pytest.mark.parametrize(
    "options, words",
    [
        ({"overlap": "forward"}, "--overlap backward"),
        ({"compression": "topk:0.1"}, "compressor's state"),
        ({"strategy": "ps", "checkpoint_every": 2}, "parameter server"),
        ({"skip_nonfinite": -1}, "skip_nonfinite must be >= 0"),
    ],
)
def test_skip_nonfinite_is_refused_where_a_step_cannot_be_left_out(options, words):
    with pytest.raises(ConfigError, match=words):
        validate(RunConfig.make(**{"skip_nonfinite": 1, **options}))


# ---------------------------------------------------------------------- F2, F3: the run folder


def _earlier_run(out: Path) -> dict[str, str]:
    (out / "checkpoints" / "step_000002").mkdir(parents=True)
    files = {"config.toml": "workers = 2\n", "summary.json": '{"steps": 99}\n', "metrics.jsonl": "{}\n"}
    for name, text in files.items():
        (out / name).write_text(text)
    return files


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_a_folder_holding_a_run_is_refused_before_any_worker_and_replaced_with_overwrite(tmp_path):
    out = tmp_path / "r"
    files = _earlier_run(out)
    p, wall = _cli(*QUICK, "--max-steps", "2", "--out", str(out), timeout=60)
    assert p.returncode == 2 and wall < 30, (wall, p.stderr[-3000:])
    assert p.stderr.strip() == (
        f"dtrain: error: the run folder {out} holds an earlier run (checkpoints, config.toml, "
        "metrics.jsonl, summary.json); choose a new --out, or --overwrite to replace it"
    )
    assert {n: (out / n).read_text() for n in files} == files and sorted(os.listdir(out)) == sorted(
        [*files, "checkpoints"]
    )
    p, _ = _cli(*QUICK, "--max-steps", "2", "--out", str(out), "--overwrite")
    assert p.returncode == 0, p.stderr[-3000:]
    assert read_summary(out)["steps"] == 2 and not (out / "checkpoints").exists()
    assert "overwrite = false" in (out / "config.toml").read_text()  # a rerun of config.toml cannot delete it


@pytest.mark.procs
@pytest.mark.parametrize(
    "where, words",
    [
        ("/proc/x/y", "cannot write the run folder /proc/x/y: No such file or directory"),
        ("FILE", "it is a file"),
    ],
)
def test_an_unwritable_out_is_one_line_before_any_worker(tmp_path, where, words):
    """F3: `--out /proc/x/y` used to end in a FileNotFoundError traceback."""
    if where == "FILE":
        where = str(tmp_path / "f")
        Path(where).write_text("")
    p, wall = _cli(*QUICK, "--out", where, timeout=60)
    assert p.returncode == 2 and wall < 30, (wall, p.stderr[-3000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dtrain: error: ") and words in lines[0], p.stderr


def test_overwrite_replaces_only_a_run_folder_and_never_the_resumed_checkpoint(tmp_path, monkeypatch):
    from dtrain.job.run import default_out_dir, open_run_folder

    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="holds no run"):
        open_run_folder(RunConfig.make(out=str(notes), overwrite=True))
    assert (notes / "todo.txt").read_text() == "keep me"
    run = tmp_path / "run"
    _earlier_run(run)
    for resume in (run, run / "checkpoints" / "step_000002"):
        with pytest.raises(ConfigError, match="holds the checkpoint --resume"):
            open_run_folder(RunConfig.make(out=str(run), overwrite=True, resume=str(resume)))
    assert (run / "summary.json").is_file()
    assert open_run_folder(RunConfig.make(out=str(tmp_path / "empty"))) == tmp_path / "empty"
    assert open_run_folder(RunConfig.make(out=str(tmp_path / "empty"))) == tmp_path / "empty"  # empty: fine
    assert open_run_folder(RunConfig.make(out=str(run), overwrite=True)) == run and os.listdir(run) == []

    # the default folder never lands on another run's, even within one second
    class Frozen:
        @staticmethod
        def now() -> datetime:
            return datetime(2024, 5, 6, 7, 8, 9)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("dtrain.job.run.datetime", Frozen)
    first = default_out_dir(RunConfig.make())
    assert first == Path("runs/20240506-070809-dp")
    first.mkdir(parents=True)
    assert default_out_dir(RunConfig.make()) == Path("runs/20240506-070809-dp-2")
