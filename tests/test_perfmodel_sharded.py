"""ZeRO in the performance model: memory per stage, step time and bytes, ``--memory-limit`` in the planner.

Pure: made-up profiles and clusters, values worked out by hand in the comments
(Rajbhandari et al., "ZeRO", SC 2020: with Adam in float32 the model states of
``Psi`` parameters are 16 Psi bytes per rank, 8 Psi + 8 Psi/N at stage 1,
4 Psi + 12 Psi/N at stage 2 and 16 Psi/N at stage 3).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from dtrain.errors import ConfigError
from dtrain.perfmodel import ClusterSpec, Device, Link, dump_cluster, plan, predict, simulate
from dtrain.perfmodel.collectives import allreduce_time, ring_allgather_time, ring_reduce_scatter_time
from dtrain.perfmodel.predict import memory_per_device
from dtrain.perfmodel.profile import LayerProfile, ModelProfile
from dtrain.perfmodel.ranking import candidates, parse_memory_limit
from dtrain.perfmodel.sharded import shard_collective, sharded_memory
from dtrain.perfmodel.units import parse_rate
from dtrain.planning.cli import main as plan_main
from dtrain.strategies import Choice, choice

MiB = 1 << 20
SHARDS = ("none", "optimizer", "gradients", "parameters")


def flat(nodes: int, beta: float, alpha: float = 0.0, per_node: int = 1, **kw: float) -> ClusterSpec:
    link = Link(1 / beta, alpha)
    return ClusterSpec(
        nodes=nodes,
        devices_per_node=per_node,
        inter=link,
        intra=link,
        device=Device(gamma=kw.pop("gamma", 0.0), host="h", **kw),
    )


def made_up(optimizer: str = "adam", sizes: tuple[int, ...] = (MiB, MiB, MiB)) -> ModelProfile:
    """A layer per size (bytes of parameters); forward 0.05 s and backward 0.1 s each; optimizer 0.01 s."""
    layers = tuple(LayerProfile(f"l{i}", b // 4, b, 1e9, 2e9, 1000.0, 0.05, 0.1) for i, b in enumerate(sizes))
    return ModelProfile("made_up", 8, layers, optimizer_s=0.01, host="h", optimizer=optimizer)


def zero(p: int, shard: str, **kw: Any) -> Choice:
    return choice("dp", p, "ring", bucket_mb=25.0, shard=shard, **kw)


# ---------------------------------------------------------------- memory


@pytest.mark.parametrize("p", [2, 4, 8])
def test_model_states_per_stage_are_zeros_closed_form(p):
    prof = made_up()
    psi = prof.params  # float32: 4 bytes each; Adam: 8 bytes of state each
    states = [sharded_memory(prof, stage, p) for stage in range(4)]
    model = [m.params + m.grads + m.optimizer for m in states]
    assert model[0] == pytest.approx(16 * psi)
    assert model[1] == pytest.approx(8 * psi + 8 * psi / p)
    assert model[2] == pytest.approx(4 * psi + 12 * psi / p)
    assert model[3] == pytest.approx(16 * psi / p)
    assert (states[1].params, states[1].grads, states[1].optimizer) == (4 * psi, 4 * psi, 8 * psi / p)
    assert (states[3].params, states[3].grads, states[3].optimizer) == (4 * psi / p, 4 * psi / p, 8 * psi / p)
    # buffers: stage 0 the flat bucket copy; 1 none (gradients live in the units' flat buffers);
    # 2 the largest unit's gradient in flight; 3 two gathered units (this one and the prefetched next)
    assert [m.buffers for m in states] == [4 * psi, 0.0, MiB, 2 * MiB]
    assert len({m.activations for m in states}) == 1  # activations do not change
    totals = [m.total for m in states]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4


def test_stage_three_buffers_are_the_two_largest_units_and_sgd_state_is_one_copy():
    prof = made_up("sgd", (MiB, 4 * MiB, 0, 2 * MiB))  # a layer without parameters is no unit
    n = 7.0 * MiB
    s2, s3 = sharded_memory(prof, 2, 4), sharded_memory(prof, 3, 4)
    assert s2.buffers == 4 * MiB and s3.buffers == 6 * MiB
    assert s2.optimizer == s3.optimizer == n / 4  # momentum: one state per parameter
    assert sharded_memory(prof, 1, 4).optimizer == n / 4
    with pytest.raises(ConfigError, match="stage must be 0 to 3"):
        sharded_memory(prof, 4, 2)


def test_the_strategy_hook_gives_the_stages_memory():
    prof = made_up()
    for stage, shard in enumerate(SHARDS):
        assert memory_per_device(prof, zero(4, shard)) == sharded_memory(prof, stage, 4)
    assert memory_per_device(prof, choice("ddp", 4)) == sharded_memory(prof, 0, 4)


# ---------------------------------------------------------------- collectives, bytes and time


@pytest.mark.parametrize("alg", ["ring", "native"])
@pytest.mark.parametrize("c", [flat(4, 1e-9, 2e-5, gamma=1e-10), flat(2, 1e-9, 2e-5, per_node=2, gamma=1e-10)])
def test_reduce_scatter_and_allgather_are_the_halves_of_the_ring(alg, c):
    n, p = 3 * MiB, 4
    rs, ag = ring_reduce_scatter_time(c, alg, n, p), ring_allgather_time(c, alg, n, p)
    assert rs + ag == pytest.approx(allreduce_time(c, alg, n, p))
    assert rs - ag == pytest.approx((p - 1) / p * n * 1e-10)  # the reduction's gamma
    one = flat(4, 1e-9, 2e-5)
    # a 768 KiB segment is one piece: (P-1) alpha + (P-1)/P n beta
    assert ring_allgather_time(one, "ring", n, p) == pytest.approx(3 * 2e-5 + 0.75 * n * 1e-9)
    with pytest.raises(ConfigError, match="ring"):
        ring_reduce_scatter_time(one, "tree", n, p)


def test_each_half_pays_p_minus_one_floors():
    c = flat(4, 1e-12, floor=0.01, p2p_floor=0.02)
    assert shard_collective(c, "ring", MiB, 4, "rs") == pytest.approx(3 * 0.02)
    assert shard_collective(c, "native", MiB, 4, "ag") == pytest.approx(3 * 0.01)
    assert shard_collective(c, "ring", MiB, 1, "ag") == 0.0


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_bytes_per_step_are_a_ring_allreduce_and_one_and_a_half(p):
    prof = made_up()
    c = flat(p, 1e-9)
    n = float(prof.param_bytes)
    ring = predict(prof, c, choice("dp", p, "ring", bucket_mb=25.0)).bytes_per_step
    sent = {shard: predict(prof, c, zero(p, shard)).bytes_per_step for shard in SHARDS[1:]}
    assert sent["optimizer"] == sent["gradients"] == pytest.approx(2 * (p - 1) / p * n)
    assert sent["parameters"] == pytest.approx(3 * (p - 1) / p * n)
    if p != 3:  # 1 MiB divides into P segments: the ring's counted bytes are the closed form
        assert sent["optimizer"] == pytest.approx(ring)
        assert sent["parameters"] == pytest.approx(1.5 * ring)


def test_step_time_by_hand():
    prof = made_up()
    c = flat(4, 0.15 / MiB)  # a 1 MiB ring allreduce on 4 ranks: 2 (3/4) 0.15 = 0.225 s; each half 0.1125 s
    plain = predict(prof, c, choice("dp", 4, "ring", bucket_mb=25.0))
    # buckets [l2] (1 MiB) ready 0.1: 0.1-0.325; [l1, l0] ready 0.3: 0.325-0.775; + fwd 0.15 + opt 0.01
    assert plain.step_s == pytest.approx(0.935)
    one = predict(prof, c, zero(4, "optimizer"))
    # units reduce-scattered as backward ends them: l2 0.1-0.2125, l1 0.2125-0.325, l0 0.325-0.4375;
    # the shard's optimizer 0.01/4; three allgathers 0.3375 s, exposed; forward 0.15
    assert one.step_s == pytest.approx(0.4375 + 0.0025 + 0.3375 + 0.15)
    assert one.compute_s == pytest.approx(0.15 + 0.3 + 0.0025)
    assert one.exposed_s == pytest.approx(one.step_s - one.compute_s)
    assert one.comm_s == pytest.approx(6 * 0.1125)
    assert predict(prof, c, zero(4, "gradients")).step_s == pytest.approx(one.step_s)  # the same traffic
    fwd = predict(prof, c, zero(4, "optimizer", overlap="forward"))
    # gathers from 0.44: l0 back 0.5525, l1 0.665, l2 0.7775; each layer's forward waits for its own:
    # l0 0.5525-0.6025, l1 0.665-0.715, l2 0.7775-0.8275
    assert fwd.step_s == pytest.approx(0.8275)
    three = predict(prof, c, zero(4, "parameters"))
    # forward: gather l0 0-0.1125, computes to 0.1625; l1's gather (issued as l0 starts) 0.1125-0.225,
    # computes to 0.275; l2 0.225-0.3375, computes to 0.3875.
    # backward: gather l2 0.3875-0.5, its backward 0.5-0.6 (prefetch l1 0.5-0.6125); reduce-scatter l2
    # 0.6125-0.725; l1 0.6125-0.7125 (prefetch l0 0.725-0.8375); rs l1 0.8375-0.95; l0 0.8375-0.9375;
    # rs l0 0.95-1.0625; + the shard's optimizer 0.0025
    assert three.step_s == pytest.approx(1.065)
    assert three.detail["allgather_s"] == pytest.approx(6 * 0.1125)
    assert three.detail["reduce_scatter_s"] == pytest.approx(3 * 0.1125)
    assert "ZeRO-3" in three.why


def test_simulator_replays_the_closed_form_without_stragglers():
    prof = made_up()
    c = flat(4, 0.15 / MiB)
    for shard in SHARDS[1:]:
        s = zero(4, shard)
        assert simulate(prof, c, s, steps=5).step_s == pytest.approx(predict(prof, c, s).step_s)


# ---------------------------------------------------------------- planner


def spec(memory: float = 8e9) -> ClusterSpec:
    return ClusterSpec(
        nodes=4,
        inter=Link(parse_rate("10gbit"), 1e-5),
        intra=Link(parse_rate("40gbit"), 5e-6),
        device=Device(flops=1e10, memory=memory),
        name="made-up",
    )


def tiny() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    return model, (torch.randn(64, 64), torch.randint(0, 10, (64,)))


def test_memory_limit_parsing():
    assert parse_memory_limit("2GB") == 2e9
    assert parse_memory_limit("512MB") == 512e6
    assert parse_memory_limit("1.5GiB") == 1.5 * 2**30
    assert parse_memory_limit("1000000") == 1e6
    assert parse_memory_limit(4096) == 4096.0
    for bad in ("2 parsecs", "GB", "-1GB"):
        with pytest.raises(ConfigError, match=f"memory limit {bad!r}"):
            parse_memory_limit(bad)
    with pytest.raises(ConfigError, match="positive size, got '0'"):
        parse_memory_limit("0")


def test_candidates_offer_every_stage_on_the_ring():
    labels = [s.label() for s in candidates(spec())]
    assert {"dp ring 25MiB zero-1", "dp ring 25MiB zero-2", "dp ring 25MiB zero-3"} <= set(labels)
    assert len(labels) == len(set(labels))
    exact = {s.label() for s in candidates(spec(), exact_only=True)}
    assert "dp ring 25MiB zero-3" in exact  # sharding changes where states live, not the result


def test_under_a_memory_limit_the_planner_picks_a_sharding_level():
    model, sample = tiny()
    free = plan(model, sample, spec(), measure=False, optimizer="adam")
    mem = {p.strategy.label(): p.memory.total for p in free.ranked}
    assert "dp ring 25MiB" in mem and not any(s.label() == "dp ring 25MiB" for s, _ in free.rejected)
    assert free.memory_limit is None
    limit = (mem["dp ring 25MiB zero-2"] + mem["dp ring 25MiB"]) / 2
    assert mem["dp ring 25MiB zero-2"] < limit < mem["dp ring 25MiB"]
    tight = plan(model, sample, spec(), measure=False, optimizer="adam", memory_limit=f"{limit:.0f}")
    best = tight.best.strategy
    assert best.strategy == "dp" and best.opts.shard != "none"
    assert all(p.memory.total <= limit for p in tight.ranked)
    reasons = dict((s.label(), r) for s, r in tight.rejected)
    assert "over the memory limit" in reasons["dp ring 25MiB"] and "torch DDP 25MiB" in reasons
    assert tight.memory_limit == pytest.approx(round(limit)) and "memory limit" in tight.table()
    # the limit overrides the cluster's device memory, smaller or larger
    roomy = plan(model, sample, spec(memory=1.0), measure=False, optimizer="adam", memory_limit="1GiB")
    assert not roomy.rejected and roomy.find("dp ring 25MiB") is not None


def test_plan_cli_memory_limit(tmp_path, capsys):
    toml = tmp_path / "c.toml"
    toml.write_text(dump_cluster(spec()))
    src = tmp_path / "tiny_model.py"
    src.write_text(
        "import torch\nfrom torch import nn\n\n\ndef build():\n    torch.manual_seed(0)\n"
        "    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),"
        " nn.Linear(256, 10))\n"
        "    return model, (torch.randn(64, 64), torch.randint(0, 10, (64,)))\n"
    )
    model, sample = tiny()
    mem = {p.strategy.label(): p.memory.total for p in plan(model, sample, spec(), measure=False).ranked}
    limit = int((mem["dp ring 25MiB zero-3"] + min(mem["dp ring 25MiB zero-1"], mem["dp ring 25MiB zero-2"])) / 2)
    args = ["--model", f"{src}:build", "--cluster", str(toml), "--no-measure", "--exact"]
    assert plan_main([*args, "--memory-limit", str(limit)]) == 0
    out = capsys.readouterr().out
    first = next(line for line in out.splitlines() if line.startswith("  1  "))
    assert "memory limit" in out.splitlines()[0] and "zero-3" in first
    assert "dp ring 25MiB zero-1" in out and "rejected: needs" in out
    assert plan_main([*args, "--memory-limit", "2XB"]) == 2
    assert "cannot read the memory limit '2XB'" in capsys.readouterr().err
