"""The training loop that ``dtrain run`` drives.

The parent process (:func:`run`) validates the configuration, creates the run
folder, starts the processes through :func:`dtrain.launch.launch`, and when they
end merges their metrics and writes ``summary.json``. Each process runs
:func:`worker_main`, which builds a :class:`TrainContext` (data, model and
optimizer factories, metrics, tracing, progress) and hands it to the strategy's
runner, found by name in :data:`RUNNERS`.

A runner is ``fn(ctx: TrainContext) -> dict`` and returns this process's part of
the summary: ``role`` ("worker" or "server"), and for workers ``steps``,
``samples``, ``train_s``, ``final_loss``, ``bytes_sent`` and, on the rank that
evaluates, ``test_accuracy`` and ``accuracy_history``. Runners may add keys
(e.g. the parameter server's ``staleness``).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from dtrain.config import RunConfig, dump_toml, parse_straggler
from dtrain.data import DatasetSplit, load_dataset
from dtrain.models import build_model
from dtrain.trace import MetricsWriter, Tracer, merge_rank_files

__all__ = ["TrainContext", "RUNNERS", "run", "worker_main", "default_out_dir", "summarize", "lr_factor"]

# strategy name -> "module:function" of its runner (imported in the worker only)
RUNNERS: dict[str, str] = {
    "dp": "dtrain.train:run_data_parallel",
    "ddp": "dtrain.train:run_data_parallel",
    "ps": "dtrain.param_server.runner:run_process",
}


def default_out_dir(cfg: RunConfig) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{stamp}-{cfg.strategy}"


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


def _schedule_updates(optimizer: torch.optim.Optimizer, schedule: str, total: int) -> None:
    """Scale every update of ``optimizer`` by :func:`lr_factor` of its own step count.

    For optimizers stepped where the loop cannot set the rate (the parameter
    server's): a pre-step hook multiplies each group's current ``lr`` (whatever
    set it: the policy's lr scale, staleness-aware scaling) by the factor and a
    post-step hook puts it back, so the schedule composes with them.
    """
    count = [0]

    def before(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        f = lr_factor(schedule, count[0], total)
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
    """What a strategy's runner gets in each process.

    Attributes:
        cfg: the validated run configuration.
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

    # ---------------------------------------------------------------- factories

    def make_model(self) -> nn.Module:
        """The configured model, initialised identically on every rank (seeded)."""
        torch.manual_seed(self.cfg.seed)
        return build_model(self.cfg.model, self.data.input_shape, self.data.num_classes)

    def make_optimizer(self, params: Any) -> torch.optim.Optimizer:
        """The configured optimizer. Under the parameter server its updates follow
        ``lr_schedule`` by themselves (:meth:`server_updates` of them); the data
        parallel loop sets the rate each step instead (:meth:`schedule_lr`)."""
        c = self.cfg
        opt: torch.optim.Optimizer
        if c.optimizer == "adam":
            opt = torch.optim.Adam(params, lr=c.lr, weight_decay=c.weight_decay)
        else:
            comp = self.make_compressor()
            momentum = 0.0 if comp is not None and comp.momentum else c.momentum  # the compressor applies it
            opt = torch.optim.SGD(params, lr=c.lr, momentum=momentum, weight_decay=c.weight_decay)
        if c.strategy == "ps" and c.lr_schedule != "constant":
            _schedule_updates(opt, c.lr_schedule, self.server_updates())
        return opt

    def server_updates(self) -> int:
        """Updates each parameter server applies in the run: one per round under bsp
        and backup:b, ``W / k`` per round under softsync:k, ``W`` under asp and ssp."""
        from dtrain.param_server.consistency import parse_consistency

        workers = self.world_size - self.cfg.servers
        steps = self.total_steps(workers)
        spec = parse_consistency(self.cfg.consistency)
        if spec.kind in ("bsp", "backup"):
            return max(1, steps)
        if spec.kind == "softsync":
            return max(1, workers * steps // min(spec.arg, workers))
        return max(1, workers * steps)

    def schedule_lr(self, optimizer: torch.optim.Optimizer, step: int, total: int) -> None:
        """Set each group's ``lr`` for ``step`` of ``total``: its initial rate times
        :func:`lr_factor` (nothing to do for a constant schedule)."""
        if self.cfg.lr_schedule == "constant":
            return
        f = lr_factor(self.cfg.lr_schedule, step, total)
        for g in optimizer.param_groups:
            g.setdefault("initial_lr", g["lr"])
            g["lr"] = g["initial_lr"] * f

    def make_compressor(self) -> Any:
        """The configured gradient compressor for dp and ps (None without one).

        Compressors that need SGD's momentum before them (sign, sign:mv, onebit)
        get it in their error feedback, and :meth:`make_optimizer` then builds SGD
        without momentum (``dtrain.compress.from_spec``'s ``momentum``).
        """
        c = self.cfg
        if c.compression in ("", "none") or c.strategy not in ("dp", "ps"):
            return None
        from dtrain.compress import from_spec

        return from_spec(c.compression, error_feedback=c.error_feedback, momentum=c.momentum if c.optimizer == "sgd" else 0.0)

    def optimizer_factory(self) -> Callable[[Any], torch.optim.Optimizer]:
        return self.make_optimizer

    def loader(self, shard: int, num_shards: int, epoch: int, start_batch: int = 0) -> DataLoader:
        """This shard's training batches for ``epoch`` (a DistributedSampler slice).

        The per-shard batch is ``batch_size // num_shards``, so the global batch is
        ``batch_size`` whatever the number of workers. ``start_batch`` skips the
        epoch's first batches without reading them (a resumed run starts mid-epoch
        on exactly the batches the uninterrupted run saw next).
        """
        sampler = DistributedSampler(
            self.data.train, num_replicas=num_shards, rank=shard, shuffle=True, seed=self.cfg.seed, drop_last=True
        )
        sampler.set_epoch(epoch)
        bs = self.cfg.batch_size // num_shards
        if start_batch:
            order = list(sampler)[start_batch * bs :]
            return DataLoader(self.data.train, batch_size=bs, sampler=order, drop_last=True)
        return DataLoader(self.data.train, batch_size=bs, sampler=sampler, drop_last=True)

    def steps_per_epoch(self, num_shards: int) -> int:
        per_shard = len(self.data.train) // num_shards
        return per_shard // (self.cfg.batch_size // num_shards)

    def total_steps(self, num_shards: int) -> int:
        n = self.steps_per_epoch(num_shards) * self.cfg.epochs
        return min(n, self.cfg.max_steps) if self.cfg.max_steps else n

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> float:
        """Accuracy of ``model`` on the whole test set."""
        was_training = model.training
        model.eval()
        x, y = self.data.test.tensors
        correct = 0
        for i in range(0, len(y), 1024):
            correct += int((model(x[i : i + 1024]).argmax(1) == y[i : i + 1024]).sum())
        model.train(was_training)
        return correct / max(1, len(y))

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

    def straggler(self) -> Any:
        """This rank's compute slowdown (:class:`dtrain.cluster.Straggler`): ``--straggler``
        times the emulated host's ``DTRAIN_SLOWDOWN``; call its ``stretch(compute_s)`` after backward."""
        from dtrain.cluster.slowdown import Straggler, slowdown_factor

        return Straggler(self.straggler_factor() * slowdown_factor())


# ---------------------------------------------------------------------- data parallel


def _wrap(model: nn.Module, ctx: TrainContext, optimizer: torch.optim.Optimizer) -> nn.Module:
    c = ctx.cfg
    if c.strategy == "ddp":
        if ctx.world_size == 1:
            return model
        return nn.parallel.DistributedDataParallel(model, bucket_cap_mb=c.bucket_mb)
    from dtrain.data_parallel import DataParallel

    kw: dict[str, Any] = dict(algorithm=c.algorithm, bucket_mb=c.bucket_mb, overlap=c.overlap, timeout_s=c.timeout_s)
    if c.compression not in ("", "none"):
        kw["compression"] = ctx.make_compressor()
    if c.overlap == "forward":
        kw["optimizer"] = optimizer
    return DataParallel(model, **kw)


def _ring_bytes(model: nn.Module, world: int) -> int:
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    return int(2 * (world - 1) / world * n) if world > 1 else 0


def _write_dp_row(ctx: TrainContext, row: dict[str, Any], st: dict[str, Any] | None, model: nn.Module,
                  world: int) -> None:
    """Complete a step's metrics with the engine's figures (DDP reports none: ring bytes, nulls)."""
    dt = row.pop("step_s")
    if st is None:
        row.update(compute_s=dt, comm_s=None, wait_s=None, bytes_sent=_ring_bytes(model, world))
    else:
        wait_s = float(st.get("wait_s", 0.0))
        row.update(compute_s=float(st.get("compute_s", dt - wait_s)), comm_s=st.get("comm_s"), wait_s=wait_s,
                   bytes_sent=int(st.get("bytes_sent", 0)))
    ctx.metrics.write(**row)


def _save_dp(ctx: TrainContext, ckpt: Any, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
             wrapped: nn.Module) -> None:
    """Checkpoint after ``step`` steps: model, optimizer, and per rank the engine's compressor state and RNGs."""
    sync = getattr(wrapped, "synchronize", None)
    if callable(sync):
        sync()  # overlap="forward": the last step's buckets are still being applied
    state_fn = getattr(wrapped, "compressor_state_dict", None)
    spe = ctx.steps_per_epoch(ctx.world_size)
    with ctx.tracer.span("checkpoint", step=step):
        ckpt.save(step, model=model, optimizer=optimizer, rank_state={"engine": state_fn() if state_fn else None},
                  epoch=step // spe, batch=step % spe)


def run_data_parallel(ctx: TrainContext) -> dict[str, Any]:
    """Synchronous data parallelism: dtrain.DataParallel (``dp``) or torch DDP (``ddp``).

    With ``checkpoint_every`` it saves every N steps and after the last one; with
    ``resume`` it restores model, optimizer, engine (compressor) state, step and data
    position, and sets the RNGs once the resumed epoch's data iterator exists.
    """
    from dtrain.checkpoint.training import RunCheckpointer

    c, rank, world = ctx.cfg, ctx.rank, ctx.world_size
    ckpt = RunCheckpointer.create(c, ctx.out_dir)  # its group first: every rank creates groups in one order
    model = ctx.make_model()
    optimizer = ctx.make_optimizer(model.parameters())
    wrapped = _wrap(model, ctx, optimizer)
    start, blob = 0, None
    if ckpt is not None and ckpt.resume_from is not None:
        info, blob = ckpt.restore(model=model, optimizer=optimizer)
        load_fn = getattr(wrapped, "load_compressor_state_dict", None)
        if load_fn is not None:
            load_fn(blob["engine"])
        start = int(info["step"])
    stats_fn = getattr(wrapped, "step_stats", None)
    steps_in_optimizer = c.strategy == "dp" and c.overlap == "forward"
    loss_fn = nn.CrossEntropyLoss()
    total = ctx.total_steps(world)
    spe = ctx.steps_per_epoch(world)
    bar = ctx.progress(total - start, rank == 0)
    slow = ctx.straggler()
    step, samples, losses, history = start, 0, [], []
    pending: dict[str, Any] | None = None
    t_start = time.perf_counter()
    eval_s = 0.0
    for epoch in range(start // spe, c.epochs):
        batches = iter(ctx.loader(rank, world, epoch, start_batch=start % spe if step == start else 0))
        if blob is not None:  # after building the iterator, which draws from torch's generator
            ckpt.restore_rng(blob)  # type: ignore[union-attr]
            blob = None
        t_free = time.perf_counter()  # this rank's own work of a step starts (the straggler's measure)
        for x, y in batches:
            if step >= total:
                break
            t0 = time.perf_counter()
            ctx.schedule_lr(optimizer, step, total)
            with ctx.tracer.span("step", step=step):
                if not steps_in_optimizer:
                    optimizer.zero_grad(set_to_none=False)
                with ctx.tracer.span("forward"):
                    loss = loss_fn(wrapped(x), y)
                with ctx.tracer.span("backward"):
                    loss.backward()
                slow.stretch(time.perf_counter() - t_free)  # backward includes the allreduce it overlaps
                if not steps_in_optimizer:
                    with ctx.tracer.span("optimizer"):
                        optimizer.step()
            t_free = time.perf_counter()
            dt = t_free - t0
            row = dict(step=step, epoch=epoch, loss=float(loss.detach()), lr=optimizer.param_groups[0]["lr"],
                       samples_per_s=len(y) * world / dt, step_s=dt)
            if steps_in_optimizer:
                # this step's buckets finish during the next forward: its figures come one step later
                if pending is not None:
                    _write_dp_row(ctx, pending, stats_fn(), model, world)
                pending = row
            else:
                _write_dp_row(ctx, row, stats_fn() if stats_fn else None, model, world)
            losses.append(row["loss"])
            samples += len(y) * world
            step += 1
            bar.update(1)
            if step % 10 == 0:
                bar.set_postfix(loss=f"{row['loss']:.3f}", refresh=False)
            if ckpt is not None and ckpt.due(step, final=step >= total):
                _save_dp(ctx, ckpt, step, model, optimizer, wrapped)
                t_free = time.perf_counter()
        if rank == 0:
            te = time.perf_counter()
            if steps_in_optimizer and hasattr(wrapped, "synchronize"):
                wrapped.synchronize()
            acc = ctx.evaluate(model)
            eval_s += time.perf_counter() - te
            history.append((round(time.perf_counter() - t_start - eval_s, 4), epoch, acc))
            bar.write(f"epoch {epoch}: test accuracy {acc:.4f}") if c.progress else None
        if step >= total:
            break
    if steps_in_optimizer and hasattr(wrapped, "synchronize"):
        wrapped.synchronize()
        if pending is not None:
            _write_dp_row(ctx, pending, stats_fn(), model, world)
    train_s = time.perf_counter() - t_start - eval_s
    bar.close()
    out: dict[str, Any] = dict(
        role="worker", steps=step - start, start_step=start, samples=samples, train_s=train_s,
        final_loss=sum(losses[-10:]) / max(1, len(losses[-10:])),
        bytes_sent=sum(json.loads(line)["bytes_sent"] for line in ctx.metrics.path.read_text().splitlines()),
    )
    if rank == 0:
        out["test_accuracy"] = ctx.evaluate(model)
        out["accuracy_history"] = history
    return out


# ---------------------------------------------------------------------- process entry


def _resolve(strategy: str) -> Callable[[TrainContext], dict[str, Any]]:
    mod, fn = RUNNERS[strategy].split(":")
    return getattr(importlib.import_module(mod), fn)  # type: ignore[no-any-return]


def worker_main(cfg_dict: dict[str, Any], out_dir: str) -> dict[str, Any]:
    """Entry point of every process of a run (called by the elastic launcher)."""
    cfg = RunConfig.from_mapping(cfg_dict)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    out = Path(out_dir)
    ctx = TrainContext(
        cfg=cfg, rank=rank, world_size=world, out_dir=out,
        data=load_dataset(cfg.dataset, seed=cfg.seed, samples=cfg.samples),
        metrics=MetricsWriter(out, rank), tracer=Tracer(rank, enabled=cfg.trace),
    )
    try:
        result = _resolve(cfg.strategy)(ctx)
    except BaseException:
        (out / f"error.rank{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        ctx.metrics.close()
        ctx.tracer.dump(out)
    result["rank"] = rank
    return result


def summarize(cfg: RunConfig, results: dict[int, dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """Combine the processes' results into ``summary.json``'s contents.

    ``samples_per_s`` counts every sample a worker computed a gradient of. A
    parameter-server run also gets ``computed_samples_per_s`` (the same) and
    ``applied_samples_per_s``: samples whose gradients went into an update, per
    second -- lower under backup:b, which drops gradients (see
    :func:`dtrain.param_server.runner.merge_stats`).
    """
    workers = [r for r in results.values() if r.get("role") == "worker"]
    if not workers:
        raise RuntimeError("no worker returned a result")
    steps = max(int(w["steps"]) for w in workers)
    evaluator = next((w for w in workers if "test_accuracy" in w), {})
    train_s = max(float(w["train_s"]) for w in workers)
    samples = max(int(w["samples"]) for w in workers) if cfg.strategy in ("dp", "ddp") else sum(
        int(w["samples"]) for w in workers)
    s: dict[str, Any] = {
        "strategy": cfg.strategy,
        "world_size": len(results),
        "workers": len(workers),
        "steps": steps,
        "wall_s": round(wall_s, 3),
        "train_s": round(train_s, 3),
        "samples_per_s": samples / train_s if train_s > 0 else math.nan,
        "test_accuracy": evaluator.get("test_accuracy"),
        "final_loss": sum(float(w["final_loss"]) for w in workers) / len(workers),
        "bytes_sent_per_step": sum(float(w["bytes_sent"]) / max(1, int(w["steps"])) for w in workers) / len(workers),
        "accuracy_history": evaluator.get("accuracy_history", []),
    }
    if cfg.resume:
        s["resumed_from"] = cfg.resume
        s["start_step"] = max(int(w.get("start_step", 0)) for w in workers)
    for r in results.values():  # strategy-specific extras (e.g. staleness) from any process
        for k, v in r.get("summary_extra", {}).items():
            s.setdefault(k, v)
    if s.get("samples_applied") is not None and train_s > 0:  # parameter server: work done vs work used
        s["computed_samples_per_s"] = s["samples_per_s"]
        s["applied_samples_per_s"] = s["samples_applied"] / train_s
    return s


def run(cfg: RunConfig, *, quiet: bool = False) -> tuple[dict[str, Any], Path]:
    """Run a whole training job from the parent process; returns (summary, run folder).

    ``strategy="auto"`` asks the planner (:func:`dtrain.perfmodel.choose`) first and
    runs its first choice; ``cluster="NAME"`` spreads the processes over the hosts
    of an emulated cluster (``dtrain cluster up``) instead of this machine.
    """
    cfg.validate()
    if cfg.strategy == "auto":
        from dtrain.perfmodel import choose

        cfg = cfg.replace(**choose(cfg)).validate()
    out = Path(cfg.out) if cfg.out else default_out_dir(cfg)
    out.mkdir(parents=True, exist_ok=True)
    for stale in list(out.glob("metrics*.jsonl")) + list(out.glob("trace*.json")) + list(out.glob("error.rank*.txt")):
        stale.unlink()
    cfg = cfg.replace(out=str(out))
    if cfg.resume:  # the concrete checkpoint, so every process (and config.toml) names the same one
        from dtrain.checkpoint import find_checkpoint

        cfg = cfg.replace(resume=str(find_checkpoint(cfg.resume).resolve()))
    (out / "config.toml").write_text(dump_toml(cfg))
    from dtrain.launch import launch

    t0 = time.perf_counter()
    try:
        if cfg.cluster:
            from dtrain.cluster import launch_on_cluster

            results = launch_on_cluster(worker_main, (cfg.to_dict(), str(out)), nprocs=cfg.num_processes,
                                        cluster=cfg.cluster, stream_first=not quiet)
        else:
            results = launch(worker_main, (cfg.to_dict(), str(out)), nprocs=cfg.num_processes,
                             backend=cfg.backend or None)
    finally:
        merge_rank_files(out)
    summary = summarize(cfg, results, time.perf_counter() - t0)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if (out / "metrics.jsonl").is_file():
        from dtrain.report import plot_run

        plot_run(out)
    return summary, out


def iter_metrics(out_dir: str | Path) -> Iterator[dict[str, Any]]:
    """Rows of a finished run's metrics.jsonl."""
    for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            yield json.loads(line)


