"""Planner: candidates, ranking on made-up clusters, rejections, ``pick_plan`` for ``--strategy auto``, CLI."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dtrain.config.schema import RunConfig
from dtrain.errors import ConfigError
from dtrain.job.validate import validate
from dtrain.perfmodel import ClusterSpec, Device, Link, dump_cluster, plan
from dtrain.perfmodel.ranking import candidates
from dtrain.perfmodel.spec import CompressorCost, this_host
from dtrain.perfmodel.units import parse_rate
from dtrain.planning import pick_plan
from dtrain.planning.cli import main as plan_main
from dtrain.planning.cli import parse_strategy


def spec(rate: str, latency: float, nodes: int = 4, per_node: int = 1, memory: float = 8e9) -> ClusterSpec:
    comps = {"fp16": CompressorCost(0.5, 1e-10, 1e-10), "topk:0.01": CompressorCost(0.02, 3e-9, 1e-10)}
    return ClusterSpec(
        nodes=nodes,
        devices_per_node=per_node,
        inter=Link(parse_rate(rate), latency),
        intra=Link(parse_rate("40gbit"), 5e-6),
        device=Device(flops=1e10, memory=memory),
        compressors=comps,
        name=f"made-up {rate}",
    )


def tiny() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    return model, (torch.randn(64, 64), torch.randint(0, 10, (64,)))


def test_candidates_cover_every_family_once():
    labels = [s.label() for s in candidates(spec("1gbit", 1e-4))]
    assert len(labels) == len(set(labels))
    assert "single process" in labels and "torch DDP 25MiB" in labels
    assert {"dp ring 25MiB", "dp tree 25MiB", "dp recursive_doubling 1MiB", "dp rabenseifner 25MiB"} <= set(labels)
    assert not any("hierarchical" in x for x in labels)  # one device per node: nothing to be hierarchical about
    assert any("hierarchical" in x for x in (s.label() for s in candidates(spec("1gbit", 1e-4, 2, 2))))
    assert {"ps bsp 1 server", "ps asp 2 servers", "dp ring 25MiB topk:0.01"} <= set(labels)
    exact = [s for s in candidates(spec("1gbit", 1e-4), exact_only=True)]
    assert all(s.opts.compressor_spec() == "none" and getattr(s.opts, "consistency", "bsp") == "bsp" for s in exact)


def test_ranking_follows_the_network():
    model, sample = tiny()
    fast = plan(model, sample, spec("100gbit", 1e-6), measure=False)
    slow = plan(model, sample, spec("1mbit", 1e-3), measure=False, exact_only=True)
    assert fast.best.strategy.kind in ("dp", "ddp") and fast.best.strategy.workers == 4
    assert slow.best.strategy.kind == "single"  # at 1 Mbit/s no exchange pays for itself
    rates = [p.samples_per_s for p in fast.ranked]
    assert rates == sorted(rates, reverse=True)
    comp = plan(model, sample, spec("1mbit", 1e-3), measure=False, compressions=("topk:0.01",))
    topk = comp.find("dp ring 25MiB topk:0.01")
    ring = comp.find("dp ring 25MiB")
    assert topk is not None and ring is not None and topk.step_s < ring.step_s
    assert "approximate" in topk.why and "approximate" not in ring.why


def test_rejections_give_the_reason():
    model, sample = tiny()
    p = plan(model, sample, spec("1gbit", 1e-4, memory=50e3), measure=False)  # 50 kB devices
    assert not p.ranked
    assert all("per device" in reason for _, reason in p.rejected if "batch" not in reason)
    with pytest.raises(Exception, match="no strategy fits"):
        _ = p.best
    q = plan(model, sample, spec("1gbit", 1e-4), measure=False, batch=2)  # 64 over 3 is fine: test_uneven_batch
    assert any("global batch 2 is smaller than 3 workers" in r for s, r in q.rejected if s.workers == 3)
    assert "rejected:" in q.table()


def _local_cache(tmp_path, monkeypatch, workers: int = 4, **device: object) -> dict[int, ClusterSpec]:
    """This machine's calibrations for 1 and ``workers`` processes, in a cache of the test's own; ``device``:
    per field of the device, its value for (1, ``workers``) processes."""
    monkeypatch.setenv("DTRAIN_CACHE", str(tmp_path))
    out = {}
    for i, w in enumerate((1, workers)):
        dev = Device(host=this_host(), overhead=2e-4, **{k: v[i] for k, v in device.items()})  # type: ignore[index]
        out[w] = s = ClusterSpec(
            nodes=1,
            devices_per_node=w,
            intra=Link(parse_rate("10gbit"), 50e-6),
            inter=Link(parse_rate("10gbit"), 50e-6),
            device=dev,
            compressors=spec("1gbit", 0).compressors,
            name="local",
        )
        (tmp_path / f"local-{this_host()}-w{w}.toml").write_text(dump_cluster(s))
    return out


def test_a_local_plan_predicts_each_choice_on_the_calibration_for_its_processes(tmp_path, monkeypatch):
    """On one machine, one process computes alone on every core while four share them: the single process is
    predicted on the calibration for 1 (its FLOP rate; the model profiled at its threads), dp on 4 on the one
    for 4, as each alone would be; not both on one."""
    from dtrain.planning.auto import plan as plan_here
    from dtrain.registry import Choice

    specs = _local_cache(tmp_path, monkeypatch, 4, flops=(4e10, 1e10), threads=(2, 1))
    model, sample = tiny()
    single, four = Choice("dp", 1), Choice("dp", 4)
    got = plan_here(model, sample, None, workers=4, strategies=[single, four], measure=False)
    for s, w in ((single, 1), (four, 4)):
        alone = plan(model, sample, specs[w], workers=w, strategies=[s], measure=False)
        assert got.find(s.label()) == alone.ranked[0], s.label()
    assert got.cluster.devices == 4 and len(got.ranked) == 2
    measured = plan_here(model, sample, None, workers=4, strategies=[single, four])
    assert {p.threads for p in measured.profiles.values()} == {2, 1}  # profiled at each job's threads


def test_a_second_plan_measures_nothing_and_ranks_the_same(tmp_path, monkeypatch):
    """The model's profile and the compressed collectives' counts are kept beside this machine's calibration:
    a second plan (as in a new process: the counts this process holds forgotten) measures neither and ranks
    the same; another model is measured."""
    from dtrain.perfmodel import _traffic, profile
    from dtrain.planning.auto import measured_here
    from dtrain.planning.auto import plan as plan_here

    _local_cache(tmp_path, monkeypatch, 2)
    model, sample = tiny()
    first = plan_here(model, sample, None, workers=2, compressions=("topk:0.01",))
    assert first.find("dp ring 25MiB topk:0.01") is not None and all(p.measured for p in first.profiles.values())
    assert {f.name for f in measured_here().iterdir()} == {"profiles.json", "traffic.json"}
    _traffic._counts.clear()
    _traffic._current.clear()

    def again(*_a, **_k):
        raise AssertionError("measured again")

    monkeypatch.setattr(profile, "_measure", again)
    monkeypatch.setattr(_traffic, "_count", again)
    second = plan_here(model, sample, None, workers=2, compressions=("topk:0.01",))
    assert second.ranked == first.ranked and second.profiles == first.profiles
    wider = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 10))
    with pytest.raises(AssertionError, match="measured again"):
        plan_here(wider, sample, None, workers=2, compressions=("topk:0.01",))


def test_choose_returns_overrides_that_make_a_valid_run(tmp_path, monkeypatch, capsys):
    _local_cache(tmp_path, monkeypatch)
    cfg = RunConfig.make(strategy="auto", workers=4, batch_size=64)
    best = pick_plan(cfg)
    assert best.strategy in ("dp", "ddp", "ps")
    run_cfg = validate(cfg.replace(strategy=best.strategy, workers=best.workers, options=best.options))
    assert run_cfg.num_processes <= 4
    assert "--strategy auto chose" in capsys.readouterr().err


def test_plan_cli_table_and_simulation(tmp_path, capsys):
    toml = tmp_path / "c.toml"
    toml.write_text(dump_cluster(spec("100mbit", 1e-4)))
    assert plan_main(["--model", "cnn", "--cluster", str(toml), "--top", "3", "--no-measure"]) == 0
    out = capsys.readouterr().out
    assert "plan for made-up 100mbit" in out and "  1  " in out and "more" in out
    png = tmp_path / "curve.png"
    rc = plan_main(
        [
            "--simulate",
            "--workers",
            "2,4,8",
            "--model",
            "cnn",
            "--cluster",
            str(toml),
            "--no-measure",
            "--strategies",
            "dp:ring,ps:asp:1/4+fp16",
            "--stragglers",
            "lognormal:0.1",
            "--png",
            str(png),
        ]
    )
    assert rc == 0 and png.stat().st_size > 1000
    out = capsys.readouterr().out
    assert out.count("dp:ring") == 3 and "ps:asp:1/4+fp16" in out
    assert plan_main(["--simulate", "--workers", "2", "--strategies", "dq:ring", "--cluster", str(toml)]) == 2
    assert "cannot read strategy" in capsys.readouterr().err


def test_strategy_text():
    assert parse_strategy("dp:tree:4+fp16", 8).label() == "dp tree 4MiB fp16"
    assert parse_strategy("ps:ssp:3:2", 8).label() == "ps ssp:3 2 servers"
    assert parse_strategy("ps:asp:1/4", 16).options.servers == 4
    assert parse_strategy("ddp", 4).strategy == "ddp" and parse_strategy("dp", 4).opts.algorithm == "ring"
    # read by each strategy's own parse hook: one without one (pipeline) is refused, naming those that read (by
    # name, whatever order the strategies registered in)
    for bad in ("pipeline:1f1b", "dp:ring:many", "nope"):
        with pytest.raises(ConfigError, match=r"cannot read strategy .*ddp, dp:ALG\[:MB\], ps:CONSISTENCY:SERVERS"):
            parse_strategy(bad, 4)


def test_the_devices_a_strategy_trains_on_are_its_entrys():
    from dtrain.job.validate import trains_on
    from dtrain.registry import registered

    assert trains_on("cuda") == ["dp", "ddp"]
    assert trains_on("cpu") == list(registered())  # every strategy trains on the CPU
