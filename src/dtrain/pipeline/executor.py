"""Play one rank's list of pipeline actions: forwards, backwards, sends and receives.

:class:`Executor` runs any valid, lowered action list (see
:func:`dtrain.pipeline.schedules.with_comms`): ``F`` runs a stage on a micro-batch's
input (the batch's slice on stage 0, a received or local activation elsewhere) and,
on the last stage, its loss; ``B`` back-propagates the received output gradient (or
the loss scaled by ``1 / M``); ``I`` and ``W`` split ``B`` into the input's gradient
and the weights'; ``SF``/``RF``/``SB``/``RB`` move activations and gradients through
the :class:`~dtrain.pipeline._channel.Channel`; ``U`` marks the optimizer step,
which the caller takes after :meth:`Executor.run`. Between stages on one rank
(interleaved schedules with one rank, or a user's placement) tensors are handed
over without a message.

A stage may take a second input beside its activation, the same on every stage (a model's token ids,
from which each stage of :mod:`dtrain.pipeline.staged` recomputes the masks and positions): ``side``, one
per micro-batch, passed to :meth:`Executor.run`.

Receives whose shapes are known (every step after the first) are posted when the
step starts, so a message never waits for its receiver to reach the action.

For PipeDream-2BW the executor keeps two weight versions (double-buffered weights):
two shadow copies of each stage that defers backwards, used in turn. Each call copies
the live parameters into one shadow and runs its forwards on it; the backward passes
deferred to the next call (micro-batch ids below zero) run on the graph of the other,
which still holds the weights their forward used. When a version's batch is complete,
its gradient goes into the live parameters' ``.grad``. The shadows share the live
stage's buffers; the last stage defers nothing and runs on its live parameters.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as recompute

from dtrain.comm.waits import add_blocked
from dtrain.pipeline._channel import ACT, GRAD, Channel, PipelineError
from dtrain.pipeline.schedules import Action, Schedule, flush_actions, with_comms
from dtrain.trace import Tracer

__all__ = ["Executor", "StepStats"]

_COMPUTE = ("F", "B", "I", "W")
_RECV = ("RF", "RB")


@dataclass
class StepStats:
    """Figures of one step on one rank.

    Attributes:
        compute_s: seconds in forward and backward passes (busy).
        wait_s: seconds blocked in receives.
        step_s: the whole call (set by the caller).
        loss_sum: the sum of the micro-batch losses (last stage only).
        loss: the batch's mean loss (set by the caller).
        in_flight: per local stage, the most micro-batches forwarded but not yet back-propagated.
    """

    step: int
    compute_s: float = 0.0
    wait_s: float = 0.0
    step_s: float = 0.0
    loss_sum: float = 0.0
    loss: float = 0.0
    in_flight: dict[int, int] = field(default_factory=dict)

    @property
    def idle_s(self) -> float:
        """Seconds of the step not computing (bubble, messages, the loss's broadcast)."""
        return max(0.0, self.step_s - self.compute_s)

    @property
    def bubble(self) -> float:
        """The idle fraction of the step."""
        return self.idle_s / self.step_s if self.step_s > 0 else 0.0


@dataclass
class _Record:
    """One micro-batch on one stage during its life on this rank."""

    inp: torch.Tensor | None = None
    out: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    gout: torch.Tensor | None = None
    module: nn.Module | None = None  # the module its forward ran (2bw: a shadow holding that weight version)


def _shadow(part: nn.Module) -> nn.Module:
    """A copy of ``part`` with its own parameters and the live buffers (running statistics stay one)."""
    twin = copy.deepcopy(part)
    for live, mod in zip(part.modules(), twin.modules()):
        for b in list(mod._buffers):
            mod._buffers[b] = live._buffers[b]
    return twin


class Executor:
    """Runs ``schedule``'s list for ``rank`` over ``parts`` (this rank's stages by virtual stage index)."""

    def __init__(
        self,
        channel: Channel,
        parts: dict[int, nn.Module],
        schedule: Schedule,
        rank: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        checkpoint: str,
    ) -> None:
        self.channel, self.parts, self.rank = channel, parts, rank
        self.schedule = with_comms(schedule)
        self.actions = self.schedule.actions[rank]
        self.M = schedule.microbatches
        self.last = schedule.stages - 1
        self.loss_fn = loss_fn
        self.checkpoint = checkpoint
        self.twobw = schedule.name == "2bw"
        self._flush = self._lower_flush(schedule) if self.twobw else ()
        self.carried = self._carried() if self.twobw else frozenset()
        self._records: dict[tuple[int, int], _Record] = {}
        self._live: dict[int, int] = dict.fromkeys(parts, 0)  # micro-batches in flight per stage
        self.peak_in_flight: dict[int, int] = dict.fromkeys(parts, 0)
        deferring = {a.stage for a in self.actions if a.mb is not None and a.mb < 0} if self.twobw else set()
        self._shadows = [{s: _shadow(self.parts[s]) for s in deferring} for _ in range(2)]
        # 2bw, stages that defer nothing (the last): they run on the live weights, but their gradient, too,
        # must reach .grad one call late -- held here meanwhile
        self._direct = [s for s in self.parts if s not in deferring] if self.twobw else []
        self._held: dict[int, list[torch.Tensor | None]] = {}
        self._cur: int | None = None  # 2bw: the shadow this call's forwards use
        self._prev: int | None = None  # 2bw: the shadow whose batch's last backwards are pending
        self._stats = StepStats(0)
        self._side: list[torch.Tensor] | None = None  # this call's second inputs, one per micro-batch
        self.tracer: Tracer | None = None  # set by the Pipeline: a span per action
        self._call = 0  # calls so far (2bw: the parity of a micro-batch's batch is part of its message tags)
        if self.twobw:
            channel.wire = self._wire

    def _wire(self, mb: int) -> int:
        """2bw: micro-batch ``mb`` of this call (``mb < 0``: of the previous call's batch) on the wire."""
        batch = self._call - (1 if mb < 0 else 0)
        return (batch % 2) * self.M + mb % self.M

    def _carried(self) -> frozenset[tuple[int, int]]:
        """2bw: (stage, micro-batch) of this rank's gradient sends whose receiver backs that micro-batch up
        in its next call (under the id ``mb - M``), not in this one."""
        out = set()
        for a in self.actions:
            if a.op == "SB" and a.mb is not None and a.mb >= 0:
                receiver = self.schedule.actions[self.schedule.stage_rank(a.stage - 1)]
                if Action(a.stage - 1, "RB", a.mb) not in receiver:
                    out.add((a.stage, a.mb))
        return frozenset(out)

    def _lower_flush(self, schedule: Schedule) -> tuple[Action, ...]:
        flush = Schedule("2bw-flush", schedule.ranks, schedule.microbatches, schedule.chunks, flush_actions(schedule))
        return with_comms(flush).actions[self.rank]

    def _local(self, stage: int) -> bool:
        return stage in self.parts

    # ------------------------------------------------------------------ a call

    def run(
        self,
        xs: list[torch.Tensor] | None,
        ys: list[torch.Tensor] | None,
        step: int,
        side: list[torch.Tensor] | None = None,
    ) -> StepStats:
        """Play the list once over micro-batches ``xs`` / ``ys`` (None where this rank does not read them);
        ``side``: every stage's second input, by micro-batch (None: the stages take their activation only)."""
        self._stats = StepStats(step)
        self._side = side
        if self.twobw:
            self._cur = self._call % 2
            with torch.no_grad():
                for s, twin in self._shadows[self._cur].items():
                    for t, p in zip(twin.parameters(), self.parts[s].parameters()):
                        t.copy_(p)
        self._prefetch(self.actions)
        for a in self.actions:
            self._do(a, xs, ys)
        if self.twobw:
            self._rotate()
        else:
            self._records.clear()
        self._call += 1
        self._stats.in_flight = dict(self.peak_in_flight)
        return self._stats

    def flush(self, step: int) -> bool:
        """2bw: the deferred backwards of the last batch, and its gradient into ``.grad``; whether
        there was such a batch."""
        if not self.twobw or self._prev is None:
            return False
        self._stats = StepStats(step)
        self._prefetch(self._flush)
        for a in self._flush:
            self._do(a, None, None)
        self._give_grads(self._prev)
        for s, grads in self._held.items():
            for p, g in zip(self.parts[s].parameters(), grads):
                p.grad = g
        self._held = {}
        self._prev = None
        self._records.clear()
        self._call += 1
        return True

    def _rotate(self) -> None:
        """2bw, end of a call: the previous batch is complete (its gradient goes to ``.grad``); this batch's
        unfinished micro-batches are renumbered ``mb - M`` for the next call."""
        held = {s: [p.grad for p in self.parts[s].parameters()] for s in self._direct}  # this batch's
        for s in self._direct:
            for p, g in zip(self.parts[s].parameters(), self._held.get(s, [])):
                p.grad = g  # the previous batch's (None after the first call: no update)
            if s not in self._held:
                for p in self.parts[s].parameters():
                    p.grad = None
        self._held = held
        if self._prev is not None:
            self._give_grads(self._prev)
        pending = {(s, m - self.M): r for (s, m), r in self._records.items() if m >= 0 and r.out is not None}
        self._records = pending
        self._prev, self._cur = self._cur, None

    def _give_grads(self, version: int) -> None:
        """A complete batch's gradient, accumulated in shadow ``version``, into the live ``.grad``."""
        for s, twin in self._shadows[version].items():
            for t, p in zip(twin.parameters(), self.parts[s].parameters()):
                g, t.grad = t.grad, None
                if g is None:
                    continue
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)

    def _skip(self, a: Action) -> bool:
        """2bw: a deferred micro-batch of a batch that does not exist (the first call, or after a flush)."""
        return a.mb is not None and a.mb < 0 and (self._prev is None or (a.stage, a.mb) not in self._records)

    def _prefetch(self, actions: tuple[Action, ...]) -> None:
        for a in actions:
            if a.op in _RECV and not self._skip(a):
                assert a.mb is not None
                self.channel.prefetch(ACT if a.op == "RF" else GRAD, a.stage, a.mb)

    # ------------------------------------------------------------------ one action

    def _do(self, a: Action, xs: list[torch.Tensor] | None, ys: list[torch.Tensor] | None) -> None:
        if a.op == "U" or self._skip(a):
            return
        assert a.mb is not None
        if a.stage not in self.parts:
            raise PipelineError(f"rank {self.rank}: action {a} is for stage {a.stage}, which is not on this rank")
        t0 = time.perf_counter()
        try:
            if a.op == "F":
                self._forward(a.stage, a.mb, xs, ys)
            elif a.op in ("B", "I", "W"):
                self._backward(a.stage, a.mb, a.op)
            elif a.op == "RF":
                self._rec(a.stage, a.mb).inp = self.channel.recv_act(a.stage, a.mb)
            elif a.op == "RB":
                self._rec(a.stage, a.mb).gout = self.channel.recv_grad(a.stage, a.mb)
            elif a.op == "SF":
                out = self._rec(a.stage, a.mb).out
                assert out is not None, f"{a}: no forward output"
                self.channel.send_act(a.stage, a.mb, out)
            elif a.op == "SB":
                self.channel.send_grad(a.stage, a.mb, self._input_grad(a.stage, a.mb))
        except PipelineError:
            raise
        except Exception as e:  # a stage's own error (shapes, dtypes, the loss): say where
            raise PipelineError(
                f"rank {self.rank}, stage {a.stage}, micro-batch {a.mb}: {a} failed: {type(e).__name__}: {e}"
            ) from e
        dt = time.perf_counter() - t0
        if self.tracer is not None:  # one span per action, on its own track (tid 1), e.g. "1F3", "2SB0"
            self.tracer.add(str(a), t0, dt, 1, stage=a.stage, mb=a.mb, op=a.op)
        if a.op in _COMPUTE:
            self._stats.compute_s += dt
        elif a.op in _RECV:
            self._stats.wait_s += dt
            add_blocked(dt)

    def _rec(self, stage: int, mb: int) -> _Record:
        r = self._records.get((stage, mb))
        if r is None:
            r = self._records[(stage, mb)] = _Record()
        return r

    def _input(self, stage: int, mb: int, xs: list[torch.Tensor] | None) -> torch.Tensor:
        if stage == 0:
            if xs is None:
                raise PipelineError(f"rank {self.rank}, stage 0, micro-batch {mb}: no input on this rank")
            return xs[mb]
        rec = self._rec(stage, mb)
        if self._local(stage - 1):  # handed over on this rank: a leaf, so backward stops here as over a message
            prev = self._records[(stage - 1, mb)].out
            assert prev is not None
            rec.inp = prev.detach()
        if rec.inp is None:
            raise PipelineError(
                f"rank {self.rank}, stage {stage}, micro-batch {mb}: forward before its input "
                f"arrived (the schedule lacks RF{mb} before F{mb}?)"
            )
        if rec.inp.is_floating_point():
            rec.inp.requires_grad_(True)
        return rec.inp

    def _forward(self, stage: int, mb: int, xs: list[torch.Tensor] | None, ys: list[torch.Tensor] | None) -> None:
        inp = self._input(stage, mb, xs)
        rec = self._rec(stage, mb)
        fn = self._stage_fn(stage, rec)
        args = (inp,) if self._side is None else (inp, self._side[mb])
        if self.checkpoint == "always" or (self.checkpoint == "except_last" and mb != self.M - 1):
            out = recompute(fn, *args, use_reentrant=False)
        else:
            out = fn(*args)
        rec.out = out
        if stage == self.last:
            if ys is None:
                raise PipelineError(f"rank {self.rank}, stage {stage}, micro-batch {mb}: no target on this rank")
            rec.loss = self.loss_fn(out, ys[mb])
            self._stats.loss_sum += float(rec.loss.detach())
        self._live[stage] += 1
        self.peak_in_flight[stage] = max(self.peak_in_flight[stage], self._live[stage])

    def _stage_fn(self, stage: int, rec: _Record) -> Callable[..., torch.Tensor]:
        """The stage as a function of its input: the module, or (2bw, a stage that defers backwards) this
        call's shadow of it."""
        module: nn.Module = self.parts[stage]
        if self._cur is not None and stage in self._shadows[self._cur]:
            module = self._shadows[self._cur][stage]
        rec.module = module
        return module

    def _backward(self, stage: int, mb: int, op: str) -> None:
        rec = self._records.get((stage, mb))
        if rec is None or rec.out is None:
            raise PipelineError(
                f"rank {self.rank}, stage {stage}, micro-batch {mb}: backward ({op}) before its forward"
            )
        if stage == self.last:
            assert rec.loss is not None
            target, grad = rec.loss / self.M, None
        else:
            target, grad = rec.out, self._output_grad(stage, mb)
        if op == "I":
            if rec.inp is not None and rec.inp.requires_grad:
                (rec.inp.grad,) = torch.autograd.grad(target, rec.inp, grad, retain_graph=True)
            return
        if target.requires_grad:
            inputs: list[torch.Tensor] | None = None
            if op == "W":
                module = rec.module if rec.module is not None else self.parts[stage]
                inputs = [t for t in module.parameters() if t.requires_grad]
            torch.autograd.backward(target, grad, inputs=inputs)
        rec.out = rec.loss = rec.gout = None
        self._live[stage] -= 1
        if stage < self.last and self._local(stage + 1):
            self._records.pop((stage + 1, mb), None)

    def _output_grad(self, stage: int, mb: int) -> torch.Tensor:
        if self._local(stage + 1):
            nxt = self._records.get((stage + 1, mb))
            if nxt is None or nxt.inp is None or nxt.inp.grad is None:
                raise PipelineError(
                    f"rank {self.rank}, stage {stage}, micro-batch {mb}: backward before stage "
                    f"{stage + 1}'s backward of the same micro-batch"
                )
            return nxt.inp.grad
        rec = self._records[(stage, mb)]
        if rec.gout is None:
            raise PipelineError(
                f"rank {self.rank}, stage {stage}, micro-batch {mb}: backward before the output's "
                f"gradient arrived (the schedule lacks RB{mb} before B{mb}?)"
            )
        return rec.gout

    def _input_grad(self, stage: int, mb: int) -> torch.Tensor:
        rec = self._records[(stage, mb)]
        assert rec.inp is not None
        if rec.inp.grad is None:  # the stage does not depend on its input (or it is not floating point)
            return torch.zeros_like(rec.inp)
        return rec.inp.grad
