"""DataParallel in one process: options, fusion, per-bucket optimizer, hooks, bucket order.

The multi-process behaviour (equivalence with single-process training and DDP,
errors across ranks, timeouts) is in tests/test_data_parallel_dist.py.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.nn.functional as F
from _helpers import max_diff
from torch import nn

import dtrain
from dtrain.comm.fusion import FlatBuffer, assign_buckets, flatten, unflatten_into
from dtrain.comm.step_stats import busy_time
from dtrain.data_parallel import ALGORITHMS, DataParallel, UnusedParametersError
from dtrain.data_parallel._optim import BucketOptimizer
from dtrain.errors import ConfigError


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 3))


def _data(steps: int, n: int = 16, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)) for _ in range(steps)]


# ---------------------------------------------------------------------- options


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(algorithm="butterfly"), ["unknown algorithm 'butterfly'", "ring"]),
        (dict(overlap="sideways"), ["unknown overlap 'sideways'", "'forward'"]),
        (dict(bucket_mb=-1), ["bucket_mb", ">= 0"]),
        (dict(first_bucket_mb=float("nan")), ["first_bucket_mb"]),
        (dict(timeout_s=0), ["timeout_s", "positive"]),
        (dict(find_unused_parameters="yes"), ["find_unused_parameters", "True or False"]),
        (dict(overlap="forward"), ["exactly one of", "optimizer_factory"]),
        (dict(optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.1)), ["for overlap='forward'"]),
        (dict(compression=3), ["compression must be"]),
        (dict(compression="zip:9"), ["unknown compressor 'zip'"]),
    ],
)
def test_bad_options_raise_config_error_saying_what_to_change(kw, words):
    with pytest.raises(ConfigError) as ei:
        DataParallel(_mlp(), **kw)
    for w in words:
        assert w in str(ei.value)


def test_options_are_keyword_only_and_module_checked():
    with pytest.raises(TypeError):
        DataParallel(_mlp(), "ring")  # type: ignore[misc]
    with pytest.raises(ConfigError, match="wraps a torch.nn.Module"):
        DataParallel(torch.randn(3))  # type: ignore[arg-type]
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ConfigError, match="no trainable parameters"):
        DataParallel(frozen)


def test_algorithms_are_the_allreduce_registry():
    assert set(ALGORITHMS) == set(dtrain.comm.ALGORITHMS)
    assert dtrain.DataParallel is DataParallel


def test_optimizer_over_foreign_parameters_is_rejected():
    other = nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="not a trainable parameter of the wrapped module"):
        DataParallel(_mlp(), overlap="forward", optimizer=torch.optim.SGD(other.parameters(), lr=0.1))


# ---------------------------------------------------------------------- fusion


def test_assign_buckets_keeps_order_caps_and_keys():
    # sizes in bytes; cap 100, first bucket 30
    b = assign_buckets([10, 25, 60, 50, 200, 5], cap_bytes=100, first_cap_bytes=30)
    assert b == [[0, 1], [2, 3], [4], [5]]
    # different keys never share a bucket; order by first member
    b = assign_buckets([10, 10, 10, 10], ["f32", "f16", "f32", "f16"], cap_bytes=15)
    assert b == [[0, 2], [1, 3]]
    assert assign_buckets([4, 4, 4], cap_bytes=1) == [[0], [1], [2]]
    with pytest.raises(ValueError):
        assign_buckets([1], cap_bytes=0)


def test_flat_buffer_views_alias_the_flat_tensor_and_flatten_roundtrips():
    fb = FlatBuffer([torch.Size([2, 3]), torch.Size([4])], torch.float32, torch.device("cpu"))
    fb.views[0].fill_(1.0)
    fb.views[1].fill_(2.0)
    assert fb.flat.tolist() == [1.0] * 6 + [2.0] * 4
    assert fb.nbytes == 40 and fb.offsets == [0, 6]
    ts = [torch.randn(2, 2), torch.randn(3)]
    flat = flatten(ts)
    out = [torch.empty(2, 2), torch.empty(3)]
    unflatten_into(flat, out)
    assert all(torch.equal(a, b) for a, b in zip(ts, out))


def test_busy_time_is_union_of_intervals():
    assert busy_time([(0, 2), (1, 3), (5, 6)]) == pytest.approx(4.0)
    assert busy_time([]) == 0.0


# ---------------------------------------------------------------------- world of one


def test_world_of_one_matches_plain_training_and_grads_are_bucket_views():
    net, ref = _mlp(), _mlp()
    model = DataParallel(net, bucket_mb=0.0001, first_bucket_mb=0.0001)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for x, y in _data(5):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        ropt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ropt.step()
    assert max_diff(net.parameters(), ref.parameters()) < 1e-6
    flats = {b.flat.data_ptr(): b for b in model._reducer.bucket_objects}
    assert len(flats) > 1
    for p in net.parameters():  # every .grad lives inside a bucket's flat buffer
        assert any(b.flat.data_ptr() <= p.grad.data_ptr() < b.flat.data_ptr() + b.nbytes for b in flats.values())
    st = model.step_stats()
    assert st["step"] == 4 and st["compute_s"] > 0 and st["bytes_sent"] == 0
    assert list(model.state_dict())[0].startswith("module.")
    model.close()


class _Reversed(nn.Module):
    """Registers its layers in the opposite order to their use, so backward order != reversed registration."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.last = nn.Linear(8, 3)
        self.mid = nn.Linear(8, 8)
        self.first = nn.Linear(6, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.relu(self.mid(torch.relu(self.first(x)))))


def test_buckets_are_rebuilt_in_the_order_backward_produced_gradients():
    model = DataParallel(_Reversed(), bucket_mb=0.0001, first_bucket_mb=0.0001)
    before = [n for b in model.buckets for n in b]
    assert before[0].startswith("first.")  # initial guess: reversed registration order
    x, y = _data(1)[0]
    F.cross_entropy(model(x), y).backward()
    after = [n.split(".")[0] for b in model.buckets for n in b]
    # backward reaches `last` first, then `mid`, then `first`
    assert after.index("last") < after.index("mid") < after.index("first")
    model.close()


class _WithSpare(nn.Module):
    """A model with a layer its forward never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 2)
        self.spare = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def test_unused_parameter_raises_naming_it_and_find_unused_accepts():
    m = DataParallel(_WithSpare())
    with pytest.raises(UnusedParametersError) as ei:
        m(torch.randn(3, 4)).sum().backward()
    msg = str(ei.value)
    assert "'spare.weight'" in msg and "'spare.bias'" in msg and "find_unused_parameters=True" in msg
    assert "rank 0" in msg and "step 0" in msg
    m.close()
    m = DataParallel(_WithSpare(), find_unused_parameters=True)
    m(torch.randn(3, 4)).sum().backward()
    assert m.module.spare.weight.grad is None  # unused everywhere: left untouched, as DDP
    assert m.module.used.weight.grad is not None
    m.close()


def test_forward_overlap_after_unused_error_fails_fast_instead_of_hanging():
    net = _WithSpare()
    m = DataParallel(net, overlap="forward", optimizer=torch.optim.SGD(net.parameters(), lr=0.1), timeout_s=60)
    with pytest.raises(UnusedParametersError):
        m(torch.randn(3, 4)).sum().backward()
    with pytest.raises(UnusedParametersError, match="spare.weight"):
        m.synchronize()  # at once, not after timeout_s
    m.close()


def test_no_sync_accumulates_like_plain_accumulation():
    net, ref = _mlp(), _mlp()
    model = DataParallel(net, algorithm="native")
    batches = _data(4)
    with model.no_sync():
        for x, y in batches[:3]:
            F.cross_entropy(model(x), y).backward()
    x, y = batches[3]
    F.cross_entropy(model(x), y).backward()
    for x, y in batches:
        F.cross_entropy(ref(x), y).backward()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6)
    model.close()


# ---------------------------------------------------------------------- overlap="forward"


@pytest.mark.parametrize("make_opt", ["sgd", "adamw"])
def test_forward_overlap_per_bucket_steps_equal_one_whole_step_with_lr_schedule(make_opt):
    def opt_for(ps):
        if make_opt == "sgd":
            return torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3)
        return torch.optim.AdamW(ps, lr=0.01)

    net, ref = _mlp(), _mlp()
    model = DataParallel(net, overlap="forward", optimizer_factory=opt_for, bucket_mb=0.0001, first_bucket_mb=0.0001)
    sched = torch.optim.lr_scheduler.StepLR(model.optimizer, step_size=2, gamma=0.5)
    ropt = opt_for(ref.parameters())
    rsched = torch.optim.lr_scheduler.StepLR(ropt, step_size=2, gamma=0.5)
    assert len(model.buckets) >= 3
    for x, y in _data(7):
        F.cross_entropy(model(x), y).backward()
        sched.step()
        ropt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ropt.step()
        rsched.step()
    model.synchronize()
    assert max_diff(net.parameters(), ref.parameters()) < 1e-6
    model.close()


def test_bucket_optimizer_steps_subsets_with_the_users_optimizer_state():
    net = _mlp()
    ref = copy.deepcopy(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ps = list(net.parameters())
    bo = BucketOptimizer(opt, [ps[:2], ps[2:]])
    for k in range(2):
        for p, q in zip(ps, ref.parameters()):
            p.grad = torch.full_like(p, 0.5 + k)
            q.grad = torch.full_like(q, 0.5 + k)
        bo.step(1)
        if k == 0:  # momentum state appears in the user's optimizer, for that bucket only
            assert all(p in opt.state for p in ps[2:]) and not any(p in opt.state for p in ps[:2])
        bo.step(0)
        ropt.step()
    assert max_diff(net.parameters(), ref.parameters()) == 0.0


def test_priority_scheduler_reduces_ready_buckets_nearest_the_input_first():
    from dtrain.comm.step_stats import StepStats
    from dtrain.data_parallel._buckets import build_buckets
    from dtrain.data_parallel._comm import StreamSync
    from dtrain.data_parallel._priority import PriorityScheduler

    params = [nn.Parameter(torch.randn(4)) for _ in range(5)]  # index = position in forward
    buckets = build_buckets(params, [4, 3, 2, 1, 0], cap_bytes=1, first_cap_bytes=1)  # one per tensor, backward order
    seen: list[str] = []
    stepped: list[int] = []

    class Recorder:
        algorithm = "recorder"

        def __call__(self, flat: torch.Tensor, key: str, shapes: object = None) -> int:
            seen.append(key)
            return 10

    done: list[StepStats] = []
    cpu = StreamSync(torch.device("cpu"))
    sched = PriorityScheduler(Recorder(), lambda b: stepped.append(b.index), None, 0, 5.0, lambda b: cpu, done.append)
    sched.set_buckets(buckets)
    sched.begin_step(0, StepStats(step=0))
    with sched._cond:  # all become ready (in backward order) before the thread may look
        for b in buckets:
            sched.mark_ready(b)
        assert sched.busy()
    sched.wait_all("test")
    by_priority = sorted(buckets, key=lambda b: b.priority)
    assert seen == [b.key for b in by_priority]  # the input layer's bucket first
    assert stepped == [b.index for b in by_priority]
    assert done and done[0].buckets == 5 and done[0].bytes_sent == 50
    sched.close()


def test_priority_scheduler_publishes_the_step_before_wait_all_returns():
    """step_stats() after synchronize() must show the step just finished, however slow the publishing."""
    from dtrain.comm.step_stats import StepStats
    from dtrain.data_parallel._buckets import build_buckets
    from dtrain.data_parallel._comm import StreamSync
    from dtrain.data_parallel._priority import PriorityScheduler

    params = [nn.Parameter(torch.randn(4)) for _ in range(3)]
    buckets = build_buckets(params, [2, 1, 0], cap_bytes=1, first_cap_bytes=1)
    published: list[int] = []

    def slow_publish(st: StepStats) -> None:
        time.sleep(0.3)  # widens the window between the last bucket's event and the publishing
        published.append(st.step)

    cpu = StreamSync(torch.device("cpu"))
    sched = PriorityScheduler(
        lambda flat, key, shapes=None: 4, lambda b: None, None, 0, 5.0, lambda b: cpu, slow_publish
    )
    sched.set_buckets(buckets)
    for step in range(2):
        sched.begin_step(step, StepStats(step=step))
        for b in buckets:
            sched.mark_ready(b)
        sched.wait_all("test")
        assert published == list(range(step + 1))
    sched.close()
