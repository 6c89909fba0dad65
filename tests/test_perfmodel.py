"""Performance model: units, cluster TOML, collective costs, profiles, step/memory predictions.

Cost functions are checked against hand-computed values (written out in the
comments) on made-up clusters; profiles against FLOPs and parameter counts
computed by hand for tiny models.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch import nn

from dtrain.comm import cost
from dtrain.errors import ConfigError
from dtrain.perfmodel import ClusterSpec, Device, Link, dump_cluster, load_cluster, predict, profile_model
from dtrain.perfmodel.collectives import CompressionModel, allreduce_bytes, allreduce_time, compressed_allreduce_time
from dtrain.perfmodel.compression import compressed_traffic, compression_model, compressor_kind
from dtrain.perfmodel.fit import fit_alpha_beta
from dtrain.perfmodel.predict import buckets_of, memory_per_device, ps_costs
from dtrain.perfmodel.profile import LayerProfile, ModelProfile
from dtrain.perfmodel.units import parse_bytes, parse_rate, parse_time
from dtrain.strategies import choice

MiB = 1 << 20


def flat(nodes: int, alpha: float, beta: float, gamma: float = 0.0, per_node: int = 1, **kw) -> ClusterSpec:
    return ClusterSpec(
        nodes=nodes,
        devices_per_node=per_node,
        inter=Link(1 / beta, alpha),
        intra=kw.pop("intra", Link(1 / beta, alpha)),
        device=Device(gamma=gamma, host="h", **kw),
    )


# ---------------------------------------------------------------- units and TOML


def test_units_parse_tc_style_rates_sizes_and_times():
    assert parse_rate("100mbit") == 100e6 / 8
    assert parse_rate("25Gbit/s") == 25e9 / 8
    assert parse_rate(8e6) == 1e6
    assert parse_bytes("16MiB") == 16 * MiB and parse_bytes("1GB") == 1e9
    assert parse_time("5us") == pytest.approx(5e-6) and parse_time("1.5ms") == pytest.approx(1.5e-3)
    for bad in ("10MB/s", "fast", "-1mbit"):
        with pytest.raises(ConfigError):
            parse_rate(bad)


def test_cluster_toml_round_trips_and_rejects_bad_keys(tmp_path):
    device = Device(
        kind="P100",
        flops=9.3e12,
        memory=16 * 2**30,
        gamma=2e-11,
        overhead=1e-3,
        wake=2e-4,
        floor=5e-3,
        imbalance=4e-4,
        p2p_floor=3e-3,
    )
    c = ClusterSpec(
        nodes=32,
        devices_per_node=4,
        inter=Link(parse_rate("25gbit"), 30e-6, 0.75, duplex_bandwidth=parse_rate("20gbit")),
        intra=Link(parse_rate("80gbit"), 5e-6),
        device=device,
        name="hvd",
    )
    p = tmp_path / "c.toml"
    p.write_text(dump_cluster(c))
    assert load_cluster(p) == c
    p.write_text('nodes = 2\nbandwith = "1gbit"\n')
    with pytest.raises(ConfigError, match="unknown key"):
        load_cluster(p)
    p.write_text('nodes = 2\n[links.inter]\nlatency = "5us"\n')
    with pytest.raises(ConfigError, match="bandwidth is required"):
        load_cluster(p)
    p.write_text('nodes = 2\n[links.inter]\nbandwidth = "1gbit"\n[models.resnet]\nsamples_per_s = 130\n')
    assert load_cluster(p).models["resnet"].samples_per_s == 130
    with pytest.raises(ConfigError, match="floor must be >= 0"):
        Device(floor=-1e-3)
    with pytest.raises(ConfigError, match="duplex_bandwidth must be > 0"):
        Link(1e9, duplex_bandwidth=0.0)
    p.write_text('nodes = 2\n[links.inter]\nbandwidth = "1gbit"\nduplex_bandwidth = "800mbit"\n')
    assert load_cluster(p).inter.duplex_beta == pytest.approx(8 / 800e6)
    assert load_cluster(p).inter.beta == pytest.approx(8 / 1e9)


# ---------------------------------------------------------------- collectives (hand-computed)

N = 1_000_000  # bytes
A, B, G = 1e-3, 1e-6, 1e-9  # alpha s, beta s/B, gamma s/B


def test_one_level_costs_match_the_textbook_formulas():
    c = flat(4, A, B, G)
    # ring: 2(P-1)a + 2(P-1)/P n b + (P-1)/P n g = 6e-3 + 1.5 + 0.75e-3
    assert allreduce_time(c, "ring", N, 4) == pytest.approx(1.50675)
    # binomial tree: 2 log2P (a + n b) + log2P n g = 4 (1e-3 + 1) + 2e-3
    assert allreduce_time(c, "tree", N, 4) == pytest.approx(4.006)
    # recursive doubling: log2P (a + n b + n g) = 2 (1e-3 + 1 + 1e-3)
    assert allreduce_time(c, "recursive_doubling", N, 4) == pytest.approx(2.004)
    # Rabenseifner: 2 log2P a + 2(P-1)/P n b + (P-1)/P n g = 4e-3 + 1.5 + 0.75e-3
    assert allreduce_time(c, "rabenseifner", N, 4) == pytest.approx(1.50475)
    assert allreduce_time(c, "ring", N, 1) == 0.0


@pytest.mark.parametrize("alg", ["ring", "native", "tree", "recursive_doubling", "rabenseifner"])
@pytest.mark.parametrize("p", [2, 3, 5, 8])
def test_one_level_costs_are_comm_cost(alg, p):
    c = flat(p, A, B, G)
    link = cost.LinkCost(A, B, G)
    piece = cost.RING_PIECE_BYTES if alg == "ring" else None
    assert allreduce_time(c, alg, N, p) == pytest.approx(cost.allreduce_time(alg, p, N, link, piece_bytes=piece))


@pytest.mark.parametrize("p", [4, 5])
def test_duplex_rate_charges_the_steps_that_send_and_receive_at_once(p):
    one_way = flat(p, A, B, G)
    duplex = ClusterSpec(
        nodes=p, inter=Link(1 / B, A, duplex_bandwidth=1 / (2 * B)), intra=one_way.intra, device=one_way.device
    )
    # ring, recursive doubling, Rabenseifner: every byte at the duplex rate (beta 2B)
    for alg in ("ring", "native", "recursive_doubling", "rabenseifner"):
        piece = cost.RING_PIECE_BYTES if alg == "ring" else None
        assert allreduce_time(duplex, alg, N, p) == pytest.approx(
            cost.allreduce_time(alg, p, N, cost.LinkCost(A, 2 * B, G), piece_bytes=piece)
        )
    # the binomial tree's rounds send one way: unchanged
    assert allreduce_time(duplex, "tree", N, p) == pytest.approx(allreduce_time(one_way, "tree", N, p))
    # ring on 4 ranks by hand: 6 steps of (1e-3 + 250000 * 2e-6) and 3 reductions of 250000 * 1e-9
    if p == 4:
        assert allreduce_time(duplex, "ring", N, p) == pytest.approx(6 * (1e-3 + 0.5) + 3 * 2.5e-4)


def test_token_bucket_by_hand():
    from dtrain.perfmodel.collectives import _tree_time_with_burst

    lk = cost.LinkCost(A, B, G)
    # without a bucket the simulated tree is the closed form
    for p in (2, 4, 8):
        assert _tree_time_with_burst(p, N, lk, 0.0) == pytest.approx(cost.allreduce_time("tree", p, N, lk))
    # 2 ranks, buckets of 0.4 MB: 1 -> 0 passes 0.6 MB at the rate, rank 0 reduces, then 0 -> 1 finds
    # its links' buckets full (unused so far): 2 (1e-3 + 0.6) + 1e-3
    bucketed = ClusterSpec(nodes=2, inter=Link(1 / B, A, burst=4e5), intra=Link(1 / B, A), device=Device(gamma=G))
    assert allreduce_time(bucketed, "tree", N, 2) == pytest.approx(2 * (A + 0.6) + 1e-3)
    # 4 ranks: 1->0 and 3->2 on fresh buckets (0.601 s, reduce: 0.602); 2->0 finds 0's in-bucket drained
    # at 0.601 and refilled by 1 ms: 1000 B (1.001 s, reduce: 1.603); 0->2 on fresh buckets (0.601 s);
    # 0->1 after it on 0's drained out-link (1.001 s); 2->3 meanwhile (fresh: 0.601 s)
    t4 = allreduce_time(
        ClusterSpec(nodes=4, inter=Link(1 / B, A, burst=4e5), intra=Link(1 / B, A), device=Device(gamma=G)),
        "tree",
        N,
        4,
    )
    assert t4 == pytest.approx((A + 0.6 + G * N) + (A + 0.999 + G * N) + (A + 0.6) + (A + 1.0))
    # the exchanges are charged their (duplex) rate throughout
    ring_b = ClusterSpec(nodes=4, inter=Link(1 / B, A, burst=1e5), intra=Link(1 / B, A), device=Device(gamma=G))
    for alg in ("ring", "native", "recursive_doubling", "rabenseifner"):
        assert allreduce_time(ring_b, alg, N, 4) == pytest.approx(allreduce_time(flat(4, A, B, G), alg, N, 4))
    with pytest.raises(ConfigError, match="burst must be >= 0"):
        Link(1e9, burst=-1.0)


def test_collective_steps_by_hand():
    from dtrain.perfmodel.collectives import collective_steps

    c, dense = ClusterSpec(nodes=8), CompressionModel()
    steps = {
        a: [collective_steps(c, a, p, dense) for p in (1, 2, 3, 4, 5, 8)]
        for a in ("ring", "native", "tree", "recursive_doubling", "rabenseifner", "hierarchical")
    }
    assert steps == {
        "ring": [0, 2, 4, 6, 8, 14],  # 2 (P-1)
        "native": [0, 2, 4, 6, 8, 14],
        "tree": [0, 2, 4, 4, 6, 6],  # 2 ceil(log2 P)
        "recursive_doubling": [0, 1, 3, 2, 4, 3],  # log2 of the power-of-two core, +2 to fold the rest
        "rabenseifner": [0, 2, 4, 4, 6, 6],
        "hierarchical": [0, 2, 4, 6, 8, 14],  # one device per node: the ring among nodes
    }
    assert collective_steps(ClusterSpec(nodes=2, devices_per_node=4), "hierarchical", 8, dense) == 2 * 2 + 2
    # compressed, counted: fp16 allreduces its payload on a ring, PowerSGD allreduces P then Q
    n = 1 << 20
    assert collective_steps(c, "ring", 4, CompressionModel("fp16", "summable", 0.5), n) == 6
    assert collective_steps(c, "ring", 4, CompressionModel("powersgd:2", "lowrank", 0.01), n) == 12
    # closed forms beyond 8 ranks
    assert collective_steps(ClusterSpec(nodes=16), "ring", 16, CompressionModel("powersgd:2", "lowrank", 0.01)) == 60


def test_two_level_costs_charge_each_round_on_its_level():
    intra = Link(1 / 1e-8, 1e-5)
    c = flat(2, A, B, G, per_node=2, intra=intra)  # 2 nodes x 2 devices, ranks node by node
    # ring: every step crosses nodes once per interface -> the one-level inter formula
    assert allreduce_time(c, "ring", N, 4) == pytest.approx(1.50675)
    # recursive doubling: distance 1 inside (1e-5 + 1e-2 + 1e-3), distance 2 across with both
    # devices of a node sharing its interface (1e-3 + 2 n b + 1e-3)
    assert allreduce_time(c, "recursive_doubling", N, 4) == pytest.approx(0.01101 + 2.002)
    # Rabenseifner: halving at distance 2 (n/2, contention 2): 2(1e-3 + 1) + 0.5e-3;
    # distance 1 inside (n/4): 2(1e-5 + 2.5e-3) + 2.5e-4
    assert allreduce_time(c, "rabenseifner", N, 4) == pytest.approx(2.0025 + 0.00527)
    # tree: round 0 inside 2(1e-5 + 1e-2) + 1e-3; round 1 across, one flow: 2(1e-3 + 1) + 1e-3
    assert allreduce_time(c, "tree", N, 4) == pytest.approx(0.02102 + 2.003)
    # hierarchical: tree in the node (0.02102) + ring of 2 leaders 2a + n b + n g / 2
    assert allreduce_time(c, "hierarchical", N, 4) == pytest.approx(0.02102 + 1.0025)


def test_bytes_per_rank_match_the_traffic_counts():
    assert allreduce_bytes("ring", 4000, 4) == pytest.approx(2 * 3 / 4 * 4000)
    assert allreduce_bytes("recursive_doubling", 4000, 4) == pytest.approx(2 * 4000)
    assert allreduce_bytes("ring", 4000, 128) == pytest.approx(2 * 127 / 128 * 4000)  # closed form beyond 64


def test_a_recount_adds_a_count_and_the_cpu_time_is_the_median_of_every_count(monkeypatch):
    from dtrain.perfmodel import _traffic

    readings = iter([(6, 900, 1.0e-3), (6, 900, 5.0e-3), (6, 900, 2.0e-3)])
    calls = []

    def fake_count(spec, world, numel, shapes=()):
        calls.append((spec, world, numel))
        return next(readings)

    monkeypatch.setattr(_traffic, "_count", fake_count)
    monkeypatch.setattr(_traffic, "_counts", {})
    monkeypatch.setattr(_traffic, "_current", set())
    assert _traffic.compressed_traffic("topk:0.01", 4, 1000) == (6, 900, 1.0e-3)
    assert _traffic.compressed_traffic("topk:0.01", 4, 1000) == (6, 900, 1.0e-3)  # no new count
    assert len(calls) == 1
    _traffic.recount_traffic()
    assert _traffic.compressed_traffic("topk:0.01", 4, 1000)[2] == pytest.approx(3.0e-3)  # median of 1 and 5
    _traffic.recount_traffic()
    assert _traffic.compressed_traffic("topk:0.01", 4, 1000)[2] == pytest.approx(2.0e-3)  # not the last alone
    assert calls == [("topk:0.01", 4, 1000)] * 3
    assert _traffic.compressed_traffic("topk:0.01", 1, 1000) == (0, 0, 0.0)  # one rank: nothing to count


def test_compressed_collectives():
    c = flat(4, 0.0, B, 0.0)
    half = CompressionModel("fp16", "summable", 0.5, 1e-9, 1e-9)
    # small world: the implementation's own counts (run on threads): a ring of fp16 payloads
    msgs, sent, cpu = compressed_traffic("fp16", 4, N // 4)
    assert msgs == 6 and sent == pytest.approx(2 * 3 / 4 * N / 2, rel=1e-3) and cpu > 0
    comm, coding = compressed_allreduce_time(c, "ring", N, 4, half)
    assert comm == pytest.approx(sent * B) and coding == pytest.approx(cpu)
    q = CompressionModel("onebit", "quantizer", 1 / 32)
    msgs, sent, _ = compressed_traffic("onebit", 4, N // 4)
    assert msgs == 12 and 2 * 3 / 4 * N / 32 <= sent <= 1.2 * 2 * 3 / 4 * N / 32  # 1 bit per element, + scales
    # large world: closed forms. fp16: a ring of half the bytes; quantizer: direct RS + AG of the payload
    c16 = flat(16, 0.0, B, 0.0)
    comm, coding = compressed_allreduce_time(c16, "ring", N, 16, half)
    assert comm == pytest.approx(2 * 15 / 16 * N / 2 * B) and coding == pytest.approx(N * 2e-9)
    assert compressed_allreduce_time(c16, "ring", N, 16, q)[0] == pytest.approx(2 * 15 * (N / 32 / 16) * B)
    dense = compressed_allreduce_time(c, "ring", N, 4, CompressionModel())
    assert dense == (allreduce_time(c, "ring", N, 4), 0.0)


def test_the_count_takes_the_buckets_layout_as_the_reducer_passes_it():
    from dtrain.perfmodel.predict import bucket_shapes
    from dtrain.workloads.load import load_model

    model, sample, _ = load_model("cnn", "digits", batch=16)
    prof = profile_model(model, sample, measure=False)
    params = [p for p in model.parameters()]
    numel = sum(p.numel() for p in params)
    # one bucket holds the CNN; the reducer packs its parameters last to first (registration order reversed)
    (layout,) = bucket_shapes(prof, 25.0)
    assert layout == tuple(tuple(p.shape) for p in reversed(params))
    assert prof.at_batch(32).layers[0].shapes == prof.layers[0].shapes
    # PowerSGD factors each weight matrix and sends the vectors dense: more bytes than the bucket as one matrix
    _, flat_sent, _ = compressed_traffic("powersgd:2", 4, numel)
    msgs, sent, _ = compressed_traffic("powersgd:2", 4, numel, layout)
    assert msgs == 12 and sent > 2 * flat_sent, (sent, flat_sent)
    # shapes that do not add up to the bucket: counted flat
    assert compressed_traffic("powersgd:2", 4, numel, ((3, 3),))[1] == flat_sent
    # and the prediction charges the layout's bytes
    c = flat(4, 0.0, 1e-6, 0.0)
    s = choice("dp", 4, "ring", bucket_mb=25.0, compression="powersgd:2")
    lowrank = CompressionModel("powersgd:2", "lowrank", 0.01)
    shaped = predict(prof, c, s, lowrank)
    unshaped = predict(replace(prof, layers=tuple(replace(ly, shapes=()) for ly in prof.layers)), c, s, lowrank)
    wire = [x.step_s - x.detail["coding_s"] for x in (shaped, unshaped)]  # the counted CPU differs too
    assert wire[0] - wire[1] == pytest.approx((sent - flat_sent) * 1e-6, rel=0.05)


def test_compressors_come_from_the_registry():
    assert compressor_kind("none") == "dense"
    assert compressor_kind("fp16") == "summable"
    assert compressor_kind("topk:0.01") == "sparse"
    assert compressor_kind("powersgd:2") == "lowrank"
    assert compressor_kind("onebit") == "quantizer"
    m = compression_model("fp16", measure=False)
    assert m.ratio == 0.5 and m.kind == "summable"
    assert compression_model("topk:0.01", measure=False).ratio == pytest.approx(0.02, rel=0.01)  # 8 B per pair
    with pytest.raises(ConfigError):
        compressor_kind("zip")


# ---------------------------------------------------------------- profile


def test_profile_counts_params_flops_and_activations_by_hand():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    b = 5
    prof = profile_model(model, (torch.randn(b, 4), torch.randint(0, 2, (b,))), name="tiny", repeats=3, warmup=1)
    l0, relu, l1 = prof.layers
    assert (l0.params, relu.params, l1.params) == (15, 0, 8)
    assert prof.param_bytes == 23 * 4
    # forward: 2 b in out; backward: weight grad 2 b in out, plus input grad for the second layer
    assert l0.fwd_flops == 2 * b * 4 * 3 and l0.bwd_flops == 2 * b * 4 * 3
    assert l1.fwd_flops == 2 * b * 3 * 2 and l1.bwd_flops == 2 * (2 * b * 3 * 2)
    assert (l0.activation_bytes, l1.activation_bytes) == (b * 3 * 4, b * 2 * 4)
    assert prof.measured and prof.fwd_s > 0 and prof.bwd_s > 0 and prof.optimizer_s > 0
    scaled = prof.at_batch(10)
    assert scaled.fwd_flops == 2 * prof.fwd_flops and scaled.activation_bytes == 2 * prof.activation_bytes


def test_profile_on_meta_device_needs_no_memory():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10))
    x = torch.empty(8, 4096, device="meta")
    prof = profile_model(model, x, measure=False)
    assert prof.params == 4096 * 4096 + 4096 + 4096 * 10 + 10
    assert prof.fwd_flops == 2 * 8 * (4096 * 4096 + 4096 * 10)
    assert not prof.measured


# ---------------------------------------------------------------- predictions


def made_up_profile(host: str = "h") -> ModelProfile:
    """Three layers of 1 MiB of parameters; forward 0.05 s and backward 0.1 s each; optimizer 0.01 s."""
    layers = tuple(LayerProfile(f"l{i}", MiB // 4, MiB, 1e9, 2e9, 1000.0, 0.05, 0.1) for i in range(3))
    return ModelProfile("made_up", 8, layers, optimizer_s=0.01, host=host)


def test_dp_overlaps_buckets_with_backward_by_hand():
    prof = made_up_profile()
    c = flat(2, 0.0, 0.15 / MiB)  # a 1 MiB bucket takes 0.15 s on a 2-rank ring
    assert [b for b, _ in buckets_of(prof, 1.0)] == [MiB, MiB, MiB]
    p = predict(prof, c, choice("dp", 2, "ring", bucket_mb=1.0))
    # buckets ready at 0.1, 0.2, 0.3; chain: 0.1-0.25, 0.25-0.4, 0.4-0.55; step = 0.15 + 0.55 + 0.01
    assert p.step_s == pytest.approx(0.71)
    assert p.exposed_s == pytest.approx(0.25)
    assert p.samples_per_s == pytest.approx(16 / 0.71)
    assert p.bytes_per_step == pytest.approx(3 * MiB)  # 2 (P-1)/P n = n per bucket for P = 2
    one = predict(prof, c, choice("dp", 2, "ring", bucket_mb=25.0))  # 1 MiB first bucket, then the rest
    # buckets [l2] ready 0.1 and [l1, l0] ready 0.3: 0.1-0.25, 0.3-0.6
    assert one.step_s == pytest.approx(0.15 + 0.6 + 0.01)
    single = predict(prof, c, choice("single", 1))
    assert single.step_s == pytest.approx(0.46) and single.comm_s == 0.0


def test_collective_floor_by_hand():
    prof = made_up_profile()
    c = flat(2, 0.0, 0.15 / MiB)  # a 1 MiB bucket takes 0.15 s on a 2-rank ring (see above)
    floored = flat(2, 0.0, 0.15 / MiB, floor=0.25)  # per step: a 2-rank ring's 2 steps take >= 0.5 s
    dp = choice("dp", 2, "ring", bucket_mb=25.0)
    # buckets [l2] ready 0.1 and [l1, l0] ready 0.3: each call takes max(0.5, its time): 0.1-0.6, 0.6-1.1
    assert predict(prof, floored, dp).step_s == pytest.approx(0.15 + 1.1 + 0.01)
    # a floor below every call's time changes nothing
    assert predict(prof, flat(2, 0.0, 0.15 / MiB, floor=0.05), dp).step_s == pytest.approx(predict(prof, c, dp).step_s)
    # one process: no collective, no floor
    assert predict(prof, floored, choice("single", 1)).step_s == pytest.approx(0.46)
    # the binomial tree of 2 ranks has 2 steps too, but sends the whole bucket each way: the 1 MiB bucket
    # is floor-bound (0.3 s < 0.5), the 2 MiB one not (0.6 s): 0.1-0.6, 0.6-1.2
    tree = choice("dp", 2, "tree", bucket_mb=25.0)
    assert predict(prof, floored, tree).step_s == pytest.approx(0.15 + 1.2 + 0.01)
    four, four_f = flat(4, 0.0, 1e-12), flat(4, 0.0, 1e-12, floor=0.1)  # links so fast that floors decide
    t_ring = predict(prof, four_f, choice("dp", 4, "ring", bucket_mb=25.0)).step_s
    t_tree = predict(prof, four_f, choice("dp", 4, "tree", bucket_mb=25.0)).step_s
    base = predict(prof, four, choice("dp", 4, "ring", bucket_mb=25.0)).step_s
    # buckets ready at 0.1 and 0.3; ring: 0.1-0.7, 0.7-1.3; tree: 0.1-0.5, 0.5-0.9; step = 0.15 + end + 0.01
    assert (t_ring, t_tree) == (pytest.approx(0.15 + 1.3 + 0.01, rel=1e-4), pytest.approx(0.15 + 0.9 + 0.01, rel=1e-4))
    assert base < t_tree
    # compressed: the coding (counted on threads: milliseconds) plus 0.075 / 0.15 s of ring is below the
    # floor either way; what of it is encode and decode (here 1e-8 + 1e-8 s/B: more than the count) adds
    fp16 = CompressionModel("fp16", "summable", 0.5, 1e-8, 1e-8)
    s16 = choice("dp", 2, "ring", bucket_mb=25.0, compression="fp16")
    p16 = predict(prof, floored, s16, fp16)
    assert p16.step_s == pytest.approx(0.15 + 1.1 + 0.01 + p16.detail["coding_s"])
    # parameter server: push, apply and pull of a step take at least 2 S floors together
    ps_c = flat(4, 1e-3, 1e-8, 1e-10, floor=0.25)
    bsp = predict(prof, ps_c, choice("ps", 3, servers=1, consistency="bsp"))
    assert bsp.step_s == pytest.approx(0.45 + 0.5)  # push 0.096 + apply 0.031 + pull 0.096 s < 0.5
    asp = predict(prof, ps_c, choice("ps", 3, servers=1, consistency="asp"))
    assert asp.step_s == pytest.approx(0.45 + 0.5)  # push 0.033 + apply 0.010 + pull 0.033 s < 0.5
    # above the floor the floor does nothing
    low = predict(prof, flat(4, 1e-3, 1e-8, 1e-10, floor=0.1), choice("ps", 3, servers=1, consistency="bsp"))
    assert low.step_s == pytest.approx(predict(prof, flat(4, 1e-3, 1e-8, 1e-10), choice("ps", 3, servers=1)).step_s)


def test_own_collectives_pay_the_p2p_floor_and_the_backend_its_own():
    prof = made_up_profile()
    base = flat(4, 0.0, 1e-12, floor=0.1)  # links so fast that floors decide (see above)
    own = replace(base, device=replace(base.device, p2p_floor=0.05))
    ring, native = choice("dp", 4, "ring", bucket_mb=25.0), choice("dp", 4, "native", bucket_mb=25.0)
    # buckets ready at 0.1 and 0.3; 6 steps each: 0.6 s per call at 0.1, 0.3 s at 0.05
    assert predict(prof, own, ring).step_s == pytest.approx(0.15 + 0.1 + 0.3 + 0.3 + 0.01, rel=1e-4)
    assert predict(prof, own, native).step_s == pytest.approx(predict(prof, base, native).step_s)
    assert predict(prof, own, choice("ddp", 4)).step_s == pytest.approx(predict(prof, base, native).step_s)
    assert predict(prof, base, ring).step_s == pytest.approx(0.15 + 1.3 + 0.01, rel=1e-4)  # None: the floor
    assert own.device.own_floor == 0.05 and base.device.own_floor == 0.1
    with pytest.raises(ConfigError, match="p2p_floor must be >= 0"):
        Device(p2p_floor=-1.0)


def test_imbalance_is_waited_for_by_synchronous_strategies_only():
    prof = made_up_profile()
    c, skew = flat(4, 1e-3, 1e-8, 1e-10), flat(4, 1e-3, 1e-8, 1e-10, imbalance=0.05)
    for s in (
        choice("dp", 4, "ring"),
        choice("ddp", 4),
        choice("ps", 3, servers=1, consistency="bsp"),
        choice("ps", 3, servers=1, consistency="backup:1"),
    ):
        base, slow = predict(prof, c, s), predict(prof, skew, s)
        assert slow.step_s == pytest.approx(base.step_s + 0.05), s
        assert slow.wait_s == pytest.approx(base.wait_s + 0.05), s
        assert slow.exposed_s == pytest.approx(base.exposed_s), s
    for cons in ("asp", "ssp:2", "softsync:2"):
        # no barrier: what the varied passes cost an asynchronous worker is its queueing at the server, not 0.05
        s = choice("ps", 3, servers=1, consistency=cons)
        base, slow = predict(prof, c, s), predict(prof, skew, s)
        assert base.detail["queue_s"] == 0.0 and 0.0 < slow.detail["queue_s"] < 0.05, cons
        assert slow.step_s == pytest.approx(base.step_s + slow.detail["queue_s"]), cons
    assert predict(prof, skew, choice("single", 1)).step_s == pytest.approx(0.46)


def test_compressors_pay_the_floor_per_step():
    prof = made_up_profile()
    floored = flat(2, 0.0, 1e-12, floor=0.25)  # links so fast that every call is floor-bound
    one = predict(
        prof,
        floored,
        choice("dp", 2, "ring", bucket_mb=25.0, compression="fp16"),
        CompressionModel("fp16", "summable", 0.5),
    )
    two = predict(
        prof,
        floored,
        choice("dp", 2, "ring", bucket_mb=25.0, compression="powersgd:2"),
        CompressionModel("powersgd:2", "lowrank", 0.01),
    )
    # 2 ranks: fp16's ring has 2 steps (0.5 s), PowerSGD's two allreduces 4 (1.0 s); buckets ready at
    # 0.1 and 0.3: 0.1-0.6, 0.6-1.1 and 0.1-1.1, 1.1-2.1. fp16's encode and decode count toward its floors;
    # PowerSGD's run between its two allreduces, while no message is in flight, and add to them
    assert one.step_s == pytest.approx(0.15 + 1.1 + 0.01, rel=1e-3)
    coding = two.detail["coding_s"]
    assert coding > 1e-5  # counted on threads: its CPU time, here small against the floors
    assert two.step_s == pytest.approx(0.15 + 2.1 + coding + 0.01, rel=1e-6)


def test_a_floor_bound_compressors_encode_and_decode_add_to_the_floors_and_its_merging_does_not():
    from dtrain.perfmodel.predict import bucket_collective

    fast = flat(4, 0.0, 1e-12, floor=0.1)  # 4 ranks, links so fast that floors decide
    n, shapes = 4 * 38282, ((38282,),)
    counted = compressed_allreduce_time(fast, "ring", n, 4, CompressionModel("topk:0.01", "sparse", 0.02), shapes)[1]
    steps = compressed_traffic("topk:0.01", 4, n // 4)[0]
    assert counted > 0 and steps >= 3
    for edge_share in (0.0, 0.25, 0.5, 1.0):
        per_byte = edge_share * counted / n  # the calibration's encode + decode, as a share of the counted CPU
        topk = CompressionModel("topk:0.01", "sparse", 0.02, per_byte / 2, per_byte / 2)
        comm, coding = bucket_collective(fast, "ring", n, 4, topk, shapes)
        assert coding == pytest.approx(counted)
        # the merging (the count less encode and decode) waits inside the floors; encode and decode add
        assert comm + coding == pytest.approx(steps * 0.1 + edge_share * counted, rel=1e-9)
    # PowerSGD's coding all adds (it runs between its allreduces), whatever its per-byte figures
    psgd = CompressionModel("powersgd:2", "lowrank", 0.01, 1e-9, 1e-9)
    comm, coding = bucket_collective(fast, "ring", n, 4, psgd, ((128, 299),))
    assert comm == pytest.approx(compressed_traffic("powersgd:2", 4, n // 4, ((128, 299),))[0] * 0.1)


def test_a_transfer_bound_compressors_merging_waits_inside_the_wire_time():
    from dtrain.perfmodel.predict import bucket_collective

    # 4 ranks, ~20 Mbit/s: the wire decides, not the floors (at ~50 Mbit/s a busy machine's counted CPU came
    # within 10x of the wire)
    slow = flat(4, 1e-4, 4e-7, floor=1e-6)
    n = 4 * 38282
    fp16 = CompressionModel("fp16", "summable", 0.5)
    wire, counted = compressed_allreduce_time(slow, "ring", n, 4, fp16)
    assert counted > 0 and wire > 10 * counted  # the transfer is far longer than the CPU counted in the call
    for edge_share in (0.0, 0.5, 1.0):
        per_byte = edge_share * counted / n
        comp = replace(fp16, encode_s_per_byte=per_byte / 2, decode_s_per_byte=per_byte / 2)
        comm, coding = bucket_collective(slow, "ring", n, 4, comp)
        assert coding == pytest.approx(counted)
        # encode before the first message and decode after the last add to the wire; the rest waits inside it
        assert comm + coding == pytest.approx(wire + edge_share * counted, rel=1e-9)
    # a call whose counted CPU exceeds its wire time and floors costs its CPU
    cpu_bound = replace(fp16, cpu_ratio=20 * wire / counted)
    comm, coding = bucket_collective(slow, "ring", n, 4, cpu_bound)
    assert comm == 0.0 and coding == pytest.approx(20 * wire)


def test_counted_coding_is_charged_at_the_compressors_cpu_ratio():
    # the counted path charges the thread count's CPU times cpu_ratio (what the cluster's processes spend
    # over the thread count, from the calibration) times the compute scale; the messages do not change
    c = flat(4, 1e-4, 1e-9, 1e-10)
    c = replace(c, device=replace(c.device, compute_scale=2.5))
    n = 38282
    shapes = ((16, 1, 3, 3), (16,), (32, 16, 3, 3), (32,), (64, 512), (64,), (10, 64), (10,))  # the CNN's
    full = CompressionModel("powersgd:2", "lowrank", 0.01)
    comm1, coding1 = compressed_allreduce_time(c, "ring", 4 * n, 4, full, shapes)
    comm2, coding2 = compressed_allreduce_time(c, "ring", 4 * n, 4, replace(full, cpu_ratio=0.6), shapes)
    assert coding1 > 0
    assert comm2 == comm1
    assert coding2 == pytest.approx(0.6 * coding1, rel=1e-9)
    cpu = compressed_traffic("powersgd:2", 4, n, shapes)[2]
    assert coding1 == pytest.approx(cpu * 2.5, rel=1e-9)


def test_cpu_ratio_is_the_processes_cpu_over_the_thread_count_and_round_trips(tmp_path):
    from dtrain.perfmodel.fit import fit_cpu_ratio
    from dtrain.perfmodel.spec import CompressorCost

    shapes = [[64, 512], [64], [10, 64], [10]]
    n = 64 * 512 + 64 + 640 + 10
    counted = compressed_traffic("onebit", 3, n, tuple(tuple(s) for s in shapes))[2]
    probe = {"numel": n, "shapes": shapes}
    results = {r: {"coding_cpu": dict(probe, cpu={"onebit": counted * x})} for r, x in enumerate((0.5, 0.7, 0.6))}
    assert fit_cpu_ratio("onebit", results) == pytest.approx(0.7, rel=1e-9)  # the busiest rank
    assert fit_cpu_ratio("topk:0.01", results) == 1.0  # not probed
    assert fit_cpu_ratio("onebit", {0: results[0]}) == 1.0  # one rank: nothing to count against
    assert fit_cpu_ratio("onebit", {0: {}, 1: {}}) == 1.0  # an older calibration
    spec = ClusterSpec(nodes=2, compressors={"onebit": CompressorCost(0.03, 5e-9, 2e-9, cpu_ratio=0.65)})
    (tmp_path / "c.toml").write_text(dump_cluster(spec))
    back = load_cluster(tmp_path / "c.toml")
    assert back.compressors["onebit"].cpu_ratio == pytest.approx(0.65)
    assert compression_model("onebit", back).cpu_ratio == pytest.approx(0.65)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="cpu_ratio"):
            CompressorCost(0.03, cpu_ratio=bad)


def test_compute_falls_back_to_flops_and_model_rates():
    prof = made_up_profile(host="elsewhere")
    c = flat(2, 0.0, 1e-9, 0.0)
    p = predict(prof, c, choice("single", 1))
    assert p.compute_s == pytest.approx(9e9 / c.device.flops + 4 * 3 * MiB * c.device.gamma)
    from dtrain.perfmodel.spec import ModelRate

    rated = ClusterSpec(nodes=2, device=Device(), models={"made_up": ModelRate(samples_per_s=80.0)})
    assert predict(prof, rated, choice("single", 1)).step_s == pytest.approx(8 / 80.0)


def test_parameter_server_bsp_by_hand():
    prof = made_up_profile()
    n = 3 * MiB
    c = flat(4, 1e-3, 1e-8, 1e-10)  # 4 nodes, one device each: server on node 0, workers on 1..3
    s = choice("ps", 3, servers=1, consistency="bsp")
    pc = ps_costs(prof, c, s, s.options, CompressionModel(), prof.optimizer_s)
    assert pc.push_all == pytest.approx(3 * n * 1e-8 + 2e-3)  # server's link takes 3 n; header + payload
    assert pc.push_one == pytest.approx(n * 1e-8 + 2e-3)
    p = predict(prof, c, s)
    apply = 3 * (n * 1e-10 + 0.01)
    assert p.step_s == pytest.approx(0.45 + 2 * (3 * n * 1e-8 + 2e-3) + apply)
    two = predict(prof, c, choice("ps", 2, servers=2, consistency="bsp"))
    assert two.detail["push_s"] == pytest.approx(2 * n / 2 * 1e-8 + 4e-3)  # each server link takes N n / S
    asp = predict(prof, c, choice("ps", 3, servers=1, consistency="asp"))
    alone = 0.45 + 2 * (n * 1e-8 + 2e-3) + n * 1e-10 + 0.01  # compute + push + apply + pull, nobody ahead
    assert asp.step_s == pytest.approx(alone)  # identical workers: a round robin, nobody queues
    # workers whose passes vary (imbalance > 0) do not wait for each other and queue at the server's link in,
    # CPU and link out: each waits rho / (2 (1 - rho)) of a service there (M/D/1), rho = 3 service / cycle
    varied = replace(c, device=replace(c.device, imbalance=1e-3))
    asp = predict(prof, varied, choice("ps", 3, servers=1, consistency="asp"))
    services = (n * 1e-8, n * 1e-10 + 0.01, n * 1e-8)
    waits = sum(3 * sv / asp.step_s / (2 * (1 - 3 * sv / asp.step_s)) * sv for sv in services)
    assert asp.step_s == pytest.approx(alone + waits, rel=1e-9)
    assert asp.step_s - alone == pytest.approx(asp.detail["queue_s"]) and 0.005 < asp.detail["queue_s"] < 0.01


def test_an_asynchronous_cycle_queues_at_the_server_as_m_d_1_and_never_behind_more_than_the_others():
    from dtrain.perfmodel.predict import async_cycle

    # c = 1 + rho / (2 (1 - rho)) 0.1 with rho = 0.2 / c: c^2 - 1.2 c + 0.19 = 0
    assert async_cycle(0.8, 0.2, 0.0, 2, (0.1,)) == pytest.approx((1.2 + math.sqrt(1.44 - 0.76)) / 2, rel=1e-9)
    assert async_cycle(0.8, 0.2, 0.0, 1, (0.1,)) == pytest.approx(1.0)  # alone: nobody to queue behind
    assert async_cycle(0.8, 0.2, 1.5, 2, (0.1,)) == pytest.approx(2.3)  # the wait hides under the floor
    # a saturated server: each of the 4 can wait for the 3 others' 0.5 s at most, not forever
    assert async_cycle(0.1, 0.1, 0.0, 4, (0.5,)) == pytest.approx(0.2 + 3 * 0.5)


def test_memory_per_device_by_hand():
    prof = made_up_profile()
    p = float(prof.param_bytes)
    act = 3 * 1000.0
    m = memory_per_device(prof, choice("dp", 4))
    assert (m.params, m.grads, m.optimizer, m.activations, m.buffers) == (p, p, p, act, p)
    adam = memory_per_device(ModelProfile("m", 8, prof.layers, optimizer="adam"), choice("single", 1))
    assert adam.optimizer == 2 * p and adam.buffers == 0
    tiny = ClusterSpec(nodes=2, device=Device(memory=1000.0, host="h"))
    assert not predict(prof, tiny, choice("dp", 2)).fits


def test_bad_strategies_are_refused_before_predicting():
    with pytest.raises(ConfigError, match="strategy 'zero' is not known"):
        choice("zero", 2)
    with pytest.raises(ConfigError, match="processes"):
        predict(made_up_profile(), flat(2, 0.0, 1e-9), choice("dp", 4))


def test_fit_alpha_beta_recovers_a_line():
    sizes = [4, 64, 1024, 1 << 18, 1 << 20, 1 << 22]
    times = [20e-6 + n * 8e-9 for n in sizes]
    a, b = fit_alpha_beta(sizes, times)
    assert a == pytest.approx(20e-6, rel=0.02) and b == pytest.approx(8e-9, rel=0.01)
    assert math.isfinite(a)


def test_trimmed_mean_drops_only_the_rare_stall():
    from dtrain.perfmodel.fit import trimmed_mean

    assert trimmed_mean([1.0] * 9 + [100.0]) == pytest.approx(1.0)
    assert trimmed_mean([1.0, 2.0, 3.0, 4.0]) == pytest.approx(2.5)  # too few to cut one in ten


def test_load_terms_from_the_payload_free_steps_by_hand():
    from dtrain.perfmodel.fit import fit_floor as _floor
    from dtrain.perfmodel.fit import fit_imbalance as _imbalance
    from dtrain.perfmodel.fit import fit_wake as _wake
    from dtrain.perfmodel.predict import WAKES_FIRST_BUCKET

    # two ranks; per rank the means of its step, its own pass, the slowest pass and the shortest allreduce
    res = {
        0: {"sync": {"step": 10e-3, "pass": 5e-3, "slowest": 6e-3, "collective": 1e-3}, "floor": 4e-3},
        1: {"sync": {"step": 10.6e-3, "pass": 6e-3, "slowest": 6e-3, "collective": 1e-3}, "floor": 2e-3},
    }
    # beyond the slowest pass and the allreduce: (3 ms + 3.6 ms) / 2 over the first bucket's wake-ups
    assert _wake(res) == pytest.approx(3.3e-3 / WAKES_FIRST_BUCKET)
    assert _imbalance(res) == pytest.approx(0.5e-3)  # rank 0 waits 1 ms, rank 1 none
    assert _floor(res) == pytest.approx(3e-3 / 2)  # 2(P-1) = 2 steps
    res[1]["sync"]["step"] = 6.5e-3  # a step shorter than its parts does not make the wake negative
    res[0]["sync"]["step"] = 6.5e-3
    assert _wake(res) == 0.0


def test_duplex_rate_is_the_exchanges_bytes_over_their_time_by_hand():
    from dtrain.perfmodel.fit import fit_duplex_rate as _duplex_rate

    one_way = Link(bandwidth=1e6, latency=1e-4)
    # two ranks' medians per size; the rate is over the medians across ranks: 3 MB in (1 + 2) s
    res = {
        0: {"duplex": [(1_000_000, 1.0), (2_000_000, 2.0)]},
        1: {"duplex": [(1_000_000, 1.2), (2_000_000, 1.8)]},
        2: {"duplex": [(1_000_000, 0.8), (2_000_000, 2.4)]},
    }
    assert _duplex_rate(res, Link(bandwidth=5e6)) == pytest.approx(3e6 / 3.0)
    assert _duplex_rate(res, one_way) == 1e6  # never above the one-way rate
    assert _duplex_rate({0: {}}, one_way) is None
