"""The loop adapter of ``dp`` and ``ddp`` (:class:`DataParallelAdapter`: :class:`dtrain.DataParallel`, or
torch's DDP, driven by the training loop; ``--shard`` derives :mod:`.sharded_dp`'s from it) and the gradient
noise scale it measures."""

from __future__ import annotations

import contextlib
import json
import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dtrain.optim.guard import flagged_ranks
from dtrain.strategies.dp_options import DDPOptions, DPOptions
from dtrain.training.context import TrainContext
from dtrain.training.loop import Position

if TYPE_CHECKING:
    from dtrain.training.checkpointing import RunCheckpointer


__all__ = ["DataParallelAdapter", "measure_noise"]


def measure_noise(ctx: TrainContext, engine: Any, model: nn.Module, batch: int, world: int) -> dict[str, Any]:
    """The step's gradient noise scale (:mod:`dtrain.training.noise_scale`): this rank's squared gradient
    norm before averaging (the reducer's), all-reduced to the workers' mean (one scalar), and the averaged
    gradient's; both unscaled (fp16). Updates ``ctx.batches.noise``; the metrics row's keys."""
    import torch.distributed as dist

    noise = ctx.batches.noise
    assert noise is not None
    local = engine.local_grad_sq()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    big = float(sum(torch.stack(torch._foreach_norm(grads)).double().pow(2))) if grads else 0.0
    values = [local if local is not None else math.nan]
    cost = ctx.batches.step_cost  # --auto-rule time: this rank's step cost rides along, so every rank decides alike
    if cost is not None:
        values.extend(cost.own or (math.nan, math.nan))
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)  # gloo: every rank gets the same sum, so every rank the same estimate
    out: dict[str, Any] = {}
    if cost is not None:
        cost.agree(float(t[1]) / world, float(t[2]) / world)
        if cost.agreed is not None:
            out.update(step_fixed_s=cost.agreed[0], sample_s=cost.agreed[1])
    small = float(t[0]) / world / ctx.loss_scale**2  # the reducer saw the scaled gradients
    if not (math.isfinite(small) and math.isfinite(big)):
        return {"b_simple": noise.b_simple, **out}
    noise.update(small, big, b_small=batch // world, b_big=batch // world * world)
    return {"b_simple": noise.b_simple, "noise_g2": noise.g2, "noise_trace": noise.trace_sigma, **out}


def _ring_bytes(model: nn.Module, world: int, wire: torch.dtype | None = None) -> int:
    """What a ring all-reduce of the gradients sends per rank (``wire``: the dtype they travel in)."""
    n = sum(
        p.numel() * (torch.tensor([], dtype=wire).element_size() if wire else p.element_size())
        for p in model.parameters()
    )
    return int(2 * (world - 1) / world * n) if world > 1 else 0


class DataParallelAdapter:
    """One data-parallel worker for :func:`~dtrain.training.loop.run_loop`: dtrain's or torch's DDP, adapted to
    the loop's :class:`~dtrain.training.loop.LoopAdapter` protocol."""

    eval_note = ""

    def __init__(self, ctx: TrainContext, ckpt: RunCheckpointer | None, *, torch_ddp: bool) -> None:
        self.ctx, self.ckpt = ctx, ckpt
        world = ctx.world_size
        self.model = ctx.make_model()
        self.optimizer = ctx.make_optimizer(self.model.parameters())
        self.evaluator = ctx.rank == 0
        self.shard, self.num_shards, self.samples_scale = ctx.rank, world, world
        self.total_steps = ctx.total_steps(world)
        self._pending: dict[str, Any] | None = None
        self._batch = ctx.cfg.batch_size  # the step's global batch
        self._noise: dict[str, Any] = {}  # the step's noise-scale figures
        self._engine: Any = None  # dtrain.DataParallel (None under torch DDP)
        self.wrapped: nn.Module = self.model
        self.steps_in_optimizer = False
        if torch_ddp:
            if world > 1:
                assert isinstance(ctx.cfg.options, DDPOptions)
                ddp = nn.parallel.DistributedDataParallel(self.model, bucket_cap_mb=ctx.cfg.options.bucket_mb)
                if ctx.precision.dtype is not None:  # 16-bit compute: DDP's own 16-bit gradient hooks
                    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as hooks

                    ddp.register_comm_hook(
                        None, hooks.fp16_compress_hook if ctx.precision.scales_loss else hooks.bf16_compress_hook
                    )
                self.wrapped = ddp
            return
        from dtrain.data_parallel import DataParallel

        o = ctx.cfg.options
        assert isinstance(o, DPOptions)
        self.steps_in_optimizer = o.overlap == "forward"
        self._engine = DataParallel(
            self.model,
            algorithm=o.algorithm,
            bucket_mb=o.bucket_mb,
            overlap=o.overlap,
            timeout_s=ctx.cfg.timeout_s,
            compression=ctx.make_compressor(),
            optimizer=self.optimizer if self.steps_in_optimizer else None,
        )
        self.wrapped = self._engine
        if ctx.batches.noise is not None:
            self._engine.measure_local_norms()

    def start(self) -> Position:
        if self.ckpt is None or self.ckpt.resume_from is None:
            return Position()
        info, blob = self.ckpt.restore(model=self.model, optimizer=self.optimizer)
        if self._engine is not None:
            self._engine.load_compressor_state_dict(blob["engine"])
        start = int(info["step"])
        return Position(start, *self.ctx.locate(start, self.num_shards), rng=blob)

    def done(self, step: int) -> bool:
        if self.ctx.batches.plan.auto:  # the batch grows as training goes: so does the epochs' step count
            self.total_steps = self.ctx.total_steps(self.num_shards)
        return step >= self.total_steps

    def before_step(self, step: int) -> None:
        self.ctx.schedule_lr(self.optimizer, step, self.total_steps)
        self._batch = self.ctx.batches.plan.batch_at(step, self.num_shards)
        if not self.steps_in_optimizer:
            self.optimizer.zero_grad(set_to_none=False)

    def forward(self, x: Any) -> torch.Tensor:
        out: torch.Tensor = self.wrapped(x)
        return out

    def update(self) -> None:
        if self.ctx.batches.noise is not None:
            self._noise = measure_noise(self.ctx, self._engine, self.model, self._batch, self.num_shards)
        if not self.steps_in_optimizer:
            with self.ctx.tracer.span("optimizer"):
                self.optimizer.step()

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.model.named_parameters())

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """``--grad-accum``'s micro-steps before the last: the wrapper's ``no_sync()`` (its backward hooks do
        not reduce; the last micro-step's backward averages the sum); nothing to hold back on one process."""
        quiet = getattr(self.wrapped, "no_sync", None)
        return quiet() if quiet is not None else contextlib.nullcontext()

    def clip_grad_norm(self, max_norm: float) -> float:
        """``--clip-grad-norm``: every rank holds the same averaged gradient, so torch's own rule on it."""
        return float(nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))

    def agree(self, bad: bool) -> list[int]:
        # every rank holds the same averaged gradients, but its loss is its own shard's: one tiny all-reduce
        return flagged_ranks(bad)

    def skip(self) -> None:
        return None  # nothing applied; before_step zeroes the gradients

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _complete(self, row: dict[str, Any]) -> dict[str, Any]:
        """A step's row with the engine's figures (DDP reports none: ring bytes, nulls)."""
        dt = row.pop("step_s")
        if self._engine is None:
            sent = _ring_bytes(self.model, self.num_shards, self.ctx.precision.dtype)  # DDP's hook: 16-bit under it
            row.update(compute_s=dt, comm_s=None, wait_s=None, bytes_sent=sent)
            return row
        st = self._engine.step_stats()
        wait_s = float(st.get("wait_s", 0.0))
        row.update(
            compute_s=float(st.get("compute_s", dt - wait_s)),
            comm_s=st.get("comm_s"),
            wait_s=wait_s,
            bytes_sent=int(st.get("bytes_sent", 0)),
        )
        return row

    def rows(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        if self.ctx.batches.noise is not None:
            row.update(batch=self._batch, **self._noise)
        if not self.steps_in_optimizer:
            return [self._complete(row)]
        # this step's buckets finish during the next forward: its figures come one step later
        prev, self._pending = self._pending, row
        return [self._complete(prev)] if prev is not None else []

    def synchronize(self) -> list[dict[str, Any]]:
        if self._engine is None:
            return []
        self._engine.synchronize()  # overlap="forward": the last step's buckets are still being applied
        prev, self._pending = self._pending, None
        return [self._complete(prev)] if prev is not None else []

    def save(self, ckpt: RunCheckpointer, step: int, epoch: int, batch: int) -> None:
        """Model, optimizer, and per rank the engine's compressor state and RNGs."""
        if self._engine is not None:
            self._engine.synchronize()
        state = self._engine.compressor_state_dict() if self._engine is not None else None
        epoch, batch = self.ctx.locate(step, self.num_shards)  # the next batch to train on
        ckpt.save(
            step, model=self.model, optimizer=self.optimizer, rank_state={"engine": state}, epoch=epoch, batch=batch
        )

    def finish(self) -> dict[str, Any]:
        rows = (json.loads(line) for line in self.ctx.metrics.path.read_text().splitlines())
        return {"bytes_sent": sum(r["bytes_sent"] for r in rows)}
