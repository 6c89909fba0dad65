"""A throw-away strategy for tests/test_strategy_seam.py: every worker trains alone, no communication.

This module plus its ``register`` call is all it takes (DTRAIN_STRATEGY_MODULES=_toy_strategy
makes every process of a run import it). Each worker keeps its own model, so its checkpoint
is per rank (``rank_state``), not the replicated model that DCP writes once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

from dtrain.perfmodel.hooks import Memory, ModelHooks, PlanSpace, Prediction, StepInputs
from dtrain.registry import Choice, Strategy, StrategyOptions, register
from dtrain.training.context import ProcessHooks, TrainContext
from dtrain.training.loop import Position, run_loop


@dataclass(frozen=True)
class AloneOptions(StrategyOptions):
    """``--strategy alone``: each worker trains its own copy on its own shard."""

    report_every: int = field(default=1, metadata={"help": "unused by training; shows a toy option flag"})

    def __post_init__(self) -> None:
        if self.report_every < 1:
            raise ValueError(f"report_every must be >= 1, got {self.report_every}")

    def label(self, workers: int) -> str:
        return f"alone x{workers}"

    def approximation(self) -> str:
        return "approximate: no averaging at all"


class AloneEngine:
    eval_note = " (rank 0's own model)"
    samples_scale = 1

    def __init__(self, ctx: TrainContext, ckpt: Any) -> None:
        self.ctx, self.ckpt = ctx, ckpt
        self.model = ctx.make_model()
        self.optimizer = ctx.make_optimizer(self.model.parameters())
        self.evaluator = ctx.rank == 0
        self.shard, self.num_shards = ctx.rank, ctx.world_size
        self.total_steps = ctx.total_steps(ctx.world_size)
        self._spe = ctx.steps_per_epoch(ctx.world_size)

    def start(self) -> Position:
        if self.ckpt is None or self.ckpt.resume_from is None:
            return Position()
        info, blob = self.ckpt.restore()
        self.model.load_state_dict(blob["model"])
        self.optimizer.load_state_dict(blob["optimizer"])
        step = int(info["step"])
        return Position(step, step // self._spe, step % self._spe, rng=blob)

    def done(self, step: int) -> bool:
        return step >= self.total_steps

    def before_step(self, step: int) -> None:
        self.optimizer.zero_grad()

    def forward(self, x: Any) -> torch.Tensor:
        return self.model(x)  # type: ignore[no-any-return]

    def update(self) -> None:
        self.optimizer.step()

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def rows(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        dt = row.pop("step_s")
        return [dict(row, compute_s=dt, comm_s=0.0, wait_s=0.0, bytes_sent=0)]

    def synchronize(self) -> list[dict[str, Any]]:
        return []

    def save(self, ckpt: Any, step: int, epoch: int, batch: int) -> None:
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        ckpt.save(step, rank_state=state, epoch=epoch, batch=batch)

    def finish(self) -> dict[str, Any]:
        return {"bytes_sent": 0, "summary_extra": {"alone": json.dumps({"rank": self.ctx.rank})}}


def _run(ctx: TrainContext) -> dict[str, Any]:
    from dtrain.training.checkpointing import RunCheckpointer

    ckpt = RunCheckpointer.create(ctx.cfg, ctx.out_dir)
    return run_loop(ctx, AloneEngine(ctx, ckpt), ckpt)


def _predict(prof: Any, c: Any, s: Choice, comp: Any, inp: StepInputs) -> Prediction:
    step = sum(inp.fwd) + sum(inp.bwd) + inp.opt + inp.overhead
    return Prediction(
        s,
        step,
        prof.batch * s.workers / step,
        step - inp.overhead,
        0.0,
        0.0,
        0.0,
        0.0,
        inp.memory,
        inp.fits,
        "compute only: every worker alone",
    )


def _memory(prof: Any, s: Choice, comp: Any) -> Memory:
    p = float(prof.param_bytes)
    return Memory(params=p, grads=p, optimizer=p, activations=prof.activation_bytes + prof.input_bytes)


def _candidates(space: PlanSpace) -> list[Choice]:
    return [] if space.exact_only or space.workers < 2 else [Choice("alone", space.workers)]


ALONE = register(
    Strategy(
        name="alone",
        options=AloneOptions,
        help="every worker trains alone (a test's toy)",
        hooks=(
            ProcessHooks(run=_run),
            ModelHooks(predict=_predict, memory=_memory, candidates=_candidates),
        ),
    )
)
