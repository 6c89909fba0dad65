"""Loaded by every Python process of a profiled test run (``scripts/suite_profile.py`` puts this folder on
PYTHONPATH): each process appends one JSON line to ``$DTRAIN_SUITE_PROFILE/<pid>.jsonl`` saying how it started
(a new interpreter, or forked), how long its interpreter took until torch was imported, and, at exit, its
CPU time and the seconds it spent in ``time.sleep``."""

from __future__ import annotations

import atexit
import json
import os
import sys
import time

_DIR = os.environ.get("DTRAIN_SUITE_PROFILE", "")


def _start_s() -> float:
    """Seconds since this process was created (the kernel's start time: before the interpreter began)."""
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


class _Record:
    def __init__(self, how: str) -> None:
        self.how, self.pid, self.t0 = how, os.getpid(), time.time() - (_start_s() if how == "exec" else 0.0)
        self.cpu0 = 0.0 if how == "exec" else time.process_time()
        self.torch_s: float | None = None
        self.slept = 0.0
        self.written = False

    def write(self) -> None:
        if self.written or os.getpid() != self.pid:
            return
        self.written = True
        self.torch_s = self.torch_s if self.torch_s is not None else (None if "torch" not in sys.modules else -1.0)
        line = {
            "pid": self.pid,
            "ppid": os.getppid(),
            "how": self.how,
            "argv": " ".join(sys.argv)[:300],
            "t0": self.t0,
            "wall_s": time.time() - self.t0,
            "cpu_s": time.process_time() - self.cpu0,
            "torch_import_s": self.torch_s,
            "slept_s": self.slept,
        }
        with open(os.path.join(_DIR, f"{self.pid}.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\n")


_rec: _Record | None = None


def _begin(how: str) -> None:
    global _rec
    _rec = _Record(how)
    atexit.register(_rec.write)


if _DIR:
    _begin("exec")
    _sleep = time.sleep

    def _counted_sleep(s: float) -> None:
        t = time.monotonic()
        try:
            _sleep(s)
        finally:
            if _rec is not None:
                _rec.slept += time.monotonic() - t

    time.sleep = _counted_sleep
    _exit = os._exit

    def _counted_exit(status: int) -> None:  # forked children and hard exits skip atexit
        if _rec is not None:
            _rec.write()
        _exit(status)

    os._exit = _counted_exit
    os.register_at_fork(after_in_child=lambda: _begin("fork"))

    import builtins

    _import = builtins.__import__

    def _timed_import(name: str, *args: object, **kwargs: object) -> object:
        """Until torch is loaded: the first import that loads it notes how long after the process began."""
        if name.partition(".")[0] != "torch" or "torch" in sys.modules:
            return _import(name, *args, **kwargs)  # type: ignore[arg-type]
        try:
            return _import(name, *args, **kwargs)  # type: ignore[arg-type]
        finally:
            if _rec is not None and "torch" in sys.modules:
                _rec.torch_s = time.time() - _rec.t0
                builtins.__import__ = _import

    builtins.__import__ = _timed_import
