"""``dtrain plan`` on this machine against ``dtrain run``: one process, and data parallel at 2 and 4 workers.

For each model (the CNN on digits, gpt-small on pytext) and each worker count, two figures a round:

- ``predicted``: the performance model's samples/s for the very strategy ``dtrain run --workers P`` runs (its
  default dp, its options), on this machine's calibration for P processes (``dtrain bench calibrate
  --workers P``, cached; made on the first round if missing) and the model profiled here;
- ``measured``: ``dtrain run --workers P --max-steps N``, timed from outside: this script's clock as rank 0's
  metrics rows appear (a row a step, flushed as written), over the steps from ``--from`` to the last.

The ratio predicted / measured must be within 20%. Cases run in rotated order in every round.

Run::

    python benchmarks/plan_local.py --out benchmarks/results/plan_local.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from nodes_launch import run_local, seconds_a_step

MODELS = {"cnn": ("digits", 200), "gpt-small": ("pytext", 14)}  # dataset, steps a run


def measure(model: str, workers: int, steps: int, first: int) -> float:
    """``dtrain run``'s samples/s from outside: rank 0's rows' arrival times."""
    dataset, _ = MODELS[model]
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-plan-") as d:
        seen = run_local(
            [
                "--model",
                model,
                "--dataset",
                dataset,
                "--workers",
                str(workers),
                "--epochs",
                "1000",
                "--max-steps",
                str(steps),
                "--eval-every",
                str(steps),
                "--eval-samples",
                "64",
                "--no-progress",
                "--no-trace",
            ],
            Path(d) / "run",
            timeout=900,
        )
    return 64 / seconds_a_step(seen, first)


def predict(model: str, workers: int) -> float:
    """The planner's samples/s for the strategy ``dtrain run --workers P`` runs, on this machine."""
    from dtrain.config.schema import RunConfig
    from dtrain.planning.auto import optimizer_kind, plan
    from dtrain.registry import Choice
    from dtrain.workloads.load import load_model

    dataset, _ = MODELS[model]
    cfg = RunConfig.from_mapping({"model": model, "dataset": dataset, "workers": workers})
    own = Choice(cfg.strategy, cfg.workers, cfg.options)
    net, sample, name = load_model(cfg.model, cfg.dataset, batch=cfg.batch_size, seed=cfg.seed, seq_len=cfg.seq_len)
    p = plan(net, sample, None, workers=own.processes, name=name, optimizer=optimizer_kind(cfg), strategies=[own])
    if not p.ranked:
        raise SystemExit(f"{model} at {workers}: no prediction ({p.rejected})")
    return float(p.ranked[0].samples_per_s)


def main(argv: list[str] | None = None) -> int:
    from dtrain.measure.harness import Bar, Benchmark, add_result_flags, command

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="cnn,gpt-small")
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--from", dest="first", type=int, default=4, help="time from this step's row (default: 4)")
    ap.add_argument("--repeats", type=int, default=5, help="rounds (default: 5)")
    add_result_flags(ap)
    ns = ap.parse_args(argv)
    bench = Benchmark(
        "plan_local",
        title="dtrain plan on this machine against dtrain run",
        family="model",
        workload="default dtrain run (dp, batch 64) of the CNN on digits and gpt-small on pytext at "
        f"{ns.workers} workers; timed steps {ns.first} to the last (CNN 200, gpt-small 14)",
        metric="samples/s",
        higher_is_better=True,
        repeats=ns.repeats,
        quick=ns.quick,
        command=command("benchmarks/plan_local.py", argv),
        notes="predicted: the planner on this machine's calibration for that many processes; "
        "measured: dtrain run, by this script's clock as rank 0's rows appear",
    )
    for model in ns.models.split(","):
        steps = MODELS[model][1]
        for w in (int(x) for x in ns.workers.split(",")):
            systems: dict[str, Any] = {
                "predicted": lambda m=model, w=w: predict(m, w),
                "measured": lambda m=model, w=w, s=steps: measure(m, w, s, ns.first),
            }
            bench.add_case(
                f"{model} x{w}", systems=systems, compare=[("predicted", "measured", Bar.within(0.2))], headline=False
            )
    bench.run()
    bench.report(ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
