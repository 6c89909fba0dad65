"""Gradient compression against torch DDP on a slow network: time to a target, the same model, data and seed.

An emulated cluster (``--hosts`` network namespaces, tbf-shaped links at ``--bandwidth``, one worker a
host) trains the same model from the same seed to the same target with each system through ``dtrain run``
(the per-node launch on every host): torch DDP (``--strategy ddp``, uncompressed, the peer) and dtrain's
data parallelism with each ``--compression`` spec. The figure is ``time_to_target_s`` of the run's summary:
training seconds from the first step to the evaluation that reached the target, evaluations excluded, the
same clock for both (DDP runs in dtrain's loop); a run that misses the target within ``--max-steps`` counts
as its whole training time, and the result's notes say so. Rounds rotate the systems; the ratio is DDP's time
/ the compressed run's (above 1: compression reaches the target sooner).

Run (root)::

    python benchmarks/compression_vs_ddp.py                    # CNN on digits, 4 hosts at 100mbit, powersgd:4
    python benchmarks/compression_vs_ddp.py --out benchmarks/results/compression_vs_ddp.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    from dtrain.measure.harness import Bar, Benchmark, add_result_flags, command

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--bandwidth", default="100mbit")
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--dataset", default="digits")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--target", type=float, default=0.95, help="test accuracy (or a language model's loss)")
    ap.add_argument("--max-steps", type=int, default=600)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--compression", default="powersgd:4", help="comma list of compression specs for dtrain's dp")
    ap.add_argument("--repeats", type=int, default=5)
    add_result_flags(ap)
    ns = ap.parse_args(argv)
    import dtrain.cluster as dc
    from dtrain.config.schema import RunConfig
    from dtrain.job.run import run
    from dtrain.job.validate import validate

    os.environ.setdefault("DTRAIN_CLUSTER_DIR", tempfile.mkdtemp(prefix="dtrain-bench-clusters-"))
    specs = [s for s in ns.compression.split(",") if s]
    base = RunConfig.make(
        model=ns.model,
        dataset=ns.dataset,
        batch_size=ns.batch_size,
        lr=ns.lr,
        epochs=1000,
        max_steps=ns.max_steps,
        target=ns.target,
        eval_every=ns.eval_every,
        trace=False,
        progress=False,
        workers=ns.hosts,
        timeout_s=600.0,
    )
    validate(base)
    name = f"cv{os.getpid() % 10000}"
    tmp = Path(tempfile.mkdtemp(prefix="dtrain-bench-compression-"))
    missed: list[str] = []
    runs = iter(range(1 << 30))

    def system(**kw: Any) -> Any:
        def one() -> float:
            label = kw.get("compression", "ddp")
            cfg = base.replace(**kw, out=str(tmp / f"run{next(runs)}"), cluster=name)
            s, _ = run(cfg, quiet=True)
            t = s.get("time_to_target_s")
            if t is None:
                missed.append(f"{label} ({s['steps']} steps, {s['metric']:.3f})")
                return float(s["train_s"])
            return float(t)

        return one

    systems = {"DDP": system(strategy="ddp")}
    for spec in specs:
        systems[f"dp ring {spec}"] = system(strategy="dp", algorithm="ring", compression=spec)
    bench = Benchmark(
        "compression_vs_ddp",
        title="Gradient compression against DDP on a slow network",
        family="compression",
        workload=f"{ns.model} on {ns.dataset}, batch {ns.batch_size}, SGD lr {ns.lr}, {ns.hosts} "
        f"emulated hosts at {ns.bandwidth}, 1 worker a host; to {ns.target:g} (evaluated "
        f"every {ns.eval_every} steps)",
        metric="seconds to target",
        higher_is_better=False,
        repeats=ns.repeats,
        quick=ns.quick,
        command=command("benchmarks/compression_vs_ddp.py", argv),
    )
    bench.add_case(
        f"{ns.bandwidth}", systems=systems, compare=[(s, "DDP", Bar.at_least(1.0)) for s in systems if s != "DDP"]
    )
    dc.up(name, hosts=ns.hosts, bandwidth=ns.bandwidth)
    try:
        bench.run()
    finally:
        dc.down(name)
    bench.notes = (
        "Time to target is the run's training time to the evaluation that reached it (evaluations "
        "excluded), the same loop and clock for DDP and dtrain. "
        + (
            f"Runs that missed the target (their whole training time counted): {'; '.join(missed)}."
            if missed
            else "Every run reached the target."
        )
    )
    bench.report(ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
