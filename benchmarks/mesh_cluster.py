"""Tensor parallelism and DP x PP x TP meshes on an emulated cluster: predicted vs measured step time, and the
planner's first choice vs the measured fastest.

Brings up an emulated cluster (one network namespace per host, tbf-shaped links; root), calibrates it
(``dtrain bench calibrate``), asks the planner (``plan(..., mesh=True)`` over the factorizations below) for
each mesh's predicted step, then runs each with ``dtrain run`` (one torchrun node per host) in interleaved
rounds and compares the median measured step (the metrics rows after warm-up) with the prediction. Ranks of
a tp group are consecutive, so on this cluster of one process per host every group crosses the 1 Gbit links.

Run (root; ~10 minutes)::

    python benchmarks/mesh_cluster.py --bandwidth 1gbit --hosts 4 --steps 20 --rounds 2

The calibration is kept beside the JSON (``mesh_cluster.toml``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from _cluster import measure

from dtrain.strategies import Choice, choice


def systems(hosts: int) -> list[tuple[str, Choice]]:
    """dp (every factor on data), pure tensor, pure pipeline and the mixed meshes of ``hosts`` (4)."""
    from dtrain.strategies.hybrid import HybridOptions, TensorOptions

    out = [("dp ring", choice("dp", hosts, "ring")), (f"tensor tp{hosts}", Choice("tensor", hosts, TensorOptions()))]
    for dp, pp, tp in ((2, 1, 2), (1, 2, 2), (2, 2, 1), (1, hosts, 1)):
        out.append(
            (
                f"hybrid dp{dp} pp{pp} tp{tp}",
                Choice("hybrid", hosts, HybridOptions(dp=dp, pp=pp, tp=tp, microbatches=4 if pp > 1 else 1)),
            )
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bandwidth", default="1gbit")
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--model", default="gpt-small")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default="benchmarks/results/raw/mesh_cluster.json")
    ap.add_argument("--name", default="mesh")
    ns = ap.parse_args()
    import torch

    import dtrain.cluster as dc
    from dtrain.config.schema import RunConfig
    from dtrain.perfmodel.ranking import plan
    from dtrain.perfmodel.spec import dump_cluster
    from dtrain.planning.calibrate import calibrate_cluster, summary
    from dtrain.workloads.load import load_model

    print(
        f"torch {torch.__version__}; {ns.model} on pytext, global batch {ns.batch} x {ns.seq_len} tokens, SGD, "
        f"{ns.hosts} emulated hosts at {ns.bandwidth}, {ns.steps} steps (median after {ns.warmup}), "
        f"{ns.rounds} interleaved rounds"
    )
    base = RunConfig.make(
        model=ns.model,
        dataset="pytext",
        seq_len=ns.seq_len,
        batch_size=ns.batch,
        max_steps=ns.steps,
        epochs=1000,
        lr=0.05,
        trace=False,
        progress=False,
        workers=ns.hosts,
        eval_samples=16,
    )
    todo = systems(ns.hosts)
    cname = f"{ns.name}_{ns.bandwidth.replace('.', '_')}"[:24]
    dc.down(cname)
    dc.up(cname, hosts=ns.hosts, bandwidth=ns.bandwidth)
    times: dict[str, list[float]] = {label: [] for label, _ in todo}
    sent: dict[str, float] = {}
    try:
        spec = calibrate_cluster(cname, model=ns.model, dataset="pytext", batch=ns.batch, quick=True)
        print(summary(spec))
        Path(ns.json).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.json).with_suffix(".toml").write_text(dump_cluster(spec, "mesh_cluster.py's calibration"))
        model, sample, name = load_model(ns.model, "pytext", batch=ns.batch, seq_len=ns.seq_len)
        pr = plan(model, sample, spec, workers=ns.hosts, name=name, strategies=[s for _, s in todo], mesh=True)
        print(pr.table())
        for r in range(ns.rounds):
            for label, s in todo if r % 2 == 0 else list(reversed(todo)):
                cfg = base.replace(strategy=s.strategy, workers=s.workers, options=s.options, cluster=cname)
                t, b = measure(cfg, cname, ns.warmup)
                times[label] += t
                sent[label] = b
                print(f"round {r}: {label:<24} median {statistics.median(t) * 1e3:8.1f} ms", flush=True)
    finally:
        dc.down(cname)
    print(f"\n{'system (' + ns.bandwidth + ')':<28}{'predicted ms':>13}{'measured ms':>12}{'error':>8}{'MB/step':>9}")
    rows = []
    for label, s in todo:
        found = pr.find(s.label())
        pred = found.step_s * 1e3 if found else float("nan")
        med = statistics.median(times[label]) * 1e3
        rows.append(
            {
                "system": label,
                "strategy": s.label(),
                "predicted_ms": pred,
                "measured_ms": med,
                "error": pred / med - 1,
                "bytes_per_step": sent[label],
            }
        )
        print(f"{label:<28}{pred:>13.1f}{med:>12.1f}{pred / med - 1:>+8.1%}{sent[label] / 1e6:>9.2f}")
    fastest = min(rows, key=lambda r: r["measured_ms"])
    chosen = next(r for r in rows if r["strategy"] == pr.best.strategy.label())
    gap = chosen["measured_ms"] / fastest["measured_ms"] - 1
    print(
        f"\nplanner's first choice: {chosen['system']!r}; measured fastest: {fastest['system']!r}; the choice is "
        f"{gap:+.1%} slower -> {'ok' if gap <= 0.10 else 'MISSED'} (bound 10%)"
    )
    Path(ns.json).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.json).write_text(
        json.dumps(
            {
                "bandwidth": ns.bandwidth,
                "hosts": ns.hosts,
                "model": ns.model,
                "rows": rows,
                "planner_choice": chosen["system"],
                "fastest": fastest["system"],
                "gap": gap,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
