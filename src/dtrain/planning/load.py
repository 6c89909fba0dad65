"""What else the machine is doing: the CPU time other processes take, read from ``/proc/stat``.

A calibration measures this machine as it finds it: made while other work keeps the cores busy
(a test suite, another user's job), its compute scale, wake-ups and floors describe that busy
machine, and a plan made later on a quiet one from it is off.
So a calibration records the load it was made under (:class:`~dtrain.perfmodel.spec.Load`,
the ``[calibrated]`` table of its TOML), and the planner looks at it before reusing one
(:func:`dtrain.planning.calibrate.local_cluster`).

The load is the CPU time that processes other than this one took over a short window while this
one sleeps: the machine's busy time (``/proc/stat``: every state but idle and iowait, over every
core) less this process's own (:func:`os.times`), as cores' worth. The calibrating processes
themselves are not running in such a window (it is taken before they start and after they end).
Where there is no ``/proc/stat`` (not Linux) nothing is recorded.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from dtrain.perfmodel.spec import Load

__all__ = ["cpu_jiffies", "others_cores", "load_around"]

PROC_STAT = Path("/proc/stat")
T = TypeVar("T")


def cpu_jiffies(text: str) -> tuple[int, int, int]:
    """``(busy, total, cores)`` from the text of ``/proc/stat``: the summed ``cpu`` line's busy and total ticks
    (busy: all but idle and iowait; guest time is already inside user time) and the number of ``cpuN`` lines."""
    lines = text.splitlines()
    head = next((line.split() for line in lines if line.startswith("cpu ")), None)
    if head is None:
        raise ValueError("no 'cpu' line in /proc/stat")
    ticks = [int(v) for v in head[1:9]]  # user nice system idle iowait irq softirq steal
    total = sum(ticks)
    busy = total - ticks[3] - ticks[4]
    cores = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    return busy, total, max(1, cores)


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def others_cores(seconds: float = 1.0, *, stat: Path = PROC_STAT) -> float | None:
    """Cores' worth of CPU that processes other than this one (and its reaped children) took over ``seconds``
    of this process sleeping; None without ``/proc/stat``."""
    try:
        busy0, total0, cores = cpu_jiffies(stat.read_text())
        own0 = _own_seconds()
        time.sleep(seconds)
        busy1, total1, _ = cpu_jiffies(stat.read_text())
    except (OSError, ValueError):
        return None
    own = (_own_seconds() - own0) * os.sysconf("SC_CLK_TCK")
    total = total1 - total0
    if total <= 0:
        return 0.0
    return max(0.0, (busy1 - busy0 - own) / total * cores)


def load_around(work: Callable[[], T], seconds: float = 1.0) -> tuple[T, Load | None]:
    """Run ``work()`` between two windows of ``seconds`` that measure the others' load (:func:`others_cores`);
    its result and the :class:`~dtrain.perfmodel.spec.Load` (the busier window), or None where it cannot be
    read. A second each way adds two seconds to a calibration of tens."""
    try:
        loadavg = os.getloadavg()[0]
    except OSError:  # pragma: no cover - no load average here
        loadavg = 0.0
    before = others_cores(seconds)
    out = work()
    after = others_cores(seconds)
    if before is None or after is None:
        return out, None
    _, _, cores = cpu_jiffies(PROC_STAT.read_text())
    return out, Load(others_cores=round(max(before, after), 3), loadavg=round(loadavg, 3), cores=cores)
