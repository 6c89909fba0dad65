"""Every registered name (algorithms, compressors, consistency policies, strategies) is reachable from the CLI."""

import pytest

from dtrain.cli import build_parser, config_from_args
from dtrain.comm.allreduce import ALGORITHMS as COMM_ALGORITHMS
from dtrain.compress import REGISTRY as COMPRESSORS
from dtrain.config import ALGORITHMS, STRATEGIES
from dtrain.param_server.consistency import POLICIES
from dtrain.train import RUNNERS

_ARGS = {"qsgd": "qsgd:16", "topk": "topk:0.01", "randomk": "randomk:0.05", "threshold": "threshold:0.001",
         "powersgd": "powersgd:2", "sign": "sign"}
_POLICY_ARGS = {"ssp": "ssp:3", "softsync": "softsync:2", "backup": "backup:1"}


def _cfg(*flags):
    return config_from_args(build_parser().parse_args(["run", *flags])).validate()


def test_cli_algorithms_are_the_comm_registry():
    assert set(ALGORITHMS) == set(COMM_ALGORITHMS)


@pytest.mark.parametrize("name", sorted(COMM_ALGORITHMS))
def test_algorithm_reachable(name):
    assert _cfg("--algorithm", name).algorithm == name


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_compressor_reachable(name):
    spec = _ARGS.get(name, name)
    assert _cfg("--compression", spec).compression == spec


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_reachable(name):
    spec = _POLICY_ARGS.get(name, name)
    assert _cfg("--strategy", "ps", "--consistency", spec, "--servers", "2").consistency == spec


def test_every_strategy_has_a_runner_or_planner():
    for s in STRATEGIES:
        assert s in RUNNERS or s == "auto"
