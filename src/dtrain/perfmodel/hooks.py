"""What a strategy's performance-model hooks take and return, and the hooks themselves.

A registry entry (:class:`dtrain.registry.Strategy`) carries a :class:`ModelHooks`: how the
strategy's step is predicted (``predict``, ``memory``), replayed (``simulate``) and which of its
choices the planner tries in a :class:`PlanSpace` (``candidates``). The planner, :func:`predict`
and :func:`simulate` read them with :meth:`ModelHooks.of`; the registry itself knows nothing of
them, so this package sits above it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dtrain.perfmodel.collectives import CompressionModel
from dtrain.perfmodel.profile import ModelProfile
from dtrain.perfmodel.spec import ClusterSpec
from dtrain.registry import Choice, Strategy

__all__ = [
    "Memory",
    "Prediction",
    "StepInputs",
    "SimResult",
    "PlanSpace",
    "ModelHooks",
    "PredictHook",
    "MemoryHook",
    "SimulateHook",
    "ParseHook",
]


@dataclass(frozen=True)
class Memory:
    """Bytes per device, by what holds them."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    buffers: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers


@dataclass(frozen=True)
class Prediction:
    """What the model predicts for one strategy.

    Attributes:
        step_s: wall time of one training step (one worker iteration).
        samples_per_s: global throughput.
        compute_s: forward + backward + optimizer of one worker.
        comm_s: communication time of one step if nothing overlapped.
        exposed_s: communication that compute does not hide.
        wait_s: time a worker waits for others / the servers beyond its own communication.
        bytes_per_step: bytes one worker sends per step (mean).
        memory: per device (the larger of worker and server for the parameter server).
        fits: whether ``memory.total`` fits the device.
        why: one line on what bounds the step.
    """

    strategy: Choice
    step_s: float
    samples_per_s: float
    compute_s: float
    comm_s: float
    exposed_s: float
    wait_s: float
    bytes_per_step: float
    memory: Memory
    fits: bool
    why: str
    detail: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class StepInputs:
    """What :func:`predict` works out for every strategy before its own hook runs.

    Attributes:
        fwd / bwd: seconds per layer on one device; opt: the optimizer step.
        overhead: the training loop's own seconds per step.
        memory / fits: bytes per device and whether they fit.
    """

    fwd: list[float]
    bwd: list[float]
    opt: float
    overhead: float
    memory: Memory
    fits: bool


@dataclass(frozen=True)
class SimResult:
    """What one simulation measured.

    Attributes:
        workers: training workers.
        strategy: its label.
        step_s: mean time per step (per worker iteration).
        samples_per_s: global throughput.
        efficiency: ``samples_per_s / (workers * one worker's samples/s alone)``.
        wait_frac: fraction of a worker's time spent not computing.
        staleness: histogram {staleness: count} of applied gradients (parameter server).
    """

    workers: int
    strategy: str
    step_s: float
    samples_per_s: float
    efficiency: float
    wait_frac: float
    staleness: dict[int, int] = field(default_factory=dict)

    @property
    def staleness_mean(self) -> float:
        n = sum(self.staleness.values())
        return sum(k * v for k, v in self.staleness.items()) / n if n else 0.0

    @property
    def staleness_max(self) -> int:
        return max(self.staleness, default=0)


@dataclass(frozen=True)
class PlanSpace:
    """What the planner may try on ``workers`` devices of ``cluster`` (see :func:`dtrain.perfmodel.candidates`)."""

    cluster: ClusterSpec
    workers: int
    compressions: tuple[str, ...]
    consistencies: tuple[str, ...]
    buckets: tuple[float, ...]
    algorithms: tuple[str, ...]
    exact_only: bool = False
    single: bool = True
    ddp: bool = True
    averaging: bool = False  # model-averaging strategies (local SGD, EASGD, gossip): they change the optimisation
    pipeline: bool = False  # pipelines (one stage per device): opt-in while their model is uncalibrated here
    mesh: bool = False  # tensor-parallel and DP x PP x TP meshes (every factorization of the workers): opt-in too


PredictHook = Callable[[ModelProfile, ClusterSpec, Choice, CompressionModel, StepInputs], Prediction]
MemoryHook = Callable[[ModelProfile, Choice, "CompressionModel | None"], Memory]
SimulateHook = Callable[..., SimResult]
ParseHook = Callable[[Sequence[str], str, int], Choice]


def _options_themselves(options: Hashable, prof: ModelProfile) -> Hashable:
    return options


@dataclass(frozen=True)
class ModelHooks:
    """A strategy's performance model (None: not modelled).

    Attributes:
        predict / memory / simulate: its step time, bytes per device and event-driven replay.
        candidates: the choices of this strategy the planner tries in a :class:`PlanSpace`.
        identity: the options' identity for a model profile: choices with equal identities are the
            same strategy for that model, and the planner keeps one (default: the options themselves).
        parse / text: a ``dtrain plan --simulate --strategies`` item of this strategy: ``parse(args,
            compression, workers)`` gets the item's ``:``-separated fields after the name and its
            ``+COMPRESSOR`` ("none" without one); ``text`` is its syntax, for help and errors
            (``"dp:ALG[:MB]"``). None: the item is not read.
    """

    predict: PredictHook | None = None
    memory: MemoryHook | None = None
    simulate: SimulateHook | None = None
    candidates: Callable[[PlanSpace], list[Choice]] | None = None
    identity: Callable[[Any, ModelProfile], Hashable] = _options_themselves
    parse: ParseHook | None = None
    text: str = ""

    @classmethod
    def of(cls, entry: Strategy) -> ModelHooks:
        """``entry``'s performance-model hooks (none modelled when it gave none)."""
        return entry.hooks_of(cls) or cls()
