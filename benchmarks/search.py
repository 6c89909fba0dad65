"""Search quality of ``dtrain sweep``: ASHA against FIFO, PBT against random search, evolution over gpt shapes.

Every figure comes from real sweeps (Ray Tune, each trial a ``dtrain run`` process), read from their
``sweep.json``; the instrument is the runs' own evaluation (test accuracy, validation loss) and the steps
their rank 0 trained (its metrics rows), not the scheduler's bookkeeping.

- ``asha``: the CNN on digits (one worker a trial, 8 epochs, 176 steps, evaluated every 11, half an epoch), 8
  trials of random search over lr and momentum, FIFO and ASHA (reduction 2) with the same seed, so the same 8
  configurations, one trial at a time: with two at once, which trials had reached a rung when another got
  there depended on start-up times, and the same seed's ASHA trained 748 steps in one run, 1,254 in the
  next. Bar: ASHA's best test accuracy within 2% of FIFO's best, with at most half FIFO's steps.
- ``pbt``: gpt-tiny on pytext, one worker a trial, a population of 4 under PBT against random search of 4
  (FIFO) over lr and momentum: the same total training steps. Bar: PBT's best validation loss at least as
  good as random search's.
- ``arch``: 8 trials of ``--search evolution`` over gpt shapes (layers, d_model, heads) within a budget of
  300,000 parameters (``--max-params``; gpt-tiny has 137,216), against gpt-tiny itself, which fits it,
  trained for the same steps. Bar: a better validation loss. The search starts at gpt-tiny's own shape
  (``--start-at-base``) and has 7 more trials to improve on it. Started at random, seed 0's best shape
  trained worse than gpt-tiny (2.2670 against 2.2422), seeds 1 and 2's better (2.2295 against 2.2593,
  2.2645 against 2.2736). At gpt-tiny's own count the space held little besides gpt-tiny's width: one
  seed's 8 trials were all over it.

Each part runs its seeds one after another. Run::

    python benchmarks/search.py --part asha --out benchmarks/results/search_asha.json
    python benchmarks/search.py --part pbt --seeds 0,1,2 --out benchmarks/results/search_pbt.json
    python benchmarks/search.py --part arch --seeds 0,1,2 --out benchmarks/results/search_arch.json

A seed is a round of the harness (:mod:`dtrain.measure.harness`): fewer than 5 are reported as too few.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PARTS = {
    "asha": {
        "run": "workers = 1\nepochs = 8\ntrace = false\neval_every = 11\n",
        "space": 'lr = "loguniform(1e-3, 0.3)"\nmomentum = "uniform(0.0, 0.95)"\n',
        "sweeps": {"fifo": ["--scheduler", "fifo"], "asha": ["--scheduler", "asha", "--reduction", "2"]},
        "flags": ["--trials", "8", "--concurrent", "1"],
    },
    "pbt": {
        "run": (
            'workers = 1\nmodel = "gpt-tiny"\ndataset = "pytext"\nmax_steps = 240\nepochs = 100\n'
            "eval_every = 40\ntrace = false\n"
        ),
        "space": 'lr = "loguniform(1e-3, 0.3)"\nmomentum = "uniform(0.0, 0.95)"\n',
        "sweeps": {"random": ["--scheduler", "fifo"], "pbt": ["--scheduler", "pbt"]},
        "flags": ["--trials", "4", "--concurrent", "4"],
    },
    "arch": {
        "run": (
            'workers = 1\nmodel = "gpt-tiny"\ndataset = "pytext"\nmax_steps = 240\nepochs = 100\n'
            "eval_every = 80\ntrace = false\n"
        ),
        "space": 'layers = "randint(1, 7)"\nd_model = "choice([32, 48, 64, 96])"\nheads = "choice([1, 2, 4, 8])"\n',
        "sweeps": {"evolution": ["--search", "evolution", "--start-at-base"]},
        "flags": ["--trials", "8", "--concurrent", "2"],
    },
}


def sweep(folder: Path, part: dict[str, Any], flags: list[str], seed: int, extra: list[str]) -> dict[str, Any]:
    """One ``dtrain sweep`` in ``folder``; its sweep.json and the wall time."""
    (folder / "run.toml").write_text(part["run"] + f"seed = {seed}\n")
    (folder / "space.toml").write_text("[sweep.space]\n" + part["space"])
    t0 = time.monotonic()
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "dtrain.cli",
            "sweep",
            str(folder / "run.toml"),
            "--space",
            str(folder / "space.toml"),
            *part["flags"],
            *flags,
            *extra,
            "--seed",
            str(seed),
            "--out",
            str(folder / "sweep"),
        ],
        capture_output=True,
        text=True,
        timeout=7200,
    )
    if p.returncode != 0:
        raise SystemExit(f"sweep failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    doc = json.loads((folder / "sweep" / "sweep.json").read_text())
    return {
        "best": doc["best"],
        "steps_trained": doc["steps_trained"],
        "wall_s": round(time.monotonic() - t0, 1),
        "trials": [
            {k: t[k] for k in ("trial", "config", "fate", "metric", "steps_trained", "exploits")} for t in doc["trials"]
        ],
    }


def reference_run(folder: Path, part: dict[str, Any], seed: int) -> dict[str, Any]:
    """The base configuration itself (gpt-tiny's own shape), trained as a run: its validation loss."""
    (folder / "ref.toml").write_text(part["run"] + f"seed = {seed}\n")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "dtrain.cli",
            "run",
            str(folder / "ref.toml"),
            "--no-progress",
            "--out",
            str(folder / "ref"),
        ],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if p.returncode != 0:
        raise SystemExit(f"reference run failed:\n{p.stderr[-3000:]}")
    from dtrain.rundir.files import read_summary

    s = read_summary(folder / "ref")
    return {"metric": s["metric"], "steps": s["steps"]}


ARCH_BUDGET = 300_000  # parameters: gpt-tiny's 137,216 and wider or deeper shapes fit

BARS = {  # part -> (metric, higher is better, (ours, peer), bar, what the rounds are)
    "asha": ("best test accuracy", True, ("asha", "fifo"), 0.98),
    "pbt": ("best validation loss", False, ("pbt", "random"), 1.0),
    "arch": ("best validation loss", False, ("evolution", "gpt-tiny"), 1.0),
}


def main(argv: list[str] | None = None) -> int:
    import tomllib

    from dtrain.config.schema import RunConfig
    from dtrain.measure.harness import Bar, Benchmark, add_result_flags, command
    from dtrain.search.trial import model_params

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=sorted(PARTS), required=True)
    ap.add_argument("--seeds", default="0,1,2,3,4", help="one round a seed (default: 0-4)")
    ap.add_argument(
        "--rows",
        default="",
        help="write the result files again from a result file's measured rows (its extra.rows), running nothing",
    )
    add_result_flags(ap)
    ns = ap.parse_args(argv)
    part, seeds = PARTS[ns.part], [int(s) for s in ns.seeds.split(",")]
    metric, higher, (ours, peer), bar = BARS[ns.part]
    root = Path(tempfile.mkdtemp(prefix=f"dtrain-bench-search-{ns.part}-"))
    extra: list[str] = []
    tiny = 0
    if ns.part == "arch":
        tiny = model_params(RunConfig.from_mapping(tomllib.loads(part["run"])))
        extra = ["--max-params", str(ARCH_BUDGET)]
    flags = " ".join(part["flags"] + extra)
    notes = {
        "asha": "the same seed draws the same 8 configurations for both; steps: as far as each trial's "
        "rank 0 trained (its metrics rows), stopped trials included",
        "pbt": "PBT (synchronous, quantile 1/4, perturbing by 0.8/1.2 or a fresh draw) against FIFO over the "
        "same random draws; both train the population's 4 x 240 steps",
        "arch": f"evolution: Nevergrad's evolution strategy over layers, d_model, heads within "
        f"{ARCH_BUDGET:,} parameters; gpt-tiny ({tiny:,} parameters, "
        "inside the budget): the base run itself",
    }[ns.part]
    bench = Benchmark(
        f"search_{ns.part}",
        title={
            "asha": "ASHA against FIFO",
            "pbt": "PBT against random search",
            "arch": "Evolution over gpt shapes against gpt-tiny",
        }[ns.part],
        family="search",
        workload=f"dtrain sweep {flags}, "
        + " against ".join(f"{k} ({' '.join(v)})" for k, v in part["sweeps"].items())
        + "; run: "
        + part["run"].strip().replace("\n", "; ")
        + "; space: "
        + part["space"].strip().replace("\n", "; "),
        metric=metric,
        higher_is_better=higher,
        repeats=len(seeds),
        command=command("benchmarks/search.py", argv),
        notes=notes,
    )
    bench.start()
    rows: list[dict[str, Any]] = []
    if ns.rows:  # the measured rows of an earlier run of this part, its date and load with them
        prior = json.loads(Path(ns.rows).read_text())
        rows, seeds = prior["extra"]["rows"], prior["extra"]["seeds"]
        bench.date, bench.load, bench.command = prior["date"], prior["load"], shlex.split(prior["command"])
        if "--out" in bench.command:  # the run's own command, writing where these files go
            bench.command[bench.command.index("--out") + 1] = ns.out
        bench.repeats = len(seeds)
    for seed in [] if ns.rows else seeds:
        row: dict[str, Any] = {"seed": seed}
        for name, sweep_flags in part["sweeps"].items():
            folder = root / f"{name}-{seed}"
            folder.mkdir(parents=True)
            row[name] = sweep(folder, part, sweep_flags, seed, extra)
            b = row[name]["best"]
            print(
                f"seed {seed} {name}: best {b['metric']:.4f} {b['config']}, {row[name]['steps_trained']} steps, "
                f"{row[name]['wall_s']:.0f}s",
                flush=True,
            )
        if ns.part == "arch":
            row["gpt-tiny"] = reference_run(root / f"evolution-{seed}", part, seed)
            print(f"seed {seed} gpt-tiny: {row['gpt-tiny']['metric']:.4f}", flush=True)
        rows.append(row)
    if not ns.rows:
        bench.stop()

    def best(row: dict[str, Any], name: str) -> float:
        return float(row[name]["best"]["metric"] if "best" in row[name] else row[name]["metric"])

    bench.add_case(
        ns.part,
        samples={ours: [best(r, ours) for r in rows], peer: [best(r, peer) for r in rows]},
        compare=[(ours, peer, Bar.at_least(bar))],
        headline=False,
    )
    bench.extra = {"seeds": seeds, "rows": rows}
    bench.report(ns.out)
    if ns.part == "asha":  # the other half of the bar, in a result file of its own: at most half of FIFO's steps
        steps = Benchmark(
            "search_asha_steps",
            title="ASHA's steps against FIFO's",
            family="search",
            workload=bench.workload,
            metric="steps trained",
            higher_is_better=False,
            repeats=len(seeds),
            command=bench.command,
            notes=notes,
        )
        steps.date, steps.load = bench.date, bench.load
        steps.add_case(
            "asha",
            samples={s: [float(r[s]["steps_trained"]) for r in rows] for s in ("asha", "fifo")},
            compare=[("asha", "fifo", Bar.at_least(2.0))],
            headline=False,
        )
        steps.report(ns.out and str(Path(ns.out).with_name(Path(ns.out).stem + "_steps.json")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
