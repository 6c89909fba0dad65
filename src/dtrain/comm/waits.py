"""Waiting on collectives: a failure or a timeout becomes a :class:`~dtrain.errors.CommError` that
names the rank, the operation and the training step.

* :func:`wait_work` -- wait for a ``torch.distributed`` work handle with a deadline;
* :func:`with_step` -- the same CommError with the step filled in (raised again by a waiter);
* :data:`GRACE_S` -- what a waiter adds to a communication thread's own timeout;
* :func:`add_blocked` / :func:`blocked_s` -- the seconds this process has spent blocked on communication
  (waiting for a collective, a bucket, a receive), which the engines note where they wait, so that the
  training loop can tell a step's own work from its waiting on the others (:mod:`dtrain.training.slowdown`).

The data-parallel engines (:mod:`dtrain.data_parallel`, :mod:`dtrain.sharded`) and the wrap-time
agreement of :mod:`dtrain.comm.replicas` use them.
"""

from __future__ import annotations

import datetime
from typing import Any

from dtrain.errors import CommError, CommTimeoutError

__all__ = ["GRACE_S", "wait_work", "with_step", "add_blocked", "blocked_s"]

#: extra seconds a waiter gives the communication thread beyond the collective's
#: own timeout, so that the thread's more precise error (naming the peer) wins.
GRACE_S = 2.0

_blocked = [0.0]  # seconds this process has spent blocked on communication (one training loop a process)


def add_blocked(seconds: float) -> None:
    """Count ``seconds`` this process spent blocked on communication (an engine calls it where it waits)."""
    _blocked[0] += seconds


def blocked_s() -> float:
    """The seconds this process has spent blocked on communication so far (differences are what count)."""
    return _blocked[0]


def wait_work(work: Any, timeout_s: float, rank: int, op: str, step: int | None = None) -> None:
    """Wait for a torch.distributed work handle; a failure or timeout becomes a CommError naming rank, op, step."""
    try:
        ok = work.wait(timeout=datetime.timedelta(seconds=max(timeout_s, 1e-3)))
    except RuntimeError as e:
        msg = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        low = msg.lower()
        cls = CommTimeoutError if "timeout" in low or "timed out" in low else CommError
        raise cls(rank, op, msg, step=step) from e
    if ok is False:
        raise CommTimeoutError(rank, op, f"not completed within {timeout_s:.0f}s", step=step)


def with_step(e: BaseException, step: int) -> BaseException:
    """The same CommError with the training step filled in (other errors unchanged).

    A CommError whose cause is the backend's timeout ("Timed out waiting ...")
    becomes a CommTimeoutError, whichever layer classified it.
    """
    if not isinstance(e, CommError):
        return e
    low = e.cause.lower()
    cls = CommTimeoutError if "timed out" in low or "timeout" in low else type(e)
    if e.step is None or cls is not type(e):
        new = cls(e.rank, e.op, e.cause, peer=e.peer, step=e.step if e.step is not None else step)
        new.__cause__ = e
        return new
    return e
