"""The strategy seam: a throw-away strategy (tests/_toy_strategy.py, one module and one
``register`` call) runs through ``dtrain run``, checkpoint/resume and the planner with no
other file touched; the registry answers every layer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _helpers import dtrain_cli, read_metrics, read_summary

from dtrain.errors import ConfigError
from dtrain.job.validate import validate

TESTS = Path(__file__).resolve().parent


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setenv("DTRAIN_STRATEGY_MODULES", "_toy_strategy")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.syspath_prepend(str(TESTS))
    import _toy_strategy

    from dtrain import registry

    yield registry.register(_toy_strategy.ALONE, replace=True)  # registered again after an earlier test's teardown
    registry.unregister("alone")


def _losses(out: Path) -> dict[tuple[int, int], float]:
    return {(r["rank"], r["step"]): r["loss"] for r in read_metrics(out)}


@pytest.mark.procs
def test_toy_strategy_runs_checkpoints_and_resumes(toy, tmp_path):
    common = [
        "--strategy",
        "alone",
        "--workers",
        "2",
        "--epochs",
        "1",
        "--max-steps",
        "12",
        "--no-progress",
        "--no-trace",
        "--report-every",
        "3",
    ]
    a = tmp_path / "a"
    p = dtrain_cli("run", *common, "--checkpoint-every", "6", "--out", str(a))
    assert p.returncode == 0, p.stderr[-3000:]
    summary = read_summary(a)
    assert summary["strategy"] == "alone" and summary["steps"] == 12 and summary["bytes_sent_per_step"] == 0
    assert "[alone]" in (a / "config.toml").read_text() and "report_every = 3" in (a / "config.toml").read_text()
    full = _losses(a)
    assert full[(0, 11)] != full[(1, 11)]  # the workers really train apart
    b = tmp_path / "b"
    p = dtrain_cli("run", *common, "--resume", str(a / "checkpoints" / "step_000006"), "--out", str(b))
    assert p.returncode == 0, p.stderr[-3000:]
    resumed = _losses(b)
    assert sorted(resumed) == [(r, s) for r in range(2) for s in range(6, 12)]
    for key, loss in resumed.items():
        assert loss == pytest.approx(full[key], rel=1e-6, abs=1e-7), key


def test_toy_strategy_in_the_planner_and_the_cli(toy):
    import torch
    from torch import nn

    from dtrain.cli import build_parser, config_from_args
    from dtrain.perfmodel import ClusterSpec, Device, Link
    from dtrain.perfmodel.ranking import candidates, plan

    cluster = ClusterSpec(
        nodes=4,
        devices_per_node=1,
        intra=Link(1e9, 1e-5),
        inter=Link(1e8, 1e-4),
        device=Device(flops=1e10),
        name="made-up",
    )
    labels = [c.label() for c in candidates(cluster, 4)]
    assert "alone x4" in labels
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    p = plan(model, (torch.randn(64, 64), torch.randint(0, 10, (64,))), cluster, measure=False)
    alone = p.find("alone x4")
    assert alone is not None and "no averaging" in alone.why
    single = p.find("single process")
    assert single is not None and alone.samples_per_s > 2 * single.samples_per_s and alone.bytes_per_step == 0
    assert alone.step_s == pytest.approx(alone.compute_s + p.cluster.device.overhead)
    cfg = config_from_args(build_parser().parse_args(["run", "--strategy", "alone", "--report-every", "2"]))
    assert validate(cfg).options.report_every == 2
    with pytest.raises(ConfigError, match="report_every must be >= 1"):
        config_from_args(build_parser().parse_args(["run", "--strategy", "alone", "--report-every", "0"]))


def test_options_of_another_strategy_are_refused_with_where_they_belong():
    from dtrain.config.schema import RunConfig

    with pytest.raises(ConfigError, match=r"belongs to strategy (\w+ / )*ps\b"):
        RunConfig.make(strategy="dp", servers=2)
    with pytest.raises(ConfigError, match=r"\[ps\] holds options of strategy ps"):
        RunConfig.from_mapping({"strategy": "dp", "ps": {"servers": 2}})
    cfg = RunConfig.from_mapping({"strategy": "ps", "servers": 3, "ps": {"servers": 2, "consistency": "asp"}})
    assert (cfg.options.servers, cfg.options.consistency, cfg.num_processes) == (3, "asp", 7)


def test_unknown_plugin_module_is_a_clear_error(monkeypatch):
    from dtrain import registry

    monkeypatch.setenv("DTRAIN_STRATEGY_MODULES", "no_such_module_here")
    with pytest.raises(ConfigError, match="no_such_module_here"):
        registry.get("dp")
