"""``dp`` (dtrain.DataParallel) and ``ddp`` (torch's DistributedDataParallel, the peer).

Synchronous data parallelism: every worker trains on its shard of the global
batch, gradients are averaged in buckets during backward, and every worker
applies the same update. ``dp`` reduces buckets with one of dtrain's allreduce
algorithms (or the backend's own), optionally compressed, with overlap in
backward or priority scheduling into the next forward; ``ddp`` is torch's DDP
on the same loop, the peer every figure is compared with.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

from dtrain.config.schema import ConfigHooks
from dtrain.data_parallel.tunables import SHARDS
from dtrain.errors import ConfigError
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
from dtrain.registry import Choice, Strategy, register
from dtrain.strategies._common import check_fp16_exchange
from dtrain.strategies.dp_adapter import DataParallelAdapter
from dtrain.strategies.dp_options import STATELESS_WIRE, DDPOptions, DPOptions
from dtrain.strategies.sharded_dp import ShardedAdapter
from dtrain.training.context import ProcessHooks, TrainContext
from dtrain.training.loop import run_loop

if TYPE_CHECKING:
    from dtrain.config.schema import RunConfig
    from dtrain.perfmodel.collectives import CompressionModel
    from dtrain.perfmodel.profile import ModelProfile
    from dtrain.perfmodel.spec import ClusterSpec


__all__ = ["DPOptions", "DDPOptions", "DataParallelAdapter", "DataParallelEngine", "DP", "DDP"]

DataParallelEngine = DataParallelAdapter  # the name older scripts import


def _run(ctx: TrainContext, *, torch_ddp: bool) -> dict[str, Any]:
    from dtrain.training.checkpointing import RunCheckpointer

    ckpt = RunCheckpointer.create(ctx.cfg, ctx.out_dir)  # its group first: every rank creates groups in one order
    o = ctx.cfg.options
    if isinstance(o, DPOptions) and o.sharded:  # ZeRO: its adapter derives from dp's
        return run_loop(ctx, ShardedAdapter(ctx, ckpt), ckpt)
    return run_loop(ctx, DataParallelAdapter(ctx, ckpt, torch_ddp=torch_ddp), ckpt)


def _run_dp(ctx: TrainContext) -> dict[str, Any]:
    return _run(ctx, torch_ddp=False)


def _run_ddp(ctx: TrainContext) -> dict[str, Any]:
    return _run(ctx, torch_ddp=True)


def _check(o: DPOptions, cfg: RunConfig) -> None:
    if cfg.device == "cuda" and (o.sharded or o.compressor_spec() not in STATELESS_WIRE):
        raise ConfigError(
            f"device cuda: dp trains there without --shard, with no compression or a 16-bit cast "
            f"(fp16, bf16); got {o.label(cfg.workers)}"
        )
    if cfg.precision == "fp16":
        check_fp16_exchange(o, cfg)
    if (cfg.noise_scale or cfg.batch_schedule == "auto") and o.overlap == "forward":
        raise ConfigError(
            "the noise scale reads the averaged gradient after backward; --overlap forward applies "
            "buckets as they arrive: use --overlap backward"
        )

    if not cfg.skip_nonfinite:
        return
    if o.overlap == "forward":
        raise ConfigError(
            "--skip-nonfinite cannot skip a step under --overlap forward: the engine applies each "
            "bucket as soon as it is averaged, before the step can be checked; use --overlap backward"
        )
    if o.compressor_spec() != "none":
        raise ConfigError(
            f"--skip-nonfinite cannot skip a step under --compression {o.compression}: the "
            "compressor's state (error feedback, PowerSGD's Q) takes the gradient in during backward, "
            "before the check, and a non-finite value would stay in it; run without one of them"
        )


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
        out += [
            Choice("dp", w, DPOptions(bucket_mb=max(space.buckets), compression=comp)) for comp in space.compressions
        ]
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


def _parse_dp(args: Sequence[str], compression: str, workers: int) -> Choice:
    """``dp:ALGORITHM[:BUCKET_MB]`` (default ring, 25 MB)."""
    alg = args[0] if args else "ring"
    bucket = float(args[1]) if len(args) > 1 else 25.0
    return Choice("dp", workers, DPOptions(algorithm=alg, bucket_mb=bucket, compression=compression))


def _parse_ddp(args: Sequence[str], compression: str, workers: int) -> Choice:
    return Choice("ddp", workers, DDPOptions())


DP = register(
    Strategy(
        name="dp",
        options=DPOptions,
        help="data parallel: dtrain.DataParallel (allreduce algorithm, buckets, overlap, compression)",
        hooks=(
            ProcessHooks(run=_run_dp),
            ConfigHooks(check=_check),
            ModelHooks(
                predict=_predict,
                memory=_memory,
                simulate=_simulate,
                candidates=_dp_candidates,
                identity=_dp_identity,
                parse=_parse_dp,
                text="dp:ALG[:MB]",
            ),
        ),
        devices=("cpu", "cuda"),
    )
)
DDP = register(
    Strategy(
        name="ddp",
        options=DDPOptions,
        help="data parallel through torch DDP (the peer)",
        hooks=(
            ProcessHooks(run=_run_ddp),
            ModelHooks(
                predict=_predict,
                memory=_memory,
                simulate=_simulate,
                candidates=_ddp_candidates,
                identity=_ddp_identity,
                parse=_parse_ddp,
                text="ddp",
            ),
        ),
        devices=("cpu", "cuda"),
    )
)
