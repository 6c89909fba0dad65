"""``dtrain run --strategy local_sgd | easgd | gossip``: real processes through the CLI, the bytes
each worker sends against the closed form, checkpoint/resume, and bad input refused before any
process starts. The wrappers' own oracles are in tests/test_local_sgd_dist.py,
tests/test_easgd_dist.py and tests/test_gossip_dist.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from _helpers import dtrain_cli, read_metrics, read_summary

from dtrain.workloads.models import build_model

pytestmark = pytest.mark.procs  # every test here starts processes

COMMON = ["--epochs", "1", "--no-progress", "--no-trace", "--batch-size", "32"]


def _model_bytes() -> int:
    return sum(p.numel() * p.element_size() for p in build_model("cnn").parameters())


def _rank_bytes(out: Path, rank: int) -> int:
    return sum(int(r["bytes_sent"]) for r in read_metrics(out) if r["rank"] == rank)


def _losses(out: Path) -> dict[tuple[int, int], float]:
    return {(r["rank"], r["step"]): r["loss"] for r in read_metrics(out)}


def test_local_sgd_runs_sends_the_closed_form_and_resumes(tmp_path):
    a = tmp_path / "a"
    flags = [*COMMON, "--strategy", "local_sgd", "--workers", "2", "--period", "3", "--max-steps", "12"]
    p = dtrain_cli("run", *flags, "--checkpoint-every", "6", "--out", str(a))
    assert p.returncode == 0, p.stderr[-3000:]
    s = read_summary(a)
    assert s["strategy"] == "local_sgd" and s["steps"] == 12
    assert s["evaluated"] == "average of the replicas" and s["consensus_distance"] > 0
    assert [h["step"] for h in s["consensus_history"]] == [12, 12]  # after the epoch and at the end
    rounds = s["averaging_rounds"]
    assert rounds == 4  # steps 0, 3, 6, 9 (torch's PeriodicModelAverager counts the same way)
    # ring average of n bytes over N = 2: 2 (N-1) / N n = n per round, each rank
    for rank in (0, 1):
        assert _rank_bytes(a, rank) == rounds * _model_bytes()
    full = _losses(a)
    assert full[(0, 11)] != full[(1, 11)]  # the replicas train apart between averages
    b = tmp_path / "b"
    p = dtrain_cli("run", *flags, "--resume", str(a / "checkpoints" / "step_000006"), "--out", str(b))
    assert p.returncode == 0, p.stderr[-3000:]
    resumed = _losses(b)
    assert sorted(resumed) == [(r, st) for r in range(2) for st in range(6, 12)]
    for key, loss in resumed.items():
        assert loss == pytest.approx(full[key], rel=1e-5, abs=1e-6), key


EASGD = [*COMMON, "--strategy", "easgd", "--alpha", "0.2", "--period", "3", "--workers", "2", "--max-steps", "12"]


@pytest.fixture(scope="module")
def easgd_run(tmp_path_factory) -> Path:
    """easgd with the centre by allreduce, a checkpoint every 5 steps: the resume test's uninterrupted run, and
    the allreduce case of the centre test (its bytes do not depend on the period or the checkpoints)."""
    a = tmp_path_factory.mktemp("easgd") / "a"
    p = dtrain_cli("run", *EASGD, "--checkpoint-every", "5", "--out", str(a))
    assert p.returncode == 0, p.stderr[-3000:]
    return a


def test_easgd_resumes_with_its_centre(easgd_run, tmp_path):
    a, b = easgd_run, tmp_path / "b"
    p = dtrain_cli("run", *EASGD, "--resume", str(a / "checkpoints" / "step_000005"), "--out", str(b))
    assert p.returncode == 0, p.stderr[-3000:]
    full, resumed = _losses(a), _losses(b)
    assert sorted(resumed) == [(r, st) for r in range(2) for st in range(5, 12)]
    for key, loss in resumed.items():  # rounds at steps 6 and 9 pull towards the restored centre
        assert loss == pytest.approx(full[key], rel=1e-5, abs=1e-6), key


def test_gossip_sync_sends_degree_times_the_model_every_step(tmp_path):
    out = tmp_path / "g"
    p = dtrain_cli(
        "run",
        *COMMON,
        "--strategy",
        "gossip",
        "--topology",
        "ring",
        "--workers",
        "4",
        "--max-steps",
        "6",
        "--out",
        str(out),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    s = read_summary(out)
    assert s["strategy"] == "gossip" and s["steps"] == 6 and s["averaging_rounds"] == 6
    for rank in range(4):  # a ring of 4: two neighbours, the whole model to each, every step
        assert _rank_bytes(out, rank) == 6 * 2 * _model_bytes()
    assert s["evaluated"] == "average of the replicas" and s["consensus_distance"] > 0


@pytest.mark.parametrize("servers", [0, 1])
def test_easgd_runs_with_the_centre_by_allreduce_or_on_a_server(request, tmp_path, servers):
    if servers == 0:  # the allreduce centre: the resume test's run
        out = request.getfixturevalue("easgd_run")
    else:
        out = tmp_path / f"e{servers}"
        p = dtrain_cli(
            "run",
            *COMMON,
            "--strategy",
            "easgd",
            "--alpha",
            "0.2",
            "--period",
            "2",
            "--workers",
            "2",
            "--servers",
            str(servers),
            "--max-steps",
            "8",
            "--out",
            str(out),
        )
        assert p.returncode == 0, p.stderr[-3000:]
    s = read_summary(out)
    assert s["strategy"] == "easgd" and s["workers"] == 2 and s["averaging_rounds"] >= 1
    sent, rounds = _rank_bytes(out, servers), s["averaging_rounds"]
    if servers == 0:  # a ring of 2 sends n per round
        assert sent == rounds * _model_bytes()
    else:  # a push of n per round (the pull comes back from the server), plus the messages' headers
        assert rounds * _model_bytes() < sent <= rounds * (_model_bytes() + 128)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--strategy", "local_sgd", "--period", "0"], "period must be >= 1, got 0"),
        (["--strategy", "easgd", "--alpha", "1.5"], "alpha must be in (0, 1), got 1.5"),
        (["--strategy", "gossip", "--topology", "torus", "--workers", "2"], "torus"),
        (["--strategy", "local_sgd", "--hierarchy", "2:x"], "'2:x'"),
        (["--strategy", "local_sgd", "--hierarchy", "3:2,4:4", "--workers", "4"], "3"),
    ],
)
def test_bad_decentralized_options_are_refused_before_any_process(tmp_path, flags, message):
    out = tmp_path / "bad"
    p = dtrain_cli("run", *flags, "--out", str(out), timeout=60)
    assert p.returncode != 0
    assert message in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr and "worker processes failed" not in p.stderr  # refused in the parent
    assert not (out / "metrics.jsonl").exists()
