"""dtrain.comm.cost: alpha-beta-gamma times against hand-computed values, and
message/byte counts against hand counts and against what a threaded run sends."""

from __future__ import annotations

import math

import pytest
import torch

from dtrain.comm import AllreduceOptions, allreduce_over, cost
from dtrain.comm.cost import LinkCost
from dtrain.comm.transport import ThreadTransport, run_threads
from dtrain.errors import ConfigError

A, B, G = 1e-5, 1e-9, 5e-10
LINK = LinkCost(alpha=A, beta=B, gamma=G)
N = 1e6  # bytes


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-18)


# ----------------------------------------------------------------------------- time, hand-computed


def test_ring_time_matches_the_table() -> None:
    # 2(P-1)a + 2(P-1)/P n b + (P-1)/P n g with P=4
    assert close(cost.ring_time(4, N, LINK), 6 * A + 1.5 * N * B + 0.75 * N * G)
    assert close(cost.ring_time(4, N, LINK), 1.935e-3)
    # four pieces per segment: four times the messages, same bytes
    assert close(cost.ring_time(4, N, LINK, pieces=4), 24 * A + 1.5 * N * B + 0.75 * N * G)


def test_power_of_two_times_match_the_table() -> None:
    # P = 8, log2 P = 3
    assert close(cost.recursive_doubling_time(8, N, LINK), 3 * A + 3 * N * B + 3 * N * G)
    assert close(cost.tree_time(8, N, LINK), 6 * A + 6 * N * B + 3 * N * G)
    assert close(cost.rabenseifner_time(8, N, LINK), 6 * A + 1.75 * N * B + 0.875 * N * G)
    assert close(cost.lower_bound_time(8, N, LINK), 3 * A + 1.75 * N * B + 0.875 * N * G)


def test_non_power_of_two_times_include_the_fold() -> None:
    fold = 2 * A + 2 * N * B + N * G
    # P = 6: core of 4 (2 rounds) plus the fold
    assert close(cost.recursive_doubling_time(6, N, LINK), 2 * (A + N * B + N * G) + fold)
    assert close(cost.rabenseifner_time(6, N, LINK), 4 * A + 1.5 * N * B + 0.75 * N * G + fold)
    # the tree needs ceil(log2 5) = 3 rounds each way
    assert close(cost.tree_time(5, N, LINK), 6 * A + 6 * N * B + 3 * N * G)
    assert close(cost.lower_bound_time(5, N, LINK), 3 * A + 1.6 * N * B + 0.8 * N * G)


def test_hierarchical_time_uses_both_levels() -> None:
    intra = LinkCost(alpha=1e-6, beta=1e-10, gamma=G)
    inter = LinkCost(alpha=1e-4, beta=1e-8, gamma=G)
    # 8 ranks, 4 per node: tree of 4 (2 rounds each way) inside, ring of 2 nodes across
    expect = (4 * 1e-6 + 4 * N * 1e-10 + 2 * N * G) + (2 * 1e-4 + 1.0 * N * 1e-8 + 0.5 * N * G)
    assert close(cost.hierarchical_time(8, N, 4, intra, inter), expect)
    # one rank per node is a plain ring over the inter-node links
    assert close(cost.hierarchical_time(8, N, 1, intra, inter), cost.ring_time(8, N, inter))
    # a single node is a plain tree
    assert close(cost.hierarchical_time(8, N, 8, intra, inter), cost.tree_time(8, N, intra))


def test_one_rank_costs_nothing() -> None:
    for fn in (
        cost.ring_time,
        cost.recursive_doubling_time,
        cost.tree_time,
        cost.rabenseifner_time,
        cost.lower_bound_time,
    ):
        assert fn(1, N, LINK) == 0.0


def test_allreduce_time_dispatches_and_counts_ring_pieces() -> None:
    assert close(cost.allreduce_time("ring", 8, N, LINK), cost.ring_time(8, N, LINK))
    assert close(cost.allreduce_time("native", 8, N, LINK), cost.ring_time(8, N, LINK))
    assert close(cost.allreduce_time("tree", 8, N, LINK), cost.tree_time(8, N, LINK))
    assert close(cost.allreduce_time("lower_bound", 8, N, LINK), cost.lower_bound_time(8, N, LINK))
    # 16 MiB float32 over 4 ranks with 1 MiB pieces: 4 MiB segments, 4 pieces each without the
    # default cap, 2 (of 2 MiB) with it
    n = 16 << 20
    t = cost.allreduce_time("ring", 4, n, LINK, piece_bytes=1 << 20, max_pieces=64)
    assert close(t, cost.ring_time(4, n, LINK, pieces=4))
    assert close(cost.allreduce_time("ring", 4, n, LINK, piece_bytes=1 << 20), cost.ring_time(4, n, LINK, pieces=2))
    # 64 MiB: 16 MiB segments in 16 pieces, or 4 (of 4 MiB) when capped at 4
    n = 64 << 20
    t = cost.allreduce_time("ring", 4, n, LINK, piece_bytes=1 << 20, max_pieces=64)
    assert close(t, cost.ring_time(4, n, LINK, pieces=16))
    t = cost.allreduce_time("ring", 4, n, LINK, piece_bytes=1 << 20, max_pieces=4)
    assert close(t, cost.ring_time(4, n, LINK, pieces=4))
    # 1 MiB over 4 ranks: 256 KiB segments, one piece each, with or without the cap
    assert close(cost.allreduce_time("ring", 4, 1 << 20, LINK), cost.ring_time(4, 1 << 20, LINK, pieces=1))
    with pytest.raises(ConfigError, match="ring"):
        cost.allreduce_time("bcube", 4, n, LINK)


def test_lower_bound_is_below_every_algorithm() -> None:
    for p in (2, 3, 4, 5, 8, 13, 16):
        for n in (8.0, 1e3, 1e6, 1e9):
            lb = cost.lower_bound_time(p, n, LINK)
            for alg in ("ring", "tree", "recursive_doubling", "rabenseifner"):
                assert cost.allreduce_time(alg, p, n, LINK) >= lb * (1 - 1e-12), (alg, p, n)


def test_latency_and_bandwidth_regimes() -> None:
    slow_start = LinkCost(alpha=1e-3, beta=1e-10)
    # tiny messages: log P rounds beat 2(P-1) steps
    assert cost.recursive_doubling_time(16, 64, slow_start) < cost.ring_time(16, 64, slow_start)
    # large messages: the ring's 2(P-1)/P n beats the butterfly's log P n
    assert cost.ring_time(16, 1e9, slow_start) < cost.recursive_doubling_time(16, 1e9, slow_start)


def test_link_cost_validation() -> None:
    with pytest.raises(ConfigError, match="alpha"):
        LinkCost(alpha=-1.0, beta=0.0)
    with pytest.raises(ConfigError, match="beta"):
        LinkCost(alpha=0.0, beta=float("nan"))


# ----------------------------------------------------------------------------- traffic, hand-counted


def test_ring_traffic_by_hand() -> None:
    # 16 float32 over 4 ranks: 4-element segments, 6 sends of 16 B each
    t = cost.traffic("ring", 4, 64)
    assert t.messages == (6,) * 4 and t.bytes_sent == (96,) * 4
    # 10 elements over 2 ranks with 8-byte pieces: segments of 5 in 3 pieces (2, 2, 1)
    t = cost.ring_traffic(2, 10, itemsize=4, piece_bytes=8, max_pieces=64)
    assert t.messages == (6, 6) and t.bytes_sent == (40, 40)
    # ... or at most 2 pieces (3, 2), the default cap
    for t in (
        cost.ring_traffic(2, 10, itemsize=4, piece_bytes=8, max_pieces=2),
        cost.ring_traffic(2, 10, itemsize=4, piece_bytes=8),
    ):
        assert t.messages == (4, 4) and t.bytes_sent == (40, 40)
    # 3 elements over 5 ranks: segments (1,1,1,0,0); rank r skips r+1 in RS and r+2 in AG
    t = cost.ring_traffic(5, 3, itemsize=4)
    segs = [1, 1, 1, 0, 0]
    for r in range(5):
        expect = 2 * 3 - segs[(r + 1) % 5] - segs[(r + 2) % 5]
        assert t.bytes_sent[r] == 4 * expect
    # every element crosses P-1 links in each phase
    assert t.total_bytes == 2 * 4 * 3 * 4


def test_tree_traffic_by_hand() -> None:
    t = cost.traffic("tree", 8, 80)
    # root: three children; 4: parent + children 6, 5; 2: parent + child 3; odd ranks: parent only
    assert t.messages == (3, 1, 2, 1, 3, 1, 2, 1)
    assert t.total_messages == 14 and t.max_bytes == 3 * 80


def test_fold_traffic_by_hand() -> None:
    # P = 6: ranks 0, 2 fold into 1, 3; core {1, 3, 4, 5} runs 2 rounds; 1, 3 send the result back
    t = cost.traffic("recursive_doubling", 6, 40)
    assert t.messages == (1, 3, 1, 3, 2, 2)
    assert t.bytes_sent == tuple(40 * m for m in t.messages)
    # Rabenseifner, 8 elements on 4 ranks: halves of 4 then 2 elements, doubling 2 then 4
    t = cost.traffic("rabenseifner", 4, 32)
    assert t.messages == (4,) * 4 and t.bytes_sent == (48,) * 4


def test_hierarchical_traffic_by_hand() -> None:
    # nodes {0,1} {2,3} {4}: inside a node the member sends up, the leader sends down;
    # leaders 0, 2, 4 run a ring of 3 over 6 elements (segments of 2): 4 sends of 8 B
    t = cost.traffic("hierarchical", 5, 24, node_size=2)
    assert t.messages == (1 + 4, 1, 1 + 4, 1, 4)
    assert t.bytes_sent == (24 + 32, 24, 24 + 32, 24, 32)


def test_traffic_rejects_bad_input() -> None:
    with pytest.raises(ConfigError, match="rabenseifner"):
        cost.traffic("allgather", 4, 64)
    with pytest.raises(ConfigError, match="whole number"):
        cost.traffic("ring", 4, 10, itemsize=4)
    with pytest.raises(ConfigError, match="one per rank"):
        cost.traffic("hierarchical", 4, 64, nodes=(0, 1))


# ----------------------------------------------------------------------------- traffic, measured


@pytest.mark.parametrize(
    "world_size,numel,dtype,opts",
    [
        (4, 100_000, torch.float32, AllreduceOptions(piece_bytes=64 << 10)),
        (3, 100_000, torch.float32, AllreduceOptions(piece_bytes=4096, max_pieces=100, window=5)),
        (6, 50_001, torch.float16, AllreduceOptions(piece_bytes=4096, window=3, node_size=4)),
        (7, 30_000, torch.float64, AllreduceOptions(piece_bytes=10_000, nodes=(0, 1, 0, 1, 2, 2, 2))),
    ],
)
def test_threaded_runs_send_what_cost_says(
    world_size: int, numel: int, dtype: torch.dtype, opts: AllreduceOptions
) -> None:
    for alg in ("ring", "tree", "recursive_doubling", "rabenseifner", "hierarchical"):

        def fn(t: ThreadTransport) -> tuple[int, int]:
            allreduce_over(t, torch.ones(numel, dtype=dtype), "sum", alg, opts)
            return t.stats.messages, t.stats.bytes_sent

        got = run_threads(world_size, fn, timeout=30)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        expect = cost.traffic(
            alg,
            world_size,
            numel * itemsize,
            itemsize=itemsize,
            piece_bytes=opts.piece_bytes,
            max_pieces=opts.max_pieces,
            node_size=opts.node_size if opts.nodes is None else None,
            nodes=opts.nodes,
        )
        assert [g[0] for g in got] == list(expect.messages), alg
        assert [g[1] for g in got] == list(expect.bytes_sent), alg
