"""``dtrain run --strategy ps``: the parameter server inside the training loop.

:func:`run_process` runs in every process of the job (``servers + workers`` of
them). Ranks ``0..S-1`` serve; worker ``i`` (rank ``S + i``) trains on shard ``i``
of the data (the data is split among workers only).

The amount of work is a budget of gradients, the same for every policy:
``workers x steps`` (steps from the epochs and ``max_steps`` as in data
parallelism). Each worker cycles through its shard until the servers report that
the budget is spent, so under asynchronous policies a fast worker computes more
gradients than a straggler instead of idling at the end -- which is the point of
those policies. Worker 0 evaluates its copy of the model after each pass over its
shard (the accuracy history) and the final model after :meth:`finish`.

``--straggler RANK:FACTOR`` (and an emulated host's ``DTRAIN_SLOWDOWN``) makes
that worker's own work ``FACTOR`` times slower (:class:`dtrain.cluster.Straggler`).
Its own work in a step is everything from the previous ``ps.step()``'s return to
the end of backward -- bookkeeping, the next batch, forward, backward: what
``WorkerStats.compute_s`` counts -- and the parameter exchange is not slowed (a
slow machine on the same network). After each backward pass it sleeps so that
this work takes ``FACTOR`` times its reference, the median own work of its last
50 steps in this run.

Checkpoints (``--checkpoint-every N``, bsp only): each server saves its shard,
optimizer state and clock table from the ``on_update`` hook right after update
``k * N`` (and the last one), when every worker has just been released; each
worker saves its clock, compressor state, data position and RNGs after its step
``k * N``; one collective save (:class:`dtrain.checkpoint.training.RunCheckpointer`)
holds them all. ``--resume`` hands each rank its own state back
(``ParameterServer(state=...)``): servers restore before serving, workers pull
the checkpoint's parameters at their saved clock and continue mid-epoch.

At the end every process publishes its :meth:`ParameterServer.stats` to the c10d
store; the first server merges them, writes ``ps_stats.json`` to the run folder,
prints a table, and returns ``staleness`` and ``clock_lag`` (``{max, mean, hist}``
over all servers' applied gradients) for ``summary.json``.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

import torch
from torch import nn

from dtrain.errors import ConfigError
from dtrain.param_server.consistency import parse_consistency
from dtrain.param_server.parameter_server import ParameterServer
from dtrain.param_server.server import hist_summary

__all__ = ["run_process", "lr_scale", "format_table", "merge_stats"]



def run_process(ctx: Any) -> dict[str, Any]:
    """One process of a parameter-server run (``ctx`` is a :class:`dtrain.train.TrainContext`)."""
    c = ctx.cfg
    servers = c.servers
    workers = ctx.world_size - servers
    if workers < 1:
        raise ConfigError(f"--strategy ps needs workers >= 1 besides the {servers} servers")
    steps = ctx.total_steps(workers)
    if steps < 1:
        raise ConfigError("the data shard of each worker is smaller than one batch; use a smaller batch size")
    comp = ctx.make_compressor()  # with momentum in it for sign/onebit; the servers' optimizer then has none
    from dtrain.checkpoint.training import RunCheckpointer

    ckpt = RunCheckpointer.create(c, ctx.out_dir)  # its group before the parameter server's, on every rank
    blob: dict[str, Any] | None = None
    if ckpt is not None and ckpt.resume_from is not None:
        _, blob = ckpt.restore()
    model = ctx.make_model()
    scale = lr_scale(c.consistency, workers)

    def optimizer_factory(params: Any) -> torch.optim.Optimizer:
        opt: torch.optim.Optimizer = ctx.make_optimizer(params)
        for group in opt.param_groups:
            group["lr"] = group["lr"] * scale
        return opt

    holder: list[ParameterServer] = []

    def on_update(version: int, spent: bool) -> None:  # servers: after an update's replies went out
        if ckpt is not None and ckpt.due(version, final=spent):
            ckpt.save(version, rank_state={"ps": holder[0].state_dict()}, updates=version)

    ps = ParameterServer(
        model, optimizer_factory, servers=servers, consistency=c.consistency, staleness_lr=c.staleness_lr,
        compression=comp, timeout_s=c.timeout_s, max_gradients=workers * steps,
        state=blob["ps"] if blob is not None else None, on_update=on_update if ckpt is not None else None,
    )
    holder.append(ps)
    if ps.is_server:
        return _serve(ctx, ps)
    return _work(ctx, ps, model, workers, steps, ckpt, blob)


def lr_scale(consistency: str, workers: int) -> float:
    """Learning-rate factor so that ``--lr`` means the rate of a global batch under every policy.

    An update averages ``m`` of the ``W`` workers' gradients (``m = W`` for bsp,
    ``W - b`` for backup:b, ``k`` for softsync:k, 1 for asp and ssp), i.e. a batch
    ``m / W`` of the global one; the linear scaling rule (Goyal et al. 2017) gives
    it ``lr * m / W``. Without it an asynchronous run takes ``W`` full-size steps
    per global batch and diverges where bsp converges.
    """
    spec = parse_consistency(consistency)
    per_update = {"bsp": workers, "backup": workers - spec.arg, "softsync": min(spec.arg, workers)}.get(spec.kind, 1)
    return per_update / workers


def _serve(ctx: Any, ps: ParameterServer) -> dict[str, Any]:
    stats = ps.serve()
    store = ps.store
    store.set(_stats_key(ps, ps.rank), json.dumps(stats))
    out: dict[str, Any] = {"role": "server", "ps": stats}
    if ps.rank != 0:
        return out
    lost = {int(w) for w in stats["lost"]}
    ranks = [r for r in range(ps.world_size) if r not in lost]
    everything = _collect(store, [_stats_key(ps, r) for r in ranks], timeout_s=min(60.0, ctx.cfg.timeout_s))
    merged = merge_stats(list(everything.values()), batch_per_worker=ctx.cfg.batch_size // ps.num_workers)
    (ctx.out_dir / "ps_stats.json").write_text(json.dumps(merged, indent=2) + "\n")
    if ctx.cfg.extra.get("ps_table", True):
        print(format_table(merged), flush=True)
    out["summary_extra"] = {
        "consistency": merged["consistency"],
        "servers": merged["servers"],
        "staleness": merged["staleness"],
        "clock_lag": merged["clock_lag"],
        "updates": merged["updates"],
        "gradients_dropped": merged["gradients_dropped"],
        "samples_computed": merged["samples_computed"],
        "samples_applied": merged["samples_applied"],
        "lost_workers": merged["lost_workers"],
        "bytes_received_per_step": merged["bytes_received_per_step"],
    }
    return out


def _work(ctx: Any, ps: ParameterServer, model: nn.Module, workers: int, steps: int, ckpt: Any = None,
          blob: dict[str, Any] | None = None) -> dict[str, Any]:
    c = ctx.cfg
    i = ps.worker_index
    evaluator = i == 0
    loss_fn = nn.CrossEntropyLoss()
    slow = ctx.straggler()
    start, epoch, first_batch = 0, 0, 0
    if blob is not None:  # resumed: this worker's clock and data position at the checkpoint
        start, epoch, first_batch = int(blob["ps"]["clock"]), int(blob["epoch"]), int(blob["batch"])
        if first_batch >= ctx.steps_per_epoch(workers):
            epoch, first_batch = epoch + 1, 0
    bar = ctx.progress(steps - start, evaluator)
    step, samples, losses, history = start, 0, [], []
    eval_s = 0.0
    t_start = time.perf_counter()
    sent_before = 0
    while not ps.should_stop:
        batches = first_batch
        data = iter(ctx.loader(i, workers, epoch, start_batch=first_batch))
        first_batch = 0
        if blob is not None:  # after building the iterator, which draws from torch's generator
            ckpt.restore_rng(blob)
            blob = None
        t_free = time.perf_counter()  # the worker's own work of a step starts (the straggler's measure)
        for x, y in data:
            batches += 1
            t0 = time.perf_counter()
            with ctx.tracer.span("step", step=step):
                with ctx.tracer.span("forward"):
                    loss = loss_fn(model(x), y)
                with ctx.tracer.span("backward"):
                    loss.backward()
                loss_v = float(loss.detach())
                slow.stretch(time.perf_counter() - t_free)
                with ctx.tracer.span("ps.step"):
                    ps.step()
                t_free = time.perf_counter()
            dt = time.perf_counter() - t0
            last = ps.last_step
            st = ps.stats()
            ctx.metrics.write(
                step=step, epoch=epoch, loss=loss_v, lr=c.lr * lr_scale(c.consistency, workers),
                samples_per_s=len(y) / dt,
                compute_s=dt - last["push_s"] - last["wait_s"] - last["pull_s"],
                comm_s=last["push_s"] + last["pull_s"], wait_s=last["wait_s"],
                bytes_sent=st["bytes_sent"] - sent_before,
            )
            sent_before = st["bytes_sent"]
            losses.append(loss_v)
            samples += len(y)
            step += 1
            bar.update(1)
            if step % 10 == 0:
                bar.set_postfix(loss=f"{loss_v:.3f}", refresh=False)
            if ckpt is not None and ckpt.due(step, final=ps.should_stop):
                with ctx.tracer.span("checkpoint", step=step):
                    ckpt.save(step, rank_state={"ps": ps.state_dict(), "epoch": epoch, "batch": batches})
                t_free = time.perf_counter()
            if ps.should_stop:
                break
        if batches == 0:
            raise ConfigError(f"worker {i}'s data shard yields no batch; use a smaller batch size")
        if evaluator:
            te = time.perf_counter()
            acc = ctx.evaluate(model)
            eval_s += time.perf_counter() - te
            history.append((round(time.perf_counter() - t_start - eval_s, 4), epoch, acc))
            if c.progress:
                bar.write(f"epoch {epoch}: test accuracy {acc:.4f} (worker 0's copy)")
        epoch += 1
    train_s = time.perf_counter() - t_start - eval_s
    ps.finish()
    bar.close()
    st = ps.stats()
    ps.store.set(_stats_key(ps, ps.rank), json.dumps(st))
    out: dict[str, Any] = dict(
        role="worker", steps=step - start, start_step=start, samples=samples, train_s=train_s,
        final_loss=sum(losses[-10:]) / max(1, len(losses[-10:])), bytes_sent=st["bytes_sent"], ps=st,
    )
    if slow.active:
        out["straggler"] = {"factor": slow.factor, "reference_s": slow.reference_s}
    if evaluator:
        out["test_accuracy"] = ctx.evaluate(model)  # the final parameters, pulled by finish()
        out["accuracy_history"] = history
    return out


# ---------------------------------------------------------------------- stats


def _stats_key(ps: ParameterServer, rank: int) -> str:
    return f"{ps.store_prefix}/stats/{rank}"


def _collect(store: Any, keys: list[str], timeout_s: float) -> dict[str, dict[str, Any]]:
    import datetime

    out: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    for key in keys:
        left = max(0.1, deadline - time.monotonic())
        try:
            store.wait([key], datetime.timedelta(seconds=left))
            out[key] = json.loads(store.get(key).decode())
        except Exception:  # noqa: BLE001 - a rank that died after finishing: report without it
            continue
    return out


def merge_stats(stats: list[dict[str, Any]], batch_per_worker: int | None = None) -> dict[str, Any]:
    """Combine the processes' :meth:`ParameterServer.stats` into one report.

    Work done and work used: ``gradients_computed`` is the workers' steps (every
    gradient pushed), ``gradients_applied`` the gradients the first server put into
    an update (as for ``updates`` and ``gradients_dropped``, the first server's
    count; every server sees every gradient). With ``batch_per_worker`` (every gradient is of that
    many samples, as in ``dtrain run``, whose loaders drop the last partial batch)
    they become ``samples_computed`` and ``samples_applied`` -- the same under bsp,
    asp, ssp and softsync; about ``N / (N + b)`` of it under backup:b, which drops
    the ``b`` latest gradients of every update while all ``N + b`` workers work (Chen et al. 2016, "Revisiting
    Distributed Synchronous SGD"), so applied samples per second is the training
    throughput and computed samples per second the hardware's.

    Args:
        stats: every process's :meth:`ParameterServer.stats`.
        batch_per_worker: samples per gradient (default: None, no sample counts).
    """
    servers = sorted((s for s in stats if s["role"] == "server"), key=lambda s: s["rank"])
    workers = sorted((s for s in stats if s["role"] == "worker"), key=lambda s: s["rank"])
    stale: Counter[int] = Counter()
    lag: Counter[int] = Counter()
    lost: dict[str, str] = {}
    for s in servers:
        stale.update({int(k): v for k, v in s["staleness"]["hist"].items()})
        lag.update({int(k): v for k, v in s["clock_lag"]["hist"].items()})
        lost.update(s["lost"])
    first = (servers or workers or [{}])[0]
    computed = sum(int(w["steps"]) for w in workers)
    applied = sum(servers[0]["applied"].values()) if servers else 0
    return {
        "consistency": first.get("consistency"),
        "servers": first.get("servers"),
        "workers": first.get("workers"),
        "staleness": hist_summary(stale),
        "clock_lag": hist_summary(lag),
        "updates": servers[0]["updates"] if servers else 0,
        "gradients_dropped": sum(sum(s["dropped"].values()) for s in servers[:1]),
        "gradients_computed": computed,
        "gradients_applied": applied,
        "samples_computed": computed * batch_per_worker if batch_per_worker is not None else None,
        "samples_applied": applied * batch_per_worker if batch_per_worker is not None else None,
        "lost_workers": lost,
        "bytes_received_per_step": (
            sum(w["bytes_received"] / max(1, w["steps"]) for w in workers) / len(workers) if workers else 0.0
        ),
        "per_server": servers,
        "per_worker": workers,
    }


def _n(k: int, word: str) -> str:
    return f"{k} {word}" + ("" if k == 1 else "s")


def format_table(m: dict[str, Any]) -> str:
    """The end-of-run table: one row per server, one per worker."""
    lines = [
        f"parameter server: {_n(m['servers'], 'server')}, {_n(m['workers'], 'worker')}, "
        f"consistency {m['consistency']}; "
        f"staleness mean {m['staleness']['mean']:.2f} max {m['staleness']['max']}, "
        f"clock lag mean {m['clock_lag']['mean']:.2f} max {m['clock_lag']['max']}",
        f"{'rank':>4} {'server':<7}{'updates':>8}{'applied':>9}{'dropped':>9}{'stale':>7}{'lag':>6}"
        f"{'MB in':>9}{'MB out':>9}{'busy':>7}",
    ]
    for s in m["per_server"]:
        busy = s["busy_s"] / s["wall_s"] if s["wall_s"] else 0.0
        lines.append(
            f"{s['rank']:>4} {'':<7}{s['updates']:>8}{sum(s['applied'].values()):>9}{sum(s['dropped'].values()):>9}"
            f"{s['staleness']['mean']:>7.2f}{s['clock_lag']['mean']:>6.2f}{s['bytes_in'] / 1e6:>9.2f}"
            f"{s['bytes_out'] / 1e6:>9.2f}{busy:>7.0%}"
        )
    lines.append(
        f"{'rank':>4} {'worker':<7}{'steps':>8}{'compute':>9}{'push':>9}{'wait':>7}{'pull':>6}{'MB out':>9}{'MB in':>9}"
    )
    for w in m["per_worker"]:
        lines.append(
            f"{w['rank']:>4} {'':<7}{w['steps']:>8}{w['compute_s']:>8.2f}s{w['push_s']:>8.2f}s{w['wait_s']:>6.1f}s"
            f"{w['pull_s']:>5.2f}s{w['bytes_sent'] / 1e6:>9.2f}{w['bytes_received'] / 1e6:>9.2f}"
        )
    first = m["per_server"][0]["rank"] if m["per_server"] else "-"
    work = f"gradients: {m['gradients_computed']} computed, {m['gradients_applied']} applied (server {first})"
    if m.get("samples_computed") is not None:
        work += f"; samples: {m['samples_computed']} computed, {m['samples_applied']} applied"
    lines.append(work)
    for r, why in m["lost_workers"].items():
        lines.append(f"worker rank {r} was dropped: {why}")
    return "\n".join(lines)
