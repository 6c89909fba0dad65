"""``dtrain plan``: rank strategies for a model on a cluster, or simulate a scaling curve.

Examples::

    dtrain plan --model cnn --batch 64 --cluster cluster.toml
    dtrain plan --model cnn --emulated emu            # an emulated cluster's calibration
    dtrain plan --model cnn                           # this machine (quick calibration, cached)
    dtrain plan --model gpt-small --memory-limit 2GB  # devices of 2 GB: ZeRO (dp --shard) where dp does not fit
    dtrain plan --simulate --workers 8,16,32,64,128 --model my_models.py:vgg16 \\
        --cluster benchmarks/clusters/horovod_tcp.toml --device-batch 64 \\
        --strategies dp:ring,ps:asp:1/8 --stragglers lognormal:0.1 --png scaling.png

Strategy text for ``--strategies``: ``dp:ALGORITHM[:BUCKET_MB]``, ``ddp``,
``ps:CONSISTENCY:SERVERS`` (``SERVERS`` a number or ``1/K``: one server per K
workers), each optionally ``+COMPRESSOR`` (``dp:ring+fp16``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace

from dtrain.config.files import parse_model_args
from dtrain.errors import ConfigError, run_command
from dtrain.perfmodel.hooks import ModelHooks
from dtrain.perfmodel.profile import profile_model
from dtrain.perfmodel.ranking import DEFAULT_COMPRESSIONS, parse_memory_limit
from dtrain.perfmodel.simulator import SimResult, Stragglers, simulate_steps
from dtrain.perfmodel.spec import ClusterSpec, load_cluster
from dtrain.planning.auto import cluster_for, plan
from dtrain.registry import Choice, registered
from dtrain.workloads.load import load_model

__all__ = ["main", "parse_strategy"]


def parse_strategy(text: str, workers: int) -> Choice:
    """One ``--strategies`` item for ``workers`` workers: ``NAME[:FIELD...][+COMPRESSOR]``, the fields read by
    the strategy's own ``parse`` hook (:class:`~dtrain.perfmodel.hooks.ModelHooks`; see the module docstring)."""
    body, _, comp = text.partition("+")
    name, *args = body.split(":")
    readable = {n: h for n, e in registered().items() if (h := ModelHooks.of(e)).parse is not None}
    hooks = readable.get(name)
    if hooks is not None and hooks.parse is not None:
        try:
            return hooks.parse(args, comp or "none", workers)
        except (IndexError, ValueError):
            pass  # fields the hook cannot read: the same refusal as an unknown name, with the syntaxes
    syntax = ", ".join(h.text or n for n, h in sorted(readable.items()))  # by name: not the registration order
    raise ConfigError(f"cannot read strategy {text!r}; use {syntax}, each optionally +COMPRESSOR")


def _cluster(ns: argparse.Namespace) -> ClusterSpec | None:
    if ns.cluster and ns.emulated:
        raise ConfigError("give --cluster FILE or --emulated NAME, not both")
    if ns.cluster:
        return load_cluster(ns.cluster)
    if ns.emulated:
        return cluster_for(ns.emulated)
    return None


def _simulate(ns: argparse.Namespace) -> int:
    from dtrain.perfmodel.compression import compression_model

    spec = _cluster(ns)
    if spec is None:
        from dtrain.planning.calibrate import local_cluster

        spec = local_cluster()
    workers = [int(w) for w in ns.workers.split(",")]
    model, sample, name = load_model(
        ns.model, ns.dataset, batch=ns.batch or 64, seq_len=ns.seq_len, model_args=parse_model_args(ns.model_arg or [])
    )
    strag = Stragglers.parse(ns.stragglers)
    base_batch = sample[0].shape[0] if isinstance(sample, (tuple, list)) else sample.shape[0]
    base = profile_model(model, sample, name=name, measure=not ns.no_measure, threads=spec.device.threads)
    curves: dict[str, list[SimResult]] = {}
    for text in ns.strategies.split(","):
        rows = []
        for w in workers:
            s = parse_strategy(text, w)
            b = ns.device_batch or max(1, (ns.batch or base_batch) // s.workers)
            spec_c = s.opts.compressor_spec()
            comp = compression_model(spec_c, spec) if spec_c != "none" else None
            c = replace(spec.with_devices(s.processes), models=spec.models, compressors=spec.compressors)
            rows.append(
                simulate_steps(
                    base.at_batch(b), c, s, comp=comp, stragglers=strag, steps=ns.steps, overhead_s=spec.device.overhead
                )
            )
        curves[text] = rows
    scaling = "weak" if ns.device_batch else "strong"
    print(f"simulated on {spec.describe()}; {scaling} scaling, stragglers {strag}, {ns.steps} steps")
    print(f"{'strategy':<22}{'workers':>8}{'samples/s':>12}{'efficiency':>11}{'step ms':>10}{'wait':>7}{'stale':>12}")
    for text, rows in curves.items():
        for r in rows:
            st = f"{r.staleness_mean:.1f}/{r.staleness_max}" if r.staleness and r.staleness_max else "-"
            print(
                f"{text:<22}{r.workers:>8}{r.samples_per_s:>12.4g}{r.efficiency:>10.1%}{r.step_s * 1e3:>10.4g}"
                f"{r.wait_frac:>7.0%}{st:>12}"
            )
    if ns.png:
        _plot(curves, ns.png, f"{name} on {spec.name} ({scaling} scaling, stragglers {strag})")
        print(f"wrote {ns.png}")
    return 0


def _plot(curves: dict[str, list[SimResult]], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--png needs matplotlib: pip install matplotlib (or dtrain[plot])") from None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for text, rows in curves.items():
        w = [r.workers for r in rows]
        a1.plot(w, [r.samples_per_s for r in rows], marker="o", label=text)
        a2.plot(w, [100 * r.efficiency for r in rows], marker="o", label=text)
    for a in (a1, a2):
        a.set_xscale("log", base=2)
        a.set_xlabel("workers")
        a.grid(alpha=0.3)
    a1.plot(w, [rows[0].samples_per_s / rows[0].efficiency / rows[0].workers * x for x in w], "k:", label="ideal")
    a1.set_yscale("log")
    a1.set_ylabel("samples/s")
    a2.set_ylabel("scaling efficiency %")
    a2.set_ylim(0, 105)
    a1.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="dtrain plan",
        description="Rank strategies by predicted step time (or, with --simulate, replay them for many workers).",
    )
    ap.add_argument(
        "--model",
        default="cnn",
        help="cnn, mlp, gpt-tiny, gpt-small, gpt-medium (on pytext), "
        "FILE.py:FUNCTION / MODULE:FUNCTION returning a model or (model, batch), or hf:TYPE (a "
        "transformers architecture built from its config)",
    )
    ap.add_argument(
        "--model-arg",
        dest="model_arg",
        action="append",
        metavar="KEY=VALUE",
        help="a keyword argument of --model, as dtrain run takes it (repeatable)",
    )
    ap.add_argument("--seq-len", type=int, default=64, help="a gpt model's context in tokens (default: 64)")
    ap.add_argument("--dataset", default="digits", help="dataset for dtrain's models (default: digits)")
    ap.add_argument("--batch", type=int, default=None, help="global batch (default: 64, or the function's batch)")
    ap.add_argument("--cluster", default="", help="cluster TOML (default: this machine, calibrated once)")
    ap.add_argument("--emulated", default="", help="an emulated cluster's name (uses its calibration)")
    ap.add_argument("--workers", default="", help="devices to plan for (default: all); with --simulate a list 8,16,...")
    ap.add_argument("--top", type=int, default=0, help="show only the best K (default: all)")
    ap.add_argument("--exact", action="store_true", help="only strategies equivalent to one-process training")
    ap.add_argument(
        "--averaging",
        action="store_true",
        help="also rank model averaging (local_sgd, easgd, gossip): cheaper steps, different optimisation",
    )
    ap.add_argument(
        "--mesh",
        action="store_true",
        help="also rank tensor parallelism and every DP x PP x TP factorization (gpt models, and a model with a "
        "list of repeated blocks whose attention its derived plan splits)",
    )
    ap.add_argument(
        "--pipeline",
        action="store_true",
        help="also rank pipelines (gpipe, 1f1b, interleaved, 2bw) of one stage per device",
    )
    ap.add_argument("--compressions", default=",".join(DEFAULT_COMPRESSIONS), help="compressors to try")
    ap.add_argument("--no-measure", action="store_true", help="do not time the model here (FLOPs only)")
    ap.add_argument(
        "--memory-limit",
        default="",
        help="memory per device to plan for (2GB, 512MB, 1.5GiB or bytes; "
        "default: the cluster's): strategies that need more are rejected",
    )
    tpg = ap.add_argument_group("tensor parallelism")
    tpg.add_argument(
        "--show-tp-plan",
        action="store_true",
        help="print the tensor-parallel plan --strategy tensor splits --model by (derived for a model without a "
        "hand-written one) and exit",
    )
    tpg.add_argument("--tp", type=int, default=2, help="with --show-tp-plan: the tensor-parallel size (default: 2)")
    tpg.add_argument(
        "--sequence-parallel", action="store_true", help="with --show-tp-plan: the plan with sequence parallelism"
    )
    sim = ap.add_argument_group("simulation")
    sim.add_argument("--simulate", action="store_true", help="replay the strategies for each worker count")
    sim.add_argument("--strategies", default="dp:ring", help="comma list: dp:ALG[:MB], ddp, ps:POLICY:SERVERS[+COMP]")
    sim.add_argument("--device-batch", type=int, default=0, help="samples per device (weak scaling)")
    sim.add_argument("--stragglers", default="none", help="none, lognormal:S, slow:F:X, random:P:X")
    sim.add_argument("--steps", type=int, default=20, help="simulated steps per worker (default: 20)")
    sim.add_argument("--png", default="", help="write the scaling curve here")
    return ap


def _show_tp_plan(ns: argparse.Namespace) -> int:
    from dtrain.tensor_parallel.plans import for_model

    if ns.tp < 1:
        raise ConfigError(f"--tp must be >= 1, got {ns.tp}")
    model, _, name = load_model(
        ns.model, ns.dataset, batch=2, seq_len=ns.seq_len, model_args=parse_model_args(ns.model_arg or [])
    )
    plan = for_model(model, ns.tp, sequence_parallel=ns.sequence_parallel)
    print(f"{name} over {ns.tp} tensor-parallel ranks{' with sequence parallelism' if ns.sequence_parallel else ''}")
    print(plan.text())
    return 0


def _plan(ns: argparse.Namespace) -> int:
    if ns.show_tp_plan:
        return _show_tp_plan(ns)
    if ns.simulate:
        if not ns.workers:
            raise ConfigError("--simulate needs --workers, e.g. 8,16,32,64")
        return _simulate(ns)
    limit = parse_memory_limit(ns.memory_limit) if ns.memory_limit else None  # before anything is loaded
    spec = _cluster(ns)
    workers = int(ns.workers) if ns.workers else None
    model, sample, name = load_model(
        ns.model, ns.dataset, batch=ns.batch or 64, seq_len=ns.seq_len, model_args=parse_model_args(ns.model_arg or [])
    )
    comps = tuple(c for c in ns.compressions.split(",") if c)
    p = plan(
        model,
        sample,
        spec,
        batch=ns.batch,
        workers=workers,
        name=name,
        compressions=comps,
        exact_only=ns.exact,
        measure=not ns.no_measure,
        averaging=ns.averaging,
        pipeline=ns.pipeline,
        memory_limit=limit,
        mesh=ns.mesh,
    )
    print(p.table(top=ns.top or None))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ns = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    return run_command("dtrain plan", lambda: _plan(ns), also=(ValueError,))


if __name__ == "__main__":
    # run the importable module's main, so worker functions pickle as dtrain.planning.cli.*, not __main__.*
    from dtrain.planning.cli import main as _main

    sys.exit(_main())
