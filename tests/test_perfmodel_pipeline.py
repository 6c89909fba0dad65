"""The performance model of pipeline parallelism (dtrain.perfmodel.pipeline) by hand: step times,
bubbles, the cut, memory and the planner's candidates, on made-up profiles and clusters."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch
from torch import nn

from dtrain import registry
from dtrain.errors import ConfigError
from dtrain.perfmodel import ClusterSpec, Device, Link, predict
from dtrain.perfmodel import pipeline as pm
from dtrain.perfmodel.hooks import ModelHooks, PlanSpace
from dtrain.perfmodel.profile import LayerProfile, ModelProfile
from dtrain.perfmodel.ranking import candidates, plan
from dtrain.pipeline.schedules import generate, peak_in_flight_bound, simulate
from dtrain.strategies import choice
from dtrain.strategies.pipeline import PipelineOptions

MS = 1e-3
ACT = 8000.0  # activation bytes of every layer at the profile's batch of 8 (2000 per micro-batch of 2)
PARAM = 400


def _profile(fwd_ms: list[float], batch: int = 8, optimizer_ms: float = 4.0) -> ModelProfile:
    """Made-up measured layers: forward as given, backward twice the forward (at ``batch`` samples)."""
    layers = tuple(
        LayerProfile(
            name=f"l{i}",
            params=PARAM // 4,
            param_bytes=PARAM,
            fwd_flops=f,
            bwd_flops=2 * f,
            activation_bytes=ACT,
            fwd_s=f * MS,
            bwd_s=2 * f * MS,
        )
        for i, f in enumerate(fwd_ms)
    )
    return ModelProfile(
        name="made-up", batch=batch, layers=layers, optimizer_s=optimizer_ms * MS, input_bytes=800.0, host="h"
    )


def _cluster(nodes: int = 4, latency: float = 1e-4, bandwidth: float = 1e6) -> ClusterSpec:
    """One device per node; a transfer of 2000 bytes takes 0.1 ms + 2 ms = 2.1 ms."""
    return ClusterSpec(nodes=nodes, inter=Link(bandwidth, latency), device=Device(host="h", memory=2.0**40))


EQUAL = [4.0] * 4  # at the batch of 8: forward 4 ms, backward 8 ms per layer; per micro-batch of 2: 1 ms and 2 ms
TC = 1e-4 + 2000 / 1e6  # one transfer of a micro-batch's activation


@pytest.fixture
def hooks() -> Iterator[None]:
    """The pipeline entry with this module's hooks (as strategies/pipeline.py registers it)."""
    entry = registry.get("pipeline")
    others = tuple(h for h in entry.hooks if not isinstance(h, ModelHooks))
    model = ModelHooks(predict=pm.predict, memory=pm.memory, candidates=ModelHooks.of(entry).candidates)
    registry.register(replace(entry, hooks=(*others, model)), replace=True)
    yield
    registry.register(entry, replace=True)


# ---------------------------------------------------------------- step time by hand


def test_gpipe_and_1f1b_step_is_the_closed_form_by_hand():
    prof, c = _profile(EQUAL), _cluster()
    two = pm.pipeline_cost(prof, c, 2, 4, "gpipe")
    # cut [2, 2]: t_f = 2 ms, t_b = 4 ms; cycle 2 + 4 + 2 * 2.1 = 10.2 ms; (4 + 2 - 1) cycles; optimizer 4 ms / 2
    assert two.sizes == (2, 2)
    assert two.fwd_s == pytest.approx((2 * MS, 2 * MS)) and two.bwd_s == pytest.approx((4 * MS, 4 * MS))
    assert two.comm_s == pytest.approx((TC,))
    assert two.cycle_s[0] == pytest.approx(10.2 * MS)
    assert two.pipeline_s == pytest.approx(5 * 10.2 * MS)
    assert two.opt_s == pytest.approx(2 * MS) and two.step_s == pytest.approx(53 * MS)
    # each sends 4 micro-batches of 2000 bytes: stage 0 the activations, stage 1 their gradients
    assert two.bytes_sent == pytest.approx((8000.0, 8000.0))
    four = pm.pipeline_cost(prof, c, 4, 4, "1f1b")
    # cut [1, 1, 1, 1]: a middle stage pays both directions of its boundary: 1 + 2 + 2 * 2.1 = 7.2 ms; 7 cycles
    assert four.cycle_s == pytest.approx((1 * MS + 2 * MS + 2 * TC,) * 4)
    assert four.step_s == pytest.approx(7 * 7.2 * MS + 1 * MS)
    assert four.bytes_sent == pytest.approx((8000.0, 16000.0, 16000.0, 8000.0))


def test_interleaved_and_2bw_steps_by_hand():
    prof, c = _profile(EQUAL), _cluster()
    inter = pm.pipeline_cost(prof, c, 2, 4, "interleaved", chunks=2)
    # virtual stages 0, 2 on worker 0 and 1, 3 on worker 1, one layer each: t_f 2 ms, t_b 4 ms, four transfers
    assert inter.sizes == (1, 1, 1, 1) and len(inter.comm_s) == 3
    assert inter.link_s == pytest.approx((4 * TC, 4 * TC))
    cycle = 2 * MS + 4 * MS + 4 * TC
    assert inter.pipeline_s == pytest.approx((4 + 1 / 2) * cycle)
    twobw = pm.pipeline_cost(prof, c, 2, 4, "2bw")
    # no flush: 4 cycles of 10.2 ms, plus the refill of one forward and its transfer
    assert twobw.pipeline_s == pytest.approx(4 * 10.2 * MS + (2 * MS + TC))
    assert twobw.step_s < pm.pipeline_cost(prof, c, 2, 4, "1f1b").step_s


def test_recomputation_adds_forwards_to_the_backward():
    prof, c = _profile(EQUAL), _cluster()
    never = pm.pipeline_cost(prof, c, 2, 4, "gpipe")
    always = pm.pipeline_cost(prof, c, 2, 4, "gpipe", checkpoint="always")
    except_last = pm.pipeline_cost(prof, c, 2, 4, "gpipe", checkpoint="except_last")
    assert always.cycle_s[0] == pytest.approx(never.cycle_s[0] + 2 * MS)
    assert except_last.cycle_s[0] == pytest.approx(never.cycle_s[0] + 3 / 4 * 2 * MS)


def test_without_transfers_the_step_is_the_schedules_makespan():
    """With free links the closed forms are exact for balanced stages: the schedule played in time agrees."""
    free = _cluster(8, latency=0.0, bandwidth=1e30)
    prof = _profile([3.0] * 12, batch=24, optimizer_ms=0.0)
    for (schedule, v), p, m in itertools.product(
        [("gpipe", 1), ("1f1b", 1), ("2bw", 1), ("interleaved", 2), ("interleaved", 3)],
        (1, 2, 3, 4),
        (1, 2, 3, 4, 6, 8, 12),
    ):
        if p * v > 12 or 24 % m or (schedule == "interleaved" and m % p):
            continue
        cost = pm.pipeline_cost(prof, free, p, m, schedule, chunks=v)
        tf = cost.fwd_s[0] / v  # per virtual stage
        played = simulate(generate(schedule, p, m, v), tf=tf, tb=2 * tf)
        assert cost.step_s == pytest.approx(played.makespan), (schedule, v, p, m)
        if schedule != "2bw":  # the simulator leaves 2bw's refill out of its bubble (a long run's steady state)
            assert cost.bubble == pytest.approx(played.bubble), (schedule, v, p, m)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_bubble_of_a_balanced_flushing_pipeline(schedule):
    prof = _profile([3.0] * 8, batch=48)
    for p, m in itertools.product((1, 2, 4, 8), (1, 2, 3, 4, 8, 16)):
        cost = pm.pipeline_cost(prof, _cluster(8), p, m, schedule)
        assert cost.bubble == pytest.approx((p - 1) / (m + p - 1)), (p, m)


def test_bubble_of_the_interleaved_schedule():
    prof = _profile([3.0] * 16, batch=48)
    for p, v, m in itertools.product((2, 4), (2, 4), (4, 8, 16)):
        cost = pm.pipeline_cost(prof, _cluster(4), p, m, "interleaved", chunks=v)
        assert cost.bubble == pytest.approx((p - 1) / (v * m + p - 1)), (p, v, m)
        assert cost.bubble < pm.pipeline_cost(prof, _cluster(4), p, m, "1f1b").bubble


def test_more_microbatches_lower_the_step():
    prof, c = _profile(EQUAL, batch=32), _cluster(latency=1e-5)
    for schedule in ("gpipe", "1f1b"):
        steps = [pm.pipeline_cost(prof, c, 4, m, schedule).step_s for m in (1, 2, 4, 8, 16, 32)]
        assert steps == sorted(steps, reverse=True) and len(set(steps)) == len(steps)
    inter = [pm.pipeline_cost(prof, c, 2, m, "interleaved", chunks=2).step_s for m in (2, 4, 8, 16)]
    assert inter == sorted(inter, reverse=True)


def test_the_cut_is_the_minimal_max_partition():
    fwd = [1.0, 5.0, 2.0, 2.0, 3.0, 1.0, 4.0]
    prof, c = _profile(fwd, batch=4), _cluster()
    for p in (2, 3, 4):
        cut = pm.pipeline_cost(prof, c, p, 2, "1f1b").sizes
        best = min(
            max(sum(fwd[a:b]) for a, b in zip((0, *ends), (*ends, len(fwd))))
            for ends in itertools.combinations(range(1, len(fwd)), p - 1)
        )
        starts = [sum(cut[:i]) for i in range(p)]
        assert max(sum(fwd[s : s + n]) for s, n in zip(starts, cut)) == pytest.approx(best)
        assert pm.stage_cut(prof, p, "time") == cut  # the hooks' cut from the profile alone: the same here
    given = pm.pipeline_cost(prof, c, 2, 2, "1f1b", sizes=[6, 1])
    assert given.sizes == (6, 1) and given.fwd_s[0] == pytest.approx(sum(fwd[:6]) / 2 * MS)


def test_arguments_no_run_would_accept_are_refused():
    prof, c = _profile(EQUAL), _cluster()
    for kwargs, what in [
        ({"stages": 5}, "fewer than the 5"),
        ({"microbatches": 3}, "do not divide"),
        ({"schedule": "zigzag"}, "not known"),
        ({"chunks": 2}, "chunks"),
        ({"schedule": "interleaved"}, "chunks"),
        ({"sizes": [3, 2]}, "summing"),
        ({"schedule": "interleaved", "chunks": 2, "microbatches": 1}, "multiple"),
        ({"checkpoint": "sometimes"}, "not known"),
    ]:
        args = {"stages": 2, "microbatches": 4, "schedule": "1f1b", **kwargs}
        with pytest.raises(ConfigError, match=what):
            pm.pipeline_cost(prof, c, **args)


# ---------------------------------------------------------------- memory


def test_in_flight_microbatches_per_schedule():
    assert [pm.in_flight("gpipe", 4, 8, 1, w) for w in range(4)] == [8] * 4
    assert [pm.in_flight("1f1b", 4, 8, 1, w) for w in range(4)] == [4, 3, 2, 1]
    assert [pm.in_flight("2bw", 4, 2, 1, w) for w in range(4)] == [3, 3, 2, 1]  # with the deferred ones
    for schedule, p, m in itertools.product(("gpipe", "1f1b", "2bw"), (1, 2, 4, 8), (1, 2, 3, 4, 8)):
        assert [pm.in_flight(schedule, p, m, 1, w) for w in range(p)] == [
            peak_in_flight_bound(schedule, p, m, w) for w in range(p)
        ]
    for p, v in itertools.product((2, 4, 8), (2, 3)):
        assert pm.in_flight("interleaved", p, 64, v, 0) == pytest.approx(p * (1 + (p - 1) / (p * v)))
        # the rank's peak at once, never more than its virtual stages' peaks added up
        bound = sum(peak_in_flight_bound("interleaved", p, 8 * p, k, v) for k in range(0, p * v, p))
        assert pm.in_flight("interleaved", p, 8 * p, v, 0) * v <= bound


def test_memory_by_schedule_and_recomputation():
    prof = _profile(EQUAL)
    gpipe, f1b = pm.pipeline_memory(prof, 2, 4, "gpipe"), pm.pipeline_memory(prof, 2, 4, "1f1b")
    # stage 1 of [2, 2] keeps its input and two outputs of 2000 bytes per micro-batch: 4 of them under gpipe
    assert gpipe.activations == pytest.approx(4 * 3 * 2000)
    assert f1b.activations == pytest.approx(2 * 2 * 2000)  # stage 0 (no input to keep): 2 in flight
    assert gpipe.activations > f1b.activations and gpipe.params == f1b.params == 2 * PARAM
    assert f1b.optimizer == pytest.approx(2 * PARAM)  # sgd with momentum: one buffer per parameter
    assert f1b.buffers == pytest.approx(800.0)  # every worker reads the whole batch
    twobw = pm.pipeline_memory(prof, 2, 4, "2bw")
    assert twobw.params == pytest.approx(2 * f1b.params) and twobw.activations == pytest.approx(f1b.activations)
    for schedule in ("gpipe", "1f1b", "2bw"):
        never = pm.pipeline_memory(prof, 2, 4, schedule).activations
        assert pm.pipeline_memory(prof, 2, 4, schedule, checkpoint="always").activations < never
        assert pm.pipeline_memory(prof, 2, 4, schedule, checkpoint="except_last").activations <= never
    # with two micro-batches in flight, the last one kept whole and one recomputed hold as much as no recomputation
    assert pm.pipeline_memory(prof, 2, 4, "gpipe", checkpoint="except_last").activations < gpipe.activations
    assert pm.pipeline_memory(prof, 2, 4, "gpipe", checkpoint="always").activations == pytest.approx(4 * 2000 + 4000)
    adam = pm.pipeline_memory(replace(prof, optimizer="adam"), 2, 4, "1f1b")
    assert adam.optimizer == pytest.approx(2 * f1b.optimizer)
    inter = pm.pipeline_memory(_profile([4.0] * 8, batch=16), 2, 8, "interleaved", chunks=2)
    assert inter.activations > pm.pipeline_memory(_profile([4.0] * 8, batch=16), 2, 8, "1f1b").activations


# ---------------------------------------------------------------- the hooks and the planner


def test_candidates_are_pipelines_over_every_worker():
    candidates_of = ModelHooks.of(registry.get("pipeline")).candidates  # strategies/pipeline.py's
    assert candidates_of is not None
    assert candidates_of(PlanSpace(_cluster(1), 1, (), (), (), (), pipeline=True)) == []
    for w in (2, 4, 8):
        space = PlanSpace(_cluster(8), w, (), (), (), (), pipeline=True)
        cands = candidates_of(space)
        assert cands and all(
            isinstance(s, registry.Choice)
            and s.strategy == "pipeline"
            and s.workers == w
            and isinstance(s.options, PipelineOptions)
            for s in cands
        )
        assert len({s.label() for s in cands}) == len(cands)
        assert {s.opts.schedule for s in cands} == {"gpipe", "1f1b", "interleaved", "2bw"}
        assert all(s.opts.microbatches % w == 0 for s in cands if s.opts.schedule == "interleaved")
        exact = candidates_of(replace(space, exact_only=True))
        assert {s.opts.schedule for s in exact} == {"gpipe", "1f1b", "interleaved"}
    sixteen = candidates_of(PlanSpace(_cluster(16), 16, (), (), (), (), pipeline=True))
    assert {s.opts.schedule for s in sixteen} == {"gpipe", "1f1b", "2bw"}  # M in (4, 8): no multiple of 16


@pytest.mark.parametrize("layers", [4, 6])
def test_workers_sharing_cores_are_paced_by_the_cores_or_the_critical_path(hooks, layers):
    """Cores shared by the stages (compute_scale s when all compute at once): the step is the larger of the
    critical path at full speed and s x the work over the workers, for equal stages (4 layers on 4) as for
    unequal ones (6 on 4: one stage of 2 layers, the mean 1.5), where scaling the slowest stage by s x the
    closed-form busy fraction would charge the imbalance twice."""
    free = _cluster(4, latency=0.0, bandwidth=1e30)
    per_worker = _profile([4.0] * layers, optimizer_ms=0.0).at_batch(2)  # the pipeline's batch: 8
    s = choice("pipeline", 4, microbatches=4, schedule="1f1b", balance="time")
    layer = 3 * MS  # forward + backward of a layer and a micro-batch of 2
    critical = 7 * (2 if layers == 6 else 1) * layer  # (M + P - 1) cycles of the slowest stage
    for scale in (1.0, 1.5, 2.62):
        c = replace(free, device=Device(host="h", compute_scale=scale))
        pred = predict(per_worker, c, s)
        work = scale * 4 * layers * layer / 4  # s x M micro-batches x every layer / P workers
        assert pred.step_s == pytest.approx(max(critical, work)), (layers, scale)
    # the closed-form busy fraction for the same cores: 4 / 7 of the step, applied to the slowest stage
    idle = pm.idle_aware(replace(free, device=Device(host="h", compute_scale=2.62)), "1f1b", 4, 4)
    by_bubble = pm.pipeline_cost(per_worker.at_batch(8), idle, 4, 4, "1f1b").step_s
    if layers == 4:
        assert by_bubble == pytest.approx(2.62 * 4 * layer)
    else:
        assert by_bubble == pytest.approx(critical * 2.62 * 4 / 7) and by_bubble > 1.3 * pred.step_s


def test_prediction_through_the_registry(hooks):
    per_worker = _profile(EQUAL).at_batch(4)  # the planner's profile: global batch / workers
    c = replace(_cluster(), device=Device(host="h", imbalance=1 * MS))
    s = choice("pipeline", 2, microbatches=4, schedule="gpipe", balance="time")
    pred = predict(per_worker, c, s, overhead_s=0.5 * MS)
    # the pipeline's batch is the global one, 2 x 4 = 8: the hand-computed step above, plus imbalance and overhead
    assert pred.step_s == pytest.approx(53 * MS + 1 * MS + 0.5 * MS)
    assert pred.samples_per_s == pytest.approx(8 / pred.step_s)
    assert pred.step_s == pytest.approx(pred.compute_s + pred.exposed_s + pred.wait_s + 0.5 * MS)
    assert pred.comm_s == pytest.approx(4 * 2 * TC) and pred.bytes_per_step == pytest.approx(8000.0)
    assert pred.detail["bubble"] == pytest.approx(1 / 5) and pred.fits
    assert pred.memory == pm.pipeline_memory(per_worker.at_batch(8), 2, 4, "gpipe")


def test_infeasible_pipelines_are_rejected_not_raised(hooks):
    per_worker, c = _profile(EQUAL, batch=4), _cluster(8)
    too_deep = predict(per_worker, c, choice("pipeline", 8, microbatches=8))
    assert not too_deep.fits and math.isinf(too_deep.step_s) and "fewer than the 8" in too_deep.why
    uneven = predict(_profile(EQUAL, batch=3), c, choice("pipeline", 2, microbatches=4))
    assert not uneven.fits and "do not divide" in uneven.why
    counts = predict(per_worker, c, choice("pipeline", 2, microbatches=4, balance="1,2"))
    assert not counts.fits and "summing to the model's 4" in counts.why
    assert predict(per_worker, c, choice("pipeline", 2, microbatches=4, balance="1,3")).fits


def test_the_planner_ranks_feasible_pipelines_and_rejects_the_rest(hooks):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    sample = (torch.randn(32, 32), torch.randint(0, 10, (32,)))
    c = ClusterSpec(nodes=8, inter=Link(1e8, 1e-5), device=Device(flops=1e9))
    assert not any(s.strategy == "pipeline" for s in candidates(c, 4))  # opt-in
    assert any(s.strategy == "pipeline" for s in candidates(c, 4, pipeline=True))
    few = {"measure": False, "compressions": (), "consistencies": ("bsp",), "pipeline": True}
    four = plan(model, sample, c, workers=4, **few)
    assert any(p.strategy.strategy == "pipeline" for p in four.ranked)
    eight = plan(model, sample, c, workers=8, **few)  # five layers: no pipeline of eight stages
    assert not any(p.strategy.strategy == "pipeline" for p in eight.ranked)
    assert any(s.strategy == "pipeline" for s, _ in eight.rejected)
