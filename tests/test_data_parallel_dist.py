"""DataParallel across 4 real processes (gloo on loopback), against single-process training and DDP.

One spawn runs every scenario in sequence (the references in the same processes)
and returns plain numbers and messages; the tests below assert on them. A second,
2-process spawn checks that a silent rank becomes CommTimeoutError.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist import guard as _guard
from _dist import run_distributed
from _dist import scenario_result as _ok
from _helpers import max_diff, train_steps
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORLD = 4
# 5 steps: every path of the equality (the optimizer's state, each step's exchanges) runs from the second
# step on; the 20 this file ran before repeated them at four times the cost
STEPS = 5
GLOBAL_BATCH = 32
TOL = 1e-5  # float32, different summation order
ALGOS = ("native", "ring", "tree", "recursive_doubling", "rabenseifner", "hierarchical")
# small buckets so that the tiny CNN spans several buckets (fusion, ordering, priority all exercised)
BUCKET = dict(bucket_mb=1 / 1024, first_bucket_mb=1 / 1024)


def _cnn(width: int = 4) -> nn.Module:
    from dtrain.workloads.models import build_model

    torch.manual_seed(123)
    return build_model("cnn", (1, 8, 8), 10, width=width)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _batches(steps: int, seed: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(GLOBAL_BATCH, 1, 8, 8, generator=g), torch.randint(0, 10, (GLOBAL_BATCH,), generator=g))
        for _ in range(steps)
    ]


def _shard(t: torch.Tensor, rank: int) -> torch.Tensor:
    n = t.shape[0] // WORLD
    return t[rank * n : (rank + 1) * n]


def _shards(batches: list[tuple[torch.Tensor, torch.Tensor]], rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(_shard(x, rank), _shard(y, rank)) for x, y in batches]


def _wrap(net: nn.Module, algorithm: str, overlap: str, **extra: Any) -> tuple[Any, torch.optim.Optimizer | None]:
    """DataParallel over ``net`` with the test's buckets and SGD, and the optimizer the loop steps:
    None under overlap="forward", where the model steps its own, bucket by bucket."""
    import dtrain

    kw: dict[str, Any] = dict(algorithm=algorithm, overlap=overlap, **BUCKET, **extra)
    if overlap == "forward":
        kw["optimizer_factory"] = _sgd
    model = dtrain.DataParallel(net, **kw)
    return model, None if overlap == "forward" else _sgd(model.parameters())


def _params(m: nn.Module) -> list[Any]:
    # numpy, not tensors: tensors cross the result queue as shared-memory handles that die with the worker
    return [p.detach().clone().numpy() for p in m.parameters()]


# ---------------------------------------------------------------------- references


def _single_process(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    net = _cnn()
    train_steps(net, _sgd(net.parameters()), batches)
    return _params(net)


def _ddp(batches: list[tuple[torch.Tensor, torch.Tensor]], rank: int) -> list[torch.Tensor]:
    net = _cnn()
    model = DDP(net)
    train_steps(model, _sgd(model.parameters()), _shards(batches, rank))
    return _params(net)


# ---------------------------------------------------------------------- scenarios


def _equivalence(rank: int, algorithm: str, overlap: str, batches: list, compression: Any = None) -> dict[str, Any]:
    from dtrain.comm.cost import traffic

    net = _cnn()
    model, opt = _wrap(net, algorithm, overlap, timeout_s=60, compression=compression)
    train_steps(model, opt, _shards(batches, rank))
    model.synchronize()
    stats = model.step_stats()
    nbytes = [b.nbytes for b in model._reducer.bucket_objects]
    itemsize = 2 if compression is not None and "16" in str(compression) else 4
    expect = sum(
        traffic(algorithm, WORLD, n * itemsize // 4, itemsize=itemsize, node_size=WORLD).bytes_sent[rank]
        for n in nbytes
    )
    model.close()
    return dict(params=_params(net), stats=stats, buckets=len(nbytes), expected_bytes=expect)


def _mismatch(rank: int) -> dict[str, str]:
    import dtrain

    out = {}
    try:  # rank 3 builds a wider first convolution
        dtrain.DataParallel(_cnn(width=5 if rank == 3 else 4))
        out["model"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["model"] = f"{type(e).__name__}: {e}"
    try:  # rank 2 asks for another algorithm
        dtrain.DataParallel(_cnn(), algorithm="tree" if rank == 2 else "ring")
        out["options"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["options"] = f"{type(e).__name__}: {e}"
    return out


class _Branchy(nn.Module):
    """``spare`` is never used; ``branch`` only on even ranks (when asked)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.stem = nn.Linear(6, 6)
        self.branch = nn.Linear(6, 6)
        self.spare = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        if use_branch:
            h = h + self.branch(h)
        return self.head(h)


def _branchy_data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(steps)]


def _unused(rank: int, overlap: str) -> dict[str, Any]:
    """find_unused_parameters=True against DDP(find_unused_parameters=True); weight decay makes a zero grad visible."""
    import dtrain

    def opt_for(ps: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1)

    use = rank % 2 == 0
    data = _branchy_data(4)
    ref = _Branchy()
    ddp = DDP(ref, find_unused_parameters=True)
    ropt = opt_for(ddp.parameters())
    for x, y in data:
        ropt.zero_grad()
        F.cross_entropy(ddp(x, use), y).backward()
        ropt.step()
    net = _Branchy()
    kw: dict[str, Any] = dict(algorithm="ring", overlap=overlap, find_unused_parameters=True, bucket_mb=1e-4)
    if overlap == "forward":
        kw["optimizer_factory"] = opt_for
    model = dtrain.DataParallel(net, **kw)
    opt = model.optimizer if overlap == "forward" else opt_for(model.parameters())
    for x, y in data:
        if overlap == "backward":
            opt.zero_grad()
        F.cross_entropy(model(x, use), y).backward()
        if overlap == "backward":
            opt.step()
    model.synchronize()
    model.close()
    return dict(
        diff=max_diff(_params(net), _params(ref)),
        spare_grad_none=net.spare.weight.grad is None,
        spare_moved=max_diff(_params(net.spare), _params(_Branchy().spare)),
    )


def _unused_error(rank: int) -> str:
    import dtrain

    model = dtrain.DataParallel(_Branchy(), algorithm="ring", bucket_mb=1e-4, timeout_s=30)
    x, y = _branchy_data(1)[0]
    try:
        F.cross_entropy(model(x), y).backward()
        return "no error"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    finally:
        model.close()


def _no_sync(rank: int, algorithm: str, overlap: str) -> float:
    """Two micro-batches per step, the first under no_sync, against DDP doing the same."""
    batches = _batches(8, seed=11)

    def run(model: nn.Module, opt: torch.optim.Optimizer | None) -> None:
        for k in range(0, len(batches), 2):
            if opt is not None:
                opt.zero_grad()
            with model.no_sync():
                x, y = batches[k]
                F.cross_entropy(model(_shard(x, rank)), _shard(y, rank)).backward()
            x, y = batches[k + 1]
            F.cross_entropy(model(_shard(x, rank)), _shard(y, rank)).backward()
            if opt is not None:
                opt.step()

    ref = _cnn()
    ddp = DDP(ref)
    run(ddp, _sgd(ddp.parameters()))
    net = _cnn()
    model, opt = _wrap(net, algorithm, overlap)
    run(model, opt)
    model.synchronize()
    model.close()
    return max_diff(_params(net), _params(ref))


def _buffers(rank: int, algorithm: str, overlap: str) -> float:
    """BatchNorm running statistics follow rank 0 (broadcast_buffers), as in DDP."""

    def bn_net() -> nn.Module:
        torch.manual_seed(9)
        return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(144, 10))

    batches = _batches(4, seed=13)
    ref = bn_net()
    ddp = DDP(ref)
    train_steps(ddp, _sgd(ddp.parameters()), _shards(batches, rank))
    net = bn_net()
    model, opt = _wrap(net, algorithm, overlap)
    train_steps(model, opt, _shards(batches, rank))
    model.synchronize()
    model.close()
    mine = [t.detach().float() for t in [*net.parameters(), *net.buffers()]]
    theirs = [t.detach().float() for t in [*ref.parameters(), *ref.buffers()]]
    assert len(mine) == 9  # 6 parameters + running mean, running var, batches tracked
    return max_diff(mine, theirs)


def _subgroups(rank: int, algorithm: str, overlap: str) -> float:
    """Two independent pairs {0,1} and {2,3}, each averaging over its own group, against DDP on the same groups."""
    mine, _ = dist.new_subgroups(group_size=2)
    batches = _shards(_batches(4, seed=17 + rank // 2), rank % 2)  # each pair trains on its own data

    ref = _cnn()
    ddp = DDP(ref, process_group=mine)
    train_steps(ddp, _sgd(ddp.parameters()), batches)
    net = _cnn()
    model, opt = _wrap(net, algorithm, overlap, group=mine)
    train_steps(model, opt, batches)
    model.synchronize()
    model.close()
    return max_diff(_params(net), _params(ref))


COMBOS = [(a, o) for a in ALGOS for o in ("backward", "forward")]


def _all_scenarios(rank: int, world: int) -> dict[str, Any]:
    from dtrain.compress import FP16, Identity

    assert world == WORLD
    batches = _batches(STEPS)
    out: dict[str, Any] = {"single": _single_process(batches), "ddp": _guard(lambda: _ddp(batches, rank))}
    for a, o in COMBOS:
        out[f"eq/{a}/{o}"] = _guard(lambda: _equivalence(rank, a, o, batches))
    out["eq/identity/backward"] = _guard(lambda: _equivalence(rank, "ring", "backward", batches, Identity()))
    out["eq/identity/forward"] = _guard(lambda: _equivalence(rank, "rabenseifner", "forward", batches, Identity()))
    out["eq/fp16/backward"] = _guard(lambda: _equivalence(rank, "ring", "backward", batches, "fp16"))
    out["fp16_is"] = type(FP16()).__name__
    out["mismatch"] = _guard(lambda: _mismatch(rank))
    out["unused/backward"] = _guard(lambda: _unused(rank, "backward"))
    out["unused/forward"] = _guard(lambda: _unused(rank, "forward"))
    out["unused_error"] = _guard(lambda: _unused_error(rank))
    for a, o in (("native", "backward"), ("ring", "backward"), ("tree", "forward")):
        out[f"no_sync/{a}/{o}"] = _guard(lambda: _no_sync(rank, a, o))
    for a, o in (("native", "backward"), ("recursive_doubling", "forward")):
        out[f"buffers/{a}/{o}"] = _guard(lambda: _buffers(rank, a, o))
    out["subgroups"] = _guard(lambda: _subgroups(rank, "ring", "forward"))
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(_all_scenarios, WORLD, timeout=240)


# ---------------------------------------------------------------------- tests


@pytest.mark.procs
@pytest.mark.parametrize("algorithm, overlap", COMBOS)
def test_equivalence_with_single_process_and_ddp(results, algorithm, overlap):
    for rank, res in enumerate(results):
        r = _ok(res[f"eq/{algorithm}/{overlap}"])
        ddp = _ok(res["ddp"])
        assert max_diff(r["params"], res["single"]) < TOL, f"rank {rank} vs single process"
        assert max_diff(r["params"], ddp) < TOL, f"rank {rank} vs DDP"
        assert r["buckets"] >= 3
        st = r["stats"]
        assert st["step"] == STEPS - 1 and st["buckets"] == r["buckets"]
        assert st["bytes_sent"] == r["expected_bytes"] > 0
        assert st["comm_s"] > 0 and st["compute_s"] > 0 and st["wait_s"] >= 0


@pytest.mark.procs
@pytest.mark.parametrize("name", ["identity/backward", "identity/forward"])
def test_compression_wiring_with_lossless_compressor_is_exact(results, name):
    for res in results:
        r = _ok(res[f"eq/{name}"])
        assert max_diff(r["params"], res["single"]) < TOL
        assert r["stats"]["bytes_sent"] == r["expected_bytes"]


@pytest.mark.procs
def test_fp16_compression_halves_bytes_and_stays_close(results):
    for res in results:
        r = _ok(res["eq/fp16/backward"])
        exact = _ok(res["eq/ring/backward"])
        assert r["stats"]["bytes_sent"] == r["expected_bytes"] == exact["stats"]["bytes_sent"] // 2
        d = max_diff(r["params"], res["single"])
        assert 0 < d < 1e-2  # rounded to float16 on the wire, not exact
    assert results[0]["fp16_is"] == "FP16"


@pytest.mark.procs
def test_mismatched_models_raise_on_every_rank_naming_parameter_and_ranks(results):
    for res in results:
        msg = _ok(res["mismatch"])["model"]
        assert msg.startswith("ModelMismatchError"), msg
        assert "'0.weight'" in msg and "rank 3" in msg and "(4, 1, 3, 3)" in msg and "(5, 1, 3, 3)" in msg
        assert "[3]" in msg  # the list of differing ranks


@pytest.mark.procs
def test_mismatched_options_raise_config_error_naming_ranks(results):
    for res in results:
        msg = _ok(res["mismatch"])["options"]
        assert msg.startswith("ConfigError") and "rank 2" in msg and "'tree'" in msg and "'ring'" in msg, msg


@pytest.mark.procs
@pytest.mark.parametrize("overlap", ["backward", "forward"])
def test_find_unused_parameters_matches_ddp(results, overlap):
    for res in results:
        r = _ok(res[f"unused/{overlap}"])
        assert r["diff"] < TOL
        assert r["spare_grad_none"] and r["spare_moved"] == 0.0  # weight decay would have moved a zero grad


@pytest.mark.procs
def test_unused_parameters_raise_naming_them(results):
    for rank, res in enumerate(results):
        msg = _ok(res["unused_error"])
        assert msg.startswith("UnusedParametersError"), msg
        assert "'spare.weight'" in msg and "'spare.bias'" in msg and f"rank {rank}" in msg
        assert "find_unused_parameters=True" in msg


@pytest.mark.procs
@pytest.mark.parametrize("algorithm, overlap", [("native", "backward"), ("ring", "backward"), ("tree", "forward")])
def test_no_sync_accumulation_matches_ddp(results, algorithm, overlap):
    for res in results:
        assert _ok(res[f"no_sync/{algorithm}/{overlap}"]) < TOL


@pytest.mark.procs
@pytest.mark.parametrize("algorithm, overlap", [("native", "backward"), ("recursive_doubling", "forward")])
def test_buffers_follow_rank_zero_like_ddp(results, algorithm, overlap):
    for res in results:
        assert _ok(res[f"buffers/{algorithm}/{overlap}"]) < TOL


@pytest.mark.procs
def test_a_subgroup_is_averaged_over_on_its_own_like_ddp(results):
    for res in results:
        assert _ok(res["subgroups"]) < TOL


# ---------------------------------------------------------------------- a silent rank


def _silent_peer(rank: int, world: int) -> dict[str, str]:
    """Both ranks train step 0; at step 1 rank 1 goes silent (stays alive, never joins the step)."""
    import dtrain

    out: dict[str, str] = {}
    # a private group with a short timeout, so that the backend's own wait also gives up quickly
    short = dist.new_group(timeout=datetime.timedelta(seconds=4))
    cases = [("ring", "backward", None), ("tree", "forward", None), ("native", "backward", short)]
    batches = _batches(2)
    for algorithm, overlap, group in cases:
        dist.barrier()  # start each case together (the default group has a long timeout)
        kw: dict[str, Any] = dict(algorithm=algorithm, overlap=overlap, timeout_s=4, group=group, **BUCKET)
        if overlap == "forward":
            kw["optimizer_factory"] = _sgd
        model = dtrain.DataParallel(_cnn(), **kw)
        key = f"{algorithm}/{overlap}"
        t0 = time.monotonic()
        try:
            for step, (x, y) in enumerate(batches):
                if rank == 1 and step == 1:  # waits in the next barrier, alive but silent on this step
                    raise RuntimeError("silent")
                F.cross_entropy(model(_shard(x, rank)), _shard(y, rank)).backward()
                model.synchronize()
                dist.barrier()  # step 0 done on both ranks, whatever the machine's load
            out[key] = "no error"
        except Exception as e:  # noqa: BLE001
            out[key] = f"{type(e).__name__}: {e} [after {time.monotonic() - t0:.1f}s]"
    dist.barrier()  # rank 1 stays alive (its sockets open) until rank 0 has timed out
    return out


@pytest.mark.procs
def test_a_silent_rank_becomes_comm_timeout_error_naming_rank_operation_step():
    res = run_distributed(_silent_peer, 2, timeout=120)
    assert all(msg.startswith("RuntimeError: silent") for msg in res[1].values()), res[1]
    for key, msg in res[0].items():
        assert msg.startswith("CommTimeoutError"), (key, msg)
        assert "rank 0" in msg and "step 1" in msg, (key, msg)
        algorithm = key.split("/")[0]
        assert f"allreduce({algorithm})" in msg or "bucket agreement" in msg, (key, msg)
        after = float(msg.rsplit("after ", 1)[1].rstrip("s]"))
        assert after < 12, (key, msg)
