"""The loop adapter of ``dtrain run --strategy dp --shard optimizer|gradients|parameters`` (ZeRO 1-3).

The data-parallel adapter with :class:`dtrain.ShardedDataParallel` in place of
:class:`dtrain.DataParallel`: the optimizer steps this rank's shards, the guard checks
the shards' gradients, checkpoints hold each rank's segments as DTensors (so a run
resumes on another number of workers: DCP reshards), and the summary gets each rank's
memory by kind.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dtrain.strategies.dp_adapter import DataParallelAdapter
from dtrain.strategies.dp_options import DPOptions
from dtrain.training.context import TrainContext
from dtrain.training.loop import Position

if TYPE_CHECKING:
    from dtrain.training.checkpointing import RunCheckpointer

__all__ = ["ShardedAdapter"]


class _SavedBytes:
    """Bytes autograd saves for backward during one forward: the activation memory of a step."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.now += t.numel() * t.element_size()
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def hooks(self) -> Any:
        self.now = 0
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def done(self) -> None:
        self.peak = max(self.peak, self.now)


class ShardedAdapter(DataParallelAdapter):
    """One ZeRO worker for :func:`~dtrain.training.loop.run_loop`."""

    def __init__(self, ctx: TrainContext, ckpt: RunCheckpointer | None) -> None:
        from dtrain.sharded import ShardedDataParallel

        o = ctx.cfg.options
        assert isinstance(o, DPOptions) and o.sharded
        self.ctx, self.ckpt = ctx, ckpt
        world = ctx.world_size
        self.model = ctx.make_model()
        self.evaluator = ctx.rank == 0
        self.shard, self.num_shards, self.samples_scale = ctx.rank, world, world
        self.total_steps = ctx.total_steps(world)
        self._pending: dict[str, Any] | None = None
        self.steps_in_optimizer = False
        self.sdp = ShardedDataParallel(
            self.model,
            shard=o.shard,
            algorithm=o.algorithm,
            overlap=o.overlap,
            timeout_s=ctx.cfg.timeout_s,
            grad_dtype=ctx.precision.dtype,
        )
        self._engine: Any = self.sdp
        self.wrapped: nn.Module = self.sdp
        self.optimizer = ctx.make_optimizer(self.sdp.parameters())
        self._saved = _SavedBytes()
        self._mem_peak: dict[str, int] = {}

    def start(self) -> Position:
        if self.ckpt is None or self.ckpt.resume_from is None:
            return Position()
        from dtrain.sharded.state import load_sharded_state, sharded_state

        template = sharded_state(self.sdp, self.optimizer)
        info, blob = self.ckpt.restore(sharded=template)
        load_sharded_state(self.sdp, self.optimizer, template)
        start = int(info["step"])
        return Position(start, *self.ctx.locate(start, self.num_shards), rng=blob)

    def before_step(self, step: int) -> None:
        self.ctx.schedule_lr(self.optimizer, step, self.total_steps)
        self.optimizer.zero_grad(set_to_none=True)

    def forward(self, x: Any) -> torch.Tensor:
        with self._saved.hooks():
            out: torch.Tensor = self.wrapped(x)
        self._saved.done()
        return out

    def update(self) -> None:
        with self.ctx.tracer.span("optimizer"):
            self.optimizer.step()
        for k, v in self.sdp.memory_stats(self.optimizer).items():  # after the step: Adam's state exists
            self._mem_peak[k] = max(self._mem_peak.get(k, 0), v)

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.sdp.named_parameters())  # the guard checks each rank's reduced shard gradients

    def clip_grad_norm(self, max_norm: float) -> float:
        """``--clip-grad-norm``: the norm over every rank's shard (the local sum of squares, all-reduced)."""
        return float(self.sdp.clip_grad_norm_(max_norm))

    def save(self, ckpt: RunCheckpointer, step: int, epoch: int, batch: int) -> None:
        """Each rank's segments of the parameters and optimizer state (DTensors), and its RNGs."""
        from dtrain.sharded.state import sharded_state

        self.sdp.synchronize()
        epoch, batch = self.ctx.locate(step, self.num_shards)  # the next batch to train on
        ckpt.save(
            step, rank_state={"engine": None}, sharded=sharded_state(self.sdp, self.optimizer), epoch=epoch, batch=batch
        )

    def finish(self) -> dict[str, Any]:
        out = super().finish()
        mem = dict(self._mem_peak)
        mem["activations"] = self._saved.peak
        mem["model_state"] = mem.get("params", 0) + mem.get("grads", 0) + mem.get("optimizer", 0)
        out["memory"] = mem
        return out
