"""``dtrain sweep``: search hyper-parameters and architectures with Ray Tune, each trial a ``dtrain run``.

Everything is checked before Ray starts (:func:`dtrain.search.sweep.build_spec`); then the trials run,
a line per evaluation, and ``SWEEP/sweep.json`` records every trial.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dtrain.errors import ConfigError

__all__ = ["main", "build_parser"]

EXAMPLE = """\
example:
  dtrain sweep run.toml --space space.toml --search tpe --scheduler asha --trials 16 --concurrent 2

space.toml:
  [sweep.space]
  lr = "loguniform(1e-3, 1e-1)"
  batch_size = "choice([32, 64, 128])"
"""


def build_parser() -> argparse.ArgumentParser:
    from dtrain.search.space import DISTRIBUTIONS
    from dtrain.search.sweep import SCHEDULERS, SEARCHES

    ap = argparse.ArgumentParser(
        prog="dtrain sweep",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Search hyper-parameters with Ray Tune, each trial an ordinary `dtrain run` "
        "(needs the tune extra: pip install 'dtrain[tune]'). Distributions: "
        + "; ".join(f"{k}{v}" for k, v in DISTRIBUTIONS.items())
        + ".",
        epilog=EXAMPLE,
    )
    ap.add_argument(
        "config",
        nargs="?",
        help="the run configuration every trial starts from (TOML, as for "
        "`dtrain run`; default: the embedded default run)",
    )
    ap.add_argument("--space", required=True, help='TOML file with a [sweep.space] table: key = "distribution"')
    _search_flags(ap, SEARCHES, SCHEDULERS)
    _placement_flags(ap)
    _trial_flags(ap)
    ap.add_argument("--out", default="", help="the sweep folder (default: sweeps/<timestamp>)")
    return ap


def _search_flags(ap: argparse.ArgumentParser, searches: Iterable[str], schedulers: Iterable[str]) -> None:
    """The searcher, the scheduler and what they optimise."""
    ap.add_argument("--search", default="random", help=f"{' | '.join(searches)} (default: random)")
    ap.add_argument("--scheduler", default="fifo", help=f"{' | '.join(schedulers)} (default: fifo)")
    ap.add_argument("--trials", type=int, default=None, help="trials to run (default: 8; grid: every combination)")
    ap.add_argument("--concurrent", type=int, default=2, help="trials at once (default: 2)")
    ap.add_argument(
        "--metric",
        default=None,
        help="the run's metric to optimise (default: what the run reports: "
        "test_accuracy for a classifier, val_loss for a language model)",
    )
    ap.add_argument("--mode", default=None, help="min | max (default: max for accuracy, min for a loss)")
    ap.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="evaluate (and report to Tune) every N steps "
        "(default: the config's eval_every, else a quarter of the steps)",
    )
    ap.add_argument(
        "--perturbation-interval",
        type=int,
        default=0,
        help="pbt: steps between exploit/explore decisions (default: --eval-every)",
    )
    ap.add_argument("--reduction", type=int, default=2, help="asha: keep the top 1/N at each rung (default: 2)")
    ap.add_argument("--seed", type=int, default=0, help="the searcher's seed (default: 0)")


def _placement_flags(ap: argparse.ArgumentParser) -> None:
    """Where the trials run: a Ray cluster, the CPUs a trial holds, an emulated cluster, restarts."""
    ap.add_argument(
        "--address",
        default="",
        help="a Ray cluster to place trials on (ray start --head ...); default: a Ray instance on this machine",
    )
    ap.add_argument(
        "--cpus-per-trial",
        type=float,
        default=1.0,
        help="Ray CPUs a trial holds (default: 1; on one machine --concurrent x this are offered)",
    )
    ap.add_argument(
        "--cluster",
        default="",
        help="run on the emulated cluster NAME (root): a Ray node a host, the driver on host 0 (dtrain cluster up ...)",
    )
    ap.add_argument(
        "--slots-per-host", type=int, default=1, help="--cluster: Ray CPUs (trial slots) a host offers (default: 1)"
    )
    ap.add_argument(
        "--max-failures", type=int, default=0, help="restarts of a failed trial, from its last checkpoint (default: 0)"
    )


def _trial_flags(ap: argparse.ArgumentParser) -> None:
    """Which trials start: a parameter or memory budget, the base configuration first."""
    ap.add_argument(
        "--max-params",
        type=int,
        default=0,
        help="a parameter budget: a trial whose model has more "
        "is skipped before it starts (architecture search; default: 0, none)",
    )
    ap.add_argument(
        "--start-at-base",
        action="store_true",
        help="the first trial is the base configuration's "
        "own values of the space's keys (a gpt preset's shape as it resolves); the searcher goes on "
        "from there",
    )
    ap.add_argument(
        "--memory-limit",
        default="",
        help="memory per device (2GB, 512MB, bytes): a trial that needs "
        "more by the planner's memory model is skipped before it starts (default: none)",
    )


def spec_from_args(ns: argparse.Namespace) -> Any:
    """The checked :class:`~dtrain.search.sweep.SweepSpec` of the command line."""
    from dtrain.config.files import load_toml, read_toml
    from dtrain.config.schema import RunConfig
    from dtrain.job.validate import validate
    from dtrain.search.sweep import build_spec

    base = validate(RunConfig.from_mapping(load_toml(ns.config) if ns.config else {}))
    doc = read_toml(ns.space, "space file")
    table = doc.get("sweep", {}).get("space") if isinstance(doc.get("sweep"), dict) else None
    if table is None:
        raise ConfigError(
            f'{ns.space}: no [sweep.space] table; write one key a line, e.g. lr = "loguniform(1e-4, 1e-1)"'
        )
    out = ns.out or str(Path("sweeps") / time.strftime("%Y%m%d-%H%M%S"))
    if Path(out).exists() and any(Path(out).iterdir()):
        raise ConfigError(f"--out {out}: the folder exists and is not empty; give a new sweep folder")
    return build_spec(
        base,
        table,
        out=str(Path(out).resolve()),
        search=ns.search,
        scheduler=ns.scheduler,
        trials=ns.trials,
        concurrent=ns.concurrent,
        metric=ns.metric,
        mode=ns.mode,
        seed=ns.seed,
        address=ns.address,
        cpus_per_trial=ns.cpus_per_trial,
        eval_every=ns.eval_every,
        perturbation_interval=ns.perturbation_interval,
        reduction=ns.reduction,
        max_failures=ns.max_failures,
        max_params=ns.max_params,
        memory_limit=ns.memory_limit,
        start_at_base=ns.start_at_base,
    )


def _without_cluster(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--cluster":
            skip = True
        elif not a.startswith("--cluster="):
            out.append(a)
    return out


def _on_cluster(ns: argparse.Namespace, argv: list[str]) -> int:
    """Start Ray on the emulated cluster's hosts, run this sweep's driver in host 0's namespace, stop Ray."""
    import os
    import subprocess

    from dtrain.search.raycluster import auth_env, ray_down, ray_up

    if ns.address:
        raise ConfigError("--cluster starts its own Ray cluster on the emulated hosts; leave out --address")
    if ns.slots_per_host < 1:
        raise ConfigError(f"--slots-per-host must be >= 1, got {ns.slots_per_host}")
    c, head, token = ray_up(ns.cluster, ns.slots_per_host)
    try:
        print(f"Ray on {c.hosts} emulated hosts of {ns.cluster}, head {head}", flush=True)
        cmd = [sys.executable, "-m", "dtrain.cli", "sweep", *_without_cluster(argv), "--address", head]
        return subprocess.call(["ip", "netns", "exec", c.host_ns(0), *cmd], env={**os.environ, **auth_env(token)})
    finally:
        ray_down(c)


def main(argv: list[str] | None = None) -> int:
    from dtrain.search.tune import require_tune, run_sweep_on_tune

    argv = list(sys.argv[1:] if argv is None else argv)
    ns = build_parser().parse_args(argv)
    require_tune(ns.search)
    spec = spec_from_args(ns)
    if ns.cluster:
        return _on_cluster(ns, argv)
    print(
        f"sweep: {spec.trials} trials ({spec.search}, {spec.scheduler}), {spec.concurrent} at once, "
        f"{spec.metric} ({spec.mode}) every {spec.eval_every} steps; folder {spec.out}",
        flush=True,
    )
    doc = run_sweep_on_tune(spec)
    for t in doc["trials"]:
        m = "-" if t["metric"] is None else f"{t['metric']:.4f}"
        cfg = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in t["config"].items())
        why = f" ({t['error']})" if t["error"] else ""
        print(f"  {t['trial']}  {spec.metric} {m:>8}  {t['fate']}{why}  {cfg}")
    best = doc["best"]
    if best is None:
        print("no trial reported a metric", file=sys.stderr)
        return 1
    print(
        f"best: trial {best['trial']}, {spec.metric} {best['metric']:.4f}: "
        + " ".join(f"{k}={v}" for k, v in best["config"].items())
    )
    print(
        f"sweep folder: {spec.out} ({doc['steps_trained']} steps trained over {doc['trials_run']} trials, "
        f"{doc['wall_s']:.0f}s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
