"""Activations and their gradients between pipeline stages, as point-to-point messages.

A :class:`Channel` sits on a :class:`~dtrain.comm.transport.Transport` (so every byte
is counted in its stats) and knows where each virtual stage lives. Shapes are
exchanged once: the first time stage ``s`` sends its output, a small header
(dtype and shape) goes ahead of it; afterwards both sides know the shape, the
receiver can post its receives before they are needed (:meth:`Channel.prefetch`),
and a sender whose output changes shape raises :class:`PipelineError` instead of
sending something the receiver would misread. Every failure of a send or receive
becomes a :class:`PipelineError` naming the stage, the micro-batch, the peer and
the cause.

Tags are unique per (kind, stage, micro-batch) within a step; a pair of ranks
reuses them step after step in order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dtrain.comm.transport import Transport, Work
from dtrain.errors import CommError, DTrainError

__all__ = ["PipelineError", "Channel", "next_space", "ACT", "GRAD", "LOSS", "STATE", "EVAL"]

ACT, GRAD, META, LOSS, STATE, EVAL, EVAL_META = 1, 2, 3, 4, 5, 6, 7
_KIND_NAMES = {
    ACT: "the activation",
    GRAD: "the gradient",
    META: "the activation's shape",
    LOSS: "the loss",
    STATE: "the parameters",
    EVAL: "the evaluation activation",
    EVAL_META: "the evaluation activation's shape",
}
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_META_LEN = 10  # dtype code, ndim, up to 8 dimensions
_MB_OFFSET = 2048  # micro-batch ids from -2048 (2bw's deferred ones are negative)


class PipelineError(DTrainError):
    """A pipeline failed: the message names the rank, the stage, the micro-batch and the cause."""


_SPACE = 1 << 25  # tags of one pipeline: below this; pipelines on one group get spaces 0..31


def tag(kind: int, stage: int, mb: int, space: int = 0) -> int:
    """The message tag of ``kind`` for ``stage`` and micro-batch ``mb`` (unique within a step) in the
    tag space of pipeline number ``space`` on its group."""
    return (space % 32) * _SPACE + (kind * 1024 + stage) * 4096 + mb + _MB_OFFSET


_SPACES: dict[int, int] = {}


def next_space(transport: Transport) -> int:
    """A tag space for a new pipeline on ``transport``'s group: pipelines built in the same order on every
    rank get the same number, and two of them (two models, or dtrain beside another pipeline) never
    take each other's messages."""
    key = id(getattr(transport, "_pg", transport))
    n = _SPACES.get(key, 0)
    _SPACES[key] = n + 1
    return n


def _same(mb: int) -> int:
    return mb


@dataclass
class _Pending:
    work: Work
    buf: torch.Tensor


class Channel:
    """Messages between the stages of one pipeline.

    Args:
        transport: ranks of the pipeline's group.
        stage_rank: the rank that holds a virtual stage.
        stages: number of virtual stages.
    """

    def __init__(self, transport: Transport, stage_rank: Callable[[int], int], stages: int, space: int = 0) -> None:
        self.t = transport
        self.space = space
        self.rank = transport.rank
        self.stage_rank = stage_rank
        self.stages = stages
        self.out_meta: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}  # stage -> its output's shape
        self.in_meta: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}  # stage -> its input's shape
        self._sends: list[tuple[Work, int, int, int, str]] = []  # (work, kind, stage, mb, what)
        self._posted: dict[tuple[int, int, int], _Pending] = {}  # (kind, stage, mb) -> receive
        # a micro-batch's id on the wire (2bw: its batch's parity and its index in the batch, so that a
        # gradient sent in one call and received, as a deferred micro-batch, in the next still matches)
        self.wire: Callable[[int], int] = _same

    def _tag(self, kind: int, stage: int, mb: int) -> int:
        return tag(kind, stage, mb, self.space)

    # ------------------------------------------------------------------ errors

    def fail(self, stage: int, mb: int | None, what: str, e: BaseException) -> PipelineError:
        at = f"rank {self.rank}, stage {stage}" + ("" if mb is None else f", micro-batch {mb}")
        cause = e.cause if isinstance(e, CommError) else str(e)
        return PipelineError(f"{at}: {what} failed: {cause}")

    def _wait(self, work: Work, stage: int, mb: int | None, what: str) -> None:
        try:
            work.wait()
        except CommError as e:
            raise self.fail(stage, mb, what, e) from e

    # ------------------------------------------------------------------ sends

    def _isend(self, t: torch.Tensor, dst_stage: int, kind: int, stage: int, mb: int, what: str) -> None:
        dst = self.stage_rank(dst_stage)
        try:
            w = self.t.isend(t, dst, self._tag(kind, stage, self.wire(mb)))
        except CommError as e:
            raise self.fail(stage, mb, what, e) from e
        self._sends.append((w, kind, stage, mb, what))

    def send_act(self, stage: int, mb: int, out: torch.Tensor) -> None:
        """Stage ``stage``'s output for micro-batch ``mb`` to stage ``stage + 1`` (a header first, once)."""
        what = f"sending {_KIND_NAMES[ACT]} to stage {stage + 1} (rank {self.stage_rank(stage + 1)})"
        if not isinstance(out, torch.Tensor):
            raise PipelineError(
                f"rank {self.rank}, stage {stage}, micro-batch {mb}: the stage's output is a "
                f"{type(out).__name__}; a pipeline stage must return one tensor"
            )
        shape, dtype = tuple(out.shape), out.dtype
        known = self.out_meta.get(stage)
        if known is None:
            if dtype not in _DTYPES or len(shape) > _META_LEN - 2:
                raise PipelineError(
                    f"rank {self.rank}, stage {stage}, micro-batch {mb}: cannot send an output "
                    f"of dtype {dtype} with {len(shape)} dimensions"
                )
            meta = torch.zeros(_META_LEN, dtype=torch.int64)
            meta[0], meta[1] = _DTYPES.index(dtype), len(shape)
            meta[2 : 2 + len(shape)] = torch.tensor(shape, dtype=torch.int64)
            self._isend(meta, stage + 1, META, stage, mb, what)
            self.out_meta[stage] = (shape, dtype)
        elif known != (shape, dtype):
            raise PipelineError(
                f"rank {self.rank}, stage {stage}, micro-batch {mb}: the output is {dtype} {list(shape)} but was "
                f"{known[1]} {list(known[0])} at the first step; a stage's output must keep its shape and dtype "
                f"from step to step (keep the batch size fixed: drop the last incomplete batch)"
            )
        self._isend(out.detach().contiguous(), stage + 1, ACT, stage, mb, what)

    def send_grad(self, stage: int, mb: int, grad: torch.Tensor) -> None:
        """The gradient of stage ``stage``'s input for ``mb`` back to stage ``stage - 1``."""
        what = f"sending {_KIND_NAMES[GRAD]} to stage {stage - 1} (rank {self.stage_rank(stage - 1)})"
        self._isend(grad.contiguous(), stage - 1, GRAD, stage, mb, what)

    def send_to(self, t: torch.Tensor, rank: int, kind: int, stage: int, mb: int) -> None:
        """A message of ``kind`` to ``rank`` (the loss, parameters, evaluation activations)."""
        try:
            w = self.t.isend(t.contiguous(), rank, self._tag(kind, stage, mb))
        except CommError as e:
            raise self.fail(stage, mb, f"sending {_KIND_NAMES[kind]} to rank {rank}", e) from e
        self._sends.append((w, kind, stage, mb, f"sending {_KIND_NAMES[kind]} to rank {rank}"))

    def wait_sends(self, carried: frozenset[tuple[int, int]] = frozenset()) -> None:
        """Wait for every send started so far (the tensors may change after this), except the gradients
        of ``carried`` (stage, micro-batch) pairs: 2bw's receiver takes those in its next call, and gloo
        completes a send only once its receive is posted. They are waited at the next call's end."""
        sends, self._sends = self._sends, []
        for w, kind, stage, mb, what in sends:
            if kind == GRAD and (stage, mb) in carried:
                self._sends.append((w, kind, stage, mb, what))
            else:
                self._wait(w, stage, mb, what)

    # ------------------------------------------------------------------ receives

    def _post(
        self, kind: int, stage: int, mb: int, src_stage: int, shape: tuple[int, ...], dtype: torch.dtype
    ) -> _Pending:
        buf = torch.empty(shape, dtype=dtype)
        src = self.stage_rank(src_stage)
        try:
            w = self.t.irecv(buf, src, self._tag(kind, stage, self.wire(mb)))
        except CommError as e:
            raise self.fail(stage, mb, f"receiving {_KIND_NAMES[kind]} from stage {src_stage} (rank {src})", e) from e
        return _Pending(w, buf)

    def _recv_meta(self, stage: int, mb: int, kind: int = META) -> tuple[tuple[int, ...], torch.dtype]:
        meta = torch.zeros(_META_LEN, dtype=torch.int64)
        src = self.stage_rank(stage - 1)
        what = f"receiving {_KIND_NAMES[kind]} from stage {stage - 1} (rank {src})"
        try:
            w = self.t.irecv(meta, src, self._tag(kind, stage - 1, self.wire(mb)))
        except CommError as e:
            raise self.fail(stage, mb, what, e) from e
        self._wait(w, stage, mb, what)
        code, ndim = int(meta[0]), int(meta[1])
        return tuple(int(d) for d in meta[2 : 2 + ndim]), _DTYPES[code]

    def prefetch(self, kind: int, stage: int, mb: int) -> bool:
        """Post the receive of ``kind`` (ACT: stage ``stage``'s input; GRAD: the gradient of its output) for
        ``mb`` now, if its shape is known; returns whether it was posted."""
        key = (kind, stage, mb)
        if key in self._posted:
            return True
        if kind == ACT:
            meta = self.in_meta.get(stage)
            if meta is None:
                return False
            self._posted[key] = self._post(ACT, stage - 1, mb, stage - 1, *meta)
        else:
            meta = self.out_meta.get(stage)
            if meta is None:
                return False
            self._posted[key] = self._post(GRAD, stage + 1, mb, stage + 1, *meta)
        return True

    def recv_act(self, stage: int, mb: int) -> torch.Tensor:
        """Stage ``stage``'s input for ``mb``, from stage ``stage - 1``."""
        if stage not in self.in_meta:
            self.in_meta[stage] = self._recv_meta(stage, mb)
        self.prefetch(ACT, stage, mb)
        p = self._posted.pop((ACT, stage, mb))
        self._wait(
            p.work,
            stage,
            mb,
            f"receiving {_KIND_NAMES[ACT]} from stage {stage - 1} (rank {self.stage_rank(stage - 1)})",
        )
        return p.buf

    def recv_grad(self, stage: int, mb: int) -> torch.Tensor:
        """The gradient of stage ``stage``'s output for ``mb``, from stage ``stage + 1``."""
        if stage not in self.out_meta:
            raise PipelineError(
                f"rank {self.rank}, stage {stage}, micro-batch {mb}: a gradient is expected for an "
                f"output this stage has not sent (the schedule runs B before SF?)"
            )
        self.prefetch(GRAD, stage, mb)
        p = self._posted.pop((GRAD, stage, mb))
        self._wait(
            p.work,
            stage,
            mb,
            f"receiving {_KIND_NAMES[GRAD]} from stage {stage + 1} (rank {self.stage_rank(stage + 1)})",
        )
        return p.buf

    def recv_from(
        self, rank: int, kind: int, stage: int, mb: int, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """A message of ``kind`` from ``rank`` into a new tensor."""
        buf = torch.empty(shape, dtype=dtype)
        try:
            w = self.t.irecv(buf, rank, self._tag(kind, stage, mb))
        except CommError as e:
            raise self.fail(stage, mb, f"receiving {_KIND_NAMES[kind]} from rank {rank}", e) from e
        self._wait(w, stage, mb, f"receiving {_KIND_NAMES[kind]} from rank {rank}")
        return buf

    # ------------------------------------------------------------------ evaluation (shapes every time)

    def send_eval(self, stage: int, out: torch.Tensor) -> None:
        meta = torch.zeros(_META_LEN, dtype=torch.int64)
        meta[0], meta[1] = _DTYPES.index(out.dtype), out.dim()
        meta[2 : 2 + out.dim()] = torch.tensor(tuple(out.shape), dtype=torch.int64)
        dst = self.stage_rank(stage + 1)
        self.send_to(meta, dst, EVAL_META, stage, 0)
        self.send_to(out, dst, EVAL, stage, 0)

    def recv_eval(self, stage: int) -> torch.Tensor:
        shape, dtype = self._recv_meta(stage, 0, EVAL_META)
        return self.recv_from(self.stage_rank(stage - 1), EVAL, stage - 1, 0, shape, dtype)
