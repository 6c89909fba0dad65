"""``dtrain run``: the parent process and each process's entry point.

The parent process (:func:`run`) validates the configuration, lets the strategy
resolve itself (``auto`` asks the planner), creates the run folder, starts the
processes through :func:`dtrain.launch.agent.launch`, and when they end merges their
metrics and writes the run's summary (:mod:`dtrain.rundir`). Each process runs :func:`worker_main`,
which builds a :class:`~dtrain.training.context.TrainContext` and hands it to
the registered strategy's ``run`` hook (:mod:`dtrain.strategies`); the
strategies' workers share one loop (:func:`dtrain.training.loop.run_loop`).

A process body returns this process's part of the summary: ``role`` ("worker"
or "server"), and for workers ``steps``, ``samples``, ``train_s``,
``final_loss``, ``bytes_sent`` and, on the rank that evaluates, the metric
(``metric_name``, ``metric``, ``metric_history``; ``test_accuracy`` and
``accuracy_history`` for a classifier, ``val_loss`` and ``perplexity`` for a
language model; ``time_to_target_s`` under ``--target``). It may add keys (e.g. the parameter
server's ``staleness`` under ``summary_extra``).
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
import traceback
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from dtrain.cluster.nodes import NodeArgs
from dtrain.config.files import dump_toml
from dtrain.config.schema import RunConfig
from dtrain.errors import ConfigError
from dtrain.job.validate import validate
from dtrain.rundir.attribution import attribute
from dtrain.rundir.curves import plot_run
from dtrain.rundir.files import CONFIG, has_metrics, iter_metrics, read_summary, write_summary
from dtrain.trace import MetricsWriter, Tracer, activate, align_clock, merge_rank_files, parse_trace_steps
from dtrain.training.context import ProcessHooks, TrainContext
from dtrain.training.lr import lr_factor, schedule_updates
from dtrain.workloads.batch import batch_note

if TYPE_CHECKING:
    from dtrain.cluster.nodes import Meeting
    from dtrain.launch.agent import NodeSpec

__all__ = [
    "TrainContext",
    "run",
    "run_node",
    "worker_main",
    "default_out_dir",
    "open_run_folder",
    "summarize",
    "lr_factor",
    "iter_metrics",
]

_schedule_updates = schedule_updates  # the name tests and older scripts import


def default_out_dir(cfg: RunConfig) -> Path:
    """``runs/<timestamp>-<strategy>``, with ``-2``, ``-3``, ... when a run started in the same second."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path("runs") / f"{stamp}-{cfg.strategy}"
    out, n = base, 1
    while out.exists():
        n += 1
        out = base.with_name(f"{base.name}-{n}")
    return out


def _writable(out: Path, what: str) -> ConfigError:
    return ConfigError(f"cannot write the run folder {out}: {what}; choose another --out")


def open_run_folder(cfg: RunConfig) -> Path:
    """Create (or, with ``--overwrite``, empty) the run folder ``cfg.out`` before any process starts.

    A folder that holds files is refused, naming it: an earlier run's metrics, summary and
    curves would be overwritten. ``--overwrite`` deletes its contents first -- only where it
    holds a run (its configuration), and never one that ``--resume`` reads from. A path that
    cannot be created or written is a one-line :class:`ConfigError` naming it.
    """
    out = Path(cfg.out) if cfg.out else default_out_dir(cfg)
    try:
        if out.exists() and not out.is_dir():
            raise _writable(out, "it is a file")
        held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
        if held:
            _clear(out, held, cfg)
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".dtrain-write-check"
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise _writable(out, e.strerror or str(e)) from None
    return out


def _clear(out: Path, held: list[str], cfg: RunConfig) -> None:
    """Empty ``out`` for ``--overwrite``, or refuse (ConfigError saying what to do)."""
    shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
    if not cfg.overwrite:
        what = "an earlier run" if CONFIG in held else "files"
        raise ConfigError(
            f"the run folder {out} holds {what} ({shown}); choose a new --out, or --overwrite to replace it"
        )
    if CONFIG not in held:
        raise ConfigError(
            f"--overwrite replaces a run folder, and {out} holds no run (no {CONFIG}; it holds "
            f"{shown}); choose an empty or new --out"
        )
    if cfg.resume and out.resolve() in (src := Path(cfg.resume).resolve(), *src.parents):
        raise ConfigError(
            f"--overwrite would delete {out}, which holds the checkpoint --resume {cfg.resume} "
            "reads; write the resumed run to a new --out"
        )
    for name in held:
        p = out / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def worker_main(cfg_dict: dict[str, Any], out_dir: str) -> dict[str, Any]:
    """Entry point of every process of a run (called by the elastic launcher)."""
    from dtrain.job.restart import resume_after_restart

    cfg = RunConfig.from_mapping(cfg_dict)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    out = Path(out_dir)
    cfg = resume_after_restart(cfg, out, rank)  # after an elastic restart: from the newest checkpoint
    if cfg.device == "cuda":  # several processes may share a GPU (gloo stages their collectives on the host)
        import torch

        from dtrain import runtime

        torch.cuda.set_device(runtime.local_rank() % torch.cuda.device_count())
    ctx = TrainContext(
        cfg=cfg,
        rank=rank,
        world_size=world,
        out_dir=out,
        data=cfg.load_data(),
        metrics=MetricsWriter(out, rank),
        tracer=Tracer(rank, enabled=cfg.trace, steps=parse_trace_steps(cfg.trace_steps)),
    )
    activate(ctx.tracer)  # transports and collectives record into it
    align_clock(ctx.tracer, cfg.timeout_s)  # every process, before training: the trace's clock offsets
    hooks = cfg.entry.hooks_of(ProcessHooks)
    if hooks is None:
        raise ConfigError(f"strategy {cfg.strategy!r} has no process body; it must resolve to one that has")
    try:
        result = hooks.run(ctx)
    except KeyboardInterrupt:  # Ctrl-C: the launcher reports it, no error to keep
        raise
    except BaseException:
        (out / f"error.rank{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        ctx.metrics.close()
        activate(None)
        ctx.tracer.dump(out)
    result["rank"] = rank
    result["world"] = world
    return result


def summarize(cfg: RunConfig, results: dict[int, dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """Combine the processes' results into the run's summary.

    ``global_batch`` is the samples a step trains on (:attr:`RunConfig.global_batch`:
    ``--batch-size`` rounded down to a multiple of the workers).
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
    evaluator = next((w for w in workers if "metric" in w), {})
    train_s = max(float(w["train_s"]) for w in workers)
    samples = sum(int(w["samples"]) for w in workers)
    s: dict[str, Any] = {
        "strategy": cfg.strategy,
        "world_size": len(results),
        "workers": len(workers),
        "device": cfg.device,
        "backend": cfg.process_backend(),
        "steps": steps,
        "global_batch": cfg.global_batch,
        "wall_s": round(wall_s, 3),
        "train_s": round(train_s, 3),
        "samples_per_s": samples / train_s if train_s > 0 else math.nan,
        "test_accuracy": evaluator.get("test_accuracy"),
        "final_loss": sum(float(w["final_loss"]) for w in workers) / len(workers),
        "bytes_sent_per_step": sum(float(w["bytes_sent"]) / max(1, int(w["steps"])) for w in workers) / len(workers),
        "accuracy_history": evaluator.get("accuracy_history", []),
        "metric_name": evaluator.get("metric_name"),
        "metric": evaluator.get("metric"),
        "metric_history": evaluator.get("metric_history", []),
    }
    for k in ("val_loss", "perplexity", "target", "time_to_target_s", "target_step"):
        if k in evaluator:
            s[k] = evaluator[k]
    if cfg.batch_schedule and cfg.batch_schedule != "auto":  # global_batch is the first epoch's
        from dtrain.training.checkpointing import fresh_batch_plan

        s["batch_per_epoch"] = fresh_batch_plan(cfg, 1).batches
    if cfg.precision != "fp32":
        s["precision"] = cfg.precision
        if cfg.precision == "fp16":  # steps skipped for overflow (the most any rank skipped; agreed ranks skip alike)
            s["overflow_steps"] = max(int(w.get("overflow_steps", 0)) for w in workers)
    if cfg.resume:
        s["resumed_from"] = cfg.resume
        s["start_step"] = max(int(w.get("start_step", 0)) for w in workers)
    for _, r in sorted(results.items()):  # strategy-specific extras (e.g. staleness), the lowest rank's first
        for k, v in r.get("summary_extra", {}).items():
            s.setdefault(k, v)
    memory = {str(r): res["memory"] for r, res in sorted(results.items()) if "memory" in res}
    if memory:  # bytes held per rank by kind (a sharded engine's)
        s["memory_per_rank"] = memory
    if s.get("samples_applied") is not None and train_s > 0:  # parameter server: work done vs work used
        s["computed_samples_per_s"] = s["samples_per_s"]
        s["applied_samples_per_s"] = s["samples_applied"] / train_s
    return s


def run(cfg: RunConfig, *, quiet: bool = False, nodes: NodeArgs | None = None) -> tuple[dict[str, Any], Path]:
    """Run a whole training job from the parent process; returns (summary, run folder).

    The run folder (``cfg.out``) must be new or empty, or replaced with ``overwrite``
    (:func:`open_run_folder`); every check happens before any process starts.

    The strategy's ``resolve`` hook runs first (``auto`` asks the planner and runs
    its first choice); ``cluster="NAME"`` spreads the processes over the hosts
    of an emulated cluster (``dtrain cluster up``) instead of this machine.
    With ``nodes`` of several nodes, this is one node of a job on several machines
    (:func:`run_node`).
    """
    if nodes is not None and nodes.multi:  # this node's share decides the backend (a GPU per local process)
        os.environ["DTRAIN_LOCAL_PROCESSES"] = str(max(1, cfg.num_processes // nodes.nnodes))
    cfg = validate(cfg)
    if nodes is not None and nodes.multi:
        return run_node(cfg, nodes, quiet=quiet)
    if cfg.cluster:
        return _run_on_cluster(cfg, quiet)
    cfg, out = _prepare(cfg, quiet)
    from dtrain.job.restart import RestartLog
    from dtrain.launch.agent import LaunchInterrupted, launch

    restarts = RestartLog(cfg, out, say=(lambda line: None) if quiet else None)
    t0 = time.perf_counter()
    try:
        results = launch(
            worker_main,
            (cfg.to_dict(), str(out)),
            nprocs=cfg.num_processes,
            backend=cfg.process_backend(),
            max_restarts=cfg.max_restarts,
            on_restart=restarts if cfg.max_restarts else None,
        )
    except LaunchInterrupted as e:  # the workers are gone: say where the run stopped and how to go on
        merge_rank_files(out)
        raise LaunchInterrupted(e.signum, _interrupted_message(cfg, out, e.signum)) from None
    finally:
        merge_rank_files(out)
    return _finish(cfg, out, results, time.perf_counter() - t0, restarts), out


def _run_on_cluster(cfg: RunConfig, quiet: bool) -> tuple[dict[str, Any], Path]:
    """``--cluster NAME``: the per-node command on every emulated host (:func:`run_nodes_on_cluster`); node 0
    (host 0) opens the run folder and writes the summary, read back here."""
    from dtrain.cluster.multinode import run_nodes_on_cluster

    out = (Path(cfg.out) if cfg.out else default_out_dir(cfg)).absolute()
    run_nodes_on_cluster(
        dump_toml(cfg.replace(out=str(out))), out, cluster=cfg.cluster, processes=cfg.num_processes, quiet=quiet
    )
    return read_summary(out), out


def _prepare(cfg: RunConfig, quiet: bool) -> tuple[RunConfig, Path]:
    """Resolve the strategy, open the run folder, pin the checkpoint to resume from, write its configuration."""
    cfg = cfg.hooks.resolve(cfg)
    if cfg.tensorboard:  # refused before any process starts where the tensorboard package is missing
        from dtrain.trace import require_tensorboard

        require_tensorboard()
    note = batch_note(cfg.batch_size, cfg.opts.batch_shards(cfg.workers))
    if note and not quiet:  # the effective batch, when --batch-size does not divide over the workers
        print(f"dtrain: {note}", file=sys.stderr, flush=True)
    out = open_run_folder(cfg)
    cfg = cfg.replace(out=str(out))
    if cfg.resume:  # the concrete checkpoint, so every process (and the written configuration) names the same one
        from dtrain.checkpoint import find_checkpoint

        def say(line: str) -> None:  # which checkpoint, how far verified, why a newer one was skipped
            if not quiet:
                print(f"dtrain: {line}", file=sys.stderr, flush=True)

        cfg = cfg.replace(resume=str(find_checkpoint(cfg.resume, checksums=True, report=say).resolve()))
    # recorded without --overwrite: `dtrain run` of it must not delete the run it comes from
    (out / CONFIG).write_text(dump_toml(cfg.replace(overwrite=False)))
    return cfg, out


def _finish(
    cfg: RunConfig, out: Path, results: dict[int, dict[str, Any]], wall_s: float, restarts: Any
) -> dict[str, Any]:
    """The summary (with the attribution) and the run's plots, from every process's result."""
    summary = summarize(cfg, results, wall_s)
    restarts.add_to(summary, results)  # --max-restarts: each restart, and steps over every attempt
    if has_metrics(out):  # straggler and bottleneck attribution over every rank's rows
        summary["attribution"] = attribute(iter_metrics(out)).to_dict()
    write_summary(out, summary)
    if has_metrics(out):
        plot_run(out)
    return summary


def run_node(cfg: RunConfig, nodes: NodeArgs, *, quiet: bool = False) -> tuple[dict[str, Any], Path]:
    """This machine's node of a job on several (``dtrain run --nnodes N --node-rank R --rdzv-endpoint H:P``).

    Node 0 hosts the job's store on the endpoint; the nodes meet there (:class:`dtrain.cluster.nodes.Meeting`:
    the same job, every node present, the same configuration and versions, the run folder seen and writable
    by all), node 0 resolves the strategy and opens the run folder, then every node starts its processes
    through torch's elastic agent. Each node posts its processes' results to the store; node 0 waits for all,
    merges the metrics and writes the summary. Returns (summary, run folder); the summary is empty on the
    other nodes.
    """
    import pickle

    from dtrain.cluster.nodes import Meeting, route_iface
    from dtrain.job.restart import RestartLog
    from dtrain.launch.agent import launch

    nodes, k = _check_nodes(cfg, nodes)
    host, port = nodes.host_port
    iface, addr = route_iface(host, port, nodes.iface)
    R = nodes.node_rank

    def say(line: str) -> None:
        if not quiet:
            print(f"dtrain: {line}", file=sys.stderr, flush=True)

    store = _job_store(nodes)
    say(
        f"node {R} of {nodes.nnodes}: {k} process(es), interface {iface} ({addr}), job {nodes.job!r} at "
        f"{nodes.endpoint}" + (" (from SLURM)" if nodes.source == "slurm" else "")
    )
    meeting = Meeting(nodes, store, say=say)
    ns = f"dtrain/{nodes.job}"
    try:
        cfg, out, arrived = _meet(meeting, cfg, R, quiet)
        spec = _node_spec(nodes, f"{host}:{port}", addr, iface)
        restarts = RestartLog(cfg.replace(min_workers=0), out, say=(lambda line: None) if quiet else None)

        def on_restart(restart: Any) -> None:  # said and logged; the node keeps its processes (the rendezvous
            restarts(restart)  # decides the world: a lost node's processes are left out)

        t0 = time.perf_counter()
        try:
            results = launch(
                worker_main,
                (cfg.to_dict(), str(out)),
                nprocs=k,
                node=spec,
                backend=cfg.process_backend(),
                run_id=nodes.job,
                max_restarts=cfg.max_restarts,
                on_restart=on_restart if cfg.max_restarts else None,
            )
        except BaseException as e:
            store.set(f"{ns}/results/{R}", pickle.dumps((False, f"{type(e).__name__}: {e}")))
            raise
        store.set(f"{ns}/results/{R}", pickle.dumps((True, results)))
        if R != 0:
            return {}, out
        merged = _gather_results(store, ns, arrived, results, nodes.rdzv_timeout_s)
        if len(merged) < cfg.num_processes:  # went on without a lost node
            restarts.shrank_to(len(merged), sum(1 for r in merged.values() if r.get("role") == "worker"))
        merge_rank_files(out)
        return _finish(cfg, out, merged, time.perf_counter() - t0, restarts), out
    finally:  # node 0 returns only once every node has posted its results: none of them needs the store after
        meeting.close()


def _meet(meeting: Meeting, cfg: RunConfig, node_rank: int, quiet: bool) -> tuple[RunConfig, Path, list[int]]:
    """The nodes meet: node 0 prepares the run and publishes it, the others take it; (configuration, run
    folder, the node ranks that arrived), the run folder checked on every node."""
    meeting.open()
    arrived = sorted(meeting.arrive(cfg.to_dict()))
    if node_rank == 0:
        cfg, out = _prepare(cfg, quiet)
        meeting.publish_plan(cfg.to_dict(), out)
    else:
        cfg = RunConfig.from_mapping(meeting.plan())
        out = Path(cfg.out)
    meeting.check_paths(out, cfg.resume)
    return cfg, out, arrived


def _node_spec(nodes: NodeArgs, endpoint: str, addr: str, iface: str) -> NodeSpec:
    """What torch's elastic agent needs of this node: the rendezvous on node 0's store, the interface to use."""
    from dtrain.launch.agent import NodeSpec

    return NodeSpec(
        nnodes=nodes.nnodes,
        min_nodes=nodes.min_nodes,
        rdzv_endpoint=endpoint,
        is_host=False,
        local_addr=addr,
        env={"GLOO_SOCKET_IFNAME": iface, "NCCL_SOCKET_IFNAME": iface},
        job_store=endpoint,
        node_rank=nodes.node_rank,
        rdzv_timeout_s=nodes.rdzv_timeout_s,
    )


def _check_nodes(cfg: RunConfig, nodes: NodeArgs) -> tuple[NodeArgs, int]:
    """The node flags against the configuration, before anything connects; (nodes, this node's processes)."""
    if cfg.cluster and os.environ.get("DTRAIN_CLUSTER") != cfg.cluster:  # (set on the nodes --cluster starts)
        raise ConfigError(
            "--cluster starts one node per emulated host itself: drop --nnodes, --node-rank and "
            "--rdzv-endpoint, or --cluster"
        )
    if not cfg.out:
        raise ConfigError(
            "a job on several nodes needs --out: a run folder on a filesystem every node shares "
            "(the default name differs from node to node)"
        )
    nodes = nodes.check()
    k = nodes.processes(cfg.num_processes)
    if nodes.min_nodes < nodes.nnodes:  # elastic: a lost node's processes are left out at the restart
        if cfg.max_restarts < 1:
            raise ConfigError(
                f"--nnodes {nodes.min_nodes}:{nodes.nnodes} goes on without a lost node by restarting "
                "the others from the newest checkpoint: add --max-restarts N and --checkpoint-every K"
            )
        servers = cfg.num_processes - cfg.workers
        validate(cfg.replace(min_workers=nodes.min_nodes * k - servers))  # every count from MIN up must train
    return nodes, k


def _job_store(nodes: NodeArgs) -> Any:
    """Node 0: the job's store, hosted on the endpoint's address; the others: a client of it."""
    import socket

    from dtrain.cluster.nodes import NodeError, connect_store
    from dtrain.launch.agent import host_store

    host, port = nodes.host_port
    if nodes.node_rank != 0:
        return connect_store(host, port, nodes.rdzv_timeout_s)
    try:
        ip = socket.gethostbyname(host)
    except OSError as e:
        raise NodeError(f"--rdzv-endpoint {host}:{port}: cannot resolve {host!r} ({e})") from None
    return host_store(ip, port, nodes.rdzv_timeout_s)


def _gather_results(
    store: Any, ns: str, nodes: list[int], own: dict[int, dict[str, Any]], timeout_s: float
) -> dict[int, dict[str, Any]]:
    """Node 0: every node's processes' results, until they cover the world the processes ran in."""
    import pickle

    from dtrain.launch.agent import LaunchError

    world = max((int(r.get("world", 0)) for r in own.values()), default=0)
    merged = dict(own)
    deadline = time.monotonic() + timeout_s
    pending = [r for r in nodes if r != 0]
    while pending and len(merged) < world:
        for r in list(pending):
            if store.check([f"{ns}/results/{r}"]):
                ok, value = pickle.loads(store.get(f"{ns}/results/{r}"))
                if not ok:
                    raise LaunchError(f"node {r} failed: {value}")
                merged.update(value)
                pending.remove(r)
        if time.monotonic() > deadline:
            raise LaunchError(
                f"node 0 has the results of {len(merged)} of {world} processes; node(s) "
                f"{', '.join(map(str, pending))} posted none within {timeout_s:.0f} s"
            )
        time.sleep(0.05)
    return merged


def _interrupted_message(cfg: RunConfig, out: Path, signum: int) -> str:
    """One line for a run a signal stopped: the step it got to, the newest complete checkpoint (of this
    run folder, else the one this run resumed from) and the command that resumes from it (the run's own
    configuration; a new run folder, as :func:`open_run_folder` wants for a resumed run).

    The step counts steps completed, as checkpoints do: one more than the last step index any worker
    wrote to its metrics, or the checkpoint's step where that is later (a row may lag its step).
    """
    import shlex
    import signal

    from dtrain.checkpoint import CheckpointError, find_checkpoint, read_info

    rows = iter_metrics(out)
    done = max((int(r["step"]) + 1 for r in rows if "step" in r), default=0)
    try:
        ckpt: Path | None = find_checkpoint(out)
    except CheckpointError:
        ckpt = Path(cfg.resume) if cfg.resume else None
    saved = int(read_info(ckpt)["step"]) if ckpt is not None else 0
    done = max(done, saved)
    name = signal.Signals(signum).name
    head = f"interrupted ({name}) at step {done}" if done else f"interrupted ({name}) before the first step"
    if ckpt is None:
        return f"{head}; no checkpoint to resume from (--checkpoint-every N saves some)"
    base = out if out.name else out.resolve()  # --out .
    to, n = base.with_name(f"{base.name}-resumed"), 1
    while to.exists():
        n += 1
        to = base.with_name(f"{base.name}-resumed-{n}")
    command = ["dtrain", "run", str(out / CONFIG), "--resume", str(ckpt), "--out", str(to)]
    return f"{head}; last complete checkpoint: step {saved}; resume with: {shlex.join(command)}"
