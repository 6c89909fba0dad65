"""``pipeline``: the model cut into one stage per worker, micro-batches played through a schedule.

Every worker builds the whole model, keeps its stage (:class:`dtrain.Pipeline`) and
reads the whole batch (only the first stage uses the inputs and the last the
targets). dtrain's own models are cut between their children; a user's model (``FILE.py:FN``,
``hf:gpt2``, ``hf:llama``, ...) between the blocks of its list of repeated blocks, each stage running the
model's own forward on the token ids (:mod:`dtrain.pipeline.staged`); ``--split-points`` names the children
or blocks that start the stages after the first. The evaluated model is the stages' parameters gathered on rank 0 (a
message from every stage at each evaluation).

Checkpoints (``--checkpoint-every``, ``--resume``, and so ``--max-restarts``): each stage saves its own
layers' parameters and optimizer state under the whole model's names (DCP writes every rank's keys into
one checkpoint), with its RNGs and the cut; a resume cuts the model where the checkpoint did. Same number
of workers, schedule and chunks only; 2bw is refused (between steps it holds deferred backwards and two
weight versions).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dtrain.checkpoint.layout import read_info
from dtrain.config.schema import ConfigHooks
from dtrain.errors import ConfigError, check_choice
from dtrain.optim.guard import flagged_ranks
from dtrain.perfmodel import pipeline as pipeline_model
from dtrain.perfmodel.hooks import ModelHooks, PlanSpace
from dtrain.registry import Choice, Strategy, StrategyOptions, register
from dtrain.training.context import ProcessHooks, TrainContext
from dtrain.training.loop import Position, run_loop
from dtrain.workloads.data import first_samples

if TYPE_CHECKING:
    from dtrain.config.schema import RunConfig
    from dtrain.pipeline.pipe import Pipeline
    from dtrain.training.checkpointing import RunCheckpointer

__all__ = ["PipelineOptions", "PipelineAdapter", "PipelineEngine", "PIPELINE"]

_SCHEDULES = ("gpipe", "1f1b", "interleaved", "2bw")
_RECOMPUTE = ("never", "except_last", "always")


def parse_balance(spec: str) -> str | list[int]:
    """``"equal"``, ``"params"``, ``"memory"``, ``"time"`` or layer counts ``"2,3,2"``."""
    if spec in ("equal", "params", "memory", "time"):
        return spec
    try:
        counts = [int(p) for p in spec.split(",")]
    except ValueError:
        raise ConfigError(f"balance {spec!r}: equal, params, memory, time or layer counts such as 2,3,2") from None
    return counts


@dataclass(frozen=True)
class PipelineOptions(StrategyOptions):
    """Options of ``--strategy pipeline`` (:class:`dtrain.Pipeline`).

    Attributes:
        microbatches: micro-batches per step (must divide the batch).
        schedule: gpipe, 1f1b, interleaved or 2bw (PipeDream-2BW, asynchronous).
        chunks: virtual stages per worker for the interleaved schedule.
        balance: how the model is cut: equal, params, memory, time, or layer counts "2,3,2".
        recompute: activation recomputation: never, except_last, always (torch.utils.checkpoint).
        split_points: the children (or a user model's blocks, ``model.layers.2``) that start the stages after
            the first, comma-separated, instead of ``balance``.
        checkpoint: recompute's name before it was renamed (it read as saving checkpoints, beside
            ``--checkpoint-every``); a configuration written then still loads, its value moved to ``recompute``.
    """

    microbatches: int = field(default=4, metadata={"help": "micro-batches per step (default: 4)"})
    schedule: str = field(default="1f1b", metadata={"choices": _SCHEDULES, "help": "pipeline schedule"})
    chunks: int = field(default=2, metadata={"help": "virtual stages per worker, interleaved only (default: 2)"})
    balance: str = field(
        default="equal",
        metadata={"help": "the cut: equal, params, memory, time (profiled), or layer counts such as 2,3,2"},
    )
    recompute: str = field(
        default="never",
        metadata={
            "choices": _RECOMPUTE,
            "help": "recompute activations in "
            "backward instead of keeping them from forward: always, except_last (every micro-batch's but the "
            "last's) or "
            "never (default: never)",
        },
    )
    split_points: str = field(
        default="",
        metadata={
            "help": "the cut by name: the children, or a user model's blocks (model.layers.2), that start the "
            "stages after the first, comma-separated (default: none, cut by --balance)"
        },
    )
    checkpoint: str = field(default="", repr=False, compare=False, metadata={"renamed_to": "recompute"})

    def __post_init__(self) -> None:
        if self.checkpoint:  # written before the rename
            if self.recompute not in ("never", self.checkpoint):
                raise ConfigError(
                    f"checkpoint {self.checkpoint!r} is the old name of recompute "
                    f"({self.recompute!r}): give recompute only"
                )
            object.__setattr__(self, "recompute", self.checkpoint)
            object.__setattr__(self, "checkpoint", "")
        check_choice("schedule", self.schedule, _SCHEDULES)
        check_choice("recompute", self.recompute, _RECOMPUTE)
        if self.microbatches < 1:
            raise ConfigError(f"microbatches must be >= 1, got {self.microbatches}")
        if self.chunks < 1 or (self.schedule == "interleaved" and self.chunks < 2):
            raise ConfigError(f"chunks must be >= 2 for the interleaved schedule (>= 1 otherwise), got {self.chunks}")
        parse_balance(self.balance)

    def points(self) -> list[str]:
        """``split_points`` as a list of names."""
        return [p.strip() for p in self.split_points.split(",") if p.strip()]

    @property
    def virtual(self) -> int:
        """Virtual stages per worker."""
        return self.chunks if self.schedule == "interleaved" else 1

    def batch_shards(self, workers: int) -> int:
        return 1  # every stage sees the whole batch (the micro-batches split it)

    def checkpoint_keys(self) -> dict[str, Any]:
        return {"schedule": self.schedule, "balance": self.balance, "chunks": self.virtual}

    def refuses_grad_accum(self, workers: int) -> str:
        return (
            f"already accumulates a step's gradients over its {self.microbatches} micro-batches: for smaller "
            f"micro-batches of the same batch use --microbatches {self.microbatches} x N instead"
        )

    def refuses_clip_grad_norm(self, workers: int) -> str:
        if self.schedule == "2bw":
            return "--schedule 2bw applies a batch's gradients a step later; clip under gpipe, 1f1b or interleaved"
        return ""  # each stage's sum of squares, all-reduced over the stages

    def to_table(self) -> dict[str, Any]:
        return {k: v for k, v in super().to_table().items() if k != "checkpoint"}  # the old name: never written

    def approximation(self) -> str:
        return "approximate: gradients one weight version old (PipeDream-2BW)" if self.schedule == "2bw" else ""

    def pipeline_schedule(self) -> tuple[str, int, int]:
        return self.schedule, self.microbatches, self.chunks if self.schedule == "interleaved" else 1

    def label(self, workers: int) -> str:
        v = f" v{self.chunks}" if self.schedule == "interleaved" else ""
        return f"pipeline {self.schedule}{v} M{self.microbatches} x{workers}"


def _model_children(cfg: RunConfig) -> int:
    from dtrain.workloads.models import build_model, is_language_model
    from dtrain.workloads.models.gpt import resolve_gpt_config

    if is_language_model(cfg.model):
        layers: int = resolve_gpt_config(cfg.model, **cfg.gpt_overrides(), seq_len=cfg.seq_len).layers
        return layers + 3
    return len(build_model(cfg.model))


def cut_points(cfg: RunConfig) -> tuple[list[str] | None, str]:
    """The names a pipeline cuts between (a user model's blocks, a Sequential's children) and what they are,
    from the model built on the meta device (nothing allocated); None where that build fails (the worker's
    own build says why)."""
    from dtrain.pipeline.blocks import find_blocks
    from dtrain.pipeline.partition import PartitionError
    from dtrain.workloads.models import make_model

    data = cfg.load_data()
    try:
        with torch.device("meta"):
            model = make_model(
                cfg.model,
                tuple(data.input_shape),
                data.num_classes,
                task=data.task,
                model_args=cfg.model_args,
                seq_len=cfg.seq_len,
                **cfg.gpt_overrides(),
            )
    except ConfigError:
        raise
    except Exception:  # noqa: BLE001 - a function that cannot build on the meta device: the worker's build
        return None, ""
    if isinstance(model, nn.Sequential):
        return [n for n, _ in model.named_children()], f"the children of model {cfg.model}"
    try:
        name, blocks = find_blocks(model)
    except PartitionError as e:
        raise ConfigError(f"pipeline: {e}") from None
    what = f"{name} of model {cfg.model} ({type(model).__name__}, blocks {type(blocks[0]).__name__})"
    return [f"{name}.{i}" for i in range(len(blocks))], what


def _check_cut(o: PipelineOptions, cfg: RunConfig, stages: int) -> None:
    """Enough cut points for the stages, split points that name them, layer counts that add up."""
    from dtrain.pipeline.blocks import split_sizes
    from dtrain.pipeline.partition import PartitionError
    from dtrain.workloads.models.specs import is_builtin

    if is_builtin(cfg.model) and not o.points():
        names: list[str] | None = [str(i) for i in range(_model_children(cfg))]
        what = f"model {cfg.model}'s layers (children)"
    else:
        names, what = cut_points(cfg)
    if names is None:
        return
    if len(names) < stages:
        raise ConfigError(
            f"pipeline: {what}: {len(names)} to cut between, fewer than the {stages} stages of "
            f"{cfg.workers} workers x {o.virtual}; use fewer workers (or chunks), or a model with more layers"
        )
    if o.points():
        try:
            split_sizes(names, o.points(), stages, what)
        except PartitionError as e:
            raise ConfigError(f"pipeline: {e}") from None
        return
    counts = parse_balance(o.balance)
    if isinstance(counts, list) and (len(counts) != stages or sum(counts) != len(names) or min(counts) < 1):
        raise ConfigError(
            f"pipeline: balance {o.balance} must give {stages} positive layer counts summing to {len(names)}"
        )


def _check(o: PipelineOptions, cfg: RunConfig) -> None:
    from dtrain.pipeline.schedules import ScheduleError, generate

    if cfg.precision == "fp16" and o.schedule == "2bw":
        raise ConfigError(
            "--precision fp16 with --schedule 2bw: 2bw applies a batch's gradients a step later, "
            "under another step's loss scale; use --precision bf16 or another schedule"
        )
    if cfg.batch_size % o.microbatches:
        raise ConfigError(
            f"pipeline: {o.microbatches} micro-batches do not divide the batch of {cfg.batch_size}; "
            f"use --batch-size a multiple of {o.microbatches}"
        )
    _check_cut(o, cfg, cfg.workers * o.virtual)
    try:
        generate(o.schedule, cfg.workers, o.microbatches, o.virtual)
    except (ScheduleError, ValueError) as e:
        raise ConfigError(f"pipeline: {e}") from None


def _check_checkpointing(o: PipelineOptions, cfg: RunConfig) -> None:
    if o.schedule == "2bw":
        raise ConfigError(
            "checkpoints of a pipeline run with --schedule 2bw are not supported: between steps it "
            "holds a batch's deferred backwards and two versions of each stage's weights; use "
            "gpipe, 1f1b or interleaved"
        )


class PipelineAdapter:
    """One stage of the pipeline for :func:`~dtrain.training.loop.run_loop` (a ``WholeStep`` engine)."""

    eval_note = " (the stages gathered on rank 0)"

    def __init__(self, ctx: TrainContext, ckpt: RunCheckpointer | None = None) -> None:
        from dtrain.pipeline.pipe import Pipeline

        o = ctx.cfg.options
        assert isinstance(o, PipelineOptions)
        self.ctx, self.o, self.ckpt = ctx, o, ckpt
        model = ctx.make_model()
        # a module that is not an nn.Sequential is cut in place: rank 0 evaluates a whole copy of it
        whole = isinstance(model, nn.Sequential) or ctx.rank != 0
        self.model = model if whole else copy.deepcopy(model)
        x0 = first_samples(ctx.data.train, max(1, ctx.cfg.batch_size // o.microbatches))[0].to(ctx.device)
        self.pipe: Pipeline = Pipeline(
            model,
            o.microbatches,
            o.schedule,
            loss_fn=ctx.scaled_loss,
            balance=self._balance(),
            checkpoint=o.recompute,
            chunks=o.chunks,
            sample=x0,
            timeout=ctx.cfg.timeout_s,
            tracer=ctx.tracer,
            split_points=o.points() if self.ckpt is None or self.ckpt.resume_from is None else (),
        )
        params = list(self.pipe.parameters())  # a stage of parameter-free layers (pooling, flatten) has none
        self.optimizer = ctx.make_optimizer(params) if params else None
        self.evaluator = ctx.rank == 0
        self.shard, self.num_shards, self.samples_scale = 0, 1, 1  # every stage reads the whole batch
        self.total_steps = ctx.total_steps(1)
        self._sent = 0
        self._flushes = 0
        self._compute: list[float] = []  # this rank's compute seconds per step

    def _balance(self) -> str | list[int]:
        """The cut: ``--balance``'s, or a resumed checkpoint's own (``time`` would profile anew and may cut
        elsewhere, and each stage's checkpoint holds the layers of its cut)."""
        if self.ckpt is not None and self.ckpt.resume_from is not None:
            cut = read_info(self.ckpt.resume_from).get("cut")
            if isinstance(cut, list):
                return [int(n) for n in cut]
        return parse_balance(self.o.balance)

    def _stateful(self) -> nn.Module | None:
        """This rank's stage module, or None where its layers hold no state (pooling, activations)."""
        return self.pipe.module if self.pipe.module.state_dict() else None

    def start(self) -> Position:
        if self.ckpt is None or self.ckpt.resume_from is None:
            return Position()
        # each stage loads its own layers' parameters and optimizer state (keys are the whole model's names)
        info, blob = self.ckpt.restore(model=self._stateful(), optimizer=self.optimizer)
        start = int(info["step"])
        return Position(start, *self.ctx.locate(start, 1), rng=blob)

    def done(self, step: int) -> bool:
        return step >= self.total_steps

    def before_step(self, step: int) -> None:
        if self.optimizer is not None:
            self.ctx.schedule_lr(self.optimizer, step, self.total_steps)
            self.optimizer.zero_grad(set_to_none=True)  # 2bw's first step leaves no gradient: no update

    def train_step(self, x: Any, y: Any) -> float:
        with self.ctx.tracer.span("pipeline"):
            return self.pipe.step(x, y) / self.ctx.loss_scale  # fp16: the loss was scaled for backward

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.pipe.named_parameters())  # this stage's, named as in the whole model

    def agree(self, bad: bool) -> list[int]:
        # every stage has the same loss, but its own stage's gradients: one tiny all-reduce over the stages
        return flagged_ranks(bad)

    def skip(self) -> None:
        return None  # nothing applied; before_step drops the gradients

    def clip_grad_norm(self, max_norm: float) -> float:
        """``--clip-grad-norm``: each stage's sum of squares of its own layers' gradients, all-reduced over the
        stages (one float64 scalar), the norm of the whole model's gradient."""
        import torch.distributed as dist

        from dtrain.training.accumulate import clip_, gradients_of

        shared = {id(p): ranks for p, ranks in self.pipe.shared_parameters()}  # counted on their first holder
        mine = [p for p in self.pipe.parameters() if shared.get(id(p), [self.ctx.rank])[0] == self.ctx.rank]
        rest = [p for p in self.pipe.parameters() if shared.get(id(p), [self.ctx.rank])[0] != self.ctx.rank]
        grads = list(gradients_of(mine))
        norm = clip_(grads, max_norm, reduce=dist.all_reduce if dist.is_initialized() else None)
        coef = min(1.0, max_norm / (norm + 1e-6))  # the copies held elsewhere too: scaled as their first holder's
        if coef < 1.0:
            for g in gradients_of(rest):
                g.mul_(coef)
        return norm

    def forward(self, x: Any) -> torch.Tensor:
        raise ConfigError("a pipeline runs whole steps (train_step); forward alone is its evaluation")

    def update(self) -> None:
        if self.optimizer is not None:
            with self.ctx.tracer.span("optimizer"):
                self.optimizer.step()

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer is not None else self.ctx.cfg.lr

    def rows(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        dt = row.pop("step_s")
        st = self.pipe.last_stats
        assert st is not None
        sent = self.pipe.transport.stats.bytes_sent
        row.update(
            compute_s=st.compute_s,
            comm_s=None,
            wait_s=st.wait_s,
            idle_s=max(0.0, dt - st.compute_s),
            bubble=max(0.0, dt - st.compute_s) / dt if dt > 0 else 0.0,
            bytes_sent=sent - self._sent,
            stage=self.pipe.stage,
        )
        self._sent = sent
        if row["step"] > 0:  # the first step exchanges shapes and warms up
            self._compute.append(st.compute_s)
        return [row]

    def synchronize(self) -> list[dict[str, Any]]:
        """2bw: finish the deferred backwards and apply that batch; then gather the stages on rank 0."""
        if self.o.schedule == "2bw":
            if self.pipe.flush() and self.optimizer is not None:
                self._flushes += 1
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
        full = self.pipe.full_state_dict(dst=0)
        if full is not None:
            self.model.load_state_dict(full)
        return []

    def save(self, ckpt: RunCheckpointer, step: int, epoch: int, batch: int) -> None:
        """Each stage's parameters and optimizer state under the whole model's names (DCP writes every rank's
        own keys), RNGs per rank, and the cut, so that a resume cuts the model where this run did."""
        epoch, batch = self.ctx.locate(step, 1)  # the next batch to train on
        ckpt.save(
            step,
            model=self._stateful(),
            optimizer=self.optimizer,
            rank_state={},
            epoch=epoch,
            batch=batch,
            cut=list(self.pipe.sizes),
        )

    def finish(self) -> dict[str, Any]:
        """Result keys: bytes sent, the cut and per stage its peak micro-batches in flight; the batch's
        samples are counted once (rank 0): every stage sees the same batch."""
        st = self.pipe.stats()
        common: dict[str, Any] = {
            "cut": self.pipe.sizes,
            "schedule": self.o.schedule,
            "microbatches": self.o.microbatches,
            "flush_updates": self._flushes,
            "stage_params": self.pipe.stage_params,
        }
        per_mb = sum(self._compute) / max(1, len(self._compute)) / self.o.microbatches
        measured = self.pipe.gather_floats([per_mb])  # collective: each rank's busy time per micro-batch
        if measured is not None:
            common["measured_stage_s"] = [m[0] for m in measured]
            if self.pipe.predicted_s is not None:
                common["predicted_stage_s"] = self.pipe.predicted_s
            if self.o.virtual == 1 and self.ctx.cfg.progress:
                print(
                    f"pipeline cut ({self.o.balance}); times per micro-batch, forward + backward:\n"
                    + self.pipe.cut_table(common["measured_stage_s"])
                    + "\nparameters per stage: "
                    + ", ".join(f"{n:,}" for n in self.pipe.stage_params),
                    flush=True,
                )
        mine = {"rank": self.ctx.rank, "peak_in_flight": st["peak_in_flight"], "bytes_sent": int(st["bytes_sent"])}
        out: dict[str, Any] = {
            "bytes_sent": int(st["bytes_sent"]),
            "summary_extra": {"pipeline": common, f"stage{self.pipe.stage}": mine},
        }
        if self.ctx.rank != 0:
            out["samples"] = 0
        return out


PipelineEngine = PipelineAdapter  # the name older scripts import


def _run(ctx: TrainContext) -> dict[str, Any]:
    from dtrain.training.checkpointing import RunCheckpointer

    ckpt = RunCheckpointer.create(ctx.cfg, ctx.out_dir)  # (its group before the pipeline's, on every rank)
    return run_loop(ctx, PipelineAdapter(ctx, ckpt), ckpt)


CANDIDATE_MICROBATCHES = (4, 8)  # the micro-batches the planner tries


def _candidates(space: PlanSpace) -> list[Choice]:
    """The registry's ``candidates`` hook: one pipeline over all ``space.workers`` devices.

    gpipe, 1f1b and 2bw (not exact: left out with ``exact_only``) with ``M`` in (4, 8);
    interleaved with two chunks (the default) where ``M`` is a multiple of the workers (the schedule
    needs it). Only when the space asks for pipelines (``dtrain plan --pipeline``). Each is cut
    by time (``balance="time"``). The hook does not see the
    model: a pipeline with more stages than the model has layers, or an ``M`` that does
    not divide the batch, is left for :func:`dtrain.perfmodel.pipeline.predict` to reject.
    """
    w = space.workers
    if w < 2 or not space.pipeline:
        return []
    out: list[Choice] = []
    for m in CANDIDATE_MICROBATCHES:
        schedules = ["gpipe", "1f1b"] + ["interleaved"] * (m % w == 0) + ["2bw"] * (not space.exact_only)
        out += [Choice("pipeline", w, PipelineOptions(microbatches=m, schedule=s, balance="time")) for s in schedules]
    return out


PIPELINE = register(
    Strategy(
        name="pipeline",
        options=PipelineOptions,
        help="pipeline parallel: one stage per worker, micro-batches through gpipe, 1f1b, interleaved or 2bw",
        hooks=(
            ProcessHooks(run=_run),
            ConfigHooks(check=_check, check_checkpointing=_check_checkpointing),
            ModelHooks(predict=pipeline_model.predict, memory=pipeline_model.memory, candidates=_candidates),
        ),
    )
)
