"""What the merged trace costs: step throughput with and without it, its size, its clock error.

Each round runs the same ``dtrain run`` twice, ``--no-trace`` and traced (alternating which goes
first, so that the shared machine's drift falls on both), and prints per round and as the median
over rounds: samples/s of each and their ratio (traced / untraced), the size of ``trace.json``,
its events, the messages matched send-to-receive and left unmatched, and the clock alignment's
largest stated error (half the shortest ping round trip to rank 0). A traced run with
``--trace-steps`` shows the size that a window keeps.

Run::

    python benchmarks/trace_cost.py                       # dp, 4 workers, 200 steps, 3 rounds
    python benchmarks/trace_cost.py --flags "--strategy ps --servers 1" --workers 3
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def _run(out: Path, flags: list[str]) -> dict[str, Any]:
    p = subprocess.run(
        [sys.executable, "-m", "dtrain.cli", "run", "--no-progress", "--out", str(out), *flags],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if p.returncode != 0:
        raise SystemExit(f"dtrain run {' '.join(flags)} failed:\n{p.stderr[-3000:]}")
    from dtrain.rundir.files import read_summary

    summary = read_summary(out)
    res: dict[str, Any] = {"samples_per_s": summary["samples_per_s"]}
    trace = out / "trace.json"
    if trace.is_file():
        data = json.loads(trace.read_text())
        meta = data["otherData"]
        res.update(
            trace_mb=trace.stat().st_size / 2**20,
            events=len(data["traceEvents"]),
            messages=meta["messages"],
            unmatched=meta["unmatched_messages"],
            clock_error_us=meta["clock_error_max_us"],
        )
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--flags", default="", help="more dtrain run flags (quoted)")
    ap.add_argument("--window", default="20-40", help="--trace-steps of the extra windowed run")
    a = ap.parse_args(argv)
    base = ["--workers", str(a.workers), "--max-steps", str(a.steps), "--epochs", "100", *shlex.split(a.flags)]
    ratios, rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.rounds):
            order = ["off", "on"] if i % 2 == 0 else ["on", "off"]
            got = {k: _run(Path(tmp) / f"{k}{i}", base + (["--no-trace"] if k == "off" else [])) for k in order}
            ratio = got["on"]["samples_per_s"] / got["off"]["samples_per_s"]
            ratios.append(ratio)
            rows.append(got["on"])
            on = got["on"]
            print(
                f"round {i}: untraced {got['off']['samples_per_s']:.0f} samples/s, traced "
                f"{on['samples_per_s']:.0f} (ratio {ratio:.3f}); trace {on['trace_mb']:.2f} MB, "
                f"{on['events']} events, {on['messages']} messages matched, "
                f"{on['unmatched']} unmatched, clock error <= {on['clock_error_us']:.0f} us"
            )
        w = _run(Path(tmp) / "window", base + ["--trace-steps", a.window])
    print(
        f"median over {a.rounds} rounds: traced/untraced samples/s {statistics.median(ratios):.3f}; "
        f"trace {statistics.median(r['trace_mb'] for r in rows):.2f} MB for {a.steps} steps x {a.workers} ranks"
    )
    print(
        f"--trace-steps {a.window}: {w['trace_mb']:.2f} MB, {w['events']} events, {w['messages']} messages, "
        f"{w['unmatched']} unmatched"
    )


if __name__ == "__main__":
    main()
