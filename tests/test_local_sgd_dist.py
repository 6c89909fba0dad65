"""LocalSGD across 4 real processes (gloo on loopback): against DDP, a single-process simulation,
torch's PostLocalSGDOptimizer / HierarchicalModelAverager, and the ring's byte count.

One 4-process spawn runs every scenario in sequence (the references in the same processes) and
returns plain numbers and messages; the tests assert on them. A 1-process spawn checks that a
single worker trains exactly like plain single-process training.

Peer tolerance: 1e-6 (algorithm "native" and "ring"). Torch's DDP and averager divide by the
world size before a gloo sum, dtrain after; dividing by 4 is exact in float, so the only
difference is the order of the float32 sums (gloo's buckets and chunks against one flat
buffer), which is a few ulps per step, not bitwise zero.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist import guard as _guard
from _dist import run_distributed
from _dist import scenario_result as _ok
from _helpers import max_diff
from torch import nn

WORLD = 4
STEPS = 20
BATCH = 8
TOL = 1e-5  # against a simulation or DDP: float32, different summation order
PEER_TOL = 1e-6  # against torch's own local SGD (see the module docstring)
LR = 0.1
NUMEL = 8 * 16 + 16 + 16 * 4 + 4  # 212, a multiple of WORLD: the ring's closed form is exact


def _mlp() -> nn.Module:
    torch.manual_seed(123)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _data(world: int = WORLD, steps: int = STEPS, seed: int = 7) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``data[rank][step]``: each worker's own batch, the same lists in every process."""
    g = torch.Generator().manual_seed(seed)
    return [
        [(torch.randn(BATCH, 8, generator=g), torch.randint(0, 4, (BATCH,), generator=g)) for _ in range(steps)]
        for _ in range(world)
    ]


def _sgd(params: Any, momentum: float = 0.0) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=momentum)


def _params(m: nn.Module) -> list[Any]:
    # numpy: tensors would cross the result queue as shared memory that dies with the worker
    return [p.detach().clone().numpy() for p in m.parameters()]


def _train_local(local: Any, net: nn.Module, opt: torch.optim.Optimizer, batches: list[Any]) -> None:
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(local(x), y).backward()
        opt.step()
        local.step()


# ---------------------------------------------------------------------- references


def _ddp(rank: int, data: list[Any]) -> list[Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    net = _mlp()
    model = DDP(net)
    opt = _sgd(model.parameters())
    for x, y in data[rank]:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return _params(net)


def _simulation(data: list[Any], period: int, momentum: float) -> list[list[Any]]:
    """4 replicas in one process, each its own optimizer, averaged after step s when s % period == 0."""
    nets = [_mlp() for _ in data]
    opts = [_sgd(n.parameters(), momentum) for n in nets]
    for s in range(len(data[0])):
        for net, opt, batches in zip(nets, opts, data):
            x, y = batches[s]
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
        if s % period == 0:
            with torch.no_grad():
                for ps in zip(*(n.parameters() for n in nets)):
                    mean = torch.stack([p for p in ps]).mean(0)
                    for p in ps:
                        p.copy_(mean)
    return [_params(n) for n in nets]


def _torch_post_local(rank: int, data: list[Any], averager: Any, warmup: int, local_group: Any) -> list[Any]:
    """torch's post-local SGD: DDP with post_localSGD_hook (global gradient averaging for ``warmup``
    backward passes, then within ``local_group``, a 1-rank group) and PostLocalSGDOptimizer."""
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
    from torch.distributed.optim import PostLocalSGDOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    net = _mlp()
    model = DDP(net)
    state = PostLocalSGDState(process_group=None, subgroup=local_group, start_localSGD_iter=warmup)
    model.register_comm_hook(state, post_localSGD_hook)
    opt = PostLocalSGDOptimizer(_sgd(model.parameters(), 0.9), averager)
    for x, y in data[rank]:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return _params(net)


# ---------------------------------------------------------------------- scenarios


def _local_sgd(rank: int, data: list[Any], momentum: float, **kw: Any) -> dict[str, Any]:
    from dtrain.decentralized import LocalSGD

    net = _mlp()
    local = LocalSGD(net, timeout=60, **kw)
    _train_local(local, net, _sgd(net.parameters(), momentum), data[rank])
    return dict(
        params=_params(net),
        stats=local.stats(),
        expected=local.expected_bytes_per_step(),
        model_bytes=local.model_bytes(),
    )


def _periodic_peer(rank: int, data: list[Any], period: int, warmup: int, algorithm: str) -> dict[str, Any]:
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    solo, _ = dist.new_subgroups(group_size=1)  # makes DDP's after-warm-up gradient allreduce local
    ref = _torch_post_local(rank, data, PeriodicModelAverager(period, warmup), warmup, solo)
    mine = _local_sgd(rank, data, 0.9, period=period, warmup_steps=warmup, algorithm=algorithm)
    return dict(diff=max_diff(mine["params"], ref), stats=mine["stats"])


def _hierarchical_peer(rank: int, data: list[Any], levels: list[tuple[int, int]], warmup: int) -> dict[str, Any]:
    from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import HierarchicalModelAverager

    solo, _ = dist.new_subgroups(group_size=1)
    averager = HierarchicalModelAverager(OrderedDict((p, g) for g, p in levels), warmup_steps=warmup)
    ref = _torch_post_local(rank, data, averager, warmup, solo)
    mine = _local_sgd(rank, data, 0.9, hierarchy=dict(levels), warmup_steps=warmup, algorithm="ring")
    return dict(
        diff=max_diff(mine["params"], ref),
        stats=mine["stats"],
        expected=mine["expected"],
        model_bytes=mine["model_bytes"],
    )


BAD_HIERARCHIES: list[tuple[Any, str]] = [
    ({3: 2, 4: 4}, "group_size=3"),  # 3 does not divide 4
    ([(2, 4), (4, 2)], "period=2"),  # periods decrease
    ([(2, 2)], "group_size=2"),  # the last level is not the whole group
    ([(4, 2), (2, 4)], "group_size=2"),  # sizes decrease
    ([], "[]"),
    ([(2, 0), (4, 4)], "period=0"),
    ([(2, "x"), (4, 4)], "'x'"),
]


def _bad_hierarchies(rank: int) -> list[str]:
    from dtrain.decentralized import LocalSGD

    out = []
    for value, _ in BAD_HIERARCHIES:
        try:
            LocalSGD(_mlp(), hierarchy=value)
            out.append("no error")
        except Exception as e:  # noqa: BLE001
            out.append(f"{type(e).__name__}: {e}")
    return out


class _Spare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(8, 4)
        self.spare = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def _unused_in_warmup(rank: int, data: list[Any]) -> str:
    from dtrain.decentralized import LocalSGD

    net = _Spare()
    local = LocalSGD(net, period=2, warmup_steps=2)
    try:
        _train_local(local, net, _sgd(net.parameters()), data[rank][:2])
        return "no error"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def _buffers(rank: int, data: list[Any], average_buffers: bool) -> list[Any]:
    """BatchNorm running statistics after 3 steps, period 2: averaged at steps 0 and 2, the last one."""
    from dtrain.decentralized import LocalSGD

    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6), nn.Linear(6, 4))
    local = LocalSGD(net, period=2, average_buffers=average_buffers)
    _train_local(local, net, _sgd(net.parameters()), data[rank][:3])
    return [b.detach().clone().numpy() for b in net.buffers() if b.is_floating_point()]


def _all_scenarios(rank: int, world: int) -> dict[str, Any]:
    assert world == WORLD
    data = _data()
    out: dict[str, Any] = {"ddp": _guard(lambda: _ddp(rank, data))}
    out["sim"] = _simulation(data, 4, 0.9)
    out["period1"] = _guard(lambda: _local_sgd(rank, data, 0.0, period=1))
    for algo in ("ring", "tree", "recursive_doubling", "native"):
        out[f"period4/{algo}"] = _guard(lambda: _local_sgd(rank, data, 0.9, period=4, algorithm=algo))
    out["period4/fp16"] = _guard(lambda: _local_sgd(rank, data, 0.9, period=4, compression="fp16"))
    for algo in ("native", "ring"):
        out[f"peer/{algo}"] = _guard(lambda: _periodic_peer(rank, data, 4, 5, algo))
    out["peer/nowarmup"] = _guard(lambda: _periodic_peer(rank, data, 3, 0, "ring"))
    out["hpeer/2-4"] = _guard(lambda: _hierarchical_peer(rank, data, [(2, 2), (4, 4)], 3))
    out["hpeer/2-3"] = _guard(lambda: _hierarchical_peer(rank, data, [(2, 3), (4, 5)], 0))
    out["bad_hierarchy"] = _guard(lambda: _bad_hierarchies(rank))
    out["unused"] = _guard(lambda: _unused_in_warmup(rank, data))
    out["buffers/on"] = _guard(lambda: _buffers(rank, data, True))
    out["buffers/off"] = _guard(lambda: _buffers(rank, data, False))
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(_all_scenarios, WORLD, timeout=300)


# ---------------------------------------------------------------------- tests


@pytest.mark.procs
def test_period_one_plain_sgd_equals_ddp(results):
    for rank, res in enumerate(results):
        r = _ok(res["period1"])
        assert max_diff(r["params"], _ok(res["ddp"])) < TOL, f"rank {rank}"
        assert r["stats"]["rounds"] == STEPS and r["stats"]["last_average_step"] == STEPS - 1


@pytest.mark.procs
@pytest.mark.parametrize("algorithm", ["ring", "tree", "recursive_doubling", "native"])
def test_period_four_momentum_equals_single_process_simulation(results, algorithm):
    for rank, res in enumerate(results):
        r = _ok(res[f"period4/{algorithm}"])
        assert max_diff(r["params"], res["sim"][rank]) < TOL, f"rank {rank}"
        # the replicas were averaged last at step 16, then took 3 local steps: they differ again
        assert max_diff(res["sim"][rank], res["sim"][(rank + 1) % WORLD]) > 1e-4
        assert r["stats"]["rounds"] == 5 and r["stats"]["last_average_step"] == 16 and r["stats"]["period"] == 4


@pytest.mark.procs
def test_bytes_per_round_equal_ring_closed_form(results):
    from dtrain.comm.cost import traffic

    for rank, res in enumerate(results):
        r = _ok(res["period4/ring"])
        st = r["stats"]
        assert r["model_bytes"] == NUMEL * 4
        closed = 2 * (WORLD - 1) / WORLD * r["model_bytes"]
        assert st["bytes_sent"] == st["rounds"] * closed == 5 * 1272
        assert st["bytes_sent"] // st["rounds"] == traffic("ring", WORLD, NUMEL * 4).bytes_sent[rank]
        assert r["expected"] == closed / 4


@pytest.mark.procs
def test_fp16_compression_halves_bytes_and_stays_close(results):
    for rank, res in enumerate(results):
        r = _ok(res["period4/fp16"])
        assert r["stats"]["bytes_sent"] == _ok(res["period4/ring"])["stats"]["bytes_sent"] // 2
        assert 0 < max_diff(r["params"], res["sim"][rank]) < 1e-2


@pytest.mark.procs
@pytest.mark.parametrize("name", ["native", "ring", "nowarmup"])
def test_matches_torch_post_local_sgd_optimizer(results, name):
    for rank, res in enumerate(results):
        r = _ok(res[f"peer/{name}"])
        assert r["diff"] < PEER_TOL, f"rank {rank}: {r['diff']}"
    st = _ok(results[0]["peer/native"])["stats"]
    # warm-up 5, period 4: gradients averaged at steps 0-4, the model at 5, 9, 13, 17
    assert st["warmup_rounds"] == 5 and st["rounds"] == 4 and st["last_average_step"] == 17


@pytest.mark.procs
@pytest.mark.parametrize("name", ["2-4", "2-3"])
def test_matches_torch_hierarchical_model_averager(results, name):
    for rank, res in enumerate(results):
        r = _ok(res[f"hpeer/{name}"])
        assert r["diff"] < PEER_TOL, f"rank {rank}: {r['diff']}"


@pytest.mark.procs
def test_hierarchical_levels_and_bytes(results):
    r = _ok(results[0]["hpeer/2-4"])
    st = r["stats"]
    # warm-up 3: steps 3..19; step % 4 == 0 -> world (4, 8, 12, 16), else step % 2 == 0 -> pairs (6, 10, 14, 18)
    assert st["level_rounds"] == {2: 4, 4: 4} and st["last_average_step"] == 18
    b = r["model_bytes"]
    world_bytes, pair_bytes = 2 * 3 / 4 * b, 2 * 1 / 2 * b
    assert st["bytes_sent"] - st["warmup_rounds"] * world_bytes == 4 * world_bytes + 4 * pair_bytes
    assert r["expected"] == pytest.approx(world_bytes / 4 + pair_bytes / 4)
    st = _ok(results[0]["hpeer/2-3"])["stats"]
    # 3 | s and not 5 | s: 3, 6, 9, 12, 18; 5 | s: 0, 5, 10, 15
    assert st["level_rounds"] == {2: 5, 4: 4}


@pytest.mark.procs
def test_bad_hierarchy_raises_config_error_naming_the_value(results):
    for res in results:
        msgs = _ok(res["bad_hierarchy"])
        for (value, needle), msg in zip(BAD_HIERARCHIES, msgs):
            assert msg.startswith("ConfigError") and needle in msg, (value, msg)


@pytest.mark.procs
def test_parameter_without_gradient_in_warmup_raises_naming_it(results):
    for res in results:
        msg = _ok(res["unused"])
        assert msg.startswith("ConfigError") and "'spare.weight'" in msg and "'spare.bias'" in msg, msg


@pytest.mark.procs
def test_average_buffers(results):
    on = [_ok(res["buffers/on"]) for res in results]
    off = [_ok(res["buffers/off"]) for res in results]
    assert len(on[0]) == 2  # running mean and variance
    assert max(max_diff(on[0], o) for o in on[1:]) < 1e-6
    assert max(max_diff(off[0], o) for o in off[1:]) > 1e-3


# ---------------------------------------------------------------------- one worker


def _single_worker(rank: int, world: int) -> dict[str, Any]:
    from dtrain.decentralized import LocalSGD

    data = _data(world=1)
    ref = _mlp()
    ropt = _sgd(ref.parameters(), 0.9)
    for x, y in data[0]:
        ropt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ropt.step()
    out = {}
    for warmup in (0, 3):
        net = _mlp()
        local = LocalSGD(net, period=4, warmup_steps=warmup)
        _train_local(local, net, _sgd(net.parameters(), 0.9), data[0])
        out[warmup] = dict(diff=max_diff(_params(net), _params(ref)), stats=local.stats())
    return out


@pytest.mark.procs
def test_single_worker_equals_single_process_training_exactly():
    (res,) = run_distributed(_single_worker, 1, timeout=120)
    for warmup, r in res.items():
        assert r["diff"] == 0.0, warmup
        assert r["stats"]["bytes_sent"] == 0


# ---------------------------------------------------------------------- validation (no processes)


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(period=0), "period=0"),
        (dict(period=-3), "period=-3"),
        (dict(period=2.5), "period=2.5"),
        (dict(warmup_steps=-1), "warmup_steps=-1"),
        (dict(algorithm="butterfly"), "'butterfly'"),
        (dict(compression="nosuchcodec"), "nosuchcodec"),
    ],
)
def test_bad_options_raise_config_error_naming_the_value(kw, needle):
    from dtrain.decentralized import LocalSGD
    from dtrain.errors import ConfigError

    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        LocalSGD(_mlp(), **kw)


def test_parse_hierarchy_accepts_nested_levels():
    from dtrain.decentralized.local_sgd import parse_hierarchy

    assert parse_hierarchy({2: 2, 4: 4, 8: 16}, 8) == [(2, 2), (4, 4), (8, 16)]
    assert parse_hierarchy([(8, 5)], 8) == [(8, 5)]
    for value, _ in BAD_HIERARCHIES:
        with pytest.raises(ValueError):
            parse_hierarchy(value, 4)
