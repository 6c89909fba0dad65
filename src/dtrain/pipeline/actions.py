"""The data a pipeline schedule is made of: :class:`Action` and :class:`Schedule`.

An :class:`Action` is a virtual stage, an op and a micro-batch, written compactly as
``"1F3"`` (stage 1, forward, micro-batch 3); :meth:`Action.parse` reads the text back. The ops:

====  ===========================================================================
F     forward
B     full backward (input and weights)
I     backward for the input only; with W it replaces B (Qi et al. 2024, "Zero
      Bubble Pipeline Parallelism", ICLR 2024)
W     backward for the weights only
SF    send the activation to the next stage; RF receive it from the previous one
SB    send the input's gradient to the previous stage; RB receive the output's
      gradient from the next one
U     optimizer step (no micro-batch: ``"1U"``)
====  ===========================================================================

A :class:`Schedule` holds one list per rank; ``stages = ranks * chunks`` virtual stages sit round-robin,
stage ``s`` on rank ``s % ranks``. :mod:`dtrain.pipeline.schedules` builds, lowers, plays and checks them;
this module imports nothing of dtrain's, so the play's engine (:mod:`dtrain.pipeline._simulate`) reads the
same classes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = ["OPS", "COMM_OPS", "ScheduleError", "Action", "Schedule"]

OPS = ("F", "B", "I", "W", "SF", "RF", "SB", "RB", "U")
COMM_OPS = ("SF", "RF", "SB", "RB")

_ACTION_RE = re.compile(r"(\d+)(SF|RF|SB|RB|F|B|I|W|U)(-?\d+)?")


class ScheduleError(ValueError):
    """A schedule (or the arguments that build one) is invalid; names the rank, the action and the cause."""


@dataclass(frozen=True)
class Action:
    """One step of one rank: ``op`` on virtual stage ``stage`` for micro-batch ``mb``.

    Args:
        stage: virtual stage index, ``0 .. stages-1``.
        op: one of :data:`OPS`.
        mb: micro-batch id; None only for U. A negative id (2bw only) is the previous batch's
            micro-batch ``mb + M``, whose backward was deferred into this call.

    Raises:
        ScheduleError: an unknown op, a negative stage, a missing or superfluous micro-batch.
    """

    stage: int
    op: str
    mb: int | None = None

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ScheduleError(f"action {self.stage}{self.op}{self.mb}: unknown op {self.op!r} (ops: {' '.join(OPS)})")
        if not isinstance(self.stage, int) or self.stage < 0:
            raise ScheduleError(f"action {self.op}{self.mb}: stage must be an int >= 0, got {self.stage!r}")
        if self.mb is not None and not isinstance(self.mb, int):
            raise ScheduleError(f"action {self.stage}{self.op}: micro-batch must be an int, got {self.mb!r}")
        if (self.mb is None) != (self.op == "U"):
            need = "takes no micro-batch" if self.op == "U" else "needs a micro-batch"
            raise ScheduleError(f"action {self.stage}{self.op}{'' if self.mb is None else self.mb}: {self.op} {need}")

    def __str__(self) -> str:
        return f"{self.stage}{self.op}" if self.mb is None else f"{self.stage}{self.op}{self.mb}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """The action written as ``text`` (``"1F3"``, ``"0B-2"``, ``"2SF3"``, ``"1U"``): the inverse of ``str``."""
        m = _ACTION_RE.fullmatch(text.strip())
        if m is None:
            raise ScheduleError(
                f"action {text!r}: not of the form <stage><op><micro-batch> with op one of "
                f"{' '.join(OPS)} (e.g. '1F3', '0B-2', '1U')"
            )
        return cls(int(m.group(1)), m.group(2), None if m.group(3) is None else int(m.group(3)))


@dataclass(frozen=True)
class Schedule:
    """The per-rank action lists of one call (one batch) of a pipeline.

    Args:
        name: ``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"2bw"`` or ``"custom"``; only ``"2bw"``
            allows negative (deferred) micro-batch ids.
        ranks: P, the pipeline's ranks.
        microbatches: M, micro-batches per call.
        chunks: v, virtual stages per rank (1 except interleaved).
        actions: per rank, its actions in execution order (lists are stored as tuples).

    Raises:
        ScheduleError: ``ranks``, ``microbatches`` or ``chunks`` below 1, or not one list per rank.
    """

    name: str
    ranks: int
    microbatches: int
    chunks: int
    actions: tuple[tuple[Action, ...], ...] = field(repr=False)

    def __post_init__(self) -> None:
        for what in ("ranks", "microbatches", "chunks"):
            value = getattr(self, what)
            if not isinstance(value, int) or value < 1:
                raise ScheduleError(f"schedule {self.name!r}: {what} must be an int >= 1, got {value!r}")
        object.__setattr__(self, "actions", tuple(tuple(acts) for acts in self.actions))
        if len(self.actions) != self.ranks:
            raise ScheduleError(
                f"schedule {self.name!r}: {self.ranks} ranks need {self.ranks} action lists, got {len(self.actions)}"
            )

    @property
    def stages(self) -> int:
        """Virtual stages, ``ranks * chunks``."""
        return self.ranks * self.chunks

    def stage_rank(self, stage: int) -> int:
        """The rank holding virtual stage ``stage`` (round-robin; the identity when ``chunks == 1``)."""
        return stage % self.ranks

    def rank_stages(self, rank: int) -> list[int]:
        """The virtual stages on ``rank``, increasing."""
        return list(range(rank, self.stages, self.ranks))

    def text(self) -> str:
        """One line per rank, ``"rank 0: 0F0 0F1 0B0 ..."``; :func:`parse_schedule` reads it back."""
        return "\n".join(f"rank {r}:" + "".join(f" {a}" for a in acts) for r, acts in enumerate(self.actions))
