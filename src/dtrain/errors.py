"""Exceptions raised by dtrain.

Every error that comes out of a blocking operation names the rank, the operation
and (where known) the training step, so a hang in a job of many processes turns
into one line that says where to look. :func:`run_command` is what every ``dtrain``
command does with one: one line on stderr, exit status 2.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

__all__ = [
    "DTrainError",
    "ConfigError",
    "CommError",
    "CommTimeoutError",
    "ModelMismatchError",
    "NonFiniteError",
    "check_choice",
    "run_command",
]


class DTrainError(RuntimeError):
    """Base class of every error dtrain raises on purpose."""


class ConfigError(DTrainError, ValueError):
    """A configuration value is invalid; raised before any process starts."""


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    """ConfigError unless ``value`` is one of ``choices`` (``name`` is the option, as the message says it)."""
    if value not in choices:
        raise ConfigError(f"{name} {value!r} is not known; choose one of: {', '.join(choices)}")


class CommError(DTrainError):
    """A communication operation failed.

    Args:
        rank: the rank that observed the failure.
        op: the operation, e.g. ``"allreduce(ring)"`` or ``"recv"``.
        cause: what went wrong, in words.
        peer: the other rank involved, when there is one.
        step: the training step, when known.
    """

    def __init__(self, rank: int, op: str, cause: str, *, peer: int | None = None, step: int | None = None) -> None:
        self.rank = rank
        self.op = op
        self.cause = cause
        self.peer = peer
        self.step = step
        where = f"rank {rank}: {op}"
        if peer is not None:
            where += f" with rank {peer}"
        if step is not None:
            where += f" at step {step}"
        super().__init__(f"{where}: {cause}")


class CommTimeoutError(CommError):
    """A blocking communication call did not complete within its timeout."""


class ModelMismatchError(DTrainError):
    """Ranks wrapped models that differ (names, shapes or dtypes)."""


class NonFiniteError(DTrainError):
    """A training step's loss or gradients are not finite (inf or nan).

    Args:
        rank: the rank that raises.
        step: the step (as in the run's metrics rows).
        detail: what was not finite, e.g. ``"gradient (inf) of parameter '0.weight'; loss 3e+17"``.
        parameter: the first parameter (model order) whose gradient is not finite; None when every
            gradient of this rank is finite (a non-finite loss alone, or another rank's step).
    """

    def __init__(self, rank: int, step: int, detail: str, *, parameter: str | None = None) -> None:
        self.rank = rank
        self.step = step
        self.parameter = parameter
        super().__init__(f"rank {rank} at step {step}: non-finite {detail}")


def run_command(prog: str, body: Callable[[], int], *, also: tuple[type[Exception], ...] = ()) -> int:
    """``body()``'s exit status; a :class:`DTrainError` (or one of ``also``) becomes
    ``"PROG: error: MESSAGE"`` on stderr and status 2 instead of a traceback."""
    caught: tuple[type[Exception], ...] = (DTrainError, *also)
    try:
        return body()
    except caught as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
