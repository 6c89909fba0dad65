"""A parameter-server checkpoint resumes on another number of workers.

Oracle: under bsp an update is the mean gradient of one global batch, whoever computed its slices. With
the same global batch (192: 48, 64 or 96 samples a worker on 4, 3 or 2 workers, 7 steps an epoch on each)
a run saved on 4 workers and resumed on 2 -- and that one's checkpoint resumed on 3 -- follows the
uninterrupted 4-worker run: the same per-step loss (mean over the workers) and the same final shard and
momentum, up to the order in which the server sums the gradients (measured: about 2e-7 on the loss, 3e-8
on the parameters; the tolerances are 1e-5 and 1e-6). A stateful compressor (each worker's residuals), a
different ``--servers`` and a global batch that does not divide are refused before any process starts.
"""

import pytest
import torch
from _helpers import dtrain_cli, max_diff, mean_losses, read_summary
from _procs import Run, kill_rank, past_checkpoint

from dtrain.checkpoint import read_checkpoint, save_checkpoint
from dtrain.config.schema import RunConfig
from dtrain.errors import ConfigError
from dtrain.job.validate import validate
from dtrain.param_server.consistency import parse_consistency
from dtrain.param_server.parameter_server import reshard_server_state
from dtrain.strategies.ps import PSOptions
from dtrain.training.checkpointing import run_info

# ---------------------------------------------------------------------- one process: the rules


def test_reshards_where_no_worker_keeps_state_of_its_own():
    assert PSOptions().reshards()
    assert PSOptions(compression="fp16").reshards() and PSOptions(compression="bf16").reshards()
    assert not PSOptions(compression="topk:0.01").reshards()  # error-feedback residuals per worker
    assert not PSOptions(consistency="ssp:2").reshards()  # no common clock (and no checkpoints)


def test_a_server_state_moves_to_new_workers_at_the_common_clock():
    saved = {"pieces": [torch.ones(3)], "clock": {1: 6, 2: 6, 3: 6, 4: 6}, "version": 6, "received": 24, "updates": 6}
    got = reshard_server_state(saved, [1, 2], parse_consistency("bsp"))
    assert got["clock"] == {1: 6, 2: 6} and got["received"] == 12  # a 2-worker run's count after 6 steps
    assert got["version"] == 6 and got["updates"] == 6 and got["pieces"] is saved["pieces"]
    assert reshard_server_state(saved, [1, 2, 3, 4, 5])["received"] == 30
    with pytest.raises(ConfigError, match="different clocks"):
        reshard_server_state({**saved, "clock": {1: 6, 2: 5}}, [1])
    with pytest.raises(ConfigError, match="bsp only"):
        reshard_server_state(saved, [1, 2], parse_consistency("asp"))


def _cfg(**kw):
    base = dict(
        strategy="ps", servers=1, workers=4, batch_size=192, epochs=2, max_steps=20, progress=False, trace=False
    )
    return RunConfig.from_mapping({**base, **kw})


@pytest.fixture
def four_worker_marker(tmp_path):
    """What check_resume reads of a 4-worker ps checkpoint at step 4: its marker (the state is not loaded)."""

    def make(**kw):
        cfg = _cfg(**kw)
        save_checkpoint(
            tmp_path / "run" / "checkpoints", 4, rank_state={}, info={"run": run_info(cfg), "epoch": 0, "batch": 4}
        )
        return tmp_path / "run"

    return make


def test_resume_on_other_workers_passes_the_checks(four_worker_marker):
    run = four_worker_marker()
    for w in (2, 3):
        validate(_cfg(workers=w, resume=str(run)))


@pytest.mark.parametrize(
    "saved, change, words",
    [
        ({}, dict(workers=5), "global batch of 192, 5 workers would take 190"),
        ({}, dict(servers=2, workers=2), "servers=1; this run has servers=2"),
        (
            dict(compression="topk:0.01"),
            dict(compression="topk:0.01", workers=2),
            "saved by 4 workers with --compression topk:0.01, whose state (error-feedback residuals",
        ),
        (dict(compression="topk:0.01"), dict(compression="none", workers=2), "--compression topk:0.01"),
    ],
    ids=["batch", "servers", "topk", "topk-dropped"],
)
def test_resume_on_other_workers_refuses_what_would_not_continue_the_run(four_worker_marker, saved, change, words):
    run = four_worker_marker(**saved)
    with pytest.raises(ConfigError, match="cannot resume") as e:
        validate(_cfg(**{**saved, **change}, resume=str(run)))
    assert words in str(e.value)


# ---------------------------------------------------------------------- real processes: 4 -> 2 -> 3 workers

RUN = [
    "--strategy",
    "ps",
    "--servers",
    "1",
    "--batch-size",
    "192",
    "--epochs",
    "2",
    "--max-steps",
    "10",
    "--checkpoint-every",
    "4",
    "--lr",
    "0.3",
    "--no-progress",
    "--no-trace",
    "--timeout-s",
    "60",
]


def _dtrain(*args):
    return dtrain_cli("run", *RUN, *args, timeout=240)


def _server(ckpt):
    return read_checkpoint(ckpt)["rank_state"][0]["ps"]


@pytest.mark.procs
@pytest.mark.timeout(600)
def test_a_ps_checkpoint_resumes_on_fewer_and_on_more_workers_as_if_nothing_changed(tmp_path):
    a, b, c = tmp_path / "four", tmp_path / "two", tmp_path / "three"
    p = _dtrain("--workers", "4", "--out", str(a))
    assert p.returncode == 0, p.stderr[-3000:]
    p = _dtrain("--workers", "2", "--out", str(b), "--resume", str(a / "checkpoints" / "step_000004"))
    assert p.returncode == 0, p.stderr[-3000:]
    # the 2-worker run's own checkpoint at step 8 (it crossed into epoch 1 at step 7) goes on 3 workers
    p = _dtrain("--workers", "3", "--out", str(c), "--resume", str(b / "checkpoints" / "step_000008"))
    assert p.returncode == 0, p.stderr[-3000:]
    for out, start, world in ((b, 4, 3), (c, 8, 4)):
        s = read_summary(out)
        assert (s["start_step"], s["steps"], s["world_size"]) == (start, 10 - start, world), s

    la, lb, lc = mean_losses(a), mean_losses(b), mean_losses(c)
    assert sorted(lb) == list(range(4, 10)) and sorted(lc) == [8, 9]
    assert all(abs(la[s] - lb[s]) < 1e-5 for s in lb), (la, lb)
    assert all(abs(la[s] - lc[s]) < 1e-5 for s in lc), (la, lc)
    assert la[9] < la[4] - 0.02, la  # it trains: the comparison is of a moving trajectory

    sa = _server(a / "checkpoints" / "step_000010")
    for out, workers in ((b, 2), (c, 3)):
        sb = _server(out / "checkpoints" / "step_000010")
        assert max_diff(sa["pieces"], sb["pieces"]) < 1e-6
        assert (
            max_diff(
                [x["momentum_buffer"] for x in sa["optimizer"]["state"].values()],
                [x["momentum_buffer"] for x in sb["optimizer"]["state"].values()],
            )
            < 1e-6
        )
        # the clock table of the new workers, and the gradient count a run on them would have
        assert sb["clock"] == {1 + i: 10 for i in range(workers)} and sb["version"] == sb["updates"] == 10
        assert sb["received"] == 10 * workers
    ranks = read_checkpoint(c / "checkpoints" / "step_000010")["rank_state"]
    assert [ranks[r]["ps"]["clock"] for r in (1, 2, 3)] == [10, 10, 10]
    assert {(ranks[r]["epoch"], ranks[r]["batch"]) for r in (1, 2, 3)} == {(1, 3)}


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_refusals_come_before_any_process_starts(four_worker_marker, tmp_path):
    run = four_worker_marker(compression="topk:0.01")
    out = tmp_path / "out"
    p = dtrain_cli(
        "run",
        *RUN,
        "--workers",
        "2",
        "--compression",
        "topk:0.01",
        "--resume",
        str(run),
        "--out",
        str(out),
        timeout=120,
    )
    assert p.returncode == 2 and "saved by 4 workers with --compression topk:0.01" in p.stderr, p.stderr[-2000:]
    assert "resume with --workers 4" in p.stderr and not out.exists()
    p = dtrain_cli(
        "run",
        *RUN,
        "--servers",
        "2",
        "--workers",
        "4",
        "--compression",
        "topk:0.01",
        "--resume",
        str(run),
        "--out",
        str(out),
        timeout=120,
    )
    assert p.returncode == 2 and "(--servers 1)" in p.stderr and not out.exists(), p.stderr[-2000:]


@pytest.mark.procs
@pytest.mark.timeout(600)
def test_with_min_workers_a_ps_run_that_loses_a_worker_goes_on_on_fewer_as_the_run_on_all(tmp_path):
    """Scale-down (``--max-restarts 1 --min-workers 2``): a worker SIGKILLed after the step-10 checkpoint, the
    run restarts on 1 server and 2 workers from it (global batch 48 = 3 x 16 = 2 x 24) and follows the
    uninterrupted 3-worker run step by step (measured: 2e-7 on the loss)."""

    # 3 workers that lose one (the scale-down of 4 -> 3 on fewer processes); the kill comes 3 steps after the
    # step-10 checkpoint (rows for the restart to drop), 17 before the end
    scale = (
        "run",
        "--strategy",
        "ps",
        "--servers",
        "1",
        "--workers",
        "3",
        "--batch-size",
        "48",
        "--epochs",
        "2",
        "--max-steps",
        "30",
        "--checkpoint-every",
        "10",
        "--no-progress",
        "--timeout-s",
        "60",
    )
    plain, out = tmp_path / "plain", tmp_path / "scaled"
    p = dtrain_cli(*scale, "--out", str(plain), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    run = Run(*scale, "--max-restarts", "1", "--min-workers", "2", "--out", str(out))
    kill_rank(out, 2, run, once=past_checkpoint(out, 10, 2))
    run.finish(timeout=300)
    assert run.p.returncode == 0, run.stderr[-3000:]
    summary = read_summary(out)
    frm = summary["world_sizes"][1]["from_step"]
    assert summary["world_sizes"] == [{"from_step": 0, "workers": 3}, {"from_step": frm, "workers": 2}], summary
    got, ref = mean_losses(out), mean_losses(plain)
    assert sorted(got) == sorted(ref) == list(range(30))
    assert max(abs(got[s] - ref[s]) for s in ref) < 1e-5, (got, ref)
