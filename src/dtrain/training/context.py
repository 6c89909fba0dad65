"""What every process of a run gets: :class:`TrainContext`.

The context knows the run configuration, this process's rank, the data, the
metrics writer and the tracer, and composes the parts every strategy uses alike:
:class:`~dtrain.training.factories.Factories` (the seeded model, the optimizer, the
compressor), :class:`~dtrain.training.batch_control.BatchControl` (the global batch
and ``auto``'s decisions), :class:`~dtrain.training.lr.LearningRate` (the schedule),
:class:`~dtrain.training.loaders.ShardLoaders` (a shard's data loader),
:class:`~dtrain.training.evaluation.Evaluation`, the progress bar and the straggler
emulation. Its methods delegate to them. It holds nothing strategy-specific; a
strategy's options are ``cfg.options``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from dtrain.compress.base import Compressor
from dtrain.config.schema import RunConfig
from dtrain.optim.precision import Precision
from dtrain.trace import MetricsWriter, Tracer
from dtrain.training import slowdown
from dtrain.training.batch_control import BatchControl
from dtrain.training.evaluation import Evaluation
from dtrain.training.factories import Factories
from dtrain.training.loaders import ShardLoaders
from dtrain.training.lr import LearningRate, lr_factor, schedule_updates
from dtrain.training.progress import progress_bar
from dtrain.training.slowdown import Straggler
from dtrain.workloads.data import DatasetSplit
from dtrain.workloads.models import run_loss

__all__ = ["TrainContext", "ProcessHooks", "lr_factor", "schedule_updates"]


@dataclass
class TrainContext:
    """What a strategy's process body gets in each process.

    Attributes:
        cfg: the validated run configuration (the strategy's options are ``cfg.options``).
        rank / world_size: this process in the whole job.
        out_dir: the run folder (shared by all local processes).
        data: the dataset (every process loads it; it is small and deterministic).
        metrics: this rank's metrics writer (one JSON object per step).
        tracer: this rank's timeline (a no-op unless ``cfg.trace``).
    """

    cfg: RunConfig
    rank: int
    world_size: int
    out_dir: Path
    data: DatasetSplit
    metrics: MetricsWriter
    tracer: Tracer
    started: float = field(default_factory=time.perf_counter)
    loss_scale: float = 1.0  # fp16: the loss scale of the step in progress (the loop sets it)

    resumed_scaler: dict[str, Any] | None = field(default=None, init=False)  # fp16: the checkpoint's scaler

    # ---------------------------------------------------------------- the parts

    @functools.cached_property
    def batches(self) -> BatchControl:
        """The global batch of every epoch and step, and ``--batch-schedule auto``'s decisions."""
        return BatchControl(self.cfg, self.data)

    @functools.cached_property
    def learning_rate(self) -> LearningRate:
        """The learning rate of every step."""
        return LearningRate(self.cfg, self.batches)

    @functools.cached_property
    def loaders(self) -> ShardLoaders:
        """A shard's training batches and the run's steps."""
        return ShardLoaders(self.cfg, self.data, self.batches.plan)

    @functools.cached_property
    def evaluation(self) -> Evaluation:
        """The run's metric."""
        return Evaluation(self.cfg, self.data)

    @functools.cached_property
    def factories(self) -> Factories:
        """The model, optimizer and compressor."""
        return Factories(self.cfg, self.data, self.device, self.precision)

    @functools.cached_property
    def precision(self) -> Precision:
        """The compute precision (``--precision``)."""
        return Precision(self.cfg.precision, self.device.type)

    @functools.cached_property
    def device(self) -> torch.device:
        """Where this process trains (``--device``): the CPU, or its GPU (set by the worker at start)."""
        if self.cfg.device == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # ---------------------------------------------------------------- the batch (:attr:`batches`)

    def observe(self, row: dict[str, Any]) -> None:
        self.batches.observe(row)

    def begin_epoch(self, epoch: int) -> None:
        self.batches.begin_epoch(epoch)

    def after_step(self, steps: int) -> None:
        self.batches.after_step(steps)

    def loop_state(self, scaler: Any) -> dict[str, Any]:
        """What a checkpoint keeps of the loop's own state: the batch plan (``auto``'s decisions), the noise
        scale's averages, the fp16 loss scaler's state."""
        out = self.batches.state_dict()
        if scaler is not None:
            out["scaler"] = dict(scaler.state_dict())
        return out

    def restore_loop_state(self, state: dict[str, Any]) -> None:
        """:meth:`loop_state` back (a resumed run), before the engine locates its position in the data."""
        self.batches.load_state_dict(state)
        self.resumed_scaler = state.get("scaler")

    # ---------------------------------------------------------------- factories (:attr:`factories`)

    def make_model(self) -> nn.Module:
        return self.factories.model()

    def make_optimizer(self, params: Iterable[Any]) -> torch.optim.Optimizer:
        return self.factories.optimizer(params)

    def make_compressor(self) -> Compressor | None:
        return self.factories.compressor()

    # ---------------------------------------------------------------- the learning rate (:attr:`learning_rate`)

    def lr_multiplier(self, step: int, total: int, batch: int | None = None) -> float:
        return self.learning_rate.multiplier(step, total, batch)

    def schedule_lr(self, optimizer: torch.optim.Optimizer, step: int, total: int) -> None:
        self.learning_rate.apply(optimizer, step, total)

    # ---------------------------------------------------------------- the loss

    @functools.cached_property
    def loss_fn(self) -> Callable[[Any, torch.Tensor], torch.Tensor]:
        """``--loss``'s function, or cross entropy (:func:`~dtrain.workloads.models.task_loss`)."""
        return run_loss(self.cfg)

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The training loss: ``--loss``, or cross entropy over classes (over every position for a language
        model) of the output's logits (a tensor, a tuple's first item, or ``.logits``)."""
        return self.loss_fn(output, target)

    def scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """:meth:`loss` times the step's fp16 loss scale (1 otherwise): what a whole-step engine backpropagates."""
        return self.loss(output, target) * self.loss_scale

    # ---------------------------------------------------------------- the data (:attr:`loaders`)

    def loader(self, shard: int, num_shards: int, epoch: int, start_batch: int = 0) -> DataLoader[Any]:
        return self.loaders.loader(shard, num_shards, epoch, start_batch)

    def steps_per_epoch(self, num_shards: int, epoch: int = 0) -> int:
        return self.loaders.steps_per_epoch(num_shards, epoch)

    def total_steps(self, num_shards: int) -> int:
        return self.loaders.total_steps(num_shards)

    def locate(self, step: int, num_shards: int) -> tuple[int, int]:
        return self.loaders.locate(step, num_shards)

    # ---------------------------------------------------------------- evaluation (:attr:`evaluation`)

    @property
    def language_model(self) -> bool:
        return self.evaluation.language_model

    @property
    def metric_name(self) -> str:
        return self.evaluation.metric_name

    def reached(self, metric: float) -> bool:
        return self.evaluation.reached(metric)

    def metric_text(self, metric: float) -> str:
        return self.evaluation.metric_text(metric)

    def evaluate(self, model: nn.Module) -> float:
        return self.evaluation.evaluate(model)

    # ---------------------------------------------------------------- progress and stragglers

    def progress(self, total: int, show: bool) -> Any:
        """A tqdm bar when ``show`` and progress is enabled (``--progress``), else a no-op object."""
        return progress_bar(total, show and self.cfg.progress, self.cfg.strategy)

    def straggler_factor(self, rank: int | None = None) -> float:
        """The slowdown factor of ``rank`` (default: this rank) from ``cfg.straggler``."""
        return slowdown.straggler_factor(self.cfg.straggler, self.rank if rank is None else rank)

    def straggler(self) -> Straggler:
        """This rank's compute slowdown (:func:`dtrain.training.slowdown.straggler`)."""
        return slowdown.straggler(self.cfg.straggler, self.rank)


@dataclass(frozen=True)
class ProcessHooks:
    """A strategy's process body, its registry entry's hook for this layer (a strategy without one,
    ``auto``, resolves to another before any process starts).

    Attributes:
        run: the body of every process of a run (the :class:`TrainContext` -> this process's
            result, see :mod:`dtrain.job.run`).
    """

    run: Callable[[TrainContext], dict[str, Any]]
