"""Checkpoint and resume: the on-disk layout, DataParallel's compressor state, `dtrain run --resume`.

Oracle: training 2N steps without interruption. N steps + save + a fresh process
state + load + N steps must give the same parameters (max abs diff < 1e-6,
float32), for DataParallel without compression, with error feedback (TopK) and
with PowerSGD, and for the parameter server under bsp. Resuming with the
compressor state zeroed must give a different result (so the test can fail).
"""

import pickle

import pytest
import torch
from _dist import run_distributed
from _helpers import dtrain_cli, max_diff, read_metrics, read_summary

from dtrain.checkpoint import (
    CheckpointError,
    find_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_checkpoint,
    read_info,
    save_checkpoint,
)
from dtrain.config.schema import RunConfig
from dtrain.errors import ConfigError
from dtrain.job.validate import validate
from dtrain.training.checkpointing import run_info
from dtrain.workloads.models import build_model

TOL = 1e-6


def _model_and_opt(seed=0):
    torch.manual_seed(seed)
    m = build_model("cnn")
    return m, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)


def _one_step(m, opt, seed):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(m(x), y).backward()
    opt.step()


# ---------------------------------------------------------------------- one process: layout and round trip


def test_round_trip_restores_model_optimizer_and_rank_state(tmp_path):
    m, opt = _model_and_opt()
    _one_step(m, opt, 1)
    blob = {"residual": torch.randn(5), "clock": 7}
    path = save_checkpoint(tmp_path / "checkpoints", 3, model=m, optimizer=opt, rank_state=blob, info={"note": "x"})
    assert path.name == "step_000003" and read_info(path)["step"] == 3 and read_info(path)["note"] == "x"

    m2, opt2 = _model_and_opt(seed=1)  # different weights, no optimizer state yet
    info, got = load_checkpoint(tmp_path, model=m2, optimizer=opt2)
    assert info["world_size"] == 1
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["momentum_buffer"], opt2.state[b]["momentum_buffer"])
    assert torch.equal(got["residual"], blob["residual"]) and got["clock"] == 7
    # one more step from both gives the same parameters
    _one_step(m, opt, 2)
    _one_step(m2, opt2, 2)
    assert max_diff(m.parameters(), m2.parameters()) == 0.0


def test_latest_complete_checkpoint_and_interrupted_saves(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    m, opt = _model_and_opt()
    save_checkpoint(root, 2, model=m, optimizer=opt)
    save_checkpoint(root, 5, model=m, optimizer=opt)
    # a save that fails half-way (this rank's state cannot be pickled) leaves no complete checkpoint
    with pytest.raises((pickle.PicklingError, AttributeError)):  # AttributeError: "Can't pickle local object"
        save_checkpoint(root, 7, model=m, optimizer=opt, rank_state=lambda: None)
    assert (root / ".tmp-step_000007").is_dir()
    # a step folder without the marker (e.g. copied by hand, or cut short) is never taken
    (root / "step_000009").mkdir()
    (root / "step_000009" / ".metadata").write_bytes(b"partial")
    assert [(s, ok) for s, _, ok in list_checkpoints(root)] == [(2, True), (5, True), (9, False)]
    assert find_checkpoint(tmp_path / "run") == root / "step_000005"
    assert find_checkpoint(root) == root / "step_000005"
    assert find_checkpoint(root / "step_000002") == root / "step_000002"
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        find_checkpoint(root / "step_000009")
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        find_checkpoint(root / ".tmp-step_000007")
    with pytest.raises(CheckpointError, match="does not exist"):
        find_checkpoint(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        find_checkpoint(tmp_path)
    (root / "step_000002" / "checkpoint.json").unlink()
    (root / "step_000005" / "checkpoint.json").unlink()
    with pytest.raises(CheckpointError, match="only incomplete checkpoints"):
        find_checkpoint(tmp_path / "run")


def test_resaving_a_step_replaces_it(tmp_path):
    m, opt = _model_and_opt()
    save_checkpoint(tmp_path, 4, model=m, optimizer=opt, rank_state={"v": 1})
    save_checkpoint(tmp_path, 4, model=m, optimizer=opt, rank_state={"v": 2})
    assert read_checkpoint(tmp_path)["rank_state"] == {0: {"v": 2}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000004"]


# ---------------------------------------------------------------------- bad input, before any process starts


def _cfg(**kw):
    base = dict(workers=1, batch_size=64, epochs=1, max_steps=20, progress=False, trace=False)
    return RunConfig.from_mapping({**base, **kw})


@pytest.fixture
def one_worker_checkpoint(tmp_path):
    """A real checkpoint as a 1-worker `dtrain run` would write it, at step 10."""
    cfg = _cfg(compression="topk:0.01")
    m, opt = _model_and_opt()
    save_checkpoint(
        tmp_path / "run" / "checkpoints",
        10,
        model=m,
        optimizer=opt,
        info={"run": run_info(cfg), "epoch": 0, "batch": 10},
    )
    return cfg, tmp_path / "run"


def test_resume_checks_pass_for_the_same_run(one_worker_checkpoint):
    cfg, run = one_worker_checkpoint
    validate(cfg.replace(resume=str(run), lr=0.01, max_steps=30))  # hyperparameters and length may change
    validate(cfg.replace(resume=str(run), batch_size=32))  # so may a fixed batch (from the checkpoint's sample)


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(workers=2), "workers=1"),
        (dict(compression="powersgd:2"), "compression='topk:0.01'"),
        (dict(compression="none"), "--compression topk:0.01"),
        (dict(error_feedback=False), "--error-feedback"),
        (dict(batch_schedule="0:64,1:128"), "batch_schedule='0:64,1:128'"),
        (dict(model="mlp"), "model='cnn'"),
        (dict(strategy="ps", workers=1, servers=1), "strategy='dp'"),
        (dict(max_steps=10), "nothing is left to train"),
    ],
)
def test_resume_refuses_a_checkpoint_of_another_run(one_worker_checkpoint, change, words):
    cfg, run = one_worker_checkpoint
    with pytest.raises(ConfigError, match="cannot resume|nothing is left") as e:
        validate(cfg.replace(resume=str(run), **change))
    assert words in str(e.value)


def test_resume_refuses_missing_and_incomplete_checkpoints(tmp_path, one_worker_checkpoint):
    cfg, run = one_worker_checkpoint
    with pytest.raises(CheckpointError, match="does not exist"):
        validate(cfg.replace(resume=str(tmp_path / "missing")))
    (run / "checkpoints" / "step_000010" / "checkpoint.json").unlink()
    with pytest.raises(CheckpointError, match="only incomplete"):
        validate(cfg.replace(resume=str(run)))
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        validate(cfg.replace(resume=str(run / "checkpoints" / "step_000010")))


def test_checkpoint_options_are_checked():
    with pytest.raises(ConfigError, match="checkpoint_every must be >= 0"):
        validate(_cfg(checkpoint_every=-1))
    with pytest.raises(ConfigError, match="need consistency bsp"):
        validate(_cfg(strategy="ps", workers=2, consistency="ssp:1", checkpoint_every=5))
    with pytest.raises(ConfigError, match="instead of auto"):
        validate(_cfg(strategy="auto", resume="."))


@pytest.mark.procs
def test_cli_world_size_mismatch_fails_before_launch(one_worker_checkpoint, tmp_path):
    _, run = one_worker_checkpoint
    out = tmp_path / "out"
    p = dtrain_cli(
        "run",
        "--workers",
        "2",
        "--compression",
        "topk:0.01",
        "--resume",
        str(run),
        "--out",
        str(out),
        "--no-progress",
        timeout=120,
    )
    assert p.returncode == 2, p.stderr[-2000:]
    assert "cannot resume" in p.stderr and "--workers 1" in p.stderr
    assert not out.exists()


# ---------------------------------------------------------------------- DataParallel, real processes


def _dp_resume(rank, world, root, specs, n):
    """Per compressor spec: params after 2n straight steps, after n + save/load + n, and with zeroed state."""
    return {spec: _dp_resume_one(rank, world, f"{root}/{spec.replace(':', '_')}", spec, n) for spec in specs}


def _dp_resume_one(rank, world, root, spec, n):
    from dtrain import DataParallel
    from dtrain.workloads.data import load_dataset

    torch.set_num_threads(1)
    x_all, y_all = load_dataset("digits").train.tensors
    bs = 16

    def build():
        torch.manual_seed(0)
        m = build_model("cnn")
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        return m, opt, DataParallel(m, algorithm="ring", compression=None if spec == "none" else spec, timeout_s=60)

    def train(m, opt, dp, steps):
        for t in steps:
            lo = (t * world + rank) * bs
            opt.zero_grad()
            torch.nn.functional.cross_entropy(dp(x_all[lo : lo + bs]), y_all[lo : lo + bs]).backward()
            opt.step()

    def params(m):
        return torch.cat([p.detach().reshape(-1) for p in m.parameters()]).clone()

    m, opt, dp = build()
    train(m, opt, dp, range(2 * n))
    straight = params(m)
    dp.close()

    m, opt, dp = build()
    train(m, opt, dp, range(n))
    save_checkpoint(root, n, model=m, optimizer=opt, rank_state=dp.compressor_state_dict())
    dp.close()

    m, opt, dp = build()
    _, mine = load_checkpoint(root, model=m, optimizer=opt)
    dp.load_compressor_state_dict(mine)
    train(m, opt, dp, range(n, 2 * n))
    resumed = params(m)
    dp.close()

    out = {"resumed": (straight - resumed).abs().max().item(), "zeroed": None}
    if spec != "none":
        m, opt, dp = build()
        _, mine = load_checkpoint(root, model=m, optimizer=opt)
        dp.load_compressor_state_dict(mine)
        dp.compressor.reset()  # residuals and warm starts forgotten: what a resume without them would do
        train(m, opt, dp, range(n, 2 * n))
        out["zeroed"] = (straight - params(m)).abs().max().item()
        dp.close()
        out["residual_norm"] = sum(float(r.norm()) for r in mine["compressor"]["residuals"].values())
    return out


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_data_parallel_resume_equals_straight_training(tmp_path):
    specs = ["none", "topk:0.01", "powersgd:2"]
    results = run_distributed(_dp_resume, 2, str(tmp_path), specs, 6, timeout=200)
    for spec in specs:
        for rank, r in enumerate(res[spec] for res in results):
            assert r["resumed"] < TOL, (spec, rank, r)
            if spec != "none":
                assert r["residual_norm"] > 0, (spec, rank, r)
                assert r["zeroed"] > 1e-4, (spec, rank, r)  # the compressor state matters: the test can fail
        # per-rank state was saved per rank and differs between ranks
        if spec != "none":
            state = read_checkpoint(tmp_path / spec.replace(":", "_"))["rank_state"]
            r0, r1 = (state[k]["compressor"]["residuals"] for k in (0, 1))
            assert r0.keys() == r1.keys()
            assert any(not torch.equal(r0[k], r1[k]) for k in r0)


# ---------------------------------------------------------------------- dtrain run --resume, end to end


def _dtrain(*args):
    return dtrain_cli("run", *args, "--no-progress", "--no-trace", "--timeout-s", "60", timeout=300)


def _rows(out):
    return {(r["rank"], r["step"]): r for r in read_metrics(out)}


# batch 256 on 2 workers: 5 steps per epoch, so the resumed run starts mid-epoch and crosses an epoch
RUN = ["--workers", "2", "--batch-size", "256", "--epochs", "2", "--max-steps", "8", "--checkpoint-every", "3"]


@pytest.mark.procs
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "extra",
    [
        ["--compression", "sign"],
        ["--strategy", "ps", "--servers", "1", "--compression", "topk:0.01"],
    ],
    ids=["dp-sign", "ps-bsp-topk"],
)
def test_dtrain_run_resume_equals_straight_run(tmp_path, extra):
    a, b = tmp_path / "straight", tmp_path / "resumed"
    p = _dtrain(*RUN, *extra, "--out", str(a))
    assert p.returncode == 0, p.stderr[-3000:]
    assert [s for s, _, ok in list_checkpoints(a / "checkpoints") if ok] == [3, 6, 8]
    p = _dtrain(*RUN, *extra, "--out", str(b), "--resume", str(a / "checkpoints" / "step_000003"))
    assert p.returncode == 0, p.stderr[-3000:]
    summary = read_summary(b)
    assert summary["start_step"] == 3 and summary["steps"] == 5

    ca, cb = read_checkpoint(a / "checkpoints" / "step_000008"), read_checkpoint(b)
    assert cb["info"]["step"] == 8
    if "ps" in extra:  # the server's shard and momentum, each worker's clock and residuals
        sa, sb = ca["rank_state"][0]["ps"], cb["rank_state"][0]["ps"]
        assert max_diff(sa["pieces"], sb["pieces"]) < TOL
        for x, y in zip(sa["optimizer"]["state"].values(), sb["optimizer"]["state"].values()):
            assert (x["momentum_buffer"] - y["momentum_buffer"]).abs().max().item() < TOL
        assert sb["clock"] == {1: 8, 2: 8} and sb["version"] == 8
        workers = (1, 2)
        state = [(r, "ps", "push_compressor") for r in workers]
    else:
        assert max((ca["model"][k] - cb["model"][k]).abs().max().item() for k in ca["model"]) < TOL
        workers = (0, 1)
        state = [(r, "engine", "compressor") for r in workers]
    for r, part, comp in state:
        ra, rb = ca["rank_state"][r][part][comp]["residuals"], cb["rank_state"][r][part][comp]["residuals"]
        assert ra.keys() == rb.keys() and all((ra[k] - rb[k]).abs().max().item() < TOL for k in ra)
    # the resumed run saw the same batches: same loss at every step it ran
    ra, rb = _rows(a), _rows(b)
    assert sorted(rb) == sorted((r, s) for r in workers for s in range(3, 8))
    assert all(abs(ra[k]["loss"] - rb[k]["loss"]) < TOL and ra[k]["epoch"] == rb[k]["epoch"] for k in rb)
    assert {rb[(workers[0], s)]["epoch"] for s in range(3, 8)} == {0, 1}


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_a_plain_dp_checkpoint_resumes_on_fewer_workers_as_if_nothing_changed(tmp_path):
    """4 workers save, 2 resume: every rank held the same model and optimizer state, and the
    global batch (256) is the same, so the resumed steps average the gradients of the same samples: the
    per-step loss (mean over ranks, each rank a quarter or half of the batch) and the final model are the
    4-worker run's. 3 workers would train on 255 samples a step: refused before any process starts."""
    a, b = tmp_path / "four", tmp_path / "two"
    run = ["--batch-size", "256", "--epochs", "2", "--max-steps", "8", "--checkpoint-every", "3"]
    p = _dtrain(*run, "--workers", "4", "--out", str(a))
    assert p.returncode == 0, p.stderr[-3000:]
    p = _dtrain(*run, "--workers", "2", "--out", str(b), "--resume", str(a / "checkpoints" / "step_000003"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert read_summary(b)["start_step"] == 3 and read_summary(b)["world_size"] == 2

    def mean_loss(out):
        by = {}
        for r in read_metrics(out):
            by.setdefault(r["step"], []).append(r["loss"])
        return {s: sum(v) / len(v) for s, v in by.items()}

    la, lb = mean_loss(a), mean_loss(b)
    assert sorted(lb) == list(range(3, 8))
    assert all(abs(la[s] - lb[s]) < 1e-5 for s in lb), (la, lb)
    ca, cb = read_checkpoint(a / "checkpoints" / "step_000008"), read_checkpoint(b)
    assert max((ca["model"][k] - cb["model"][k]).abs().max().item() for k in ca["model"]) < 1e-5
    p = dtrain_cli(
        "run",
        *run,
        "--workers",
        "3",
        "--resume",
        str(a),
        "--out",
        str(tmp_path / "three"),
        "--no-progress",
        timeout=120,
    )
    assert p.returncode == 2 and "global batch of 256, 3 workers would take 255" in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "three").exists()
