"""The per-node launch beside the one-launcher launch on an emulated cluster: steps/s, the same job.

Two ways to run one job on the emulated hosts (network namespaces, shaped links, one process a host):

- ``per-node``: on every host its own ``dtrain run ... --nnodes H --node-rank i --rdzv-endpoint HOST0:PORT``,
  as on real machines (``dtrain run --cluster`` starts exactly these);
- ``one-launcher``: one parent process that starts a torchrun node per host and hands each the pickled
  worker function (``dtrain.cluster.launch_on_cluster``, torch's rendezvous hosting its own store), the
  way ``--cluster`` ran before.

Both train with the same workers, so the steps should take the same time. The instrument is outside the
code under test: this script's clock, reading rank 0's ``metrics.rank0.jsonl`` as it grows (a row a step,
flushed as written); the time from the row of step ``--from`` to that of the last step, over the steps
between. Systems and strategies run in rotated order in every round; ``--repeats`` rounds; medians with
min-max, and the ratio per-node / one-launcher of each round's pair (1.0: no cost).

Run (root)::

    python benchmarks/nodes_launch.py                       # 4 hosts at 1gbit, dp and pipeline, 5 rounds
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

STRATEGIES = {
    "dp": ["--strategy", "dp"],
    "pipeline": ["--strategy", "pipeline", "--schedule", "1f1b", "--microbatches", "4"],
}


def _step_times(rows: Path, stop: threading.Event, seen: dict[int, float]) -> None:
    """Record when each step's row of rank 0 appears (this process's clock), until ``stop``."""
    while not stop.is_set():
        try:
            for line in rows.read_text().splitlines():
                if line.endswith("}"):
                    step = int(json.loads(line)["step"])
                    seen.setdefault(step, time.monotonic())
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.005)


def _watch(out: Path) -> tuple[threading.Event, dict[int, float], threading.Thread]:
    stop, seen = threading.Event(), {}
    th = threading.Thread(target=_step_times, args=(out / "metrics.rank0.jsonl", stop, seen), daemon=True)
    th.start()
    return stop, seen, th


def per_node(c: Any, flags: list[str], out: Path) -> dict[int, float]:
    from dtrain.cluster import node_env

    port = random.randint(20000, 40000)
    stop, seen, th = _watch(out)
    procs = [subprocess.Popen(["ip", "netns", "exec", c.host_ns(h), sys.executable, "-m", "dtrain.cli", "run",
                               *flags, "--out", str(out), "--nnodes", str(c.hosts), "--node-rank", str(h),
                               "--rdzv-endpoint", f"{c.address(0)}:{port}", "--rdzv-id", f"b{port}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                              env={**os.environ, **node_env(c, h)})
             for h in range(c.hosts)]  # fmt: skip
    codes = [p.wait(timeout=600) for p in procs]
    stop.set()
    th.join()
    if any(codes):
        raise SystemExit(f"per-node run failed: exit codes {codes}")
    return seen


def one_launcher(c: Any, flags: list[str], out: Path) -> dict[int, float]:
    from dtrain.cli import build_parser, config_from_args
    from dtrain.cluster import launch_on_cluster
    from dtrain.train import worker_main

    cfg = config_from_args(build_parser().parse_args(["run", *flags, "--out", str(out)])).validate()
    out.mkdir(parents=True)
    stop, seen, th = _watch(out)
    try:
        launch_on_cluster(worker_main, (cfg.to_dict(), str(out)), nprocs=cfg.num_processes, cluster=c.name,
                          stream_first=False, timeout_s=600)  # fmt: skip
    finally:
        stop.set()
        th.join()
    return seen


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--bandwidth", default="1gbit")
    ap.add_argument("--steps", type=int, default=60, help="steps a run (default: 60)")
    ap.add_argument("--from", dest="first", type=int, default=10, help="time from this step's row (default: 10)")
    ap.add_argument("--repeats", type=int, default=5, help="rounds (default: 5)")
    ap.add_argument("--strategies", default="dp,pipeline")
    ns = ap.parse_args(argv)
    from dtrain.cluster import down, up

    os.environ.setdefault("DTRAIN_CLUSTER_DIR", tempfile.mkdtemp(prefix="dtrain-bench-clusters-"))
    name = f"nl{os.getpid() % 10000}"
    c = up(name, hosts=ns.hosts, bandwidth=ns.bandwidth)
    systems = {"per-node": per_node, "one-launcher": one_launcher}
    strategies = ns.strategies.split(",")
    load0 = os.getloadavg()
    per_step: dict[tuple[str, str], list[float]] = {(s, k): [] for s in systems for k in strategies}
    pairs = [(s, k) for k in strategies for s in systems]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(ns.repeats):
                order = pairs[r % len(pairs):] + pairs[:r % len(pairs)]  # rotated each round
                for system, strat in order:
                    # --max-steps ends the run (digits has 28 steps of 64 an epoch); one evaluation, at the end
                    flags = ["--workers", str(ns.hosts), "--epochs", "1000", "--max-steps", str(ns.steps),
                             "--eval-every", str(ns.steps), "--no-progress", "--no-trace", "--batch-size", "64",
                             *STRATEGIES[strat]]  # fmt: skip
                    seen = systems[system](c, flags, Path(tmp) / f"{system}-{strat}-{r}")
                    last = max(seen)
                    per_step[(system, strat)].append((seen[last] - seen[ns.first]) / (last - ns.first))
                    print(f"round {r + 1}: {system:12s} {strat:8s} {1 / per_step[(system, strat)][-1]:6.2f} steps/s",
                          flush=True)  # fmt: skip
    finally:
        down(name)
    load1 = os.getloadavg()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"\n{ns.hosts} emulated hosts at {ns.bandwidth}, 1 process a host; steps {ns.first}..{ns.steps - 1} "
          f"of rank 0, timed from outside; {ns.repeats} rounds; commit {commit}; {time.strftime('%Y-%m-%d')}; "
          f"load {load0[0]:.2f} before, {load1[0]:.2f} after")  # fmt: skip
    print("| strategy | per-node steps/s | one-launcher steps/s | per-node / one-launcher (median, min-max) |")
    print("|---|---|---|---|")
    for strat in strategies:
        a, b = per_step[("per-node", strat)], per_step[("one-launcher", strat)]
        ratios = [y / x for x, y in zip(a, b)]  # steps/s ratio = time ratio inverted
        fa, fb = [1 / x for x in a], [1 / x for x in b]
        print(f"| {strat} | {statistics.median(fa):.2f} ({min(fa):.2f}-{max(fa):.2f}) | {statistics.median(fb):.2f} "
              f"({min(fb):.2f}-{max(fb):.2f}) | {statistics.median(ratios):.3f} "
              f"({min(ratios):.3f}-{max(ratios):.3f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
