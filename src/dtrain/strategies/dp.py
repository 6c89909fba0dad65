"""``dp`` (dtrain.DataParallel) and ``ddp`` (torch's DistributedDataParallel, the peer).

Synchronous data parallelism: every worker trains on its shard of the global
batch, gradients are averaged in buckets during backward, and every worker
applies the same update. ``dp`` reduces buckets with one of dtrain's allreduce
algorithms (or the backend's own), optionally compressed, with overlap in
backward or priority scheduling into the next forward; ``ddp`` is torch's DDP
on the same loop, the peer every figure is compared with.
"""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dtrain.data_parallel.options import ALGORITHMS, OVERLAPS, SHARD_ALGORITHMS, SHARDS
from dtrain.errors import ConfigError, check_choice
from dtrain.job.config import ConfigHooks
from dtrain.perfmodel.hooks import ModelHooks, PlanSpace
from dtrain.perfmodel.predict import (
    Memory,
    Prediction,
    StepInputs,
    buckets_of,
    data_parallel_memory,
    predict_data_parallel,
)
from dtrain.perfmodel.sharded import predict_sharded, sharded_memory
from dtrain.perfmodel.simulator import simulate_sync
from dtrain.registry import Choice, Strategy, StrategyOptions, register
from dtrain.strategies._common import CompressedOptions, check_fp16_exchange
from dtrain.training.context import ProcessHooks, TrainContext
from dtrain.training.guard import flagged_ranks
from dtrain.training.loop import Position, run_loop

# compressors without per-rank state: a plain dp checkpoint with them resumes on any number of workers
STATELESS_WIRE = ("none", "fp16", "bf16")

if TYPE_CHECKING:
    from dtrain.checkpoint.training import RunCheckpointer
    from dtrain.job.config import RunConfig
    from dtrain.perfmodel.collectives import CompressionModel
    from dtrain.perfmodel.profile import ModelProfile
    from dtrain.perfmodel.spec import ClusterSpec

__all__ = ["DPOptions", "DDPOptions", "DataParallelEngine", "DP", "DDP"]


@dataclass(frozen=True)
class DPOptions(CompressedOptions):
    """Options of ``--strategy dp`` (:class:`dtrain.DataParallel`).

    Attributes:
        algorithm: allreduce algorithm of each bucket (default: ring).
        bucket_mb: bucket size in MiB (default: 25, DDP's).
        overlap: "backward" (DDP-style) or "forward" (priority scheduling) (default: backward).
    """

    algorithm: str = field(default="ring", metadata={"choices": ALGORITHMS, "help": "allreduce algorithm"})
    bucket_mb: float = field(default=25.0, metadata={"help": "gradient bucket size in MiB (default: 25.0)"})
    overlap: str = field(default="backward", metadata={
        "choices": OVERLAPS, "help": "overlap communication with backward, or with the next forward (priority)"})
    shard: str = field(default="none", metadata={
        "choices": SHARDS, "help": "ZeRO sharding: optimizer (stage 1), gradients (2), parameters (3) (default: none)"})

    def __post_init__(self) -> None:
        check_choice("algorithm", self.algorithm, ALGORITHMS)
        check_choice("overlap", self.overlap, OVERLAPS)
        check_choice("shard", self.shard, SHARDS)
        if self.bucket_mb <= 0:
            raise ConfigError(f"bucket_mb must be > 0, got {self.bucket_mb}")
        super().__post_init__()
        if self.shard != "none":
            if self.algorithm not in SHARD_ALGORITHMS:
                raise ConfigError(
                    f"--shard {self.shard} reduce-scatters and allgathers with {' or '.join(SHARD_ALGORITHMS)}; "
                    f"--algorithm {self.algorithm} has no sharded form (use --algorithm ring)")
            if self.compressor_spec() != "none":
                raise ConfigError(f"--shard {self.shard} does not take --compression {self.compression}: "
                                  "a sharded engine reduce-scatters exact gradients; drop one of the two")

    @property
    def sharded(self) -> bool:
        return self.shard != "none"

    def checkpoint_keys(self) -> dict[str, Any]:
        keys = super().checkpoint_keys()
        if keys:
            keys["bucket_mb"] = self.bucket_mb  # the bucket layout keys the compressor state
        if self.sharded:
            keys["shard"] = self.shard  # a sharded checkpoint holds segments, not a model state dict
        return keys

    def measures_noise_scale(self, workers: int) -> bool:
        return not self.sharded and workers >= 2  # the reducer sees each worker's gradient before averaging

    def reshards(self) -> bool:
        # ZeRO: DCP reshards the segments. Plain dp: every rank holds the same model and optimizer state,
        # so any number of workers can take them, unless a compressor keeps per-rank state (residuals)
        return self.sharded or self.compression in STATELESS_WIRE

    def label(self, workers: int) -> str:
        ov = "" if self.overlap == "backward" else " fwd-overlap"
        zero = f" zero-{SHARDS.index(self.shard)}" if self.sharded else ""
        return f"dp {self.algorithm} {self.bucket_mb:g}MiB{ov}{zero}{self._comp_label()}"


@dataclass(frozen=True)
class DDPOptions(StrategyOptions):
    """Options of ``--strategy ddp`` (torch's DistributedDataParallel).

    Attributes:
        bucket_mb: DDP's ``bucket_cap_mb`` (default: 25).
    """

    bucket_mb: float = field(default=25.0, metadata={"help": "gradient bucket size in MiB (default: 25.0)"})

    def __post_init__(self) -> None:
        if self.bucket_mb <= 0:
            raise ConfigError(f"bucket_mb must be > 0, got {self.bucket_mb}")

    # what the performance model reads of a data-parallel strategy
    @property
    def algorithm(self) -> str:
        return "native"

    @property
    def overlap(self) -> str:
        return "backward"

    def label(self, workers: int) -> str:
        return f"torch DDP {self.bucket_mb:g}MiB"


def measure_noise(ctx: TrainContext, engine: Any, model: nn.Module, batch: int, world: int) -> dict[str, Any]:
    """The step's gradient noise scale (:mod:`dtrain.training.noise_scale`): this rank's squared gradient
    norm before averaging (the reducer's), all-reduced to the workers' mean (one scalar), and the averaged
    gradient's; both unscaled (fp16). Updates ``ctx.noise``; the metrics row's keys."""
    import torch.distributed as dist

    assert ctx.noise is not None
    local = engine.local_grad_sq()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    big = float(sum(torch.stack(torch._foreach_norm(grads)).double().pow(2))) if grads else 0.0
    values = [local if local is not None else math.nan]
    cost = ctx.step_cost  # --auto-rule time: this rank's step cost rides along, so every rank decides alike
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
        return {"b_simple": ctx.noise.b_simple, **out}
    ctx.noise.update(small, big, b_small=batch // world, b_big=batch // world * world)
    return {"b_simple": ctx.noise.b_simple, "noise_g2": ctx.noise.g2, "noise_trace": ctx.noise.trace_sigma, **out}


def _ring_bytes(model: nn.Module, world: int, wire: torch.dtype | None = None) -> int:
    """What a ring all-reduce of the gradients sends per rank (``wire``: the dtype they travel in)."""
    n = sum(p.numel() * (torch.tensor([], dtype=wire).element_size() if wire else p.element_size())
            for p in model.parameters())  # fmt: skip
    return int(2 * (world - 1) / world * n) if world > 1 else 0


class DataParallelEngine:
    """One data-parallel worker for :func:`~dtrain.training.loop.run_loop`: dtrain's or torch's DDP."""

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

                    ddp.register_comm_hook(None, hooks.fp16_compress_hook if ctx.precision.scales_loss
                                           else hooks.bf16_compress_hook)  # fmt: skip
                self.wrapped = ddp
            return
        from dtrain.data_parallel import DataParallel

        o = ctx.cfg.options
        assert isinstance(o, DPOptions)
        self.steps_in_optimizer = o.overlap == "forward"
        self._engine = DataParallel(self.model, algorithm=o.algorithm, bucket_mb=o.bucket_mb, overlap=o.overlap,
                                    timeout_s=ctx.cfg.timeout_s, compression=ctx.make_compressor(),
                                    optimizer=self.optimizer if self.steps_in_optimizer else None)  # fmt: skip
        self.wrapped = self._engine
        if ctx.noise is not None:
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
        if self.ctx.plan.auto:  # the batch grows as training goes: so does the epochs' step count
            self.total_steps = self.ctx.total_steps(self.num_shards)
        return step >= self.total_steps

    def before_step(self, step: int) -> None:
        self.ctx.schedule_lr(self.optimizer, step, self.total_steps)
        self._batch = self.ctx.plan.batch_at(step, self.num_shards)
        if not self.steps_in_optimizer:
            self.optimizer.zero_grad(set_to_none=False)

    def forward(self, x: Any) -> torch.Tensor:
        out: torch.Tensor = self.wrapped(x)
        return out

    def update(self) -> None:
        if self.ctx.noise is not None:
            self._noise = measure_noise(self.ctx, self._engine, self.model, self._batch, self.num_shards)
        if not self.steps_in_optimizer:
            with self.ctx.tracer.span("optimizer"):
                self.optimizer.step()

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.model.named_parameters())

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
        row.update(compute_s=float(st.get("compute_s", dt - wait_s)), comm_s=st.get("comm_s"), wait_s=wait_s,
                   bytes_sent=int(st.get("bytes_sent", 0)))  # fmt: skip
        return row

    def rows(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        if self.ctx.noise is not None:
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
        ckpt.save(step, model=self.model, optimizer=self.optimizer, rank_state={"engine": state},
                  epoch=epoch, batch=batch)  # fmt: skip

    def finish(self) -> dict[str, Any]:
        rows = (json.loads(line) for line in self.ctx.metrics.path.read_text().splitlines())
        return {"bytes_sent": sum(r["bytes_sent"] for r in rows)}


def _run(ctx: TrainContext, *, torch_ddp: bool) -> dict[str, Any]:
    from dtrain.checkpoint.training import RunCheckpointer

    ckpt = RunCheckpointer.create(ctx.cfg, ctx.out_dir)  # its group first: every rank creates groups in one order
    o = ctx.cfg.options
    if isinstance(o, DPOptions) and o.sharded:  # its engine derives from this module's (a run-time import)
        sharded = importlib.import_module("dtrain.strategies.sharded_dp").ShardedEngine
        return run_loop(ctx, sharded(ctx, ckpt), ckpt)
    return run_loop(ctx, DataParallelEngine(ctx, ckpt, torch_ddp=torch_ddp), ckpt)


def _run_dp(ctx: TrainContext) -> dict[str, Any]:
    return _run(ctx, torch_ddp=False)


def _run_ddp(ctx: TrainContext) -> dict[str, Any]:
    return _run(ctx, torch_ddp=True)


def _check(o: DPOptions, cfg: RunConfig) -> None:
    if cfg.device == "cuda" and (o.sharded or o.compressor_spec() not in STATELESS_WIRE):
        raise ConfigError(f"device cuda: dp trains there without --shard, with no compression or a 16-bit cast "
                          f"(fp16, bf16); got {o.label(cfg.workers)}")
    if cfg.precision == "fp16":
        check_fp16_exchange(o, cfg)
    if (cfg.noise_scale or cfg.batch_schedule == "auto") and o.overlap == "forward":
        raise ConfigError("the noise scale reads the averaged gradient after backward; --overlap forward applies "
                          "buckets as they arrive: use --overlap backward")  # fmt: skip

    if not cfg.skip_nonfinite:
        return
    if o.overlap == "forward":
        raise ConfigError("--skip-nonfinite cannot skip a step under --overlap forward: the engine applies each "
                          "bucket as soon as it is averaged, before the step can be checked; use --overlap backward")
    if o.compressor_spec() != "none":
        raise ConfigError(f"--skip-nonfinite cannot skip a step under --compression {o.compression}: the "
                          "compressor's state (error feedback, PowerSGD's Q) takes the gradient in during backward, "
                          "before the check, and a non-finite value would stay in it; run without one of them")


# ---------------------------------------------------------------------- performance model hooks


def _dp_options(s: Choice) -> DPOptions | DDPOptions:
    assert isinstance(s.options, (DPOptions, DDPOptions))
    return s.options


def _zero_stage(o: DPOptions | DDPOptions) -> int:
    """0 (plain data parallel) to 3 (parameters sharded): the ZeRO stage of ``--shard``."""
    return SHARDS.index(o.shard) if isinstance(o, DPOptions) else 0


def _predict(prof: ModelProfile, c: ClusterSpec, s: Choice, comp: CompressionModel, inputs: StepInputs) -> Prediction:
    o = _dp_options(s)
    if _zero_stage(o):
        return predict_sharded(prof, c, s, o, _zero_stage(o), inputs)
    return predict_data_parallel(prof, c, s, o, comp, inputs)


def _memory(prof: ModelProfile, s: Choice, comp: CompressionModel | None) -> Memory:
    stage = _zero_stage(_dp_options(s))
    return sharded_memory(prof, stage, s.workers) if stage else data_parallel_memory(prof, comp)


def _simulate(prof: ModelProfile, c: ClusterSpec, s: Choice, *args: Any) -> Any:
    return simulate_sync(prof, c, s, _dp_options(s), *args)


def _dp_candidates(space: PlanSpace) -> list[Choice]:
    w = space.workers
    out = [Choice("dp", 1)] if space.single else []
    if w < 2:
        return out
    c = space.cluster
    hier = c.nodes > 1 and c.devices_per_node > 1 and w > c.devices_per_node
    for alg in space.algorithms:
        if alg == "hierarchical" and not hier:
            continue
        out += [Choice("dp", w, DPOptions(algorithm=alg, bucket_mb=b)) for b in space.buckets]
    out.append(Choice("dp", w, DPOptions(bucket_mb=max(space.buckets), overlap="forward")))
    # ZeRO stages 1-3: what fits when plain data parallelism's model states do not
    out += [Choice("dp", w, DPOptions(bucket_mb=max(space.buckets), shard=shard)) for shard in SHARDS[1:]]
    if not space.exact_only:
        out += [Choice("dp", w, DPOptions(bucket_mb=max(space.buckets), compression=comp))
                for comp in space.compressions]  # fmt: skip
    return out


def _dp_identity(o: DPOptions, prof: ModelProfile) -> Hashable:
    # a bucket size that cuts the model into the same buckets as another is the same strategy
    return ("dp", o.algorithm, o.overlap, o.shard, o.compressor_spec(), tuple(buckets_of(prof, o.bucket_mb)))


def _ddp_identity(o: DDPOptions, prof: ModelProfile) -> Hashable:
    return ("ddp", tuple(buckets_of(prof, o.bucket_mb)))


def _ddp_candidates(space: PlanSpace) -> list[Choice]:
    if space.workers < 2 or not space.ddp:
        return []
    return [Choice("ddp", space.workers, DDPOptions(bucket_mb=max(space.buckets)))]


DP = register(Strategy(
    name="dp", options=DPOptions,
    help="data parallel: dtrain.DataParallel (allreduce algorithm, buckets, overlap, compression)",
    hooks=(
        ProcessHooks(run=_run_dp),
        ConfigHooks(check=_check),
        ModelHooks(predict=_predict, memory=_memory, simulate=_simulate, candidates=_dp_candidates,
                   identity=_dp_identity),
    ),
))
DDP = register(Strategy(
    name="ddp", options=DDPOptions,
    help="data parallel through torch DDP (the peer)",
    hooks=(
        ProcessHooks(run=_run_ddp),
        ModelHooks(predict=_predict, memory=_memory, simulate=_simulate, candidates=_ddp_candidates,
                   identity=_ddp_identity),
    ),
))
