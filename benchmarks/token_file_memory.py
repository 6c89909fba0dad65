"""A token file is memory-mapped, never read whole: a worker's peak memory on a 2 GiB file against a 20 MiB one.

``dtrain run --model gpt-tiny --dataset FILE --workers 2 --max-steps N`` on two nanoGPT-style ``.bin`` files
of uint16 token ids (random ids below 256, the largest 255 in both, so that both runs build the same model),
one of ``--big-gib`` GiB (2 by default: about 1.07 billion tokens, 15 million training windows of 65) and one of
``--small-mib`` MiB (20), written in chunks into a temporary folder and deleted after. Each run is watched from
outside: a thread reads ``VmHWM`` (the peak resident set) from ``/proc/PID/status`` of every worker process
(the children of the run's forkserver) every 20 ms until it exits, not dtrain's own counters. A round runs
both files, in an order rotated each round; the figure of a run is its largest worker's peak.

What a worker holds that grows with the file: the epoch's order of the training windows (a permutation of 4
bytes a window, where ``DistributedSampler`` would hold a Python list of them) and the pages of the map that
the drawn windows touched (the kernel maps a few pages around each). What does not: the file itself (the
vocabulary scan reads it in 8 MiB chunks with plain reads, which leave no pages in the process). The bar: the
big file's peak at most 200 MiB above the small file's, per round, judged on the interquartile range of the
rounds' differences.

Run::

    python benchmarks/token_file_memory.py --out benchmarks/results/token_file_memory.json
    python benchmarks/token_file_memory.py --rounds 5 --max-steps 10 --big-gib 0.5    # quicker
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

MIB = 2**20
BAR_MIB = 200.0
CHUNK = 32 * MIB  # bytes written at once


def write_tokens(path: Path, nbytes: int, seed: int) -> None:
    """``nbytes`` of uint16 ids below 256 (the first one 255), written a chunk at a time."""
    rng = np.random.default_rng(seed)
    left = nbytes // 2
    with open(path, "wb") as f:
        first = True
        while left:
            n = min(left, CHUNK // 2)
            ids = rng.integers(0, 256, size=n, dtype=np.uint16)
            if first:
                ids[0], first = 255, False
            ids.tofile(f)
            left -= n


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            kids += [int(k) for k in task.read_text().split()]
        except OSError:
            continue
    return kids


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def workers(launcher: int) -> list[int]:
    """The worker processes of the ``dtrain run`` whose process is ``launcher``: the forkserver's children."""
    found, todo = [], [launcher]
    while todo:
        pid = todo.pop()
        kids = _children(pid)
        if "multiprocessing.forkserver" in _cmdline(pid):
            found += kids
        else:
            todo += kids
    return found


def vm_hwm_kib(pid: int) -> int | None:
    """``VmHWM`` of ``pid`` in KiB (None once it has exited)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def watched_run(argv: list[str], every_s: float = 0.02) -> tuple[dict[int, float], float]:
    """Run ``argv``; every worker's peak resident memory (MiB) as last read before it exited, and the seconds."""
    t0 = time.monotonic()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    peaks: dict[int, float] = {}

    def watch() -> None:
        while p.poll() is None:
            for pid in workers(p.pid):
                kib = vm_hwm_kib(pid)
                if kib is not None:
                    peaks[pid] = max(peaks.get(pid, 0.0), kib / 1024)
            time.sleep(every_s)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    out, _ = p.communicate(timeout=900)
    t.join()
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {p.returncode}:\n{out[-3000:]}")
    return peaks, time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    from dtrain.measure.harness import Benchmark, add_result_flags, command, summary

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--big-gib", type=float, default=2.0, help="the large file, GiB (default: 2)")
    ap.add_argument("--small-mib", type=float, default=20.0, help="the small file, MiB (default: 20)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default: 5)")
    ap.add_argument("--max-steps", type=int, default=30, help="steps a run trains (default: 30)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--dir", default="", help="where the files go (default: a new temporary folder, deleted)")
    add_result_flags(ap)
    a = ap.parse_args(argv)
    root = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="dtrain_token_memory_"))
    root.mkdir(parents=True, exist_ok=True)
    big, small = f"{a.big_gib:g} GiB file", f"{a.small_mib:g} MiB file"
    files = {big: root / "big.bin", small: root / "small.bin"}
    try:
        t0 = time.monotonic()
        write_tokens(files[big], int(a.big_gib * 2**30), seed=0)
        write_tokens(files[small], int(a.small_mib * MIB), seed=1)
        print(
            f"wrote {files[big]} ({files[big].stat().st_size / MIB:.0f} MiB) and {files[small]} "
            f"({files[small].stat().st_size / MIB:.1f} MiB) in {time.monotonic() - t0:.1f}s",
            flush=True,
        )
        run = [
            "--model",
            "gpt-tiny",
            "--workers",
            str(a.workers),
            "--max-steps",
            str(a.max_steps),
            "--eval-samples",
            "512",
            "--no-progress",
            "--no-trace",
            "--overwrite",
        ]
        bench = Benchmark(
            "token_file_memory",
            title=f"A token file is memory-mapped: a worker's peak memory, {big} against {small}",
            family="data",
            workload=f"dtrain run --model gpt-tiny --dataset FILE.bin --workers {a.workers} "
            f"--max-steps {a.max_steps} (uint16 ids, seq_len 64, global batch 64, "
            "--eval-samples 512)",
            metric="MiB",
            higher_is_better=False,
            repeats=a.rounds,
            quick=a.quick,
            command=command("benchmarks/token_file_memory.py", argv),
        )
        bench.start()
        samples: dict[str, list[float]] = {big: [], small: []}
        per_worker: dict[str, list[list[float]]] = {big: [], small: []}
        order = [big, small]
        for r in range(a.rounds):
            for name in order[r % 2 :] + order[: r % 2]:
                cmd = [
                    sys.executable,
                    "-m",
                    "dtrain.cli",
                    "run",
                    *run,
                    "--dataset",
                    str(files[name]),
                    "--out",
                    str(root / "run"),
                ]
                peaks, secs = watched_run(cmd)
                if len(peaks) != a.workers:
                    raise RuntimeError(f"watched {len(peaks)} worker(s) of {name}'s run, expected {a.workers}")
                samples[name].append(max(peaks.values()))
                per_worker[name].append(sorted(peaks.values()))
                print(
                    f"round {r + 1}/{a.rounds}: {name}: workers' peaks "
                    f"{', '.join(f'{v:.1f}' for v in sorted(peaks.values()))} MiB ({secs:.1f}s)",
                    flush=True,
                )
        bench.stop()
        diffs = [b - s for b, s in zip(samples[big], samples[small])]
        d = summary(diffs)
        verdict = "met" if d["q3"] <= BAR_MIB else "not met" if d["q1"] > BAR_MIB else "straddles"
        bench.add_case("largest worker's peak resident memory (VmHWM)", samples=samples, headline=False)
        bench.extra = {
            "difference_mib": {"samples": diffs, **d},
            "bar_mib": BAR_MIB,
            "verdict": verdict,
            "per_worker_mib": per_worker,
            "files_bytes": {k: v.stat().st_size for k, v in files.items()},
        }
        bench.notes = (
            f"Per round, the {big}'s largest worker peak minus the {small}'s: median {d['median']:.1f} "
            f"MiB (IQR {d['q1']:.1f}-{d['q3']:.1f}, min-max {d['min']:.1f}-{d['max']:.1f}) against "
            f"the bar of at most {BAR_MIB:g} MiB: {verdict}. VmHWM read from /proc by a watcher "
            "every 20 ms; a worker is a child of the run's forkserver."
        )
        print(bench.notes)
        bench.report(a.out)
    finally:
        if not a.dir:
            shutil.rmtree(root, ignore_errors=True)
        else:
            for f in files.values():
                f.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
