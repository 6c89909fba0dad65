"""Every registered name (algorithms, compressors, consistency policies, strategies) is reachable from
the CLI, the planner and the checkpoint checks: one registry per name family."""

import re

import pytest

from dtrain.cli import build_parser, config_from_args
from dtrain.comm.allreduce import ALGORITHMS as COMM_ALGORITHMS
from dtrain.comm.cost import ALGORITHMS as COST_ALGORITHMS
from dtrain.compress import REGISTRY as COMPRESSORS
from dtrain.config.schema import ConfigHooks
from dtrain.data_parallel.options import ALGORITHMS, OVERLAPS
from dtrain.job.validate import validate
from dtrain.param_server.consistency import POLICIES
from dtrain.perfmodel import ClusterSpec, Device, Link
from dtrain.perfmodel.compression import compression_model
from dtrain.perfmodel.hooks import ModelHooks
from dtrain.perfmodel.ranking import candidates
from dtrain.perfmodel.simulator import parse_policy
from dtrain.strategies import registered
from dtrain.training.checkpointing import run_info
from dtrain.training.context import ProcessHooks

_ARGS = {
    "qsgd": "qsgd:16",
    "topk": "topk:0.01",
    "randomk": "randomk:0.05",
    "threshold": "threshold:0.001",
    "powersgd": "powersgd:2",
    "sign": "sign",
}
_POLICY_ARGS = {"ssp": "ssp:3", "softsync": "softsync:2", "backup": "backup:1"}


def _cfg(*flags):
    return validate(config_from_args(build_parser().parse_args(["run", *flags])))


def _cluster() -> ClusterSpec:
    return ClusterSpec(
        nodes=2,
        devices_per_node=4,
        intra=Link(1e10, 1e-5),
        inter=Link(1e9, 1e-4),
        device=Device(flops=1e10),
        name="made-up",
    )


def test_one_algorithm_registry_for_engine_cost_model_and_cli():
    assert set(ALGORITHMS) == set(COMM_ALGORITHMS) == set(COST_ALGORITHMS)


@pytest.mark.parametrize("name", sorted(COMM_ALGORITHMS))
def test_algorithm_reachable(name):
    assert _cfg("--algorithm", name).options.algorithm == name
    labels = {c.label() for c in candidates(_cluster(), 8)}
    assert f"dp {name} 25MiB" in labels


@pytest.mark.parametrize("name", OVERLAPS)
def test_overlap_reachable(name):
    assert _cfg("--overlap", name).options.overlap == name


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_compressor_reachable(name):
    spec = _ARGS.get(name, name)
    cfg = _cfg("--compression", spec)
    assert cfg.options.compression == spec and run_info(cfg)["compression"] == spec
    assert _cfg("--strategy", "ps", "--compression", spec).options.compression == spec
    from dtrain.compress import from_spec
    from dtrain.compress.base import COLLECTIVES

    collective = from_spec(spec).collective  # the compressor declares its collective; the cost model reads it
    assert collective in COLLECTIVES
    kind = compression_model(spec, measure=False).kind
    assert kind == ("dense" if spec == "none" else "quantizer" if collective == "gathered" else collective)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_reachable(name):
    spec = _POLICY_ARGS.get(name, name)
    cfg = _cfg("--strategy", "ps", "--consistency", spec, "--servers", "2")
    assert cfg.options.consistency == spec and run_info(cfg)["consistency"] == spec
    assert parse_policy(spec)[0] == name  # the simulator reads the policies the runs accept


@pytest.mark.parametrize("name", sorted(registered()))
def test_strategy_reachable(name):
    entry = registered()[name]
    # tensor parallelism splits a gpt's blocks (plans.gpt): the default cnn has no plan and is refused
    model = ["--model", "gpt-tiny", "--dataset", "pytext"] if name == "tensor" else []
    cfg = _cfg("--strategy", name, *model)
    assert cfg.strategy == name and isinstance(cfg.options, entry.options)
    assert entry.hooks_of(ProcessHooks) is not None or ConfigHooks.of(entry).resolve is not None
    if name != "auto":
        assert run_info(cfg)["strategy"] == name
    model = ModelHooks.of(entry)
    if model.candidates is not None:
        assert any(c.strategy == name for c in candidates(_cluster(), 8, averaging=True, pipeline=True, mesh=True))
        assert model.predict is not None and model.memory is not None


def test_strategies_package_names_every_strategy():
    import dtrain.strategies

    # the built-in ones (a test may have registered its own toy strategy beside them)
    builtin = [n for n, e in registered().items() if e.options.__module__.startswith("dtrain.strategies.")]
    missing = [n for n in builtin if f"``{n}``" not in (dtrain.strategies.__doc__ or "")]
    assert len(builtin) >= 10 and missing == [], f"dtrain.strategies' docstring does not list {missing}"


def test_the_registry_says_how_many_strategies_it_registers():
    from dtrain import registry

    builtin = [n for n, e in registered().items() if e.options.__module__.startswith("dtrain.strategies.")]
    words = ["no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]
    doc = " ".join((registry._load_builtins.__doc__ or "").split())
    assert f"the {words[len(builtin)]} built-in strategies" in doc, doc
    listed = re.findall(r"``(\w+)``", doc.split("--")[1])  # the names between the dashes
    assert sorted(listed) == sorted(builtin), (listed, builtin)  # registered in the order first imported


@pytest.mark.parametrize("name", ["cnn", "mlp", "gpt", "gpt-tiny", "gpt-small", "gpt-medium"])
def test_model_reachable(name):
    from dtrain.workloads.load import load_model
    from dtrain.workloads.models import MODELS, is_language_model

    assert name in MODELS
    flags = ["--model", name] + (["--dataset", "pytext"] if is_language_model(name) else [])
    cfg = _cfg(*flags)
    assert cfg.model == name and run_info(cfg)["model"] == name
    if name in ("cnn", "gpt-tiny"):  # the planner's loader builds it with a batch of its data
        model, (x, y), _ = load_model(name, cfg.dataset, batch=4)
        assert model(x).shape[0] == 4 and len(y) == 4


def test_every_dataset_reachable():
    from dtrain.workloads.data import DATASETS

    for name in DATASETS:
        model = "gpt-tiny" if name == "pytext" else "cnn"
        cfg = _cfg("--dataset", name, "--model", model)
        assert cfg.dataset == name and run_info(cfg)["dataset"] == name
        assert len(cfg.load_data().train) > cfg.batch_size
