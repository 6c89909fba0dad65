"""The training loop, written once; a strategy supplies a :class:`LoopAdapter` (``run_loop``'s ``engine``:
the strategy's engine, adapted to the loop).

:func:`run_loop` does what every training process does: epochs of its data
shard, a tracer span per step (forward, backward, the engine's update), the
straggler emulation after backward, one metrics row per step (also written as TensorBoard
scalars by the evaluating rank under ``--tensorboard``), checkpoints every
``checkpoint_every`` steps, the evaluation after each epoch on the evaluating
rank (each also a row of the run folder's evaluations file), and the result dict that
:func:`dtrain.job.run.summarize` merges. What
differs between strategies -- how a step's gradients are exchanged and applied,
when training ends, what a checkpoint holds -- is the engine's.

Roughly, per step::

    engine.before_step(step)              # learning rate, zero gradients
    loss = ctx.loss(engine.forward(x), y)  # span "forward"  } --grad-accum N: N micro-batches, the first
    loss.backward()                        # span "backward" } N-1 in engine.no_sync() (training/accumulate.py)
    straggler.stretch(own work)            # --straggler: this rank's own work (less its waits) takes FACTOR x
    guard.check(step, loss)                # non-finite loss or gradient: stop, or skip (--skip-nonfinite)
    engine.clip_grad_norm(MAX)             # --clip-grad-norm: the global norm, before the update
    engine.update()                        # the engine's span: optimizer step, push/pull, ...
    metrics rows <- engine.rows(row)       # the engine adds compute/comm/wait/bytes, the loop step_s

The numerics guard (:mod:`dtrain.optim.guard`) costs one fused 2-norm per gradient and
one host sync per step; ``--skip-nonfinite`` adds, where ranks share a step (dp, ddp, pipeline),
a one-flag all-reduce. ``benchmarks/nonfinite_guard.py`` measures both.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from dtrain.comm.waits import blocked_s
from dtrain.errors import ConfigError, DTrainError
from dtrain.optim.guard import NonFiniteGuard
from dtrain.optim.precision import LossScaler
from dtrain.rundir.files import EVALS as EVALS_FILE  # one row an evaluation: metric, value, step, epoch, train_s
from dtrain.training.accumulate import Accumulates, ClipsGradients, micro_steps, whole_micro_steps
from dtrain.training.context import TrainContext
from dtrain.training.live import EVERY, LiveRanks
from dtrain.training.slowdown import Straggler
from dtrain.training.watchdog import Heartbeat, explain

# set by dtrain sweep's trials: after each evaluation (and its checkpoint) the evaluating rank waits until the
# file it names holds that step, so that the scheduler decides on the run where it stands (the others wait
# for it in their next collective, as they do during the evaluation itself)
HOLD_ENV = "DTRAIN_HOLD_FILE"

if TYPE_CHECKING:
    from dtrain.training.checkpointing import RunCheckpointer

__all__ = [
    "LoopAdapter",
    "Engine",
    "WholeStep",
    "SkipsSteps",
    "Position",
    "run_loop",
    "guard_for",
    "EVALS_FILE",
    "HOLD_ENV",
]


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


class LoopAdapter(Protocol):
    """What a strategy supplies to :func:`run_loop` (one per training process): its engine, adapted to the loop.

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
        """Finish outstanding work (on every rank before an evaluation, before checkpoints, at the end);
        returns rows it completed."""

    def finish(self) -> dict[str, Any]:
        """End of training; returns result keys: ``bytes_sent`` and any extras."""


Engine = LoopAdapter  # the name older scripts import


@runtime_checkable
class WholeStep(Protocol):
    """An adapter that runs a step's forward and backward itself (a pipeline's schedule interleaves
    the micro-batches' passes): the loop calls ``train_step`` instead of forward, loss and backward."""

    def train_step(self, x: Any, y: Any) -> float:
        """Forward and backward of the batch, gradients left in ``.grad``; the batch's mean loss."""


@runtime_checkable
class SkipsSteps(Protocol):
    """An adapter that can leave a step out (``--skip-nonfinite``; :mod:`dtrain.optim.guard`)."""

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The parameters whose gradients this rank applies, named as in the model."""

    def agree(self, bad: bool) -> list[int]:
        """The ranks sharing this step whose check found it bad (a collective where ranks share a
        step; this rank's own verdict where it applies its gradients alone)."""

    def skip(self) -> None:
        """Instead of :meth:`LoopAdapter.update`: apply nothing, drop the gradients; keep what must stay in
        step with other ranks (e.g. a decentralized replica's averaging)."""


def guard_for(ctx: TrainContext, engine: LoopAdapter) -> NonFiniteGuard:
    """The numerics guard of ``engine`` (``--skip-nonfinite`` needs a :class:`SkipsSteps` engine)."""
    budget = ctx.cfg.skip_nonfinite
    if isinstance(engine, SkipsSteps):
        return NonFiniteGuard(engine.named_parameters(), rank=ctx.rank, budget=budget, agree=engine.agree)
    if budget:
        raise ConfigError(
            f"--skip-nonfinite: strategy {ctx.cfg.strategy}'s engine cannot leave a step out; "
            "run without it (a non-finite step then stops the run)"
        )
    return NonFiniteGuard(engine.model.named_parameters(), rank=ctx.rank)


def _scaler(ctx: TrainContext, engine: LoopAdapter) -> LossScaler | None:
    """fp16's loss scaler over the parameters this rank applies (None for fp32 and bf16)."""
    if not ctx.precision.scales_loss:
        return None
    if not isinstance(engine, SkipsSteps):
        raise ConfigError(f"--precision fp16: strategy {ctx.cfg.strategy}'s engine cannot skip an overflowing step")
    params = [p for _, p in engine.named_parameters()]
    return LossScaler(params, engine.agree, rank=ctx.rank, device=ctx.precision.device_type)


def _write(ctx: TrainContext, rows: list[dict[str, Any]], tally: _Progress) -> None:
    for r in rows:  # the step's time as the loop measured it (the engines pop the step_s they are handed)
        if r.get("step") in tally.step_times:
            r.setdefault("step_s", tally.step_times.pop(r["step"]))
        ctx.metrics.write(**r)
        ctx.observe(r)  # --auto-rule time: the step's cost
        if tally.live is not None:
            tally.live.observe(r)


@dataclass
class _Progress:
    """The loop's running tallies, and its numerics guard (which counts the skipped steps)."""

    step: int
    guard: NonFiniteGuard
    samples: int = 0
    eval_s: float = 0.0
    stopped: bool = False  # --target reached: every rank stops at the same evaluation
    target_s: float | None = None
    target_step: int | None = None
    scaler: LossScaler | None = None  # fp16: the loss scale, agreed over the ranks that share a step
    overflows: int = 0  # fp16: steps skipped because their gradients overflowed
    live: LiveRanks | None = None  # the progress bar's slowest rank (with the bar on)
    beat: Heartbeat = field(default_factory=lambda: Heartbeat(0, 1))  # the watchdog's heartbeat (run_loop's)

    def __post_init__(self) -> None:
        self.losses: list[float] = []
        self.history: list[dict[str, Any]] = []  # {"train_s", "step", "epoch", "value"} per evaluation
        self.step_times: dict[int, float] = {}  # step -> seconds, until its row is written


def _gradients(ctx: TrainContext, engine: LoopAdapter, x: Any, y: Any, scaler: LossScaler | None) -> float:
    """Forward (in the compute precision) and backward of a batch, the gradients left in ``.grad``
    (times the loss scale under fp16); the batch's mean loss. ``--grad-accum N``: over ``N`` micro-batches,
    exchanged once (:mod:`dtrain.training.accumulate`)."""
    ctx.loss_scale = scaler.loss_scale if scaler is not None else 1.0
    n = ctx.cfg.grad_accum
    if isinstance(engine, WholeStep):  # a pipeline interleaves forwards and backwards of micro-batches
        params: list[nn.Parameter] = []
        if n > 1:
            if not isinstance(engine, SkipsSteps):
                raise ConfigError(
                    f"--grad-accum {n}: strategy {ctx.cfg.strategy}'s whole-step engine names no "
                    "parameters whose summed gradients the loop could divide by the micro-steps"
                )
            params = [p for _, p in engine.named_parameters()]
        with ctx.precision.autocast():  # its loss function is ctx.scaled_loss; it returns the unscaled
            return whole_micro_steps(engine.train_step, params, x, y, n)

    def step(xi: Any, yi: Any, weight: float) -> float:
        with ctx.tracer.span("forward"), ctx.precision.autocast():
            loss = ctx.loss(engine.forward(xi), yi)
        with ctx.tracer.span("backward"):
            part = loss * weight if weight != 1.0 else loss
            (scaler.scale_loss(part) if scaler is not None else part).backward()
        return float(loss.detach())

    return micro_steps(step, x, y, n, engine.no_sync if isinstance(engine, Accumulates) else None)


def _clip(ctx: TrainContext, engine: LoopAdapter, row: dict[str, Any]) -> None:
    """``--clip-grad-norm MAX``: the engine clips the step's gradient by its global norm, recorded in ``row``."""
    max_norm = ctx.cfg.clip_grad_norm
    if not max_norm:
        return
    if not isinstance(engine, ClipsGradients):
        raise ConfigError(f"--clip-grad-norm: strategy {ctx.cfg.strategy}'s engine cannot clip by the global norm")
    with ctx.tracer.span("clip"):
        norm = engine.clip_grad_norm(max_norm)
    if norm is not None:  # None: clipped elsewhere (a parameter server's servers); the engine's row has it
        row["grad_norm"] = norm


def _inject_overflow(ctx: TrainContext, engine: LoopAdapter, step: int) -> None:
    """Fault injection (``extra.inject_overflow = "RANK:STEP"``, or ``"RANK:*"`` for every step): an inf in
    this rank's first gradient at ``step``, after the exchange -- an overflow only this rank sees (tests of
    the agreement and of a collapsing loss scale)."""
    spec = ctx.cfg.extra.get("inject_overflow")
    if not spec:
        return
    r, s = str(spec).split(":")
    if int(r) == ctx.rank and s in ("*", str(step)) and isinstance(engine, SkipsSteps):
        grads = [p.grad for _, p in engine.named_parameters() if p.grad is not None]
        if grads:
            grads[0].view(-1)[0] = math.inf


def _apply(ctx: TrainContext, engine: LoopAdapter, tally: _Progress, loss_v: float, row: dict[str, Any]) -> bool:
    """Check the step (fp16: unscale and agree on overflow; then the numerics guard), then the engine's
    update or skip; whether it was applied. Adds the loss scale and an overflow to ``row``."""
    _inject_overflow(ctx, engine, tally.step)
    overflow: list[int] = []
    if tally.scaler is not None:
        row["loss_scale"] = tally.scaler.loss_scale
        overflow = tally.scaler.unscale(tally.step)  # LossScaleCollapsed when it cannot back off further
    applied = not overflow and tally.guard.check(tally.step, loss_v)  # NonFiniteError unless it may skip
    if applied:
        _clip(ctx, engine, row)
        engine.update()
    else:
        assert isinstance(engine, SkipsSteps)
        engine.skip()
    if tally.scaler is not None:
        tally.scaler.advance()
    if overflow:
        row["overflow"] = overflow
        tally.overflows += 1
    return applied


def _epoch(
    ctx: TrainContext,
    engine: LoopAdapter,
    ckpt: RunCheckpointer | None,
    pos: Position,
    epoch: int,
    first_batch: int,
    tally: _Progress,
    bar: Any,
    slow: Straggler,
    t_start: float,
) -> int:
    """One pass over this shard's batches of ``epoch`` from ``first_batch``; returns batches consumed (total)."""
    batches = first_batch
    ctx.begin_epoch(epoch)  # --batch-schedule auto: this epoch's batch
    data = iter(ctx.loader(engine.shard, engine.num_shards, epoch, start_batch=first_batch))
    if pos.rng is not None and tally.step == pos.step:  # after building the iterator, which draws from the RNG
        assert ckpt is not None
        ckpt.restore_rng(pos.rng)
    t_free, blocked = time.perf_counter(), blocked_s()  # this rank's own work of a step starts (the straggler's)
    gpu = ctx.device if ctx.device.type != "cpu" else None  # --device cuda: each batch goes to the GPU
    for x, y in data:
        if gpu is not None:
            x, y = x.to(gpu, non_blocking=True), y.to(gpu, non_blocking=True)
        if engine.done(tally.step):
            break
        batches += 1
        t0 = time.perf_counter()
        extra: dict[str, Any] = {}
        ctx.tracer.at_step(tally.step)  # --trace-steps: whether this step is recorded
        tally.beat.step = tally.step
        with ctx.tracer.span("step", step=tally.step):
            engine.before_step(tally.step)
            loss_v = _gradients(ctx, engine, x, y, tally.scaler)
            slow.stretch(time.perf_counter() - t_free - (blocked_s() - blocked))  # less the waits on the others
            applied = _apply(ctx, engine, tally, loss_v, extra)
        t_free, blocked = time.perf_counter(), blocked_s()
        dt = t_free - t0
        row = dict(
            step=tally.step,
            epoch=epoch,
            loss=loss_v,
            lr=engine.lr(),
            samples_per_s=len(y) * engine.samples_scale / dt,
            step_s=dt,
            **extra,
        )
        if not applied:
            row["skipped"] = True
        tally.step_times[tally.step] = dt
        _write(ctx, engine.rows(row), tally)
        if applied:
            tally.losses.append(loss_v)
        tally.samples += len(y)
        tally.step += 1
        ctx.after_step(tally.step)  # --auto-every: the next steps' batch
        bar.update(1)
        if tally.step % EVERY == 0:
            _postfix(engine, tally, bar, loss_v)
        evaluated = bool(ctx.cfg.eval_every and tally.step % ctx.cfg.eval_every == 0)
        if evaluated:
            _evaluate(ctx, engine, tally, epoch, t_start, bar)  # may stop the run (--target)
            t_free, blocked = time.perf_counter(), blocked_s()
        if ckpt is not None and ckpt.due(tally.step, final=engine.done(tally.step) or tally.stopped):
            ckpt.loop_state = ctx.loop_state(tally.scaler)
            with ctx.tracer.span("checkpoint", step=tally.step):
                engine.save(ckpt, tally.step, epoch, batches)
            t_free, blocked = time.perf_counter(), blocked_s()
        if evaluated and engine.evaluator and os.environ.get(HOLD_ENV):
            tally.eval_s += _hold(ctx, tally.step, Path(os.environ[HOLD_ENV]))
            t_free, blocked = time.perf_counter(), blocked_s()
        if engine.done(tally.step) or tally.stopped:
            break
    return batches


def _postfix(engine: LoopAdapter, tally: _Progress, bar: Any, loss: float) -> None:
    """The bar's loss, and the slowest rank (every rank posts its own work, the evaluating rank shows it)."""
    shown = {"loss": f"{loss:.3f}"}
    if tally.live is not None:
        tally.live.post()
        slowest = tally.live.slowest() if engine.evaluator else None
        if slowest is not None:
            shown["slowest"] = slowest
    bar.set_postfix(shown, refresh=False)


def _verdict(ctx: TrainContext, engine: LoopAdapter, step: int, stop: bool) -> bool:
    """Every rank's answer to "stop now?" after the evaluation at ``step``: the evaluating rank's.

    The evaluator posts its verdict in the job's key-value store (torch.distributed's
    default store, the rendezvous's); the others wait for it there, so no collective is
    needed among processes that share no group (a parameter server's workers).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return stop
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    key = f"dtrain/target/step{step}"
    if engine.evaluator:
        store.set(key, "stop" if stop else "go")
        return stop
    try:
        store.wait([key], timedelta(seconds=ctx.cfg.timeout_s))
    except (RuntimeError, dist.DistStoreError) as e:  # the store's timeout
        raise DTrainError(
            f"rank {ctx.rank}: waiting for the evaluating rank's --target verdict at step {step} "
            f"timed out after {ctx.cfg.timeout_s:g}s ({e})"
        ) from None
    return bytes(store.get(key)) == b"stop"


def _hold(ctx: TrainContext, step: int, go: Path) -> float:
    """Wait until the file ``go`` names ``step`` or a later one (``dtrain sweep``'s trial, once its scheduler has
    seen this evaluation and its checkpoint); the seconds waited."""
    t0 = time.perf_counter()
    while True:
        with contextlib.suppress(OSError, ValueError):
            if int(go.read_text().strip() or -1) >= step:
                return time.perf_counter() - t0
        if time.perf_counter() - t0 > ctx.cfg.timeout_s:
            raise DTrainError(
                f"rank {ctx.rank}: waiting for the sweep to take the evaluation of step {step} timed "
                f"out after {ctx.cfg.timeout_s:g}s ({go} says {go.read_text().strip()!r})"
            )
        time.sleep(0.01)


def _evaluate(ctx: TrainContext, engine: LoopAdapter, tally: _Progress, epoch: int, t_start: float, bar: Any) -> None:
    """Evaluate on the evaluating rank; with ``--target``, every rank learns whether to stop."""
    te = time.perf_counter()
    stop = False
    _write(ctx, engine.synchronize(), tally)  # every rank: the evaluated model may need them all (a replicas' average)
    if engine.evaluator:
        value = ctx.evaluate(engine.model)
        ctx.metrics.scalar(f"eval/{ctx.metric_name}", value, tally.step)  # --tensorboard
        t = round(te - t_start - tally.eval_s, 4)
        tally.history.append({"train_s": t, "step": tally.step, "epoch": epoch, "value": value})
        with (ctx.out_dir / EVALS_FILE).open("a", encoding="utf-8") as f:  # read live (dtrain sweep's trials)
            f.write(json.dumps({"metric": ctx.metric_name, **tally.history[-1]}) + "\n")
        stop = ctx.reached(value)
        if stop:
            tally.target_s, tally.target_step = t, tally.step
        if ctx.cfg.progress:
            bar.write(f"step {tally.step} (epoch {epoch}): {ctx.metric_text(value)}{engine.eval_note}")
    if ctx.cfg.target:
        tally.stopped = _verdict(ctx, engine, tally.step, stop)
    tally.eval_s += time.perf_counter() - te


def _metric_keys(ctx: TrainContext, engine: LoopAdapter, tally: _Progress) -> dict[str, Any]:
    """The evaluating rank's result keys: the final metric, its history, time to target."""
    value = ctx.evaluate(engine.model)
    out: dict[str, Any] = dict(metric_name=ctx.metric_name, metric=value, metric_history=tally.history)
    if ctx.language_model:
        out.update(val_loss=value, perplexity=math.exp(min(value, 700.0)))
        torch.save(engine.model.state_dict(), ctx.out_dir / "model.pt")  # for `dtrain sample`
    else:
        out.update(
            test_accuracy=value, accuracy_history=[(h["train_s"], h["epoch"], h["value"]) for h in tally.history]
        )
    if ctx.cfg.target:
        out.update(target=ctx.cfg.target, time_to_target_s=tally.target_s, target_step=tally.target_step)
    return out


def _train(
    ctx: TrainContext,
    engine: LoopAdapter,
    ckpt: RunCheckpointer | None,
    pos: Position,
    tally: _Progress,
    bar: Any,
    slow: Straggler,
    t_start: float,
) -> None:
    """The epochs, each followed by its evaluation (without --eval-every), until the engine is done."""
    epoch, first_batch = pos.epoch, pos.batch
    while not engine.done(tally.step) and not tally.stopped:
        batches = _epoch(ctx, engine, ckpt, pos, epoch, first_batch, tally, bar, slow, t_start)
        if batches == 0:
            raise ConfigError(f"rank {ctx.rank}'s data shard yields no batch; use a smaller batch size")
        first_batch = 0
        if not ctx.cfg.eval_every and not tally.stopped:
            _evaluate(ctx, engine, tally, epoch, t_start, bar)
            if tally.stopped and ckpt is not None and ckpt.due(tally.step, final=True):
                ckpt.loop_state = ctx.loop_state(tally.scaler)
                engine.save(ckpt, tally.step, epoch, batches)  # the run ends here: its last checkpoint
        epoch += 1


def run_loop(ctx: TrainContext, engine: LoopAdapter, ckpt: RunCheckpointer | None = None) -> dict[str, Any]:
    """Train with ``engine`` until it is done; returns this process's result.

    The result: ``role`` "worker", ``steps`` (this run's), ``start_step``,
    ``samples`` (this process's), ``train_s`` (without evaluation), ``final_loss``
    (mean of the last 10 steps), ``bytes_sent``, and on the evaluating rank
    ``metric_name`` / ``metric`` / ``metric_history`` (one entry per evaluation:
    training seconds so far, evaluations excluded, step, epoch, value), with
    ``test_accuracy`` and ``accuracy_history`` ((train seconds, epoch, accuracy)) for
    a classifier, ``val_loss`` and ``perplexity`` for a language model, and under
    ``--target`` ``time_to_target_s`` (training seconds from the first step to the
    evaluation that met it; None if none did) and ``target_step``; plus the
    engine's :meth:`LoopAdapter.finish` keys.
    """
    if ckpt is not None:
        ckpt.on_restore = ctx.restore_loop_state  # the batch plan before the engine locates its position
    pos = engine.start()
    slow = ctx.straggler()
    tally = _Progress(
        step=pos.step,
        guard=guard_for(ctx, engine),
        scaler=_scaler(ctx, engine),
        live=LiveRanks(ctx.rank, ctx.world_size) if ctx.cfg.progress else None,
        beat=Heartbeat(ctx.rank, ctx.world_size).start(),
    )
    if tally.scaler is not None and ctx.resumed_scaler is not None:
        tally.scaler.load_state_dict(ctx.resumed_scaler)
    bar = ctx.progress(engine.total_steps - pos.step, engine.evaluator)
    if ctx.cfg.tensorboard and engine.evaluator:  # the evaluating rank's scalars as TensorBoard events
        ctx.metrics.open_tensorboard(ctx.out_dir / "tensorboard")
    t_start = time.perf_counter()
    try:  # a wait that times out names who did not arrive (the heartbeats of every rank)
        _train(ctx, engine, ckpt, pos, tally, bar, slow, t_start)
        _write(ctx, engine.synchronize(), tally)
    except DTrainError as e:
        told = explain(e, tally.beat)
        if told is e:
            raise
        raise told from e
    finally:
        tally.beat.stop()
    train_s = time.perf_counter() - t_start - tally.eval_s
    extra = engine.finish()
    bar.close()
    last = tally.losses[-10:]
    out: dict[str, Any] = dict(
        role="worker",
        steps=tally.step - pos.step,
        start_step=pos.step,
        samples=tally.samples,
        train_s=train_s,
        final_loss=sum(last) / max(1, len(last)),
    )
    out.update(extra)
    if engine.evaluator:
        out.update(_metric_keys(ctx, engine, tally))
    if tally.scaler is not None:
        out.update(overflow_steps=tally.overflows, loss_scale=tally.scaler.loss_scale)
    if ctx.batches.noise is not None and engine.evaluator:
        out["summary_extra"] = {
            **out.get("summary_extra", {}),
            "noise_scale": ctx.batches.noise.b_simple,
            "batch_decisions": ctx.batches.decisions,
        }
    if slow.active:
        out.setdefault("straggler", {"factor": slow.factor, "reference_s": slow.reference_s})
    return out
