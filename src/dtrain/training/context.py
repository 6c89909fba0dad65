"""What every process of a run gets: :class:`TrainContext`.

The context knows the run configuration, this process's rank, the data, the
metrics writer and the tracer, and builds what every strategy builds alike:
the seeded model, the optimizer, the data loader of a shard, the learning-rate
schedule, the evaluation, the progress bar and the straggler emulation. It holds
nothing strategy-specific; a strategy's options are ``cfg.options``.
"""

from __future__ import annotations

import functools
import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from dtrain.cluster.slowdown import Straggler, slowdown_factor
from dtrain.compress.base import Compressor
from dtrain.job.config import RunConfig, parse_straggler
from dtrain.observe.trace import MetricsWriter, Tracer
from dtrain.training.large_batch import BatchPlan, scaling_factor, warmup_factor
from dtrain.training.noise_scale import NoiseScale, StepCost, next_batch
from dtrain.training.precision import Precision
from dtrain.workloads.data import DatasetSplit
from dtrain.workloads.models import build_model, task_loss

__all__ = ["TrainContext", "ProcessHooks", "lr_factor", "schedule_updates"]


def lr_factor(schedule: str, step: int, total: int) -> float:
    """The learning rate of optimizer step ``step`` (from 0) of ``total``, as a fraction of ``--lr``.

    ``constant``: 1. ``cosine``: ``0.5 * (1 + cos(pi * step / total))``, 1 at the
    first step and falling to ``0.5 * (1 + cos(pi * (total - 1) / total))`` at the
    last (Loshchilov & Hutter, "SGDR: Stochastic Gradient Descent with Warm
    Restarts", ICLR 2017, one cycle without restarts; torch's
    ``CosineAnnealingLR`` with ``eta_min=0`` stepped per optimizer step). Steps at
    or past ``total`` get 0.

    Raises:
        ValueError: unknown schedule or ``total < 1``.
    """
    if total < 1:
        raise ValueError(f"lr schedule needs total >= 1 steps, got {total}")
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(step, total) / total))
    raise ValueError(f"lr schedule {schedule!r} is not known; choose constant or cosine")


def schedule_updates(optimizer: torch.optim.Optimizer, schedule: str, total: int,
                     factor: Callable[[int], float] | None = None) -> None:  # fmt: skip
    """Scale every update of ``optimizer`` by :func:`lr_factor` of its own step count.

    For optimizers stepped where the loop cannot set the rate (the parameter
    server's): a pre-step hook multiplies each group's current ``lr`` (whatever
    set it: the policy's lr scale, staleness-aware scaling) by the factor and a
    post-step hook puts it back, so the schedule composes with them.
    """
    count = [0]

    def before(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        f = factor(count[0]) if factor is not None else lr_factor(schedule, count[0], total)
        for g in opt.param_groups:
            g["unscheduled_lr"] = g["lr"]
            g["lr"] = g["lr"] * f

    def after(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for g in opt.param_groups:
            g["lr"] = g.pop("unscheduled_lr")
        count[0] += 1

    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)


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

    batch_decisions: list[dict[str, Any]] = field(default_factory=list, init=False)  # auto: one per epoch
    resumed_scaler: dict[str, Any] | None = field(default=None, init=False)  # fp16: the checkpoint's scaler

    @functools.cached_property
    def plan(self) -> BatchPlan:
        """Every epoch's global batch (``--batch-size``, ``--batch-schedule``; ``auto`` decides as it goes)."""
        c = self.cfg
        return BatchPlan.of(c.batch_size, c.batch_schedule, len(self.data.train), c.epochs, every=c.auto_every)

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

    @functools.cached_property
    def noise(self) -> NoiseScale | None:
        """The gradient noise scale (``--noise-scale``, ``--batch-schedule auto``; the engine feeds it every
        step), else None."""
        return NoiseScale(self.cfg.noise_beta) if self.cfg.noise_scale or self.plan.auto else None

    @functools.cached_property
    def step_cost(self) -> StepCost | None:
        """``--auto-rule time``: the step's fixed and per-sample seconds (the loop feeds this rank's rows, the
        engine's noise-scale all-reduce agrees them over the ranks), else None."""
        return StepCost() if self.plan.auto and self.cfg.auto_rule == "time" else None

    def observe(self, row: dict[str, Any]) -> None:
        """A written metrics row: its step time and compute feed :attr:`step_cost` (``--auto-rule time``)."""
        if self.step_cost is not None and row.get("compute_s") and row.get("step_s") and row.get("batch"):
            local = int(row["batch"]) // self.batch_shards
            self.step_cost.observe(float(row["step_s"]), float(row["compute_s"]), local)

    def loop_state(self, scaler: Any) -> dict[str, Any]:
        """What a checkpoint keeps of the loop's own state: the batch plan (``auto``'s decisions), the noise
        scale's averages, the fp16 loss scaler's state."""
        out: dict[str, Any] = {"plan": list(self.plan.batches), "decisions": list(self.batch_decisions),
                               "changes": [list(c) for c in self.plan.changes]}  # fmt: skip
        if self.noise is not None:
            out["noise"] = self.noise.state_dict()
        if self.step_cost is not None:
            out["cost"] = self.step_cost.state_dict()
        if scaler is not None:
            out["scaler"] = dict(scaler.state_dict())
        return out

    def restore_loop_state(self, state: dict[str, Any]) -> None:
        """:meth:`loop_state` back (a resumed run), before the engine locates its position in the data."""
        self.plan.batches[: len(state["plan"])] = state["plan"]
        self.plan.changes = [(int(s), int(b)) for s, b in state.get("changes", [])]
        self.batch_decisions = list(state["decisions"])
        if self.noise is not None and "noise" in state:
            self.noise.load_state_dict(state["noise"])
        if self.step_cost is not None and "cost" in state:
            self.step_cost.load_state_dict(state["cost"])
        self.resumed_scaler = state.get("scaler")

    def begin_epoch(self, epoch: int) -> None:
        """Before ``epoch``'s data: ``--batch-schedule auto`` doubles the batch while the smoothed noise scale
        exceeds it by the margin (:func:`dtrain.training.noise_scale.next_batch`). Every rank computes the
        same noise scale (from all-reduced norms), so every rank makes the same decision."""
        if self.plan.within_epochs and not self.batch_decisions:  # --auto-every: after_step decides
            self.batch_decisions.append({"step": 0, "batch": self.plan.current, "b_simple": None})
        if not self.plan.auto or self.plan.within_epochs or self.noise is None \
                or any(d["epoch"] == epoch for d in self.batch_decisions):
            return  # decided already (a run resumed mid-epoch keeps the decision made at its start)
        b = self.plan.batch(epoch)
        if epoch > 0:
            b = next_batch(b, self.noise.b_simple, maximum=max(b, self.batch_cap), multiple=self.batch_shards)
            self.plan.set_from(epoch, b)
        self.batch_decisions.append({"epoch": epoch, "batch": b, "b_simple": self.noise.b_simple})

    @property
    def batch_cap(self) -> int:
        """The largest global batch ``auto`` grows to (``--max-batch``, else a quarter of the training set)."""
        shards = self.batch_shards
        return self.cfg.max_batch or max(shards, len(self.data.train) // 4 // shards * shards)

    def after_step(self, steps: int) -> None:
        """After ``steps`` steps, ``--batch-schedule auto --auto-every N`` decides every N steps the batch of the
        steps that follow (the same on every rank: the noise scale and the step's cost are all-reduced); the
        loader's next batch takes it (:meth:`loader`)."""
        plan = self.plan
        if not plan.within_epochs or self.noise is None or steps % plan.every:
            return
        b, ratio = plan.current, 1.0
        if self.step_cost is not None:  # --auto-rule time
            r = self.step_cost.ratio(b // self.batch_shards)
            if r is None:
                return  # no step measured yet
            ratio = r
        nb = next_batch(b, self.noise.b_simple, maximum=max(b, self.batch_cap), multiple=self.batch_shards,
                        ratio=ratio)  # fmt: skip
        if nb != b:
            plan.change(steps, nb)
            self.batch_decisions.append({"step": steps, "batch": nb, "b_simple": self.noise.b_simple,
                                         "ratio": ratio})  # fmt: skip

    # ---------------------------------------------------------------- factories

    def make_model(self) -> nn.Module:
        """The configured model, initialised identically on every rank (seeded), on :attr:`device`."""
        torch.manual_seed(self.cfg.seed)
        model = build_model(self.cfg.model, self.data.input_shape, self.data.num_classes, **self.cfg.gpt_overrides())
        return model.to(self.device)  # initialised on the CPU: the same weights on any device

    def make_optimizer(self, params: Iterable[Any]) -> torch.optim.Optimizer:
        """The configured optimizer. SGD gets no momentum where the compressor applies it
        (:meth:`make_compressor`)."""
        c = self.cfg
        if c.optimizer == "adam":
            return torch.optim.Adam(params, lr=c.lr, weight_decay=c.weight_decay)
        if c.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=c.lr, weight_decay=c.weight_decay)
        if c.optimizer in ("lars", "lamb"):
            from dtrain.optim import LAMB, LARS

            if c.optimizer == "lars":
                return LARS(params, lr=c.lr, momentum=c.momentum, weight_decay=c.weight_decay)
            return LAMB(params, lr=c.lr, weight_decay=c.weight_decay)
        comp = self.make_compressor()
        momentum = 0.0 if comp is not None and comp.momentum else c.momentum
        return torch.optim.SGD(params, lr=c.lr, momentum=momentum, weight_decay=c.weight_decay)

    def make_compressor(self) -> Compressor | None:
        """The strategy's gradient compressor (None without one).

        Compressors that need SGD's momentum before them (sign, sign:mv, onebit)
        get it in their error feedback, and :meth:`make_optimizer` then builds SGD
        without momentum (``dtrain.compress.from_spec``'s ``momentum``).
        """
        opts = self.cfg.opts
        wire = self.precision.wire(opts.compressor_spec(), unscaled=opts.exchanges_unscaled())
        if wire != opts.compressor_spec():  # 16-bit compute: the gradients travel in 16 bits
            from dtrain.compress import from_spec

            return from_spec(wire)
        return opts.build_compressor(self.sgd_momentum)

    @property
    def sgd_momentum(self) -> float:
        """SGD's momentum (0 for other optimizers): what a sign/onebit compressor takes over."""
        return self.cfg.momentum if self.cfg.optimizer == "sgd" else 0.0

    def lr_multiplier(self, step: int, total: int, batch: int | None = None) -> float:
        """The factor on ``--lr`` at optimizer step ``step`` of ``total`` (:mod:`dtrain.training.large_batch`):
        batch scaling (``batch``: the global batch in force, default that of ``step``'s epoch) x warmup x
        schedule."""
        c = self.cfg
        if batch is None:
            batch = self.plan.batch_at(step, self.batch_shards)
        k = scaling_factor(c.lr_scaling, batch, c.base_batch or self.plan.batches[0])
        return k * warmup_factor(step, self.warmup_steps, k) * lr_factor(c.lr_schedule, step, total)

    @property
    def batch_shards(self) -> int:
        return self.cfg.opts.batch_shards(self.cfg.workers)

    @property
    def warmup_steps(self) -> int:
        """``--warmup-steps``, or ``--warmup-epochs`` in steps of the first epoch."""
        c = self.cfg
        if c.warmup_epochs:
            return max(1, round(c.warmup_epochs * self.plan.steps_at(self.plan.batches[0], self.batch_shards)))
        return c.warmup_steps

    @property
    def lr_rules(self) -> bool:
        """Whether the rate changes during the run (a schedule, scaling or warmup)."""
        c = self.cfg
        return c.lr_schedule != "constant" or c.lr_scaling != "none" or bool(c.warmup_steps or c.warmup_epochs)

    def schedule_lr(self, optimizer: torch.optim.Optimizer, step: int, total: int) -> None:
        """Set each group's ``lr`` for ``step`` of ``total``: its initial rate times
        :meth:`lr_multiplier` (nothing to do for a constant rate)."""
        if not self.lr_rules:
            return
        f = self.lr_multiplier(step, total)
        for g in optimizer.param_groups:
            g.setdefault("initial_lr", g["lr"])
            g["lr"] = g["initial_lr"] * f

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The training loss: cross entropy over classes (over every position for a language model)."""
        return task_loss(output, target)

    def scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """:meth:`loss` times the step's fp16 loss scale (1 otherwise): what a whole-step engine backpropagates."""
        return self.loss(output, target) * self.loss_scale

    def loader(self, shard: int, num_shards: int, epoch: int, start_batch: int = 0) -> DataLoader[Any]:
        """This shard's training batches for ``epoch`` (a DistributedSampler slice).

        The per-shard batch is ``batch_size // num_shards``, so the global batch is
        ``batch_size`` rounded down to a multiple of the shards (``RunConfig.global_batch``:
        64 over 3 workers trains on 63 samples a step). ``start_batch`` skips the
        epoch's first batches without reading them (a resumed run starts mid-epoch
        on exactly the batches the uninterrupted run saw next). Under ``--auto-every`` each batch is
        as large as the plan's latest decision when the step draws it, and ``start_batch`` counts batches
        of the sizes the plan's changes gave them.
        """
        sampler: DistributedSampler[Any] = DistributedSampler(
            self.data.train, num_replicas=num_shards, rank=shard, shuffle=True, seed=self.cfg.seed, drop_last=True
        )
        sampler.set_epoch(epoch)
        if self.plan.within_epochs:  # --auto-every: each batch as large as the plan's latest decision
            order = list(sampler)[self.plan.offset(epoch, start_batch, num_shards) :]
            sizes = _GrowingBatches(order, lambda: self.plan.current // num_shards)
            return DataLoader(self.data.train, batch_sampler=sizes)
        bs = self.plan.batch(epoch) // num_shards
        if start_batch:
            order = list(sampler)[start_batch * bs :]
            return DataLoader(self.data.train, batch_size=bs, sampler=order, drop_last=True)
        return DataLoader(self.data.train, batch_size=bs, sampler=sampler, drop_last=True)

    def steps_per_epoch(self, num_shards: int, epoch: int = 0) -> int:
        """Steps of ``epoch`` (its global batch: :attr:`plan`)."""
        return self.plan.steps_in(epoch, num_shards)

    def total_steps(self, num_shards: int) -> int:
        """Steps of the run: every epoch's, at most ``--max-steps`` (``auto``: as planned so far)."""
        n = self.plan.total(num_shards)
        return min(n, self.cfg.max_steps) if self.cfg.max_steps else n

    def locate(self, step: int, num_shards: int) -> tuple[int, int]:
        """``(epoch, batch)`` after ``step`` steps: where a resumed run starts."""
        return self.plan.locate(step, num_shards)

    @property
    def language_model(self) -> bool:
        """Whether the run trains a language model (next-token prediction on text)."""
        return self.data.task == "lm"

    @property
    def metric_name(self) -> str:
        """``"val_loss"`` (nats per token) for a language model, else ``"test_accuracy"``."""
        return "val_loss" if self.language_model else "test_accuracy"

    def reached(self, metric: float) -> bool:
        """Whether ``metric`` meets ``--target`` (accuracy at or above it, a loss at or below it)."""
        if not self.cfg.target:
            return False
        return metric <= self.cfg.target if self.language_model else metric >= self.cfg.target

    def metric_text(self, metric: float) -> str:
        """The metric as ``dtrain run`` prints it."""
        if self.language_model:
            return f"validation loss {metric:.4f} nats/token (perplexity {math.exp(min(metric, 700.0)):.2f})"
        return f"test accuracy {metric:.4f}"

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> float:
        """The run's metric of ``model`` (:attr:`metric_name`) on the test / validation set.

        A classifier's accuracy, or a language model's mean cross entropy per token
        (nats); over the first ``--eval-samples`` samples or windows (default: all), on
        the model's device.
        """
        was_training = model.training
        model.eval()
        x, y = self.data.test.tensors
        if self.cfg.eval_samples:
            x, y = x[: self.cfg.eval_samples], y[: self.cfg.eval_samples]
        total, chunk = 0.0, 64 if self.language_model else 1024
        dev = next(model.parameters()).device  # the data stays on the CPU; a chunk goes where the model is
        for i in range(0, len(y), chunk):
            out, target = model(x[i : i + chunk].to(dev)), y[i : i + chunk].to(dev)
            if self.language_model:
                total += float(self.loss(out, target)) * target.numel()
            else:
                total += int((out.argmax(1) == target).sum())
        model.train(was_training)
        return total / max(1, y.numel())

    def progress(self, total: int, show: bool) -> Any:
        """A tqdm bar when ``show`` and progress is enabled, else a no-op object."""
        from tqdm import tqdm

        # on a terminal the bar redraws in place; in a log file (CI, a redirected run) every
        # redraw is a line of its own, so there it updates at most every 30 s
        tty = sys.stderr.isatty()
        return tqdm(total=total, disable=not (show and self.cfg.progress), desc=self.cfg.strategy,
                    unit="step", dynamic_ncols=True, leave=False, mininterval=0.1 if tty else 30.0)

    def straggler_factor(self, rank: int | None = None) -> float:
        """The slowdown factor of ``rank`` (default: this rank) from ``cfg.straggler``."""
        if not self.cfg.straggler:
            return 1.0
        r, f = parse_straggler(self.cfg.straggler)
        return f if r == (self.rank if rank is None else rank) else 1.0

    def straggler(self) -> Straggler:
        """This rank's compute slowdown (:class:`dtrain.cluster.Straggler`): ``--straggler``
        times the emulated host's ``DTRAIN_SLOWDOWN``; call its ``stretch(compute_s)`` after backward."""
        return Straggler(self.straggler_factor() * slowdown_factor())


class _GrowingBatches:
    """A batch sampler over ``order`` whose batch size is read (``size()``) as each batch is drawn: the data
    loader draws a step's batch when the step starts, after the decision that sized it. An epoch ends where
    the next batch would not fit (``drop_last``)."""

    def __init__(self, order: list[int], size: Callable[[], int]) -> None:
        self.order, self.size = order, size

    def __iter__(self) -> Iterator[list[int]]:
        i = 0
        while True:
            bs = self.size()
            if bs < 1 or i + bs > len(self.order):
                return
            yield self.order[i : i + bs]
            i += bs


@dataclass(frozen=True)
class ProcessHooks:
    """A strategy's process body, its registry entry's hook for this layer (a strategy without one,
    ``auto``, resolves to another before any process starts).

    Attributes:
        run: the body of every process of a run (the :class:`TrainContext` -> this process's
            result, see :mod:`dtrain.job.worker`).
    """

    run: Callable[[TrainContext], dict[str, Any]]
