"""The harness every peer benchmark uses: rotated, interleaved rounds; medians with their spread; one JSON schema.

A comparison runs its systems (dtrain's and the peer's) in rounds inside one launch, each round in a
rotated order, so that a slow spell of a shared machine falls on every system alike. Each system's figure
is the median of its rounds with the interquartile range and the min-max; each comparison's ratio is taken
per round (ours / peer, so that both saw the same spell) and summarised the same way. A ratio is held
against its bar by its interquartile range, the middle half of the rounds: ``met`` when the whole range
clears the bar, ``not met`` when none of it does, ``straddles`` otherwise (reported as such, never as met).

A result file (``benchmarks/results/NAME.json``) holds one benchmark: what was measured, on what machine,
under which load, at which commit and date, with the exact command, every round's figure and the
summaries. :mod:`benchmarks.render` (``benchmarks/render.py``) writes BENCHMARKS.md from these files.

Usage::

    from dtrain.measure.harness import Bar, Benchmark, Case

    bench = Benchmark("nodes_launch", title="...", family="several machines", workload="...",
                      metric="steps/s", higher_is_better=True, repeats=5)
    for case in ("dp", "pipeline"):
        bench.add_case(case, systems={"per-node": ..., "one-launcher": ...},
                       compare=[("per-node", "one-launcher", Bar.within(0.05))])
    bench.run()                      # rounds: every (case, system) once a round, in a rotated order
    bench.save("benchmarks/results/nodes_launch.json")
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "SCHEMA",
    "Bar",
    "Benchmark",
    "Case",
    "summary",
    "machine",
    "load_result",
    "add_result_flags",
    "command",
    "commit_of",
]

SCHEMA = "dtrain-bench/1"
MIN_REPEATS = 5


def summary(values: Sequence[float]) -> dict[str, float]:
    """Median, quartiles (``statistics.quantiles``, inclusive: within the observed values) and min-max."""
    xs = sorted(float(v) for v in values)
    if not xs:
        raise ValueError("summary of no values")
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else (xs[0], xs[0], xs[0])
    return {"median": statistics.median(xs), "q1": q1, "q3": q3, "min": xs[0], "max": xs[-1], "n": len(xs)}


@dataclass(frozen=True)
class Bar:
    """What a ratio (ours / peer, oriented so that above 1 is better for ours) must reach.

    ``at_least``: the ratio >= ``value``; ``within``: |ratio - 1| <= ``value`` (no cost either way)."""

    kind: str
    value: float

    @staticmethod
    def at_least(value: float) -> Bar:
        return Bar("at_least", value)

    @staticmethod
    def within(fraction: float) -> Bar:
        return Bar("within", fraction)

    def holds(self, ratio: float) -> bool:
        if self.kind == "at_least":
            return ratio >= self.value
        if self.kind == "within":
            return abs(ratio - 1.0) <= self.value + 1e-12
        raise ValueError(f"unknown bar kind {self.kind!r} (at_least or within)")

    def verdict(self, stats: dict[str, float]) -> str:
        """``met`` / ``not met`` / ``straddles`` for a ratio's summary, judged on its interquartile range."""
        lo, hi = stats["q1"], stats["q3"]
        if self.kind == "within":
            inside = [self.holds(lo), self.holds(hi)]
            if all(inside):
                return "met"
            if hi < 1 - self.value or lo > 1 + self.value:
                return "not met"
            return "straddles"
        ok = [self.holds(lo), self.holds(hi)]
        return "met" if all(ok) else "not met" if not any(ok) else "straddles"

    def text(self) -> str:
        return f">= {self.value:g}x" if self.kind == "at_least" else f"within {self.value:.0%}"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "value": self.value}


@dataclass
class Case:
    """One workload of a benchmark: its systems (a callable a round, returning the metric) and comparisons."""

    name: str
    systems: dict[str, Callable[[], float]]
    compare: list[tuple[str, str, Bar]]
    samples: dict[str, list[float]] = field(default_factory=dict)
    headline: bool = True  # dtrain against a peer (the page's headline table); False: a check of an instrument


def machine() -> dict[str, Any]:
    """What the figures were measured on (cores as the OS schedules them, memory, the versions)."""
    import torch

    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass  # no /proc (not Linux): the result file records 0 GiB, read as unknown
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "cpus": len(os.sched_getaffinity(0)),
        "memory_gib": round(mem / 2**30, 1),
        "gpu": gpu,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def commit_of(where: Path | None = None) -> str:
    """The checkout's commit, ``+changes`` where its tracked code differs from it (the result files and the
    page rendered from them do not count); ``unknown`` outside a git checkout."""
    cwd = where or Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10, cwd=cwd
        )
        # changed code marks the figures; the result files and the page they render into do not
        dirty = subprocess.run(
            [
                "git",
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                ":(top)",
                ":(top,exclude)benchmarks/results",
                ":(top,exclude)BENCHMARKS.md",
            ],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=cwd,
        ).stdout.strip()
        return out.stdout.strip() + ("+changes" if dirty else "") or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class Benchmark:
    """Cases x systems, timed in rotated rounds; the result in one schema."""

    def __init__(
        self,
        name: str,
        *,
        title: str,
        family: str,
        workload: str,
        metric: str,
        higher_is_better: bool,
        repeats: int,
        quick: bool = False,
        notes: str = "",
        command: Sequence[str] | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        self.name, self.title, self.family, self.workload = name, title, family, workload
        self.metric, self.higher_is_better, self.repeats, self.quick = metric, higher_is_better, repeats, quick
        self.notes = notes
        self.command = list(command) if command is not None else [Path(sys.argv[0]).as_posix(), *sys.argv[1:]]
        self.cases: list[Case] = []
        self.log = log or (lambda line: print(line, flush=True))
        self.load: dict[str, list[float]] = {}
        self.date = ""
        self.extra: dict[str, Any] = {}

    def add_case(
        self,
        name: str,
        systems: dict[str, Callable[[], float]] | None = None,
        compare: Sequence[tuple[str, str, Bar]] = (),
        samples: dict[str, list[float]] | None = None,
        headline: bool = True,
    ) -> Case:
        """A case timed by :meth:`run` (``systems``: a callable a round), or one whose rounds the benchmark
        interleaved itself (``samples``: a system's figure a round, round ``r`` of every system together).
        ``headline``: dtrain against a peer, for the results page's headline table (False: a check against
        a closed form, shown in its own section only)."""
        if (systems is None) == (samples is None):
            raise ValueError(f"case {name!r}: give either systems (timed by run) or samples (already measured)")
        names = list(systems or samples or {})
        for ours, peer, _ in compare:
            if ours not in names or peer not in names:
                raise ValueError(f"case {name!r} compares {ours!r} with {peer!r}; its systems are {sorted(names)}")
        if samples is not None and len({len(v) for v in samples.values()}) > 1:
            raise ValueError(f"case {name!r}: systems with different numbers of rounds {samples}")
        rounds = {s: list(v) for s, v in samples.items()} if samples is not None else {s: [] for s in names}
        case = Case(name, dict(systems or {}), list(compare), rounds, headline)
        self.cases.append(case)
        return case

    def start(self) -> None:
        """The date and the load before (:meth:`run` calls it; a benchmark that interleaves itself calls it)."""
        self.date = time.strftime("%Y-%m-%d")
        self.load["before"] = list(os.getloadavg())

    def stop(self) -> None:
        self.load["after"] = list(os.getloadavg())

    def order(self, r: int) -> list[tuple[Case, str]]:
        """Round ``r``'s order: every (case, system) once, rotated by ``r`` so that each leads in turn."""
        pairs = [(c, s) for c in self.cases if c.systems for s in c.systems]
        k = r % len(pairs)
        return pairs[k:] + pairs[:k]

    def run(self) -> None:
        self.start()
        for r in range(self.repeats):
            for case, system in self.order(r):
                value = float(case.systems[system]())
                case.samples[system].append(value)
                self.log(f"round {r + 1}/{self.repeats}: {case.name} {system}: {value:.4g} {self.metric}")
        self.stop()

    def ratios(self, case: Case, ours: str, peer: str) -> list[float]:
        """Per round, oriented so that above 1 is better for ``ours``."""
        a, b = case.samples[ours], case.samples[peer]
        return [x / y if self.higher_is_better else y / x for x, y in zip(a, b)]

    def result(self) -> dict[str, Any]:
        cases = []
        for c in self.cases:
            comparisons = []
            for ours, peer, bar in c.compare:
                rs = self.ratios(c, ours, peer)
                stats = summary(rs)
                verdict = bar.verdict(stats) if len(rs) >= MIN_REPEATS else "too few repeats"
                comparisons.append(
                    {"ours": ours, "peer": peer, "bar": bar.to_dict(), "ratios": rs, "ratio": stats, "verdict": verdict}
                )
            cases.append(
                {
                    "name": c.name,
                    "systems": {s: {"samples": v, **summary(v)} for s, v in c.samples.items()},
                    "comparisons": comparisons,
                    "headline": c.headline,
                }
            )
        return {
            "schema": SCHEMA,
            "name": self.name,
            "title": self.title,
            "family": self.family,
            "workload": self.workload,
            "metric": self.metric,
            "higher_is_better": self.higher_is_better,
            "repeats": self.repeats,
            "quick": self.quick,
            "command": shlex.join(self.command),
            "commit": commit_of(),
            "date": self.date,
            "machine": machine(),
            "load": self.load,
            "notes": self.notes,
            "extra": self.extra,
            "cases": cases,
        }

    def table(self) -> str:
        res = self.result()
        lines = [
            f"| case | {self.metric}: system median (IQR) | ratio median (IQR; min-max) | bar | verdict |",
            "|---|---|---|---|---|",
        ]
        for c in res["cases"]:
            figs = "; ".join(f"{s} {v['median']:.4g} ({v['q1']:.4g}-{v['q3']:.4g})" for s, v in c["systems"].items())
            for cmp in c["comparisons"]:
                q = cmp["ratio"]
                lines.append(
                    f"| {c['name']} {cmp['ours']} / {cmp['peer']} | {figs} | {q['median']:.3f} "
                    f"({q['q1']:.3f}-{q['q3']:.3f}; {q['min']:.3f}-{q['max']:.3f}) | "
                    f"{Bar(**cmp['bar']).text()} | {cmp['verdict']} |"
                )
        return "\n".join(lines)

    def report(self, out: str | Path | None) -> None:
        """Print the table; with ``out``, write the result file there (a benchmark's last words)."""
        print(self.table())
        if out:
            print(f"wrote {self.save(out)}")

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.result(), indent=1) + "\n", encoding="utf-8")
        return path


def load_result(path: str | Path) -> dict[str, Any]:
    """A result file, checked against the schema's required keys."""
    data: dict[str, Any] = json.loads(Path(path).read_text(encoding="utf-8"))
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{path}: schema {data.get('schema')!r}, expected {SCHEMA!r}")
    missing = [
        k
        for k in (
            "name",
            "title",
            "family",
            "workload",
            "metric",
            "command",
            "commit",
            "date",
            "machine",
            "load",
            "cases",
            "repeats",
        )
        if k not in data
    ]
    if missing:
        raise ValueError(f"{path}: missing {missing}")
    return data


def add_result_flags(ap: argparse.ArgumentParser) -> None:
    """``--out PATH`` (write the result file) and ``--quick`` (mark it as a quick run), for every benchmark."""
    ap.add_argument("--out", default=None, help="write the harness's result file (JSON) here")
    ap.add_argument("--quick", action="store_true", help="mark the result as a quick run (fewer steps/repeats)")


def command(script: str, argv: Sequence[str] | None) -> list[str]:
    """The command line that reproduces this run: ``python SCRIPT ARGS`` (``argv`` or this process's)."""
    return ["python", script, *(sys.argv[1:] if argv is None else argv)]
