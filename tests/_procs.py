"""Helpers of the fault tests (imported as ``from _procs import ...``): a ``dtrain`` command whose stderr
lines keep the time they arrived, and SIGKILL of the worker of a given rank (found by the metrics file it
holds open)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import _warm
import pytest
from _patience import patient

__all__ = ["Run", "holder", "kill_rank", "past_checkpoint", "processes", "rank_pid", "workers_of"]


class Run:
    """``dtrain ARGS``; its stderr lines with the time each arrived (read on a thread of their own, so that
    the time is when the launcher wrote the line).

    Forked from the tests' warm interpreter (:mod:`_warm`: torch already imported, about 12 CPU-seconds less
    a run than a fresh ``python -m dtrain.cli``; its workers are real processes that take real signals and
    restart as they would); ``cold`` (or ``DTRAIN_TESTS_COLD=1``): a fresh interpreter in a new session."""

    def __init__(self, *args: str, cold: bool = False) -> None:
        self.lines: list[tuple[float, str]] = []
        self.out: list[str] = []
        self._folder = Path(args[args.index("--out") + 1]).resolve() if "--out" in args else None
        self.p: Any
        if cold or _warm.COLD:
            self.p = subprocess.Popen(
                [sys.executable, "-m", "dtrain.cli", *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            streams: list[tuple[Any, bool]] = [(self.p.stderr, True), (self.p.stdout, False)]
            self._warm = False
        else:
            self.p = _warm.WarmProcess(list(args))
            # the child writes its stdout and stderr to files (WarmProcess's): read as they grow
            streams = [(self.p._err, True), (self.p._out, False)]
            self._warm = True
        self._readers = [
            threading.Thread(target=self._read if not self._warm else self._tail, args=s, daemon=True) for s in streams
        ]
        for t in self._readers:
            t.start()

    def _read(self, stream: IO[str] | None, timed: bool) -> None:
        assert stream is not None
        for line in stream:
            self._add(line, timed)

    def _tail(self, path: str, timed: bool) -> None:
        """Lines of ``path`` as the warm child writes them, until it has exited and all is read."""
        with contextlib.ExitStack() as stack:
            f = None
            rest = ""
            while True:
                ended = self._ended()  # before the read: what it wrote before exiting is read below
                if f is None and os.path.exists(path):
                    f = stack.enter_context(open(path, errors="replace"))  # noqa: SIM115 - kept while tailing
                chunk = f.read() if f is not None else ""
                if chunk:
                    *whole, rest = (rest + chunk).split("\n")
                    for line in whole:
                        self._add(line, timed)
                elif ended:
                    break
                else:
                    time.sleep(0.02)
            if rest:
                self._add(rest, timed)

    def _add(self, line: str, timed: bool) -> None:
        if timed:
            self.lines.append((time.monotonic(), line.rstrip("\n")))
        else:
            self.out.append(line if line.endswith("\n") else line + "\n")

    def _ended(self) -> bool:
        """Whether the warm child has exited (a zombie of the warm interpreter until waited for, or reaped);
        never waits for it, so that only the test's thread talks to the warm interpreter."""
        if self.p.returncode is not None:
            return True
        try:
            return Path(f"/proc/{self.p.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            return True

    def poll(self) -> int | None:
        """The exit status once the command has ended, else None."""
        if not self._warm:
            return self.p.poll()  # type: ignore[no-any-return]
        return self.p.wait() if self._ended() else None  # type: ignore[no-any-return]

    @property
    def stderr(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def wait_for(self, what: str, ready: object, timeout: float = 180) -> None:
        timeout = patient(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():  # type: ignore[operator]
                return
            if self.poll() is not None:
                self._join()
                pytest.fail(f"the run ended (exit {self.p.returncode}) before {what}: {self.stderr[-3000:]}")
            time.sleep(0.02)
        self.kill()
        pytest.fail(f"no {what} within {timeout} s: {self.stderr[-3000:]}")

    def finish(self, timeout: float = 180) -> None:
        timeout = patient(timeout)
        try:
            self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the run did not end within {timeout} s: {self.stderr[-3000:]}")
        self._join()

    def _join(self) -> None:
        for t in self._readers:  # the pipes close once every process holding them is gone
            t.join(30)
        if self._warm:
            self.p._dir.cleanup()

    def kill(self) -> None:
        if not self._warm:
            with contextlib.suppress(ProcessLookupError):  # already gone
                os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait(timeout=30)
            return
        # the workers fork from the warm interpreter's forkserver, outside the command's session: the
        # processes holding a file of the run folder open
        self.p.kill()
        if self._folder is not None:
            for pid in _holders(self._folder):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.p.wait(timeout=30)


def _holders(folder: Path) -> set[int]:
    """The processes (not this one) with a file under ``folder`` open."""
    found = set()
    prefix = str(folder) + os.sep
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if any(os.readlink(fd).startswith(prefix) for fd in (d / "fd").iterdir()):
                found.add(int(d.name))
        except OSError:
            continue
    return found


def holder(path: Path) -> int | None:
    """The process that holds ``path`` open (a worker's metrics file: which rank it is), or None."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) == str(path) for fd in (d / "fd").iterdir()):
                return int(d.name)
        except OSError:
            continue
    return None


def rank_pid(out: Path, rank: int, run: Run, after: int | None = None) -> int:
    """The worker of ``rank`` (one that is not ``after``, a pid killed before), once it holds its metrics file."""
    path = (out / f"metrics.rank{rank}.jsonl").resolve()
    found: list[int] = []

    def ready() -> bool:
        pid = holder(path)
        if pid is not None and pid != after:
            found.append(pid)
        return bool(found)

    run.wait_for(f"a worker of rank {rank}", ready)
    return found[0]


def past_checkpoint(out: Path, step: int, rank: int, steps: int = 3) -> Callable[[], bool]:
    """Whether the run's step-``step`` checkpoint is complete and ``rank`` has written its rows of ``steps``
    steps from it on: a kill then leaves rows of steps to train again, which a restart drops."""
    from dtrain.checkpoint import MARKER

    marker, rows = out / "checkpoints" / f"step_{step:06d}" / MARKER, out / f"metrics.rank{rank}.jsonl"

    def ready() -> bool:
        return marker.is_file() and rows.is_file() and rows.read_text().count("\n") >= step + steps

    ready.__doc__ = f"the step-{step} checkpoint and rank {rank}'s rows of {steps} steps after it"
    return ready


def kill_rank(
    out: Path, rank: int, run: Run, after: int | None = None, once: Callable[[], bool] | None = None
) -> float:
    """SIGKILL the worker of ``rank`` (one that is not ``after``, the pid killed before); with ``once``, as
    soon as that is true (the worker is found before: the signal follows it within a poll, while the steps
    after it run); the time sent."""
    pid = rank_pid(out, rank, run, after)
    if once is not None:
        run.wait_for(once.__doc__ or f"the moment to kill rank {rank}", once)
    sent = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    return sent


def processes() -> list[tuple[int, int, int, int, str]]:
    """Every live (not zombie) process's ``(start time, pid, parent pid, session, command)``, from ``/proc``."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state ppid pgrp session ...
        if fields[0] != "Z":
            found.append((int(fields[19]), int(d.name), int(fields[1]), int(fields[3]), cmd))
    return found


def workers_of(launcher: int) -> list[int]:
    """The worker processes of a ``dtrain run`` whose launcher is ``launcher``, in the order they started
    (ranks 0, 1, ... on one machine): the children of its forkserver, the process they fork from."""
    procs = sorted(processes())
    servers = {pid for _, pid, ppid, _, cmd in procs if ppid == launcher and "multiprocessing.forkserver" in cmd}
    return [pid for _, pid, ppid, _, _ in procs if ppid in servers]
