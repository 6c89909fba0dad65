"""The training loop, written once; a strategy supplies an :class:`Engine`.

:func:`run_loop` does what every training process does: epochs of its data
shard, a tracer span per step (forward, backward, the engine's update), the
straggler emulation after backward, one metrics row per step, checkpoints every
``checkpoint_every`` steps, the evaluation after each epoch on the evaluating
rank, and the result dict that :func:`dtrain.train.summarize` merges. What
differs between strategies -- how a step's gradients are exchanged and applied,
when training ends, what a checkpoint holds -- is the engine's.

Roughly, per step::

    engine.before_step(step)              # learning rate, zero gradients
    loss = ctx.loss(engine.forward(x), y)  # span "forward"
    loss.backward()                        # span "backward" (overlapped exchange runs here)
    straggler.stretch(own work)            # --straggler: this rank's own work takes FACTOR x
    engine.update()                        # the engine's span: optimizer step, push/pull, ...
    metrics rows <- engine.rows(row)       # the engine adds compute/comm/wait/bytes
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from dtrain.cluster.slowdown import Straggler
from dtrain.errors import ConfigError
from dtrain.training.context import TrainContext

if TYPE_CHECKING:
    from dtrain.checkpoint.training import RunCheckpointer

__all__ = ["Engine", "Position", "run_loop"]


@dataclass(frozen=True)
class Position:
    """Where training starts: after ``step`` steps, at batch ``batch`` of epoch ``epoch``.

    ``rng``: the checkpoint's per-rank state whose RNG states the loop restores
    once the first epoch's data iterator exists (None: a fresh run).
    """

    step: int = 0
    epoch: int = 0
    batch: int = 0
    rng: dict[str, Any] | None = None


class Engine(Protocol):
    """What a strategy supplies to :func:`run_loop` (one per training process).

    Attributes:
        model: the module trained here (evaluated by the evaluating rank).
        evaluator: whether this process evaluates and shows the progress bar.
        shard / num_shards: this process's slice of the training data.
        samples_scale: samples a step's row counts per local sample (data parallel:
            the world size, since the row speaks for the global batch).
        total_steps: steps this process expects (the progress bar's length).
        eval_note: appended to the per-epoch evaluation line.
    """

    model: nn.Module
    evaluator: bool
    shard: int
    num_shards: int
    samples_scale: int
    total_steps: int
    eval_note: str

    def start(self) -> Position:
        """Restore a checkpoint if the run resumes; where to start."""

    def done(self, step: int) -> bool:
        """Whether training ends after ``step`` steps."""

    def before_step(self, step: int) -> None:
        """Before forward: set the learning rate, zero the gradients."""

    def forward(self, x: Any) -> torch.Tensor:
        """The model's output for ``x`` (through the engine's wrapper, if any)."""

    def update(self) -> None:
        """After backward: exchange gradients and apply them (the engine opens its own span)."""

    def lr(self) -> float:
        """The learning rate the step used (for the metrics row)."""

    def rows(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """Complete a step's metrics row (``step_s`` in it) with compute/comm/wait/bytes; may
        return the previous step's row instead, when its figures come one step later."""

    def save(self, ckpt: RunCheckpointer, step: int, epoch: int, batch: int) -> None:
        """Collective: checkpoint after ``step`` steps (``batch`` batches of ``epoch`` consumed)."""

    def synchronize(self) -> list[dict[str, Any]]:
        """Finish outstanding work (before evaluation, checkpoints, the end); returns rows it completed."""

    def finish(self) -> dict[str, Any]:
        """End of training; returns result keys: ``bytes_sent`` and any extras."""


def _write(ctx: TrainContext, rows: list[dict[str, Any]]) -> None:
    for r in rows:
        ctx.metrics.write(**r)


@dataclass
class _Progress:
    """The loop's running tallies."""

    step: int
    samples: int = 0
    eval_s: float = 0.0

    def __post_init__(self) -> None:
        self.losses: list[float] = []
        self.history: list[tuple[float, int, float]] = []


def _epoch(ctx: TrainContext, engine: Engine, ckpt: RunCheckpointer | None, pos: Position, epoch: int,
           first_batch: int, tally: _Progress, bar: Any, slow: Straggler) -> int:  # fmt: skip
    """One pass over this shard's batches of ``epoch`` from ``first_batch``; returns batches consumed (total)."""
    batches = first_batch
    data = iter(ctx.loader(engine.shard, engine.num_shards, epoch, start_batch=first_batch))
    if pos.rng is not None and tally.step == pos.step:  # after building the iterator, which draws from the RNG
        assert ckpt is not None
        ckpt.restore_rng(pos.rng)
    t_free = time.perf_counter()  # this rank's own work of a step starts (the straggler's measure)
    for x, y in data:
        if engine.done(tally.step):
            break
        batches += 1
        t0 = time.perf_counter()
        with ctx.tracer.span("step", step=tally.step):
            engine.before_step(tally.step)
            with ctx.tracer.span("forward"):
                loss = ctx.loss(engine.forward(x), y)
            with ctx.tracer.span("backward"):
                loss.backward()
            loss_v = float(loss.detach())
            slow.stretch(time.perf_counter() - t_free)  # backward includes the exchange it overlaps
            engine.update()
        t_free = time.perf_counter()
        dt = t_free - t0
        row = dict(step=tally.step, epoch=epoch, loss=loss_v, lr=engine.lr(),
                   samples_per_s=len(y) * engine.samples_scale / dt, step_s=dt)  # fmt: skip
        _write(ctx, engine.rows(row))
        tally.losses.append(loss_v)
        tally.samples += len(y)
        tally.step += 1
        bar.update(1)
        if tally.step % 10 == 0:
            bar.set_postfix(loss=f"{loss_v:.3f}", refresh=False)
        if ckpt is not None and ckpt.due(tally.step, final=engine.done(tally.step)):
            with ctx.tracer.span("checkpoint", step=tally.step):
                engine.save(ckpt, tally.step, epoch, batches)
            t_free = time.perf_counter()
        if engine.done(tally.step):
            break
    return batches


def _evaluate(ctx: TrainContext, engine: Engine, tally: _Progress, epoch: int, t_start: float, bar: Any) -> None:
    te = time.perf_counter()
    _write(ctx, engine.synchronize())
    acc = ctx.evaluate(engine.model)
    tally.eval_s += time.perf_counter() - te
    tally.history.append((round(time.perf_counter() - t_start - tally.eval_s, 4), epoch, acc))
    if ctx.cfg.progress:
        bar.write(f"epoch {epoch}: test accuracy {acc:.4f}{engine.eval_note}")


def run_loop(ctx: TrainContext, engine: Engine, ckpt: RunCheckpointer | None = None) -> dict[str, Any]:
    """Train with ``engine`` until it is done; returns this process's result.

    The result: ``role`` "worker", ``steps`` (this run's), ``start_step``,
    ``samples`` (this process's), ``train_s`` (without evaluation), ``final_loss``
    (mean of the last 10 steps), ``bytes_sent``, and on the evaluating rank
    ``test_accuracy`` and ``accuracy_history`` ((train seconds, epoch, accuracy) per
    epoch); plus the engine's :meth:`Engine.finish` keys.
    """
    pos = engine.start()
    slow = ctx.straggler()
    tally = _Progress(step=pos.step)
    bar = ctx.progress(engine.total_steps - pos.step, engine.evaluator)
    t_start = time.perf_counter()
    epoch, first_batch = pos.epoch, pos.batch
    while not engine.done(tally.step):
        batches = _epoch(ctx, engine, ckpt, pos, epoch, first_batch, tally, bar, slow)
        if batches == 0:
            raise ConfigError(f"rank {ctx.rank}'s data shard yields no batch; use a smaller batch size")
        first_batch = 0
        if engine.evaluator:
            _evaluate(ctx, engine, tally, epoch, t_start, bar)
        epoch += 1
    _write(ctx, engine.synchronize())
    train_s = time.perf_counter() - t_start - tally.eval_s
    extra = engine.finish()
    bar.close()
    last = tally.losses[-10:]
    out: dict[str, Any] = dict(role="worker", steps=tally.step - pos.step, start_step=pos.step, samples=tally.samples,
                               train_s=train_s, final_loss=sum(last) / max(1, len(last)))
    out.update(extra)
    if engine.evaluator:
        out["test_accuracy"] = ctx.evaluate(engine.model)
        out["accuracy_history"] = tally.history
    if slow.active:
        out.setdefault("straggler", {"factor": slow.factor, "reference_s": slow.reference_s})
    return out
