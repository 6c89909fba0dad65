"""The watchdog: when a rank's wait times out, name the rank(s) that did not arrive.

A blocking wait that times out knows only the peer it waited on -- in a ring, a stopped rank's
neighbour; everyone else waits on someone who waits on it. So every rank that trains keeps a
heartbeat in the job's key-value store (torch.distributed's default store, held by the launcher,
not by any rank): a thread posts the rank's current step and the time every :data:`PERIOD_S`.
A rank that is stopped (SIGSTOP), hung in the kernel or descheduled stops beating; a rank that
is merely slow keeps beating at an older step. When a wait times out, :func:`explain` reads every
heartbeat and adds to the error which ranks stopped beating (and since when, at which step), or,
when all beat, which are behind -- so the message that ends the run names the culprit whichever
survivor reports first. A rank that never posted (a parameter server, a rank that died before
training) is not judged. Errors other than timeouts (a connection closed by a survivor that timed out
first and exited) get the verdict too when some rank has stopped beating.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from dtrain.errors import CommTimeoutError

__all__ = ["Heartbeat", "explain", "diagnose", "timed_out", "PERIOD_S", "STALE_S"]

PERIOD_S = 1.0  # between heartbeats
STALE_BEATS = 3.5  # a rank whose last heartbeat is older than this many periods has stopped
STALE_S = STALE_BEATS * PERIOD_S
KEY = "dtrain/heartbeat/rank{}"


def _default_store(world: int) -> Any:
    if world <= 1:
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


class Heartbeat:
    """This rank's heartbeat thread (a no-op without a store or in a world of one).

    Args:
        rank: this process's global rank.
        world: processes in the job.
        store: the job's store (default: torch.distributed's default store).
        period_s: seconds between beats.
    """

    def __init__(self, rank: int, world: int, store: Any = None, period_s: float = PERIOD_S) -> None:
        self.rank = rank
        self.world = world
        self.store = store if store is not None else _default_store(world)
        self.period_s = period_s
        self.step = 0  # the step in progress (the loop sets it)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Heartbeat:
        if self.store is not None and self._thread is None:
            self._beat()
            self._thread = threading.Thread(target=self._run, name="dtrain-heartbeat", daemon=True)
            self._thread.start()
        return self

    def _beat(self) -> None:
        self.store.set(KEY.format(self.rank), f"{self.step} {time.time():.3f}")

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending, nothing to report
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.period_s)
            self._thread = None


def read(store: Any, world: int) -> dict[int, tuple[int, float]]:
    """Every posted heartbeat: rank -> (step, seconds since it beat)."""
    now, out = time.time(), {}
    for r in range(world):
        key = KEY.format(r)
        if not store.check([key]):
            continue
        step, t = bytes(store.get(key)).decode().split()
        out[r] = (int(step), max(0.0, now - float(t)))
    return out


def diagnose(beats: dict[int, tuple[int, float]], me: int, stale_s: float = STALE_S) -> str:
    """Words for :func:`explain` from the heartbeats (rank -> (step, age in seconds))."""
    others = {r: v for r, v in beats.items() if r != me}
    stopped = sorted(r for r, (_, age) in others.items() if age > stale_s)
    if stopped:
        said = ", ".join(
            f"rank {r} (no heartbeat for {others[r][1]:.1f} s, last at step {others[r][0]})" for r in stopped
        )
        return f"watchdog: {'it' if len(stopped) == 1 else 'they'} did not arrive: {said} stopped responding"
    if not beats:
        return "watchdog: no rank has posted a heartbeat"
    ahead = max(step for step, _ in beats.values())
    behind = sorted(r for r, (step, _) in beats.items() if step < ahead)
    if behind:
        said = ", ".join(f"rank {r} at step {beats[r][0]}" for r in behind)
        return f"watchdog: every rank is alive; behind the others (step {ahead}): {said}"
    return f"watchdog: every rank is alive and at step {ahead} (a lost message, or a rank waiting on another group)"


def timed_out(e: BaseException) -> bool:
    """Whether ``e`` or an exception it was raised from (or during) is a :class:`CommTimeoutError`."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, CommTimeoutError):
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


def explain(e: BaseException, beat: Heartbeat) -> BaseException:
    """``e`` with the watchdog's verdict on who did not arrive appended, where ``e`` comes from a timed-out
    wait (a :class:`CommTimeoutError`, or an error raised from one, as a pipeline's), or where another rank
    has stopped beating: a survivor whose neighbour timed out first and exited sees only a closed
    connection, and the stopped rank behind it is still the culprit. Otherwise ``e`` itself."""
    if beat.store is None:
        return e
    stale_s = STALE_BEATS * beat.period_s
    try:
        beats = read(beat.store, beat.world)
        note = diagnose(beats, beat.rank, stale_s=stale_s)
    except Exception as err:  # noqa: BLE001 - the store may be gone too: the original error stands
        beats, note = {}, f"watchdog: heartbeats unreadable ({type(err).__name__})"
    if not timed_out(e) and not any(age > stale_s for r, (_, age) in beats.items() if r != beat.rank):
        return e
    out: BaseException
    if isinstance(e, CommTimeoutError):
        out = CommTimeoutError(e.rank, e.op, f"{e.cause}; {note}", peer=e.peer, step=e.step)
    else:
        try:  # dtrain's other errors take their message alone
            out = type(e)(f"{e}; {note}")
        except Exception:  # noqa: BLE001 - a constructor that wants more: keep the error as it is
            return e
    out.__cause__ = e
    return out
