"""Time to target on an emulated cluster: which strategy gets a model to a validation loss soonest.

For each link rate: bring up an emulated cluster (one network namespace per host,
tbf-shaped links), calibrate it (``dtrain bench calibrate`` on the same model),
predict every strategy's step time with the planner, then train each strategy from
the same seed to the same validation-loss target (``dtrain run --target``, one
torchrun node per host) with torch DDP as the peer in the same run. The table gives
wall time to target (training seconds from the first step, evaluations excluded),
the speedup over DDP, steps, bytes sent per step and worker, the final and the best
metric, and the planner's predicted step time beside the measured median; for
dtrain's data parallel also the mean compute and communication time per step and
the step time over max(compute, communication) (1.00: perfect overlap). A strategy
that does not reach the target within ``--max-steps`` stays in the table with its
best metric. A plot per rate (time on x, validation loss on y, a line per strategy)
is written to ``--out``.

Run (root)::

    python benchmarks/time_to_target.py --bandwidths 100mbit,1gbit --hosts 4 --model gpt-small --target 3.0

A strategy is ``ddp``, ``dp:ALGORITHM[:OVERLAP]`` or ``ps:CONSISTENCY:SERVERS`` (``ps:ssp:3:2``), each
with an optional ``+COMPRESSOR`` (``dp:ring+powersgd:4``), or model averaging: ``local_sgd:PERIOD[:WARMUP]``,
``easgd:ALPHA:PERIOD[:SERVERS]``, ``gossip:TOPOLOGY[:async]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

DEFAULT = "ddp,dp:ring,dp:ring:forward,dp:tree,dp:ring+fp16,dp:ring+topk:0.01,dp:ring+powersgd:4,ps:bsp:2,ps:asp:2"


def strategy_options(spec: str, hosts: int) -> dict[str, Any]:
    """RunConfig keys for one ``--strategies`` entry on ``hosts`` one-process hosts."""
    body, _, comp = spec.partition("+")
    parts = body.split(":")
    if parts[0] == "ddp":
        return dict(strategy="ddp", workers=hosts)
    if parts[0] == "dp":
        kw: dict[str, Any] = dict(strategy="dp", workers=hosts, algorithm=parts[1] if len(parts) > 1 else "ring")
        if len(parts) > 2:
            kw["overlap"] = parts[2]
        if comp:
            kw["compression"] = comp
        return kw
    if parts[0] == "ps":  # ps:CONSISTENCY[:ARG]:SERVERS, e.g. ps:ssp:3:2
        servers = int(parts[-1]) if len(parts) > 2 else 1
        consistency = ":".join(parts[1:-1]) if len(parts) > 2 else parts[1]
        kw = dict(strategy="ps", workers=hosts - servers, servers=servers, consistency=consistency)
        if comp:
            kw["compression"] = comp
        return kw
    if parts[0] == "local_sgd":  # local_sgd:PERIOD[:WARMUP]
        kw = dict(strategy="local_sgd", workers=hosts, period=int(parts[1]) if len(parts) > 1 else 8)
        if len(parts) > 2:
            kw["warmup_steps"] = int(parts[2])
        return kw
    if parts[0] == "easgd":  # easgd:ALPHA:PERIOD[:SERVERS]
        servers = int(parts[3]) if len(parts) > 3 else 0
        return dict(
            strategy="easgd", workers=hosts - servers, alpha=float(parts[1]), period=int(parts[2]), servers=servers
        )
    if parts[0] == "gossip":  # gossip:TOPOLOGY[:async]
        return dict(
            strategy="gossip",
            workers=hosts,
            topology=parts[1] if len(parts) > 1 else "ring",
            mode=parts[2] if len(parts) > 2 else "sync",
        )
    raise SystemExit(f"cannot read strategy {spec!r}")


def _rows(out: Path) -> list[dict[str, Any]]:
    from dtrain.rundir.files import read_metrics

    return read_metrics(out)


def step_figures(cfg: Any, out: Path, warmup: int) -> dict[str, float]:
    """Median step seconds after warm-up, and dtrain's mean compute / communication seconds per step."""
    rows = [r for r in _rows(out) if r["step"] >= warmup and r.get("samples_per_s")]
    per_step = cfg.batch_size if cfg.strategy != "ps" else cfg.batch_size // cfg.workers
    fig = {"step_s": statistics.median(per_step / r["samples_per_s"] for r in rows)} if rows else {}
    for key in ("compute_s", "comm_s"):
        vals = [float(r[key]) for r in rows if r.get(key) is not None]
        if vals and cfg.strategy == "dp":
            fig[key] = statistics.mean(vals)
    return fig


def _predictions(spec: Any, model: Any, sample: Any, todo: dict[str, Any], base: Any) -> dict[str, float]:
    from dtrain.perfmodel.ranking import plan
    from dtrain.strategies import Choice

    choices = {}
    for name, kw in todo.items():
        cfg = base.replace(**kw)
        choices[name] = Choice(cfg.strategy, cfg.workers, cfg.options)
    p = plan(
        model,
        sample,
        spec,
        workers=max(c.workers for c in choices.values()),
        name=base.model,
        strategies=list(choices.values()),
        optimizer="adam",
    )
    out = {}
    for name, c in choices.items():
        found = p.find(c.label())
        out[name] = found.step_s if found else float("nan")
    print(p.table(top=len(choices)))
    return out


def _plot(results: dict[str, dict[str, Any]], path: Path, title: str, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, r in results.items():
        hist = r["summary"].get("metric_history") or []
        ax.plot([h["train_s"] for h in hist], [h["value"] for h in hist], marker=".", label=name)
    ax.axhline(target, color="grey", linestyle="--", linewidth=1)
    ax.set(xlabel="training time (s)", ylabel="validation loss (nats/token)", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _table(bw: str, results: dict[str, dict[str, Any]], preds: dict[str, float], target: float) -> list[str]:
    ddp = results.get("ddp", {}).get("summary", {}).get("time_to_target_s")
    lines = [
        f"\n{'strategy (' + bw + ')':<28}{'to target s':>12}{'vs DDP':>8}{'steps':>7}{'MB/step':>9}"
        f"{'final':>8}{'best':>8}{'pred ms':>9}{'meas ms':>9}{'comp ms':>9}{'comm ms':>9}{'step/max':>9}"
    ]
    for name, r in results.items():
        s, f = r["summary"], r["figures"]
        t = s.get("time_to_target_s")
        best = min((h["value"] for h in s.get("metric_history") or []), default=float("nan"))
        speed = f"{ddp / t:.2f}x" if t and ddp else "-"
        reach = f"{t:.1f}" if t is not None else f"not <={target:g}"
        comp, comm = f.get("compute_s"), f.get("comm_s")
        ratio = f"{f['step_s'] / max(comp, comm):.2f}" if comp and comm and "step_s" in f else "-"
        lines.append(
            f"{name:<28}{reach:>12}{speed:>8}{s['steps']:>7}{s['bytes_sent_per_step'] / 1e6:>9.2f}"
            f"{s['metric']:>8.3f}{best:>8.3f}{preds.get(name, float('nan')) * 1e3:>9.0f}"
            f"{f.get('step_s', float('nan')) * 1e3:>9.0f}"
            f"{comp * 1e3 if comp else float('nan'):>9.0f}{comm * 1e3 if comm else float('nan'):>9.0f}"
            f"{ratio:>9}"
        )
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bandwidths", default="100mbit,1gbit")
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--model", default="gpt-small")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="global batch in windows (default: 16, 4 per worker)")
    ap.add_argument("--lr", type=float, default=2e-3, help="Adam's learning rate (default: 0.002)")
    ap.add_argument("--target", type=float, default=3.0, help="validation loss, nats/token (default: 3.0)")
    ap.add_argument("--max-steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-samples", type=int, default=64, help="validation windows per evaluation")
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the step-time median")
    ap.add_argument("--strategies", default=DEFAULT)
    ap.add_argument("--out", default="runs/time_to_target")
    ap.add_argument("--name", default="ttt")
    ns = ap.parse_args()
    import torch

    import dtrain.cluster as dc
    from dtrain.config.schema import RunConfig
    from dtrain.job.run import run
    from dtrain.planning.calibrate import calibrate_cluster, summary
    from dtrain.workloads.data import load_dataset, unigram_entropy
    from dtrain.workloads.load import load_model

    data = load_dataset("pytext", seq_len=ns.seq_len)
    print(
        f"torch {torch.__version__}; {ns.model} on pytext ({data.source}); unigram entropy of the train text "
        f"{unigram_entropy(data.train.tensors[0]):.3f} nats/token; global batch {ns.batch} x {ns.seq_len} tokens; "
        f"Adam lr {ns.lr}; target validation loss {ns.target} nats/token; {ns.hosts} emulated hosts"
    )
    base = RunConfig.make(
        model=ns.model,
        dataset="pytext",
        seq_len=ns.seq_len,
        batch_size=ns.batch,
        lr=ns.lr,
        optimizer="adam",
        epochs=1000,
        max_steps=ns.max_steps,
        target=ns.target,
        eval_every=ns.eval_every,
        eval_samples=ns.eval_samples,
        trace=False,
        progress=False,
        workers=ns.hosts,
        timeout_s=900.0,
    )
    todo = {s: strategy_options(s, ns.hosts) for s in ns.strategies.split(",")}
    model, sample, _ = load_model(ns.model, "pytext", batch=ns.batch, seq_len=ns.seq_len)
    root = Path(ns.out)
    report: list[str] = []
    for bw in ns.bandwidths.split(","):
        cname = f"{ns.name}_{bw.replace('.', '_')}"[:24]
        dc.down(cname)
        dc.up(cname, hosts=ns.hosts, bandwidth=bw)
        results: dict[str, dict[str, Any]] = {}
        try:
            comps = sorted({kw["compression"] for kw in todo.values() if "compression" in kw})
            spec = calibrate_cluster(
                cname, model=ns.model, dataset="pytext", batch=ns.batch, quick=True, compressions=comps or ("fp16",)
            )
            print(f"\n=== {bw}: calibration\n{summary(spec)}")
            preds = _predictions(spec, model, sample, todo, base)
            for name, kw in todo.items():
                out = root / bw / name.replace(":", "_").replace("+", "_")
                cfg = base.replace(**kw, out=str(out), cluster=cname, overwrite=True)  # its own folder, rerun
                s, _ = run(cfg, quiet=True)
                results[name] = {"summary": s, "figures": step_figures(cfg, out, ns.warmup)}
                t = s.get("time_to_target_s")
                print(
                    f"  {name}: {f'{t:.1f}s' if t is not None else 'target not reached'}, {s['steps']} steps, "
                    f"final {s['metric']:.3f}",
                    flush=True,
                )
        finally:
            dc.down(cname)
        lines = _table(bw, results, preds, ns.target)
        print("\n".join(lines), flush=True)
        report += lines
        (root / bw).mkdir(parents=True, exist_ok=True)
        _plot(results, root / f"time_to_target_{bw}.png", f"{ns.model}, {ns.hosts} hosts at {bw}", ns.target)
    print("\n".join(["\nsummary"] + report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
