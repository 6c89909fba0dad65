"""A straggler against synchronous and asynchronous averaging: what each keeps of its throughput.

Runs ``dtrain run`` for each strategy twice from the same seed: without a straggler and with
one worker made ``FACTOR`` times slower (``--straggler RANK:FACTOR``: it sleeps after its own
compute so that compute plus sleep take FACTOR times its compute). Throughput is the sum over
workers of each worker's own step rate (its per-worker batch over its median step time after
warm-up, from the metrics rows): the samples the workers process together per second while
they train. Synchronous data parallelism waits for the straggler in every allreduce, so every
worker's step takes the straggler's time; asynchronous gossip (AD-PSGD, Lian et al. 2018)
averages pairwise with no barrier, so only the straggler's own rate falls.

With the same number of steps per worker (dtrain's rule), the fast workers of an asynchronous
run finish early and wait at the end; a run stopped by time or by a shared sample budget turns
the throughput below into wall time.

Run::

    python benchmarks/straggler_gossip.py --workers 4 --steps 60 --straggler 1:4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

STRATEGIES = {
    "dp ring (sync)": dict(strategy="dp", algorithm="ring"),
    "gossip ring sync (D-PSGD)": dict(strategy="gossip", topology="ring", mode="sync"),
    "gossip ring async (AD-PSGD)": dict(strategy="gossip", topology="ring", mode="async"),
    "local_sgd period 8": dict(strategy="local_sgd", period=8),
}


def rates(out: Path, workers: int, warmup: int) -> dict[int, float]:
    """Each rank's own samples per second: rows report the global batch's rate (B / step time)."""
    from dtrain.rundir.files import read_metrics

    by_rank: dict[int, list[float]] = {}
    for r in read_metrics(out):
        if r["step"] >= warmup and r.get("samples_per_s"):
            by_rank.setdefault(int(r["rank"]), []).append(float(r["samples_per_s"]))
    return {k: statistics.median(v) / workers for k, v in sorted(by_rank.items())}


def run_one(base: Any, kw: dict[str, Any], straggler: str, warmup: int) -> dict[str, Any]:
    from dtrain.job.run import run

    with tempfile.TemporaryDirectory() as d:
        cfg = base.replace(**kw, straggler=straggler, out=d)
        s, _ = run(cfg, quiet=True)
        r = rates(Path(d), cfg.workers, warmup)
    return {"rates": r, "total": sum(r.values()), "wall_s": s["wall_s"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--straggler", default="1:4", help="RANK:FACTOR (default: 1:4)")
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--dataset", default="", help="default: digits, or pytext for a gpt model")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--cluster", default="", help="an emulated cluster's name (default: this machine, loopback)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ns = ap.parse_args()
    import torch

    from dtrain.config.schema import RunConfig

    names = [n for n in ns.strategies.split(",") if n]
    dataset = ns.dataset or ("pytext" if ns.model.startswith("gpt") else "digits")
    base = RunConfig.make(
        model=ns.model,
        dataset=dataset,
        batch_size=ns.batch,
        workers=ns.workers,
        epochs=1000,
        max_steps=ns.steps,
        trace=False,
        progress=False,
        cluster=ns.cluster,
        timeout_s=600.0,
    )
    print(
        f"torch {torch.__version__}; {ns.model} on {dataset}, global batch {ns.batch}, {ns.workers} workers, "
        f"{ns.steps} steps; "
        f"straggler {ns.straggler}; {'cluster ' + ns.cluster if ns.cluster else 'loopback'}"
    )
    lines = [f"{'strategy':<30}{'alone samples/s':>16}{'straggler':>11}{'kept':>7}   per-rank samples/s with it"]
    for name in names:
        a = run_one(base, STRATEGIES[name], "", ns.warmup)
        b = run_one(base, STRATEGIES[name], ns.straggler, ns.warmup)
        per = " ".join(f"{v:.0f}" for v in b["rates"].values())
        lines.append(f"{name:<30}{a['total']:>16.0f}{b['total']:>11.0f}{b['total'] / a['total']:>7.2f}   {per}")
        print(lines[-1], flush=True)
    print("\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
