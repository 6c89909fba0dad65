"""Helpers of the fault tests (imported as ``from _procs import ...``): a ``dtrain`` command in its own
session whose stderr lines keep the time they arrived, and SIGKILL of the worker of a given rank (found by
the metrics file it holds open)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import pytest

__all__ = ["Run", "holder", "kill_rank", "processes", "workers_of"]


class Run:
    """``dtrain ARGS`` in a new session; its stderr lines with the time each arrived (read on a thread of
    their own, so that the time is when the launcher wrote the line)."""

    def __init__(self, *args: str) -> None:
        self.p = subprocess.Popen([sys.executable, "-m", "dtrain.cli", *args], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
        self.lines: list[tuple[float, str]] = []
        self.out: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(self.p.stderr, True), daemon=True),
                         threading.Thread(target=self._read, args=(self.p.stdout, False), daemon=True)]
        for t in self._readers:
            t.start()

    def _read(self, stream: IO[str] | None, timed: bool) -> None:
        assert stream is not None
        for line in stream:
            if timed:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
            else:
                self.out.append(line)

    @property
    def stderr(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def wait_for(self, what: str, ready: object, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():  # type: ignore[operator]
                return
            if self.p.poll() is not None:
                self._join()
                pytest.fail(f"the run ended (exit {self.p.returncode}) before {what}: {self.stderr[-3000:]}")
            time.sleep(0.05)
        self.kill()
        pytest.fail(f"no {what} within {timeout} s: {self.stderr[-3000:]}")

    def finish(self, timeout: float = 180) -> None:
        try:
            self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the run did not end within {timeout} s: {self.stderr[-3000:]}")
        self._join()

    def _join(self) -> None:
        for t in self._readers:  # the pipes close once every process holding them is gone
            t.join(30)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.killpg(self.p.pid, signal.SIGKILL)
        self.p.wait(timeout=30)


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


def kill_rank(out: Path, rank: int, run: Run, after: int | None = None) -> float:
    """SIGKILL the worker of ``rank`` (one that is not ``after``, the pid killed before); the time sent."""
    path = (out / f"metrics.rank{rank}.jsonl").resolve()
    found: list[int] = []

    def ready() -> bool:
        pid = holder(path)
        if pid is not None and pid != after:
            found.append(pid)
        return bool(found)

    run.wait_for(f"a worker of rank {rank}", ready)
    sent = time.monotonic()
    os.kill(found[0], signal.SIGKILL)
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
