"""The performance model of tensor parallelism and the hybrid DP x PP x TP mesh (dtrain.perfmodel.tensor and .mesh)
by hand: collective bytes against closed forms, Korthikanti's activation formulas, memory scaling,
placement, the degenerate meshes against the single-process, data-parallel and pipeline models, and
the ranked factorizations, on made-up profiles and clusters."""

from __future__ import annotations

import itertools

import pytest

from dtrain.errors import ConfigError
from dtrain.perfmodel import ClusterSpec, Device, Link, predict
from dtrain.perfmodel import mesh as hm
from dtrain.perfmodel import tensor as tm
from dtrain.perfmodel.collectives import allreduce_bytes, allreduce_time, ring_allgather_time
from dtrain.perfmodel.pipeline import pipeline_cost
from dtrain.perfmodel.profile import LayerProfile, ModelProfile
from dtrain.strategies import choice

B, S, H, L, A, V = 8, 16, 32, 4, 4, 64  # batch, sequence, width, blocks, heads, vocabulary
SHAPE = tm.TransformerShape(batch=B, seq=S, hidden=H, layers=L, heads=A, vocab=V)
KINDS = ["embed"] + ["block"] * L + ["ln", "head"]
BLOCK_MS = 1.0


def gpt_profile(optimizer: str = "sgd", batch: int = B) -> ModelProfile:
    """A made-up measured GPT laid out as dtrain.workloads.models.gpt builds it: float32 parameters counted from the
    shape, each block 1 ms forward and 2 ms backward, the other layers 0.2 and 0.4 ms, at ``batch``."""
    counts = SHAPE.params()
    layers = []
    for i, kind in enumerate(KINDS):
        n = sum(counts[kind])
        f = (BLOCK_MS if kind == "block" else 0.2) * 1e-3
        layers.append(
            LayerProfile(
                name=f"{kind}{i}",
                params=n,
                param_bytes=4 * n,
                fwd_flops=1.0,
                bwd_flops=2.0,
                activation_bytes=4.0 * batch * S * H,
                fwd_s=f,
                bwd_s=2 * f,
            )
        )
    return ModelProfile(
        name="gpt-made-up",
        batch=batch,
        layers=tuple(layers),
        optimizer_s=1e-3,
        input_bytes=8.0 * batch * S,
        host="h",
        optimizer=optimizer,
    )


def cluster(
    nodes: int = 2,
    per_node: int = 4,
    alpha: float = 1e-5,
    beta: float = 1e-8,
    intra_beta: float = 1e-9,
    **device: float,
) -> ClusterSpec:
    return ClusterSpec(
        nodes=nodes,
        devices_per_node=per_node,
        inter=Link(1 / beta, alpha),
        intra=Link(1 / intra_beta, alpha / 10),
        device=Device(host="h", memory=2.0**40, **device),
    )


def ring(p: int, nbytes: float) -> float:
    return 2 * (p - 1) / p * nbytes


# ---------------------------------------------------------------- tensor-parallel collectives


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("m", [1, 2])
def test_bytes_per_step_are_the_closed_form(tp, m):
    c = cluster(nodes=2, per_node=4)
    n = B // m * S * H * 4  # one micro-batch's activation, float32
    blocks = tm.tensor_parallel_comm(
        c, B, S, H, L, tp, sequence_parallel=False, microbatches=m, embedding=False, head=False
    )
    # 4 allreduces per block (2 forward, 2 backward), per micro-batch: 4 L 2(t-1)/t b s h 4 per step
    assert blocks.bytes == pytest.approx(m * 4 * L * ring(tp, n))
    assert blocks.calls == 4 * L * m
    whole = tm.tensor_parallel_comm(c, B, S, H, L, tp, sequence_parallel=False, microbatches=m)
    # plus the embedding's forward allreduce, the head's backward one and the loss's three of b s floats
    assert whole.bytes == pytest.approx(m * ((4 * L + 2) * ring(tp, n) + 3 * ring(tp, 4 * B // m * S)))
    assert whole.calls == (4 * L + 5) * m
    assert whole.seconds == pytest.approx(whole.fwd_s + whole.bwd_s) and whole.grads_s == 0.0


def test_sequence_parallel_moves_the_same_bytes_in_the_same_time_plus_the_split_and_the_replicated_gradients():
    c = cluster(nodes=2, per_node=4)
    n = B * S * H * 4
    for tp in (2, 4, 8):
        plain = tm.tensor_parallel_comm(c, B, S, H, L, tp, sequence_parallel=False)
        sp = tm.tensor_parallel_comm(c, B, S, H, L, tp, sequence_parallel=True)
        view = tm.group_cluster(c, [list(range(tp))])
        # each block's allreduce is an allgather + a reduce-scatter (the ring's halves add up to it exactly);
        # as dtrain's plan runs it, the embedding keeps its allreduce and block0's input is split, its backward
        # an allgather; the column layers (qkv, fc1, the head) gather their input again in backward instead of
        # keeping it; the norms' and row biases' gradients are summed (as tests/test_tensor_parallel_dist.py)
        replicated = 4.0 * (L * (4 * H + 2 * H) + 2 * H)
        regathers = 1 + 2 * L + 1
        assert sp.bytes == pytest.approx(plain.bytes + regathers * (tp - 1) / tp * n + ring(tp, replicated))
        assert sp.fwd_s + sp.bwd_s == pytest.approx(
            plain.fwd_s + plain.bwd_s + regathers * ring_allgather_time(view, "ring", n, tp)
        )
        assert sp.grads_s == pytest.approx(allreduce_time(view, "ring", replicated, tp))
        assert plain.calls == 4 * L + 1 + 1 + 3
        assert sp.calls == 10 * L + 2 + 3 + 3 + 1  # 10 halves a block, 2 for the embedding, 3 the head, gradients
    with pytest.raises(ConfigError, match="ring"):
        tm.tensor_parallel_comm(c, B, S, H, L, 2, sequence_parallel=True, algorithm="tree")


def test_a_block_by_hand_on_the_inter_link_and_the_floor():
    alpha, beta = 1e-4, 1e-8
    c = cluster(nodes=2, per_node=1, alpha=alpha, beta=beta, gamma=0.0)  # tp=2 over two nodes: the inter link
    n = B * S * H * 4
    one = tm.tensor_parallel_comm(c, B, S, H, 1, 2, sequence_parallel=False, embedding=False, head=False)
    # a ring allreduce of n on 2 ranks: 2 steps of alpha + n/2 beta (one piece each); 2 in forward, 2 in backward
    assert one.fwd_s == pytest.approx(2 * 2 * (alpha + n / 2 * beta))
    assert one.bwd_s == pytest.approx(one.fwd_s)
    floored = tm.tensor_parallel_comm(
        cluster(nodes=2, per_node=1, floor=0.5), B, S, H, 1, 2, sequence_parallel=False, embedding=False, head=False
    )
    assert floored.fwd_s == pytest.approx(2 * 2 * 0.5)  # each allreduce at least 2(t-1) floors
    assert tm.tensor_parallel_comm(c, B, S, H, L, 1, sequence_parallel=True).bytes == 0.0


def test_a_group_inside_a_node_uses_the_intra_link_and_one_across_nodes_shares_the_inter_link():
    c = cluster(nodes=4, per_node=2)
    inside = tm.group_cluster(c, tm.mesh_groups("tp", 4, 1, 2))
    assert (inside.nodes, inside.devices_per_node) == (1, 2)
    four = tm.tensor_parallel_comm(c, B, S, H, L, 2, sequence_parallel=False)
    alone = tm.tensor_parallel_comm(
        ClusterSpec(nodes=1, devices_per_node=2, intra=c.intra, device=c.device), B, S, H, L, 2, sequence_parallel=False
    )
    assert four.seconds == pytest.approx(alone.seconds)
    # dp groups {0, 2, 4, 6} and {1, 3, 5, 7}: one member on each node, two groups on its interface
    across = tm.group_cluster(c, tm.mesh_groups("dp", 4, 1, 2))
    assert (across.nodes, across.devices_per_node) == (4, 1)
    assert across.inter.beta == pytest.approx(2 * c.inter.beta)
    wide = tm.group_cluster(c, tm.mesh_groups("tp", 1, 1, 8))  # tp > devices per node: the inter link
    assert (wide.nodes, wide.devices_per_node, wide.inter.beta) == (4, 2, c.inter.beta)


def test_mesh_placement_is_tp_innermost_then_dp_then_pp():
    dp, pp, tp = 2, 3, 2
    assert tm.mesh_rank(1, 2, 1, dp=dp, tp=tp) == (2 * dp + 1) * tp + 1
    for axis, size in (("tp", tp), ("dp", dp), ("pp", pp)):
        groups = tm.mesh_groups(axis, dp, pp, tp)
        assert all(len(g) == size for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(dp * pp * tp))
    assert tm.mesh_groups("tp", dp, pp, tp)[0] == [0, 1] and tm.mesh_groups("dp", dp, pp, tp)[0] == [0, 2]
    assert tm.mesh_groups("pp", dp, pp, tp)[0] == [0, 4, 8]


# ---------------------------------------------------------------- memory


def test_block_activations_are_korthikantis_table_2():
    shape = tm.TransformerShape(batch=2, seq=64, hidden=32, layers=1, heads=4, vocab=8, dtype_bytes=2, dropout=True)
    sbh, ratio = 2 * 64 * 32, 5 * 4 * 64 / 32  # 5as/h
    assert tm.block_activation_bytes(shape, 1, False) == pytest.approx(sbh * (34 + ratio))
    for t in (2, 4):
        assert tm.block_activation_bytes(shape, t, False) == pytest.approx(sbh * (10 + 24 / t + ratio / t))
        assert tm.block_activation_bytes(shape, t, True) == pytest.approx(sbh * (34 / t + ratio / t))
    # float32, no dropout, fused attention: 4e s b h whole, 12e s b h split
    fused = tm.TransformerShape(batch=2, seq=64, hidden=32, layers=1, heads=4, vocab=8, scores=False)
    assert tm.block_activation_bytes(fused, 2, False) == pytest.approx(sbh * (16 + 48 / 2))


@pytest.mark.parametrize("sp", [False, True])
def test_tensor_memory_divides_the_split_layers_and_keeps_the_replicated_ones(sp):
    counts = SHAPE.params()
    split = counts["embed"][0] + L * counts["block"][0] + counts["head"][0]
    replicated = counts["embed"][1] + L * counts["block"][1] + counts["ln"][1]
    prof = gpt_profile("adam")
    for t in (1, 2, 4):
        mem = tm.tensor_memory(SHAPE, t, sp)
        assert mem.params == pytest.approx(4 * (split / t + replicated)) and mem.grads == mem.params
        assert mem.optimizer == mem.params  # a shape alone: one state per parameter
        sbh = B * S * H
        rest = (4 * sbh + 4 * sbh) / (t if sp else 1)  # ln_f's and the head's inputs (no dropout masks)
        assert mem.activations == pytest.approx(L * tm.block_activation_bytes(SHAPE, t, sp) + rest + 4 * B * S * V / t)
        from_profile = tm.tensor_memory(prof, t, sp, shape=SHAPE)
        assert from_profile.params == pytest.approx(mem.params) and from_profile.activations == mem.activations
        assert from_profile.optimizer == pytest.approx(2 * mem.params)  # adam
    halves = tm.tensor_memory(SHAPE, 2, sp).params / tm.tensor_memory(SHAPE, 1, sp).params
    assert 0.5 < halves < 0.52  # about half: only the small replicated parameters stay whole
    with pytest.raises(ConfigError, match="does not divide the 4 attention heads"):
        tm.tensor_memory(SHAPE, 8, sp)
    with pytest.raises(ConfigError, match="needs its TransformerShape"):
        tm.tensor_memory(prof, 2, sp)


def test_a_profile_of_another_shape_is_refused():
    with pytest.raises(ConfigError, match="expected 6 blocks"):
        tm.tensor_memory(gpt_profile(), 2, False, shape=tm.TransformerShape(B, S, H, 6, A, V))


# ---------------------------------------------------------------- the hybrid mesh


def hybrid(prof: ModelProfile, c: ClusterSpec, dp: int, pp: int, tp: int, m: int = 1, **kw):
    args = dict(
        microbatches=m,
        schedule="1f1b",
        sequence_parallel=False,
        batch=prof.batch * dp,
        seq=S,
        hidden=H,
        layers=L,
        heads=A,
        vocab=V,
    )
    args.update(kw)
    return hm.predict_hybrid(prof, c, dp=dp, pp=pp, tp=tp, **args)


def test_one_rank_is_the_single_process_prediction():
    prof, c = gpt_profile(), cluster()
    one, single = hybrid(prof, c, 1, 1, 1), predict(prof, c, choice("single"))
    assert one.compute_s == pytest.approx(single.compute_s)
    assert one.step_s == pytest.approx(single.step_s)
    assert one.bytes_per_step == 0.0 and one.exposed_s == 0.0 and one.memory.params == single.memory.params


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_data_parallel_alone_sends_a_ring_allreduce_of_the_parameters(dp):
    prof, c = gpt_profile(), cluster()
    pred = hybrid(prof, c, dp, 1, 1)
    n = float(prof.param_bytes)
    assert pred.bytes_per_step == pytest.approx(allreduce_bytes("ring", n, dp))
    assert pred.bytes_per_step == pytest.approx(ring(dp, n), rel=1e-3)
    assert pred.detail["tp_bytes"] == pred.detail["pp_bytes"] == 0.0
    assert pred.detail["dp_s"] >= allreduce_time(tm.group_cluster(c, [list(range(dp))]), "ring", n, dp)
    assert pred.compute_s == pytest.approx(predict(prof, c, choice("single")).compute_s)  # the same per replica


def test_a_pipeline_alone_is_the_pipeline_model():
    prof, c = gpt_profile(), cluster(nodes=4, per_node=1)
    for schedule, m in (("gpipe", 4), ("1f1b", 2), ("interleaved", 2)):
        pred = hybrid(prof, c, 1, 2, 1, m, schedule=schedule)
        pc = pipeline_cost(prof, c, 2, m, schedule, chunks=2 if schedule == "interleaved" else 1)
        assert pred.step_s == pytest.approx(pc.step_s)
        assert pred.detail["bubble"] == pytest.approx(pc.bubble)
        assert pred.detail["pp_bytes"] == pytest.approx(sum(pc.bytes_sent) / 2)
    equal = hybrid(prof, c, 1, 2, 1, 2, balance="equal")  # dtrain.hybrid's default cut: 4 and 3 layers
    assert equal.step_s == pytest.approx(pipeline_cost(prof, c, 2, 2, "1f1b", sizes=(4, 3)).step_s)
    assert equal.step_s > hybrid(prof, c, 1, 2, 1, 2).step_s  # the time-balanced cut is faster


def test_the_step_adds_up_and_tensor_parallelism_costs_collectives():
    prof, c = gpt_profile(), cluster(imbalance=1e-4)
    for dp, pp, tp in ((1, 1, 2), (2, 2, 2), (1, 2, 4)):
        pred = hybrid(prof, c, dp, pp, tp, 2, overhead_s=1e-3)
        d = pred.detail
        assert pred.step_s == pytest.approx(pred.compute_s + pred.exposed_s + pred.wait_s + 1e-3)
        assert pred.exposed_s == pytest.approx(d["tp_s"] + d["pp_s"] - (pred.wait_s - 1e-4) + d["dp_s"])
        assert pred.bytes_per_step == pytest.approx(d["tp_bytes"] + d["pp_bytes"] + d["dp_bytes"])
        assert d["tp_s"] > 0 and d["tp_bytes"] > 0
        assert pred.compute_s < predict(prof, c, choice("single")).compute_s  # each rank computes 1/t
    sp = hybrid(prof, c, 2, 2, 2, 2, sequence_parallel=True)
    plain = hybrid(prof, c, 2, 2, 2, 2)
    assert sp.memory.activations < plain.memory.activations
    assert sp.detail["pp_bytes"] == pytest.approx(plain.detail["pp_bytes"] / 2)  # a cut sends its 1/t slice
    tree = hybrid(prof, c, 2, 2, 2, 2, sequence_parallel=True, algorithm="tree")  # dp's algorithm; tp stays the ring
    assert tree.detail["tp_s"] == pytest.approx(sp.detail["tp_s"]) and tree.detail["dp_s"] != sp.detail["dp_s"]
    with pytest.raises(ConfigError, match="ring"):
        hybrid(prof, c, 2, 2, 2, 2, sequence_parallel=True, tp_algorithm="tree")


def test_memory_per_rank_shrinks_with_tp_and_pp():
    prof, c = gpt_profile("adam"), cluster()
    totals = {
        mesh: hybrid(prof, c, *mesh, 2 if mesh[1] > 1 else 1).memory
        for mesh in ((1, 1, 1), (1, 1, 2), (1, 2, 1), (1, 2, 2))
    }
    assert totals[(1, 1, 2)].params < totals[(1, 1, 1)].params and totals[(1, 2, 2)].params < totals[(1, 2, 1)].params
    assert totals[(1, 1, 1)].optimizer == pytest.approx(2 * totals[(1, 1, 1)].params)
    assert totals[(1, 1, 1)].params == pytest.approx(prof.param_bytes)
    assert hybrid(prof, c, 1, 1, 2, optimizer_state_factor=0.0).memory.optimizer == 0.0


# ---------------------------------------------------------------- factorizations


@pytest.mark.parametrize("world, count", [(8, 10), (12, 18), (1, 1), (7, 3)])
def test_factorizations_are_complete(world, count):
    got = hm.factorizations(world)
    every = [m for m in itertools.product(range(1, world + 1), repeat=3) if m[0] * m[1] * m[2] == world]
    assert sorted(got) == sorted(every) and len(got) == len(set(got)) == count


def test_ranked_factorizations_give_each_infeasible_mesh_its_reason():
    prof, c = gpt_profile(), cluster()
    ranked = hm.rank_factorizations(prof, c, 8, heads=A, layers=L, vocab=V, batch=16, seq=S, hidden=H, microbatches=2)
    assert len(ranked) == 10
    feasible = [r for r in ranked if r.feasible]
    assert [r.step_s for r in feasible] == sorted(r.step_s for r in feasible)
    assert ranked[: len(feasible)] == feasible
    reasons = {(r.dp, r.pp, r.tp): r.reason for r in ranked if not r.feasible}
    assert reasons[(1, 1, 8)] == "tp=8 does not divide the 4 attention heads"
    assert reasons[(1, 8, 1)] == "pp=8 stages for 4 transformer blocks"
    assert all(r.prediction is not None and r.prediction.fits for r in feasible)
    tight = hm.rank_factorizations(
        prof, c, 8, heads=A, layers=L, vocab=V, batch=16, seq=S, hidden=H, microbatches=2, memory_limit=1e5
    )
    assert not any(r.feasible for r in tight)
    assert all("over the limit" in r.reason for r in tight if r.prediction is not None)
    odd = hm.rank_factorizations(prof, c, 4, heads=A, layers=L, vocab=V, batch=6, seq=S, hidden=H, microbatches=4)
    assert {(r.dp, r.pp, r.tp): r.reason for r in odd}[(4, 1, 1)] == "the batch of 6 does not split over dp=4 replicas"
    assert (
        hm.mesh_reason(2, 2, 2, heads=A, hidden=H, layers=L, batch=16, microbatches=2, devices=4)
        == "the mesh needs 8 devices, the cluster has 4"
    )
    with pytest.raises(ConfigError, match="micro-batches do not divide"):
        hybrid(prof, c, 1, 2, 1, 3)
