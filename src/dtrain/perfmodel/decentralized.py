"""The performance model of model averaging: local SGD, EASGD, gossip (pure functions).

Every worker computes a full step on its own shard (forward, backward, optimizer, as one
device does) and then mixes models, not gradients; nothing overlaps the mixing. Bytes
each worker sends per step (``n`` the model's parameter bytes, ``N`` workers):

* local SGD, ring average every ``T`` steps: ``2(N-1)/N n / T`` (Lin et al. 2020);
  hierarchical: each level's ring over its group, at its own period;
* synchronous EASGD: the same allreduce, of the elastic differences, every ``T`` steps
  (Zhang et al. 2015); with the centre on ``S`` servers: a push of ``n`` and the pull of the
  centre back every ``T`` steps (``n / T`` sent, ``2 n / T`` through the worker's link);
* synchronous gossip (D-PSGD, Lian et al. 2017): ``degree x n`` every step, all
  neighbours at once through the worker's one link; asynchronous (AD-PSGD, Lian et
  al. 2018): an active worker sends ``n`` and gets the pair's average (``n``) back after it,
  ``2 n`` of link time one way after the other (not one duplex exchange: the reply is sent only
  once the request has arrived).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dtrain.perfmodel.collectives import cluster_allreduce_time
from dtrain.perfmodel.predict import Memory, Prediction, StepInputs, _opt_state

if TYPE_CHECKING:
    from dtrain.perfmodel.profile import ModelProfile
    from dtrain.perfmodel.spec import ClusterSpec
    from dtrain.registry import Choice

__all__ = ["local_sgd_cost", "easgd_cost", "gossip_cost", "predict_averaging", "replica_memory"]


def _link(c: ClusterSpec) -> Any:
    return c.inter if c.nodes > 1 else c.intra


def local_sgd_cost(
    c: ClusterSpec, levels: list[tuple[int, int]], algorithm: str, nbytes: float, workers: int
) -> tuple[float, float]:
    """(seconds, bytes sent) per step: each level's allreduce of ``nbytes`` over its group
    (``(group size, period)``; plain local SGD is one level of every worker), amortised."""
    secs = sent = 0.0
    for g, period in levels:
        g = min(g, workers)
        secs += cluster_allreduce_time(c, algorithm, nbytes, g) / period
        sent += 2 * (g - 1) / g * nbytes / period
    return secs, sent


def easgd_cost(c: ClusterSpec, period: int, servers: int, nbytes: float, workers: int) -> tuple[float, float]:
    """(seconds, bytes sent) per step: the ring allreduce of the elastic differences, or a push of the
    model's difference to the centre's servers and the centre's pull back, every ``period`` steps."""
    if servers:
        link = _link(c)
        return (2 * link.alpha + 2 * nbytes * link.beta) / period, nbytes / period
    return cluster_allreduce_time(c, "ring", nbytes, workers) / period, 2 * (workers - 1) / workers * nbytes / period


def gossip_cost(c: ClusterSpec, degree: int, asynchronous: bool, nbytes: float) -> tuple[float, float]:
    """(seconds, bytes sent) per step: D-PSGD sends the model to each of ``degree`` neighbours
    through the worker's one link while receiving theirs; AD-PSGD one pairwise exchange."""
    link = _link(c)
    if asynchronous:  # the request, then the pair's average back: one after the other
        return 2 * link.alpha + 2 * nbytes * link.beta, nbytes
    return degree * link.alpha + degree * nbytes * link.duplex_beta, degree * nbytes


def predict_averaging(prof: ModelProfile, s: Choice, inputs: StepInputs, cost: tuple[float, float]) -> Prediction:
    """A step of a model-averaging strategy: one device's compute plus ``cost`` (seconds and bytes of
    mixing per step, from the functions above); nothing overlaps the mixing."""
    comm, sent = cost
    compute = sum(inputs.fwd) + sum(inputs.bwd) + inputs.opt
    step = compute + comm + inputs.overhead
    why = f"{comm * 1e3:.3g} ms of model averaging per step (amortised) after {compute * 1e3:.3g} ms of compute"
    return Prediction(
        s,
        step,
        prof.batch * s.workers / step,
        compute,
        comm,
        comm,
        0.0,
        sent,
        inputs.memory,
        inputs.fits,
        why,
        {"fwd_s": sum(inputs.fwd), "bwd_s": sum(inputs.bwd), "opt_s": inputs.opt},
    )


def replica_memory(prof: ModelProfile, extra_models: int = 1) -> Memory:
    """A worker keeps its replica, gradients, optimizer state and ``extra_models`` model-sized
    buffers (the mixing buffer; EASGD's centre too)."""
    p = float(prof.param_bytes)
    return Memory(
        params=p,
        grads=p,
        optimizer=_opt_state(prof),
        activations=prof.activation_bytes + prof.input_bytes,
        buffers=extra_models * p,
    )
