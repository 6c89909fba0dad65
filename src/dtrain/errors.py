"""Exceptions raised by dtrain.

Every error that comes out of a blocking operation names the rank, the operation
and (where known) the training step, so a hang in a job of many processes turns
into one line that says where to look.
"""

from __future__ import annotations

__all__ = ["DTrainError", "ConfigError", "CommError", "CommTimeoutError", "ModelMismatchError"]


class DTrainError(RuntimeError):
    """Base class of every error dtrain raises on purpose."""


class ConfigError(DTrainError, ValueError):
    """A configuration value is invalid; raised before any process starts."""


class CommError(DTrainError):
    """A communication operation failed.

    Args:
        rank: the rank that observed the failure.
        op: the operation, e.g. ``"allreduce(ring)"`` or ``"recv"``.
        cause: what went wrong, in words.
        peer: the other rank involved, when there is one.
        step: the training step, when known.
    """

    def __init__(
        self, rank: int, op: str, cause: str, *, peer: int | None = None, step: int | None = None
    ) -> None:
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
