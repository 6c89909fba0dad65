"""Checkpoint and resume for ``dtrain run`` (``--checkpoint-every N``, ``--resume PATH``).

What a run's checkpoint holds, per strategy:

The strategy decides what goes in (its engine's ``save``) and which of its
options a checkpoint depends on (its options' ``checkpoint_keys``); for the
built-in ones:

* ``dp`` / ``ddp`` (every rank at the same step): the model and optimizer
  (written once, DCP spreads them over the ranks), and per rank: the engine's
  compressor state with the bucket layout it is keyed by
  (:meth:`dtrain.DataParallel.compressor_state_dict`) and the RNG states;
* ``ps`` under bsp: per server its shard, its optimizer state, its clock table
  and gradient count; per worker its clock, its compressor state, its data
  position and RNG states (:meth:`dtrain.ParameterServer.state_dict`);
* ``pipeline`` (not 2bw): each stage's layers and optimizer state under the whole
  model's names, and the cut; ``tensor`` / ``hybrid``: each rank's slices and
  optimizer state as its own (the same mesh resumes them).

dp (plain with a stateless wire, or ZeRO) and ps under bsp without a stateful
compressor also resume on another number of workers (``reshards``), when every
step would take the same samples (:func:`_check_same_global_batch`): what
``--min-workers`` restarts on.

The data position is ``(epoch, batch)``: the sampler's epoch (its shuffle seed)
and how many of that epoch's batches were consumed. A resumed run rebuilds the
epoch's DistributedSampler order and starts at that batch, so it sees exactly the
batches the uninterrupted run would have.

Optimizer hyperparameters (lr, momentum, weight decay) come from the resumed
run's configuration, not from the checkpoint: ``--resume PATH --lr 0.01``
continues with the new rate; the optimizer's *state* (momentum buffers, Adam's
moments and step counts) comes from the checkpoint. So may a fixed batch:
``--resume PATH --batch-size 128`` goes on from the checkpoint's sample at the new
batch (:func:`batch_plan`), the learning rate following it by ``--lr-scaling``.

:func:`check_resume` runs in the parent before any process starts: it refuses a
checkpoint that is missing, incomplete or damaged (a file whose size or SHA-256
differs from the checkpoint's manifest; a run folder falls back to its newest intact
checkpoint), saved by a different number of
processes (where the strategy does not reshard), or with a different strategy, compression, model, data order or
consistency model, and one that leaves nothing to train.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from dtrain.checkpoint.dcp import load_checkpoint, save_checkpoint
from dtrain.checkpoint.layout import CHECKPOINTS_DIR, CheckpointError, find_checkpoint, read_info
from dtrain.checkpoint.rng import rng_state, set_rng_state
from dtrain.errors import ConfigError
from dtrain.workloads.batch import split_batch

if TYPE_CHECKING:
    from dtrain.config.schema import RunConfig
    from dtrain.optim.large_batch import BatchPlan

__all__ = ["RunCheckpointer", "run_info", "check_resume", "train_steps", "batch_plan", "fresh_batch_plan"]


def run_info(cfg: RunConfig) -> dict[str, Any]:
    """The options a checkpoint of ``cfg``'s run depends on (a resumed run must match them):
    the shared ones, and the strategy's own (its options' ``checkpoint_keys``)."""
    d: dict[str, Any] = {
        "strategy": cfg.strategy,
        "workers": cfg.workers,
        "model": cfg.model,
        "dataset": cfg.dataset,
        "batch_size": cfg.batch_size,
        "seed": cfg.seed,
        "optimizer": cfg.optimizer,
        "compression": cfg.opts.compressor_spec(),
    }
    d.update(cfg.opts.checkpoint_keys())
    if cfg.batch_schedule:  # where a step falls in the data
        d["batch_schedule"] = cfg.batch_schedule
        if cfg.auto_every:  # auto deciding inside epochs: the batches' cuts
            d["auto_every"] = cfg.auto_every
    if cfg.model_args:  # the model's shape
        d["model_args"] = dict(cfg.model_args)
    if cfg.dataset == "synthetic":
        d["samples"] = cfg.samples
    if cfg.dataset == "pytext":  # the windows and the model's shape
        d.update(seq_len=cfg.seq_len, **cfg.gpt_overrides())
    return d


def fresh_batch_plan(cfg: RunConfig, samples: int) -> BatchPlan:
    """The global batch of each step of ``cfg``'s run from its start: ``--batch-size``, ``--batch-schedule``
    and ``--auto-every``, over ``samples`` training samples; :func:`batch_plan` adds what a resumed run keeps."""
    from dtrain.optim.large_batch import BatchPlan

    return BatchPlan.of(cfg.batch_size, cfg.batch_schedule, samples, cfg.epochs, every=cfg.auto_every)


def batch_plan(cfg: RunConfig, samples: int) -> BatchPlan:
    """The global batch of each of ``cfg``'s steps over ``samples`` training samples
    (:class:`~dtrain.optim.large_batch.BatchPlan`).

    A run resumed at a ``--batch-size`` other than the one in force at its checkpoint's step (population-based
    training's explore) goes on from the checkpoint's place in the data at the new batch: the plan is the
    checkpoint's (its first batch and its own changes, from the marker) with a change at that step."""
    from dtrain.optim.large_batch import BatchPlan

    if not cfg.resume or cfg.batch_schedule:
        return fresh_batch_plan(cfg, samples)
    info = read_info(find_checkpoint(cfg.resume))
    saved = info.get("batches")
    if not isinstance(saved, dict):  # a checkpoint from before batches were recorded: its own batch throughout
        saved = {"first": info.get("run", {}).get("batch_size", cfg.batch_size), "changes": []}
    plan = BatchPlan.of(int(saved["first"]), "", samples, cfg.epochs)
    plan.changes = [(int(s), int(b)) for s, b in saved["changes"]]
    step = int(info["step"])
    if plan.batch_at(step, cfg.opts.batch_shards(cfg.workers)) != cfg.batch_size:
        plan.change(step, cfg.batch_size, again=True)
    return plan


def train_steps(cfg: RunConfig) -> int:
    """Steps of ``cfg``'s run (per worker), as :meth:`dtrain.training.TrainContext.total_steps` counts them."""
    plan = batch_plan(cfg, cfg.load_data().train_size)
    n = plan.total(cfg.opts.batch_shards(cfg.workers))
    return int(min(n, cfg.max_steps) if cfg.max_steps else n)


def _flag(k: str, v: Any) -> str:
    if isinstance(v, bool):
        return f"--{'' if v else 'no-'}{k.replace('_', '-')}"
    return f"--{k.replace('_', '-')} {v}"


def check_resume(cfg: RunConfig) -> None:
    """Refuse bad checkpoint options before any process starts (:class:`ConfigError` saying what to change)."""
    if cfg.checkpoint_every < 0:
        raise ConfigError(f"checkpoint_every must be >= 0 (0: no checkpoints), got {cfg.checkpoint_every}")
    _check_restarts(cfg)
    if cfg.checkpoint_every > 0 or cfg.resume:
        cfg.hooks.check_checkpointing(cfg.opts, cfg)
    if not cfg.resume:
        return
    ckpt = find_checkpoint(cfg.resume, checksums=True)  # a damaged file fails here, naming it, not in a worker
    info = read_info(ckpt)
    saved = info.get("run")
    if not isinstance(saved, dict):
        raise CheckpointError(f"{ckpt} was not written by `dtrain run` (its marker has no run options)")
    mine = run_info(cfg)
    reshard = cfg.opts.reshards()
    if reshard:  # the segments are resharded onto this run's workers
        saved = {k: v for k, v in saved.items() if k != "workers"}
        mine = {k: v for k, v in mine.items() if k != "workers"}
    keys = sorted(set(saved) | set(mine), key=lambda k: list(mine).index(k) if k in mine else 99)
    diff = [k for k in keys if saved.get(k) != mine.get(k)]
    rebatch = "batch_size" in diff and "batch_schedule" not in saved and "batch_schedule" not in mine
    if rebatch:  # a fixed batch may change at the checkpoint's step (batch_plan)
        diff.remove("batch_size")
    if diff:
        was = ", ".join(f"{k}={saved.get(k)!r}" for k in diff)
        now = ", ".join(f"{k}={mine.get(k)!r}" for k in diff)
        fix = " ".join(_flag(k, saved[k]) for k in diff if k in saved)
        raise CheckpointError(
            f"cannot resume from {ckpt}: it was saved with {was}; this run has {now}. Resume with the "
            f"checkpoint's values ({fix}): compressor state, data order and optimizer state belong to them"
        )
    if int(info["world_size"]) != cfg.num_processes and not reshard:
        raise CheckpointError(
            f"cannot resume from {ckpt}: it was saved by {info['world_size']} processes, this run starts "
            f"{cfg.num_processes}"
        )
    if reshard and int(info["world_size"]) != cfg.num_processes:
        if rebatch:
            raise CheckpointError(
                f"cannot resume {ckpt} on {cfg.workers} workers at --batch-size {cfg.batch_size}: it was saved by "
                f"{info['run']['workers']} workers at {saved['batch_size']}; change the batch or the workers, "
                "not both at once"
            )
        _check_same_global_batch(cfg, ckpt, saved_workers=int(info["run"]["workers"]))
    total = train_steps(cfg)
    if int(info["step"]) >= total:
        raise CheckpointError(
            f"{ckpt} is at step {info['step']} and this run ends at step {total} (epochs {cfg.epochs}, max_steps "
            f"{cfg.max_steps}); nothing is left to train: raise --epochs or --max-steps"
        )


def _check_restarts(cfg: RunConfig) -> None:
    """``--max-restarts N`` restarts from the run's own checkpoints (:mod:`.restart`): it needs
    ``--checkpoint-every``, a strategy that checkpoints, and a launch on this machine."""
    n = cfg.max_restarts
    if cfg.min_workers and n <= 0:
        raise ConfigError(
            f"--min-workers {cfg.min_workers} lets a restart go on with fewer workers: add --max-restarts N"
        )
    if n <= 0:
        return
    try:
        cfg.hooks.check_checkpointing(cfg.opts, cfg)
    except ConfigError as e:
        raise ConfigError(f"--max-restarts {n} restarts from the run's checkpoints, and {e}") from None
    if cfg.checkpoint_every <= 0:
        raise ConfigError(
            f"--max-restarts {n} restarts the processes from the run's newest checkpoint: add "
            "--checkpoint-every N (e.g. 100), else every restart would begin again at step 0"
        )
    if cfg.min_workers:
        _check_min_workers(cfg)


def _check_min_workers(cfg: RunConfig) -> None:
    """``--min-workers M``: a restart may go on with any count of workers from M to ``--workers``, resuming
    the checkpoint resharded; so the strategy must reshard, and every count must train the same steps
    (the global batch and the steps of each epoch) as the run's own workers."""
    m = cfg.min_workers
    if m > cfg.workers:
        raise ConfigError(f"--min-workers {m} is more than the run's {cfg.workers} workers")
    if not cfg.opts.reshards():
        raise ConfigError(
            f"--min-workers {m}: a checkpoint of {cfg.opts.label(cfg.workers)} does not resume on "
            "another number of workers (dp, dp --shard and the parameter server under bsp do, "
            "without a compressor that keeps per-worker state)"
        )
    if cfg.batch_schedule == "auto":
        raise ConfigError(
            f"--min-workers {m} with --batch-schedule auto: the batch it chooses need not divide "
            "over fewer workers; give a fixed batch or a batch schedule"
        )
    n = cfg.load_data().train_size
    steps = {w: _data_steps(cfg, w, n) for w in range(m, cfg.workers + 1)}
    bad = [w for w in range(m, cfg.workers) if steps[w] != steps[cfg.workers]]
    if bad:
        shards = [cfg.opts.batch_shards(w) for w in range(m, cfg.workers + 1)]
        unit = math.lcm(*shards)
        near = sorted({max(unit, cfg.batch_size // unit * unit), -(-cfg.batch_size // unit) * unit})
        raise ConfigError(
            f"--min-workers {m}: on {bad[0]} workers the run would not train the steps of its {cfg.workers} "
            f"(global batch {cfg.global_batch}, {steps[cfg.workers][0]} steps an epoch; on {bad[0]}: "
            f"batch {split_batch(cfg.batch_size, cfg.opts.batch_shards(bad[0]))[1]}, "
            f"{steps[bad[0]][0]} steps), so a scale-down could not resume its checkpoint; choose a "
            f"--batch-size that every count from {m} to {cfg.workers} divides, e.g. "
            f"{' or '.join(map(str, near))}"
        )


def _data_steps(cfg: RunConfig, workers: int, samples: int) -> tuple[int, ...]:
    """Each epoch's steps and global batch on ``workers`` workers (of ``samples`` training samples): where
    each step falls in the data."""
    plan = fresh_batch_plan(cfg, samples)
    shards = cfg.opts.batch_shards(workers)
    return tuple(
        x for e in range(cfg.epochs) for x in (plan.steps_in(e, shards), split_batch(plan.batch(e), shards)[1])
    )


def _check_same_global_batch(cfg: RunConfig, ckpt: Path, saved_workers: int) -> None:
    """A checkpoint resumed on another number of workers finds its place in the data by (epoch, batch):
    only a run whose steps take the same samples (the same global batch) continues it."""
    saved = split_batch(cfg.batch_size, cfg.opts.batch_shards(saved_workers))[1]
    if saved != cfg.global_batch:
        raise CheckpointError(
            f"cannot resume {ckpt} on {cfg.workers} workers: its {saved_workers} workers trained on a global "
            f"batch of {saved}, {cfg.workers} workers would take {cfg.global_batch} (--batch-size "
            f"{cfg.batch_size} does not divide over them); choose a number of workers that divides {saved}"
        )
    n = cfg.load_data().train_size
    was, now = _data_steps(cfg, saved_workers, n), _data_steps(cfg, cfg.workers, n)
    if was != now:  # each shard drops its last partial batch: the steps of an epoch can differ by one
        e = next(i for i in range(0, len(was), 2) if was[i] != now[i]) // 2
        raise CheckpointError(
            f"cannot resume {ckpt} on {cfg.workers} workers: epoch {e} has {was[2 * e]} steps on its "
            f"{saved_workers} workers and {now[2 * e]} on {cfg.workers} (each worker drops its shard's last "
            "partial batch), so the steps would not fall on the same data; choose another number of workers"
        )


class RunCheckpointer:
    """Saves a run's state every ``checkpoint_every`` steps and restores it for ``--resume``.

    Built in every process of a run at the same point (it creates a gloo group
    with the run's timeout, so saves never share a group with training traffic
    and a stuck save fails after ``timeout_s`` naming the rank and step).

    Args:
        cfg: the run's :class:`~dtrain.config.schema.RunConfig`.
        out_dir: the run folder; checkpoints go to ``out_dir/checkpoints``.
    """

    def __init__(self, cfg: RunConfig, out_dir: str | Path) -> None:
        self.cfg = cfg
        self.every = int(cfg.checkpoint_every)
        self.root = Path(out_dir) / CHECKPOINTS_DIR
        self.resume_from = find_checkpoint(cfg.resume) if cfg.resume else None
        self.group: Any = None
        if dist.is_available() and dist.is_initialized():
            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=cfg.timeout_s))
        self._saved: set[int] = set()
        # the training loop's own state (the loss scale, the noise scale, the batch plan): saved with each
        # rank's state under "loop"; ``on_restore`` gets it back before the engine works out its position
        self.loop_state: dict[str, Any] = {}
        self.on_restore: Callable[[dict[str, Any]], None] | None = None

    @classmethod
    def create(cls, cfg: RunConfig, out_dir: str | Path) -> RunCheckpointer | None:
        """A checkpointer when the run saves or resumes, else None (every process decides alike)."""
        if cfg.checkpoint_every <= 0 and not cfg.resume:
            return None
        return cls(cfg, out_dir)

    def due(self, step: int, final: bool = False) -> bool:
        """Whether to save after ``step`` steps: every ``checkpoint_every`` steps, and at the end of training."""
        return self.every > 0 and step > 0 and step not in self._saved and (step % self.every == 0 or final)

    def save(
        self,
        step: int,
        *,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        rank_state: dict[str, Any] | None = None,
        sharded: dict[str, Any] | None = None,
        **facts: Any,
    ) -> Path:
        """Collective: save the state after ``step`` steps (``facts`` go into the marker, e.g. epoch and batch).
        ``sharded``: DTensors each rank holds a part of (see :func:`~dtrain.checkpoint.save_checkpoint`)."""
        blob = dict(rank_state or {})
        blob["rng"] = rng_state()
        info = {"run": run_info(self.cfg), **facts}
        if self.loop_state:
            blob["loop"] = self.loop_state
            if not self.cfg.batch_schedule:  # a fixed batch (or one a resume changed): a resume at another starts here
                info["batches"] = {"first": self.loop_state["plan"][0], "changes": self.loop_state["changes"]}
        path = save_checkpoint(
            self.root,
            step,
            model=model,
            optimizer=optimizer,
            rank_state=blob,
            info=info,
            group=self.group,
            sharded=sharded,
        )
        self._saved.add(step)
        return path

    def restore(
        self,
        *,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        sharded: dict[str, Any] | None = None,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Collective: load ``--resume``'s checkpoint; returns ``(info, this rank's state)``.

        The optimizer keeps the hyperparameters it was built with (the run's
        configuration); its state comes from the checkpoint. RNG states are
        not applied here: call :meth:`restore_rng` once the data iterator of the
        resumed epoch exists (building it draws from torch's generator, as it
        did in the interrupted run before the checkpoint).
        """
        assert self.resume_from is not None
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups] if optimizer else []
        info, blob = load_checkpoint(
            self.resume_from,
            model=model,
            optimizer=optimizer,
            group=self.group,
            sharded=sharded,
            reshard=self.cfg.opts.reshards(),
        )
        if optimizer is not None:
            for g, h in zip(optimizer.param_groups, hyper):
                g.update(h)
        if self.on_restore is not None and "loop" in blob:
            self.on_restore(blob["loop"])
        return info, blob

    @staticmethod
    def restore_rng(blob: dict[str, Any]) -> None:
        """Put the global generators back as they were when ``blob`` was saved."""
        set_rng_state(blob["rng"])
