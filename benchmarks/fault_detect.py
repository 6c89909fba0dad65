"""Time from a fault to the run's end with the error naming the rank: a dead rank
(SIGKILL) and a stalled one (SIGSTOP), median of ``--reps``.

Each repetition starts ``dtrain run`` (``--workers`` processes on loopback, long enough not to
finish), waits until every training rank has written ``--after`` metrics rows, sends the signal to
one worker (found by the metrics file it holds open: ``dtrain.rundir.files.rank_metrics``) and times until the launcher
exits; it checks that the last line of stderr names the rank. A dead rank is seen by its closed
connections (torch's agent also sees the exit); a stalled rank only by a wait that runs out after
``--timeout-s`` and the heartbeats that say who did not arrive, so its figure is ``--timeout-s``
plus the time to tell and stop the others.

Run::

    python benchmarks/fault_detect.py                                  # dp, 4 workers, rank 2, 5 reps
    python benchmarks/fault_detect.py --flags "--strategy ps --servers 1" --workers 3 --ranks 1-3
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _holder(root: int, name: str) -> int | None:
    """The descendant of ``root`` that holds ``name`` open."""
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            if int(fd_dir.parent.name) == root:
                continue
            for fd in fd_dir.iterdir():
                if os.readlink(fd).endswith("/" + name):
                    return int(fd_dir.parent.name)
        except OSError:
            continue
    return None


def _once(sig: int, rank: int, ranks: range, flags: list[str], timeout_s: float, after: int) -> tuple[float, str]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r"
        cmd = [
            sys.executable,
            "-m",
            "dtrain.cli",
            "run",
            *flags,
            "--epochs",
            "500",
            "--timeout-s",
            str(timeout_s),
            "--no-progress",
            "--no-trace",
            "--out",
            str(out),
        ]
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        victim = None
        try:
            deadline = time.monotonic() + 120
            from dtrain.rundir.files import rank_metrics

            files = [out / rank_metrics(r) for r in ranks]
            while time.monotonic() < deadline and not all(
                f.is_file() and len(f.read_text().splitlines()) >= after for f in files
            ):
                time.sleep(0.1)
            victim = _holder(p.pid, rank_metrics(rank))
            if victim is None:
                raise SystemExit(f"no process holds {rank_metrics(rank)}")
            os.kill(victim, sig)
            t0 = time.monotonic()
            _, err = p.communicate(timeout=timeout_s + 120)
            return time.monotonic() - t0, err.strip().splitlines()[-1]
        finally:
            if victim is not None:
                for s in (signal.SIGCONT, signal.SIGKILL):
                    with contextlib.suppress(OSError):  # already gone
                        os.kill(victim, s)
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--flags", default="", help="more dtrain run flags (quoted)")
    ap.add_argument("--ranks", default="", help="the training ranks FIRST-LAST (default: 0 to workers-1)")
    ap.add_argument("--rank", type=int, default=2, help="the rank to kill or stop")
    ap.add_argument("--timeout-s", type=float, default=10.0)
    ap.add_argument("--after", type=int, default=20, help="steps every rank has done before the fault")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    first, _, last = a.ranks.partition("-")
    ranks = range(int(first), int(last) + 1) if a.ranks else range(a.workers)
    flags = ["--workers", str(a.workers), *shlex.split(a.flags)]
    print(f"dtrain run {' '.join(flags)} --timeout-s {a.timeout_s:g}; rank {a.rank}; median of {a.reps}")
    for name, sig in (("dead (SIGKILL)", signal.SIGKILL), ("stalled (SIGSTOP)", signal.SIGSTOP)):
        times, named = [], 0
        for _ in range(a.reps):
            dt, last_line = _once(sig, a.rank, ranks, flags, a.timeout_s, a.after)
            times.append(dt)
            named += f"rank {a.rank}" in last_line
        print(
            f"{name:<18} to exit: median {statistics.median(times):.2f} s (min {min(times):.2f}, max "
            f"{max(times):.2f}); last line names rank {a.rank} in {named} of {a.reps}"
        )
        print(f"{'':<18} e.g. {last_line[:300]}")


if __name__ == "__main__":
    main()
