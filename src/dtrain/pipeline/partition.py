"""Balanced cuts of an ``nn.Sequential`` into pipeline stages.

A pipeline cuts the model between its top-level children into ``stages``
contiguous groups; the slowest (or fullest) stage sets the pace, so the cut
should minimise the largest stage. Steps:

1. a cost per child: its parameter bytes, parameter + activation bytes, or its
   measured forward + backward time (:func:`profile_children`);
2. the exact solution of the linear partition problem over those costs
   (:func:`block_partition`);
3. :func:`describe` prints the cut, its predicted (and measured) stage times and
   the imbalance.

Example::

    sizes = balance(model, stages=4, spec="time", sample=x[:8])
    costs = [c.time_s for c in profile_children(model, x[:8])]
    print(describe([n for n, _ in model.named_children()], sizes, stage_costs(costs, sizes)))
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "SPECS",
    "LayerCost",
    "PartitionError",
    "balance",
    "block_partition",
    "describe",
    "profile_children",
    "stage_costs",
]

SPECS = ("equal", "params", "memory", "time")


class PartitionError(ValueError):
    """A cut that cannot be made: too few layers, bad layer counts, an unknown spec, a missing sample."""


@dataclass(frozen=True)
class LayerCost:
    """What one child of the ``nn.Sequential`` costs on the profiling sample.

    Attributes:
        name: child name in the Sequential ("0", "block3", ...).
        time_s: forward + backward seconds of this child alone (median of the repeats).
        param_bytes: bytes of its parameters (frozen ones too: a stage holds them all).
        activation_bytes: bytes of its output (what a stage keeps per micro-batch).
    """

    name: str
    time_s: float
    param_bytes: int
    activation_bytes: int


# --- the linear partition problem ---------------------------------------------------------------


def block_partition(costs: Sequence[float], parts: int) -> list[int]:
    """Split ``costs`` into ``parts`` non-empty contiguous blocks minimising the largest block sum.

    Exact, in exact arithmetic: every cost (a finite float, i.e. a dyadic rational)
    is scaled to an integer over a common power-of-two denominator, so sums and
    comparisons are exact. Steps:

    1. binary search over the integer cap ``C`` for the smallest one that a greedy
       left-to-right packing (close a block when the next cost would pass ``C``)
       fits in ``parts`` blocks. For non-negative costs the greedy packing uses the
       fewest blocks of any packing under ``C``, so the smallest feasible ``C`` is
       the optimum (and is itself some block's sum);
    2. cut under that cap from the last block backwards, each block as long as the
       cap allows while leaving one cost per block still to place.

    Tie-break: of all optimal cuts, every cut position is the earliest possible one
    (so later stages take the slack; under 1F1B the first stages hold the most
    micro-batches in flight). The largest block sum, rounded to float, equals the
    float optimum, since rounding is monotone: ``max(stage_costs(costs, sizes))``
    (correctly rounded sums) is the brute-force minimum.

    Cost: ``O(n * b)`` integer operations, ``b`` the bits of the scaled total: about 53 plus
    the spread of the costs' binary exponents (under 100 for real costs, ~2100 at most).

    Args:
        costs: one non-negative, finite cost per item.
        parts: number of blocks, ``1 <= parts <= len(costs)``.

    Returns:
        The block sizes: ``parts`` of them, each >= 1, summing to ``len(costs)``.
    """
    if not isinstance(parts, int) or isinstance(parts, bool) or parts < 1:
        raise PartitionError(f"parts must be a positive int, got {parts!r}")
    if len(costs) < parts:
        raise PartitionError(f"cannot cut {len(costs)} costs into {parts} non-empty blocks")
    weights = _exact(costs)
    lo, hi = max(weights), sum(weights)
    while lo < hi:
        mid = (lo + hi) // 2
        if _fits(weights, parts, mid):
            hi = mid
        else:
            lo = mid + 1
    return _cut(weights, parts, lo)


def _exact(costs: Sequence[float]) -> list[int]:
    """The costs as integers over one common power-of-two denominator (exact for any finite float)."""
    ratios = []
    for i, c in enumerate(costs):
        try:
            f = float(c)
        except (TypeError, ValueError):
            raise PartitionError(f"cost {i} is not a number: {c!r}") from None
        if not math.isfinite(f) or f < 0:
            raise PartitionError(f"cost {i} must be finite and >= 0, got {c!r}")
        ratios.append(f.as_integer_ratio())
    den = max(d for _, d in ratios)
    return [num * (den // d) for num, d in ratios]


def _fits(weights: Sequence[int], parts: int, cap: int) -> bool:
    """Whether greedy packing under ``cap`` needs at most ``parts`` blocks."""
    blocks, run = 1, 0
    for w in weights:
        if w > cap:
            return False
        if run + w > cap:
            blocks, run = blocks + 1, w
            if blocks > parts:
                return False
        else:
            run += w
    return True


def _cut(weights: Sequence[int], parts: int, cap: int) -> list[int]:
    """Block sizes under a feasible ``cap``: from the end, each block as long as allowed.

    Each block stops where it would pass ``cap`` or leave fewer costs than blocks still
    to place; both bounds are the least start any cut under ``cap`` can have, so every
    cut is at its earliest and the first block, whatever is left, fits too.
    """
    sizes = []
    end = len(weights)
    for before in range(parts - 1, 0, -1):  # blocks still to place before this one
        start = end - 1
        run = weights[start]
        while start > before and run + weights[start - 1] <= cap:
            start -= 1
            run += weights[start]
        sizes.append(end - start)
        end = start
    sizes.append(end)
    return sizes[::-1]


def stage_costs(costs: Sequence[float], sizes: Sequence[int]) -> list[float]:
    """The sum of each block of ``costs`` cut into ``sizes`` (correctly rounded: ``math.fsum``)."""
    if any(not isinstance(s, int) or s < 0 for s in sizes) or sum(sizes) != len(costs):
        raise PartitionError(f"block sizes {list(sizes)} must be ints >= 0 summing to {len(costs)} (the costs)")
    values = [float(c) for c in costs]
    out, offset = [], 0
    for s in sizes:
        out.append(math.fsum(values[offset : offset + s]))
        offset += s
    return out


# --- per-child costs ---------------------------------------------------------------------------


def _children(model: nn.Module) -> list[tuple[str, nn.Module]]:
    if not isinstance(model, nn.Sequential):
        raise PartitionError(
            f"a pipeline can only cut between children of an nn.Sequential; wrap your model's blocks"
            f" in one (got a {type(model).__name__})"
        )
    return list(model.named_children())


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    return []


def _nbytes(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(obj))


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _detached(obj: Any) -> Any:
    """A fresh leaf copy of a child's input: detached, requiring grad where it is floating point."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().requires_grad_(obj.is_floating_point() or obj.is_complex())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_detached(v) for v in obj)
    return obj


@contextmanager
def _preserved(model: nn.Module, sample: Any) -> Iterator[None]:
    """Train mode inside; on exit the model's mode, ``.grad``s, buffers and the RNG are as they were.

    Profiling runs forward and backward in train mode (that is what a pipeline stage
    runs), which would otherwise accumulate gradients, move batch-norm statistics and
    draw dropout masks from the caller's random stream.
    """
    params = list(model.parameters())
    grads = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    was_training = model.training
    devices = [t.device for t in _tensors(sample)[:1] if t.device.type == "cuda"]
    try:
        for p in params:
            p.grad = None
        model.train()
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        model.train(was_training)
        for p, g in zip(params, grads):
            p.grad = g
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


def _walk(children: Sequence[tuple[str, nn.Module]], sample: Any) -> list[Any]:
    """Each child's input when ``sample`` runs through the children in order (no autograd)."""
    inputs = []
    x = sample
    with torch.no_grad():
        for _, module in children:
            inputs.append(x)
            x = module(x)
    inputs.append(x)
    return inputs


def _synchronizer(sample: Any) -> Callable[[], None]:
    cuda = [t.device for t in _tensors(sample) if t.device.type == "cuda"]
    if cuda:
        return lambda: torch.cuda.synchronize(cuda[0])
    return lambda: None


def _time_child(module: nn.Module, x: Any, repeats: int, warmup: int) -> float:
    """Median seconds of forward + backward of ``module`` alone on a detached copy of ``x``.

    The backward gets a gradient of ones for every output that requires grad; making
    that gradient is left out of the time. Parameter gradients accumulate (the caller
    restores them).
    """
    sync = _synchronizer(x)
    times = []
    for r in range(warmup + repeats):
        inp = _detached(x)
        sync()
        t0 = time.perf_counter()
        out = module(inp)
        sync()
        t1 = time.perf_counter()
        outs = [t for t in _tensors(out) if t.requires_grad]
        grads = [torch.ones_like(t) for t in outs]
        sync()
        t2 = time.perf_counter()
        if outs:
            torch.autograd.backward(outs, grads)
        sync()
        if r >= warmup:
            times.append(t1 - t0 + time.perf_counter() - t2)
    return statistics.median(times)


def profile_children(model: nn.Sequential, sample: torch.Tensor, repeats: int = 3, warmup: int = 1) -> list[LayerCost]:
    """Measure each child of ``model`` alone on the input it gets from ``sample``.

    Steps: (1) run ``sample`` through the children in order without autograd,
    recording each child's input and output size; (2) for each child, time
    ``warmup`` then ``repeats`` forward + backward passes on a detached copy of its
    input (requiring grad when floating point, so the input gradient a later stage
    sends back is part of the cost) with a gradient of ones for its output; keep
    the median. Runs in train mode; afterwards the model's mode, gradients, buffers
    (batch-norm statistics) and the random state are as they were.

    Each child is timed in isolation rather than split out of one whole-model pass
    (as :func:`dtrain.perfmodel.profile.profile_model` does with hooks), because a
    stage's cost is that of its children run alone: a child with a detached input
    that needs its input gradient, with no loss or optimizer step mixed in.

    Args:
        model: the ``nn.Sequential``.
        sample: one micro-batch of input.
        repeats: timed passes per child (default: 3).
        warmup: untimed passes before them (default: 1).

    Returns:
        One :class:`LayerCost` per child, in order.
    """
    children = _children(model)
    if not isinstance(repeats, int) or repeats < 1 or not isinstance(warmup, int) or warmup < 0:
        raise PartitionError(f"profile_children needs repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    with _preserved(model, sample):
        inputs = _walk(children, sample)
        times = [_time_child(module, x, repeats, warmup) for (_, module), x in zip(children, inputs)]
    return [
        LayerCost(name=name, time_s=t, param_bytes=_param_bytes(module), activation_bytes=_nbytes(out))
        for (name, module), t, out in zip(children, times, inputs[1:])
    ]


# --- the cut -------------------------------------------------------------------------------------


def balance(
    model: nn.Sequential,
    stages: int,
    spec: str | Sequence[int],
    sample: torch.Tensor | None = None,
    costs: Sequence[LayerCost] | None = None,
) -> list[int]:
    """How many children of ``model`` each of ``stages`` pipeline stages gets.

    Args:
        model: the ``nn.Sequential`` to cut between its children.
        stages: number of stages (at most the number of children).
        spec: the layer counts themselves (checked), or how to choose them:
            ``"equal"`` (counts as even as possible, earlier stages get the extra),
            ``"params"`` (balance parameter bytes), ``"memory"`` (parameter + output
            activation bytes on ``sample``) or ``"time"`` (forward + backward time
            of each child on ``sample``, see :func:`profile_children`).
        sample: one micro-batch of input, for ``"memory"`` and ``"time"``.
        costs: precomputed :func:`profile_children` of this model, used instead of ``sample``.

    Returns:
        Children per stage, in order: ``stages`` counts, each >= 1, summing to ``len(model)``.
    """
    children = _children(model)
    n = len(children)
    where = f"(model has {n} layers, stages={stages!r}, balance={spec!r})"
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise PartitionError(f"stages must be a positive int {where}")
    if n < stages:
        raise PartitionError(f"cannot cut {n} layers into {stages} stages of at least one layer each {where}")
    if not isinstance(spec, str):
        return _checked_counts(spec, n, stages, where)
    if spec == "equal":
        q, extra = divmod(n, stages)
        return [q + 1] * extra + [q] * (stages - extra)
    if spec == "params":
        return block_partition([_param_bytes(module) for _, module in children], stages)
    if spec not in SPECS:
        raise PartitionError(
            f"unknown balance {spec!r}: give one of {', '.join(map(repr, SPECS))} or a list of layer counts {where}"
        )
    if costs is not None:
        names = [name for name, _ in children]
        if [c.name for c in costs] != names:
            raise PartitionError(f"costs are for layers {[c.name for c in costs]}, the model's are {names} {where}")
        if spec == "time":
            return block_partition([c.time_s for c in costs], stages)
        return block_partition([c.param_bytes + c.activation_bytes for c in costs], stages)
    if sample is None:
        raise PartitionError(f"balance {spec!r} needs a sample micro-batch (or precomputed costs) {where}")
    if spec == "time":
        return block_partition([c.time_s for c in profile_children(model, sample)], stages)
    with _preserved(model, sample):
        outputs = _walk(children, sample)[1:]
    return block_partition([_param_bytes(m) + _nbytes(out) for (_, m), out in zip(children, outputs)], stages)


def _checked_counts(spec: Sequence[int], n: int, stages: int, where: str) -> list[int]:
    counts = list(spec)
    if len(counts) != stages:
        raise PartitionError(f"balance gives {len(counts)} layer counts for {stages} stages {where}")
    if any(not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in counts):
        raise PartitionError(f"each stage needs a whole number of layers >= 1 {where}")
    if sum(counts) != n:
        raise PartitionError(f"layer counts sum to {sum(counts)}, not to the model's {n} layers {where}")
    return counts


def describe(
    names: Sequence[str], sizes: Sequence[int], predicted: Sequence[float], measured: Sequence[float] | None = None
) -> str:
    """A printable table of a cut: each stage's layers and predicted (and measured) time, and the imbalance.

    Args:
        names: the children's names, in order.
        sizes: children per stage (summing to ``len(names)``).
        predicted: each stage's predicted time in seconds (e.g. :func:`stage_costs` of ``time_s``).
        measured: each stage's measured time in seconds, if any.

    Returns:
        The table; its last line is the slowest stage over the mean stage ("imbalance", 1.00x is perfect).
    """
    if any(not isinstance(s, int) or s < 1 for s in sizes) or sum(sizes) != len(names):
        raise PartitionError(f"stage sizes {list(sizes)} must be ints >= 1 summing to {len(names)} (the layers)")
    if len(predicted) != len(sizes) or (measured is not None and len(measured) != len(sizes)):
        given = "no" if measured is None else len(measured)
        raise PartitionError(
            f"need one predicted (and measured) time per stage: {len(sizes)} stages, "
            f"{len(predicted)} predicted, {given} measured"
        )
    spans, offset = [], 0
    for s in sizes:
        first, last = names[offset], names[offset + s - 1]
        spans.append(f"{first} ({s})" if s == 1 else f"{first}..{last} ({s})")
        offset += s
    width = max(len("layers"), *(len(span) for span in spans))
    head = f"{'stage':>5}  {'layers':<{width}}  {'predicted ms':>12}"
    rows = [head + (f"  {'measured ms':>12}" if measured is not None else "")]
    for i, span in enumerate(spans):
        row = f"{i:>5}  {span:<{width}}  {predicted[i] * 1e3:>12.3f}"
        rows.append(row + (f"  {measured[i] * 1e3:>12.3f}" if measured is not None else ""))
    tail = f"imbalance (slowest / mean stage): predicted {_imbalance(predicted)}"
    rows.append(tail + (f", measured {_imbalance(measured)}" if measured is not None else ""))
    return "\n".join(rows)


def _imbalance(times: Sequence[float]) -> str:
    mean = math.fsum(times) / len(times)
    return f"{max(times) / mean:.2f}x" if mean > 0 else "n/a"
