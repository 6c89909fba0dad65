"""What returning freed memory at once costs a training step: glibc's default allocator against a fixed mmap
threshold of 64 KiB (``MALLOC_MMAP_THRESHOLD_=65536``), the setting under which process memory equals the
closed form (``memory.py --allocator return``).

Each round runs ``dtrain run`` (gpt-small on pytext, dp with ring allreduce, ``--workers`` processes on this
machine) once with each setting, in rotated order; the setting is the environment the run starts with, so it
reaches every worker. The figure is the step time by this script's clock over rank 0's metrics rows as they
appear (``nodes_launch.py``'s watcher), from step ``--from`` to the last; the ratio is default / returning
step time (above 1: the default is faster), held against 1.0.

Run::

    python benchmarks/allocator_cost.py --out benchmarks/results/allocator_cost.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from nodes_launch import run_local, seconds_a_step

#: the environment of each setting: glibc's own, and every block of 64 KiB or more from its own mapping
SETTINGS = {"glibc default": {}, "returning (64 KiB threshold)": {"MALLOC_MMAP_THRESHOLD_": "65536"}}


def step_s(flags: list[str], env: dict[str, str], first: int) -> float:
    """One ``dtrain run`` with ``flags`` in ``env``: seconds a step between rank 0's rows ``first`` and the
    last, by this process's clock as the rows appear."""
    base = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    with tempfile.TemporaryDirectory() as d:
        return seconds_a_step(run_local(flags, Path(d) / "run", env={**base, **env}), first)


def main(argv: list[str] | None = None) -> int:
    from dtrain.measure.harness import Bar, Benchmark, add_result_flags, command

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-small")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=16, help="global batch (default: 16)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--from", dest="first", type=int, default=5, help="time from this step's row (default: 5)")
    ap.add_argument("--repeats", type=int, default=5)
    add_result_flags(ap)
    ns = ap.parse_args(argv)
    flags = [
        "--model",
        ns.model,
        "--dataset",
        "pytext",
        "--batch-size",
        str(ns.batch_size),
        "--workers",
        str(ns.workers),
        "--optimizer",
        "adam",
        "--lr",
        "0.001",
        "--max-steps",
        str(ns.steps),
        "--no-progress",
        "--no-trace",
    ]
    bench = Benchmark(
        "allocator_cost",
        title="What returning freed memory at once costs a step",
        family="memory",
        workload=f"{ns.model} on pytext, dp ring, {ns.workers} processes on this "
        f"machine, global batch {ns.batch_size}, Adam; {ns.steps} steps a run, timed from step "
        f"{ns.first}",
        metric="ms/step",
        higher_is_better=False,
        repeats=ns.repeats,
        quick=ns.quick,
        command=command("benchmarks/allocator_cost.py", argv),
        notes="The ratio is the returning allocator's step time over the default's: what the "
        "setting under which process memory meets the closed form costs in speed.",
    )
    default, returning = SETTINGS
    bench.add_case(
        f"{ns.model} dp, {ns.workers} processes",
        systems={name: (lambda env=env: 1e3 * step_s(flags, env, ns.first)) for name, env in SETTINGS.items()},
        compare=[(default, returning, Bar.at_least(1.0))],
        headline=False,
    )
    bench.run()
    bench.report(ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
