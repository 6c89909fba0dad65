"""Parameter-server pieces that need no peers: sharding, the wire header, heartbeats, the server's average,
the run's stats table."""

import gc
import math
import random
import time
import weakref
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from _helpers import FakeClock

from dtrain.comm.allreduce import allreduce_over
from dtrain.comm.transport import run_threads
from dtrain.errors import ConfigError
from dtrain.param_server._liveness import Liveness
from dtrain.param_server._reduce import ordered_mean
from dtrain.param_server.protocol import (
    HEADER_LEN,
    MAGIC,
    OP_BYE,
    OP_PARAMS,
    OP_PULL,
    OP_PUSH,
    Header,
)
from dtrain.param_server.runner import format_table, lr_scale, merge_stats
from dtrain.param_server.server import _SendWaiter, hist_summary
from dtrain.param_server.sharding import plan_shards, shard_model

# ---------------------------------------------------------------------- sharding


def _coverage(numels, shards):
    covered = {i: [0] * n for i, n in enumerate(numels)}
    for s in shards:
        for p in s.pieces:
            for k in range(p.start, p.start + p.numel):
                covered[p.index][k] += 1
    return covered


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("servers", [1, 2, 3, 5])
def test_every_element_has_exactly_one_server_and_loads_are_balanced(seed, servers):
    rng = random.Random(seed)
    numels = [rng.choice([1, 10, 64, 500, 4096, 20000, 70000]) for _ in range(rng.randint(1, 12))]
    if sum(numels) < servers:
        numels.append(servers)
    min_split = 4096
    shards = plan_shards(numels, 4, servers, min_split_bytes=min_split)
    assert [s.server for s in shards] == list(range(servers))
    assert all(c == [1] * len(c) for c in _coverage(numels, shards).values())
    cap = math.ceil(sum(numels) / servers)
    largest_unsplittable = max([n for n in numels if n * 4 < min_split], default=0)
    assert max(s.numel for s in shards) <= cap + max(largest_unsplittable, servers)
    assert all(s.numel > 0 for s in shards)
    cut = {p.index for s in shards for p in s.pieces if not p.whole}
    assert len(cut) <= servers - 1


def test_the_digits_cnn_splits_its_big_layer_and_balances_exactly():
    numels = [144, 16, 4608, 32, 32768, 64, 640, 10]  # dtrain's default CNN on 8x8 digits
    shards = plan_shards(numels, 4, 2)
    assert [s.numel for s in shards] == [19141, 19141]
    assert [str(p) for p in shards[0].pieces] == ["p4[0:19141]"]
    assert str(shards[1]) == "server 1: p0 p1 p2 p3 p4[19141:32768] p5 p6 p7"


def test_small_tensors_are_cut_rather_than_leave_a_server_empty():
    shards = plan_shards([3, 3], 4, 3)
    assert all(s.numel == 2 for s in shards)
    with pytest.raises(ConfigError, match="fewer than the 4 servers"):
        plan_shards([1, 2], 4, 4)


def test_gather_and_scatter_are_inverse():
    torch.manual_seed(0)
    params = [torch.randn(5, 7), torch.randn(7), torch.randn(3, 3, 3)]
    shards = shard_model(params, 3, min_split_bytes=0)
    grads = [torch.randn_like(p) for p in params]
    grads[1] = None  # a parameter without gradient reads as zeros
    out = [torch.zeros_like(p) for p in params]
    for s in shards:
        flat = s.gather(grads, params)
        assert flat.shape == (s.numel,)
        s.scatter(flat, out)
    assert torch.equal(out[0], grads[0]) and torch.equal(out[2], grads[2])
    assert torch.equal(out[1], torch.zeros(7))


def test_mixed_dtypes_are_refused():
    with pytest.raises(ConfigError, match="one dtype"):
        shard_model([torch.zeros(3), torch.zeros(3, dtype=torch.float64)], 1)


# ---------------------------------------------------------------------- header


def test_header_round_trip_and_size():
    h = Header(OP_PUSH, clock=7, version=3, nbytes=1234)
    t = h.encode()
    assert t.dtype == torch.int64 and t.shape == (HEADER_LEN,) and int(t[0]) == MAGIC
    assert Header.decode(t, allowed=(OP_PUSH,)) == h


@pytest.mark.parametrize(
    "edit,words",
    [
        ({0: 42}, "bad magic"),
        ({1: 99}, "unknown or unexpected op 99"),
        ({4: -1}, "negative"),
        ({7: 5}, "reserved"),
    ],
)
def test_header_validation(edit, words):
    t = Header(OP_PUSH, 1, 0, 10).encode()
    for k, v in edit.items():
        t[k] = v
    with pytest.raises(ValueError, match=words):
        Header.decode(t, allowed=(OP_PULL, OP_PUSH))


def test_a_server_op_is_not_a_worker_op():
    with pytest.raises(ValueError, match="unexpected op"):
        Header.decode(Header(OP_PARAMS).encode(), allowed=(OP_PULL, OP_PUSH))
    assert Header.decode(Header(OP_BYE).encode(), allowed=(OP_PARAMS, OP_BYE)).op_name == "bye"


# ---------------------------------------------------------------------- liveness


def test_a_silent_peer_is_lost_after_the_timeout_and_a_beating_one_is_not():
    """On a fake clock, each rank's heartbeat round (``tick``) run by the test every 0.05 s."""
    store = dist.HashStore()
    clock = FakeClock()
    a, b, c = (Liveness(store, "t", r, timeout_s=0.5, interval_s=0.05, clock=clock) for r in range(3))
    a.watch([1, 2])

    def interval(*ranks: Liveness) -> None:
        clock.advance(0.05)
        for x in ranks:
            assert x.tick()

    for _ in range(6):  # 0.3 s of beats
        interval(a, b, c)
    t0 = clock()  # rank 2 goes quiet
    while 2 not in a.lost() and clock() - t0 < 3:
        interval(a, b)
    waited = clock() - t0
    assert 0.4 < waited < 1.5 and "no heartbeat" in a.lost()[2]
    assert 1 not in a.lost()
    a.unwatch(2)
    assert a.lost() == {}


def test_abort_reaches_every_rank():
    store = dist.HashStore()
    a = Liveness(store, "t", 0, timeout_s=5, interval_s=0.05)
    b = Liveness(store, "t", 1, timeout_s=5, interval_s=0.05)
    a.start()
    b.start()
    assert b.aborted() is None
    a.abort("worker rank 0 stopped: boom")
    a.abort("a second reason does not overwrite the first")
    deadline = time.monotonic() + 10  # b's heartbeat thread reads it within an interval; no fixed sleep
    while b.aborted(refresh=False) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert b.aborted(refresh=False) == "worker rank 0 stopped: boom"
    a.stop()
    b.stop()


# ---------------------------------------------------------------------- runner helpers


def test_lr_scale_is_the_linear_rule_per_update_batch():
    assert lr_scale("bsp", 4) == 1.0
    assert lr_scale("asp", 4) == 0.25
    assert lr_scale("ssp:3", 4) == 0.25
    assert lr_scale("softsync:2", 4) == 0.5
    assert lr_scale("backup:1", 4) == 0.75


def test_merged_stats_and_table():
    def server(rank, hist):
        return {
            "role": "server",
            "rank": rank,
            "consistency": "asp",
            "servers": 2,
            "workers": 1,
            "updates": 4,
            "applied": {"2": 4},
            "dropped": {},
            "staleness": hist_summary(Counter({int(k): v for k, v in hist.items()})),
            "clock_lag": hist_summary(Counter({0: 4})),
            "bytes_in": 10,
            "bytes_out": 20,
            "busy_s": 0.5,
            "wall_s": 1.0,
            "lost": {"3": "gone"},
        }

    worker = {
        "role": "worker",
        "rank": 2,
        "consistency": "asp",
        "servers": 2,
        "workers": 1,
        "steps": 4,
        "compute_s": 1.0,
        "push_s": 0.1,
        "wait_s": 0.2,
        "pull_s": 0.05,
        "bytes_sent": 400,
        "bytes_received": 800,
        "clock_lag_max": 0,
    }
    m = merge_stats([server(0, {"0": 2, "3": 2}), server(1, {"1": 4}), worker])
    assert m["staleness"] == {"max": 3, "mean": 1.25, "hist": {"0": 2, "1": 4, "3": 2}}
    assert m["bytes_received_per_step"] == 200 and m["lost_workers"] == {"3": "gone"}
    text = format_table(m)
    assert "consistency asp" in text and "worker rank 3 was dropped: gone" in text
    assert "gradients: 4 computed, 4 applied (server 0)" in text
    assert len(text.splitlines()) == 2 + 2 + 1 + 1 + 1 + 1  # title and head, 2 servers, head, 1 worker, work, lost
    assert m["samples_computed"] is None  # no batch given
    m = merge_stats([server(0, {"0": 4}), server(1, {"0": 4}), worker], batch_per_worker=16)
    assert (m["gradients_computed"], m["gradients_applied"], m["samples_computed"], m["samples_applied"]) == (
        4,
        4,
        64,
        64,
    )
    assert "samples: 64 computed, 64 applied" in format_table(m)


# ---------------------------------------------------------------------- the server's average


def _grads(n, numel=4096, seed=0):
    """Gradients whose float32 sum depends on the order: magnitudes over six decades, both signs."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g) * 10.0 ** torch.randint(-3, 3, (numel,), generator=g) for _ in range(n)]


def _data_parallel_tree(grads):
    """What DataParallel(algorithm="tree") computes: each rank pre-divides, then the tree allreduce sums."""

    def rank_fn(t):
        flat = grads[t.rank].clone()
        flat.div_(t.world_size)
        allreduce_over(t, flat, "sum", "tree")
        return flat

    return run_threads(len(grads), rank_fn, timeout=10.0)[0]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7])
def test_the_server_average_is_bitwise_the_tree_allreduce_of_data_parallel(n):
    grads = _grads(n)
    mine = ordered_mean(grads)
    assert torch.equal(mine, _data_parallel_tree(grads))
    exact = torch.stack(grads).double().mean(0)  # n roundings at most, each within eps of the partial sum
    bound = n * torch.finfo(torch.float32).eps * torch.stack(grads).double().abs().mean(0)
    assert bool(((mine.double() - exact).abs() <= bound).all())
    if n >= 3:  # the order matters at all: a sum in another order differs in the last bits
        other = sum((g / n for g in reversed(grads)), torch.zeros_like(grads[0]))
        assert not torch.equal(mine, other)
    assert all(torch.equal(g, h) for g, h in zip(grads, _grads(n)))  # the inputs are left as they were


def test_the_server_average_spells_out_the_tree_order():
    big = 2.0**53  # 1 ulp of big is 2: the order decides which small terms survive
    v = (5.0, big, -big, 3.0, 3.0)
    g = [torch.tensor([x], dtype=torch.float64) for x in v]
    p = [x / 5 for x in v]
    # 5 ranks: 0 <- {4, 2, 1}, 2 <- {3}; rank 0 adds 1 first (nearest), then (2 + 3), then 4
    assert ordered_mean(g).item() == ((p[0] + p[1]) + (p[2] + p[3])) + p[4] == 2.1
    assert (((p[0] + p[1]) + p[2]) + p[3]) + p[4] == 2.2  # left to right: another result
    assert sum(v) / 5 == 2.0  # dividing the sum: another again
    with pytest.raises(ValueError, match="at least one"):
        ordered_mean([])


class _Sent:
    def __init__(self):
        self.waited = 0

    def wait(self):
        self.waited += 1


def test_the_send_waiter_is_gone_with_its_last_batch_when_closed():
    # the waits' works lead to the process group: the waiter's thread must not be the one that drops the
    # last reference while the interpreter finalizes (a SIGABRT at exit), so close() waits for the thread
    waiter = _SendWaiter()
    work = _Sent()
    batch = waiter.start([(3, work)])
    assert batch.done.wait(5.0) and work.waited == 1 and batch.errors == []
    ref = weakref.ref(work)
    del batch, work
    waiter.close()
    assert not waiter._thread.is_alive()
    gc.collect()
    assert ref() is None
