"""The per-node launch beside the one-launcher launch on an emulated cluster: steps/s, the same job.

Two ways to run one job on the emulated hosts (network namespaces, shaped links, one process a host):

- ``per-node``: on every host its own ``dtrain run ... --nnodes H --node-rank i --rdzv-endpoint HOST0:PORT``,
  as on real machines (``dtrain run --cluster`` starts exactly these);
- ``one-launcher``: one parent process that starts a torchrun node per host and hands each the pickled
  worker function (``dtrain.cluster.launch_on_cluster``, torch's rendezvous hosting its own store), the
  way ``--cluster`` ran before.

Both train with the same workers, so the steps should take the same time. The instrument is outside the
code under test: this script's clock, reading rank 0's metrics file as it grows (a row a step,
flushed as written); the time from the row of step ``--from`` to that of the last step, over the steps
between. The runs are long (1,100 timed steps by default, about 25 s) because the four hosts share two cores
here: over 350 steps the same launch's rate spread by 15% from run to run, and the ratio's spread straddled the
5% bar; at 1,100 steps and 7 rounds dp's still did by its upper quartile (1.002-1.051), so the headline runs
1,900 timed steps in 9 rounds.
Systems and strategies run in rotated order in every round; ``--repeats`` rounds; medians with
min-max, and the ratio per-node / one-launcher of each round's pair (1.0: no cost).

Run (root)::

    python benchmarks/nodes_launch.py                       # 4 hosts at 1gbit, dp and pipeline, 5 rounds
    python benchmarks/nodes_launch.py --repeats 9 --steps 2000 --out benchmarks/results/nodes_launch.json

``--out`` writes the harness's result file (:mod:`dtrain.measure.harness`); the bar: within 5% (no cost).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

STRATEGIES = {
    "dp": ["--strategy", "dp"],
    "pipeline": ["--strategy", "pipeline", "--schedule", "1f1b", "--microbatches", "4"],
}


def _step_times(rows: Path, stop: threading.Event, seen: dict[int, float]) -> None:
    """Record when each step's row of rank 0 appears (this process's clock), until ``stop``.

    Reads only what was appended since the last look (re-reading the whole file every few milliseconds
    took a third of a core by the end of a run, on the cores the hosts share)."""
    offset, partial = 0, ""
    while not stop.is_set():
        try:
            with open(rows, encoding="utf-8") as f:
                f.seek(offset)
                chunk = f.read()
                offset = f.tell()
        except OSError:
            chunk = ""
        now = time.monotonic()
        lines = (partial + chunk).split("\n")
        partial = lines.pop()  # a row not yet ended
        for line in lines:
            try:
                seen.setdefault(int(json.loads(line)["step"]), now)
            except (ValueError, KeyError):
                pass
        time.sleep(0.01)


def _watch(out: Path) -> tuple[threading.Event, dict[int, float], list[threading.Thread]]:
    stop, seen = threading.Event(), {}
    from dtrain.rundir.files import rank_metrics

    ths = [threading.Thread(target=_step_times, args=(out / rank_metrics(0), stop, seen), daemon=True)]
    for th in ths:
        th.start()
    return stop, seen, ths


def seconds_a_step(seen: dict[int, float], first: int, who: str = "") -> float:
    """Seconds a step between rank 0's rows ``first`` and the last, by the watcher's clock."""
    last = max(seen, default=-1)
    if first not in seen or last <= first:
        raise SystemExit(f"{who}rank 0's rows {sorted(seen)[:3]}...{last}; none past step {first}")
    return (seen[last] - seen[first]) / (last - first)


def run_local(
    flags: list[str], out: Path, env: dict[str, str] | None = None, timeout: float = 1800
) -> dict[int, float]:
    """``dtrain run FLAGS`` on this machine into ``out``: when each of rank 0's rows appeared (its own rows
    file, or the one process's merged rows)."""
    out.mkdir(parents=True, exist_ok=True)
    stop, seen = threading.Event(), dict[int, float]()
    from dtrain.rundir.files import METRICS, rank_metrics

    watch = [
        threading.Thread(target=_step_times, args=(out / name, stop, seen), daemon=True)
        for name in (rank_metrics(0), METRICS)
    ]
    for th in watch:
        th.start()
    try:
        p = subprocess.run(
            [sys.executable, "-m", "dtrain.cli", "run", *flags, "--out", str(out), "--overwrite"],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    finally:
        stop.set()
        for th in watch:
            th.join()
    if p.returncode != 0:
        raise SystemExit(f"dtrain run failed:\n{p.stderr[-3000:]}")
    return seen


def per_node(c: Any, flags: list[str], out: Path) -> dict[int, float]:
    from dtrain.cluster import node_env

    port = random.randint(20000, 40000)
    stop, seen, ths = _watch(out)
    procs = [
        subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                c.host_ns(h),
                sys.executable,
                "-m",
                "dtrain.cli",
                "run",
                *flags,
                "--out",
                str(out),
                "--nnodes",
                str(c.hosts),
                "--node-rank",
                str(h),
                "--rdzv-endpoint",
                f"{c.address(0)}:{port}",
                "--rdzv-id",
                f"b{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, **node_env(c, h)},
        )
        for h in range(c.hosts)
    ]
    codes = [p.wait(timeout=600) for p in procs]
    stop.set()
    for th in ths:
        th.join()
    if any(codes):
        raise SystemExit(f"per-node run failed: exit codes {codes}")
    return seen


def one_launcher(c: Any, flags: list[str], out: Path) -> dict[int, float]:
    from dtrain.cli import build_parser, config_from_args
    from dtrain.cluster import launch_on_cluster
    from dtrain.job.run import worker_main
    from dtrain.job.validate import validate

    cfg = validate(config_from_args(build_parser().parse_args(["run", *flags, "--out", str(out)])))
    out.mkdir(parents=True)
    stop, seen, ths = _watch(out)
    try:
        launch_on_cluster(
            worker_main,
            (cfg.to_dict(), str(out)),
            nprocs=cfg.num_processes,
            cluster=c.name,
            stream_first=False,
            timeout_s=600,
        )
    finally:
        stop.set()
        for th in ths:
            th.join()
    return seen


def main(argv: list[str] | None = None) -> int:
    from dtrain.measure.harness import Bar, Benchmark, add_result_flags, command

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--bandwidth", default="1gbit")
    ap.add_argument("--steps", type=int, default=1200, help="steps a run (default: 1200)")
    ap.add_argument("--from", dest="first", type=int, default=100, help="time from this step's row (default: 100)")
    ap.add_argument("--repeats", type=int, default=5, help="rounds (default: 5)")
    ap.add_argument("--strategies", default="dp,pipeline")
    add_result_flags(ap)
    ns = ap.parse_args(argv)
    if not 0 <= ns.first < ns.steps - 1:
        ap.error(f"--from must be in [0, --steps - 1), got {ns.first} with --steps {ns.steps}")
    from dtrain.cluster import down, up

    os.environ.setdefault("DTRAIN_CLUSTER_DIR", tempfile.mkdtemp(prefix="dtrain-bench-clusters-"))
    name = f"nl{os.getpid() % 10000}"
    bench = Benchmark(
        "nodes_launch",
        title="The per-node launch against the one-launcher launch",
        family="several machines",
        workload=f"the CNN on digits, batch 64, {ns.hosts} emulated hosts at {ns.bandwidth} (network "
        f"namespaces), 1 process a host; rank 0's steps {ns.first}..{ns.steps - 1}",
        metric="steps/s",
        higher_is_better=True,
        repeats=ns.repeats,
        quick=ns.quick,
        command=command("benchmarks/nodes_launch.py", argv),
        notes="per-node: on every host its own `dtrain run --nnodes --node-rank --rdzv-endpoint` (what "
        "`dtrain run --cluster` starts); one-launcher: one parent starting a torchrun node a "
        "host with a pickled function. Timed from outside, by this script's clock as rank 0's "
        "metrics rows appear. All hosts share this machine's cores.",
    )
    c = up(name, hosts=ns.hosts, bandwidth=ns.bandwidth)
    tmp = Path(tempfile.mkdtemp(prefix="dtrain-bench-nodes-"))
    runs = iter(range(1 << 30))

    def timed(system: Callable[[Any, list[str], Path], dict[int, float]], strat: str) -> Callable[[], float]:
        def one() -> float:
            # --max-steps ends the run (digits has 28 steps of 64 an epoch); one evaluation, at the end
            flags = [
                "--workers",
                str(ns.hosts),
                "--epochs",
                "1000",
                "--max-steps",
                str(ns.steps),
                "--eval-every",
                str(ns.steps),
                "--no-progress",
                "--no-trace",
                "--batch-size",
                "64",
                *STRATEGIES[strat],
            ]
            return 1.0 / seconds_a_step(system(c, flags, tmp / f"run{next(runs)}"), ns.first)

        return one

    try:
        for strat in ns.strategies.split(","):
            systems = {"per-node": timed(per_node, strat), "one-launcher": timed(one_launcher, strat)}
            bench.add_case(strat, systems=systems, compare=[("per-node", "one-launcher", Bar.within(0.05))])
        bench.run()
    finally:
        down(name)
        shutil.rmtree(tmp, ignore_errors=True)
    bench.report(ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
