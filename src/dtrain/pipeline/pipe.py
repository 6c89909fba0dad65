"""``dtrain.Pipeline``: a model cut into stages, trained micro-batch by micro-batch.

An ``nn.Sequential`` is cut between its children. Any other module is cut between the blocks of its list of
repeated blocks (GPT-2's ``transformer.h``, Llama's ``model.layers``), found by one forward of ``sample``
(:mod:`dtrain.pipeline.blocks`); each stage then runs the model's own forward on the micro-batch's token ids
with only its blocks in place and only its parameters held (:mod:`dtrain.pipeline.staged`), every rank
reading the input. A parameter held on two ranks (an embedding tied to the head) has its gradient summed
over them after each step, so that its copies stay equal.

Every rank of the group builds the same model and calls :class:`Pipeline` with it;
each keeps only its stages (``stages = ranks * chunks``; virtual stage ``s`` lives
on rank ``s % ranks``). :meth:`Pipeline.step` splits the batch into micro-batches
and plays this rank's list of the schedule (:mod:`dtrain.pipeline.schedules`,
lowered with its sends and receives) through :mod:`dtrain.pipeline.executor`; it
leaves in every local parameter's ``.grad`` the gradient of the mean loss over the
whole batch (the micro-batch losses are scaled by ``1 / M``), exactly what the
unsplit model would have, and returns that loss on every rank.

PipeDream-2BW (``schedule="2bw"``) is asynchronous: the backward passes of a
batch's last micro-batches run during the next call (no pipeline flush), on the
weight version their forward used (weight stashing with two versions). A call
then leaves in ``.grad`` the gradient of the *previous* batch, computed on the
weights one optimizer step older: ``W(t+1) = W(t) - lr * grad(W(t-1))`` (Narayanan
et al., "Memory-Efficient Pipeline-Parallel DNN Training", ICML 2021). The first
call has no earlier batch and leaves ``.grad`` as it was; :meth:`Pipeline.flush`
finishes the last batch.

Example (every rank of a 4-process job)::

    pipe = dtrain.Pipeline(build_gpt("gpt-small"), microbatches=8, schedule="1f1b")
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    loss = pipe.step(x, y); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from dtrain.comm.transport import DEFAULT_TIMEOUT_S, TorchTransport, Transport
from dtrain.pipeline import blocks as _blocks
from dtrain.pipeline import partition as _partition
from dtrain.pipeline import staged as _staged
from dtrain.pipeline._channel import LOSS, STATE, Channel, PipelineError, next_space, tag
from dtrain.pipeline.executor import Executor, StepStats
from dtrain.pipeline.schedules import Schedule, ScheduleError, generate, validate, with_comms
from dtrain.trace import Tracer

__all__ = ["Pipeline", "PipelineError", "CHECKPOINTS", "SCHEDULES"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "2bw")
_TIED = 2  # the stage number of STATE messages that carry a shared parameter's gradient (0: the state, 1: floats)
CHECKPOINTS = ("never", "except_last", "always")


def _call(model: nn.Module, x: torch.Tensor) -> Any:
    """How a stage calls a module that is not an ``nn.Sequential``: on the micro-batch's input."""
    return model(x)


def _default_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    from dtrain.workloads.models import task_loss

    return task_loss(out, target)


class Pipeline:
    """This rank's stages of a pipeline-parallel model.

    Args:
        model: the same module on every rank of ``group``: an ``nn.Sequential`` (cut between its children;
            ``dtrain``'s gpt models are one), or any module with a list of repeated blocks (cut between them,
            in place: afterwards it holds only this rank's stages; give ``sample``).
        microbatches: M, micro-batches per step; must divide the batch.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"2bw"``, or a
            :class:`~dtrain.pipeline.schedules.Schedule` of one's own (its ranks must be the group's size).
        loss_fn: ``loss_fn(output, target)`` of a micro-batch, a mean over its samples (default: cross
            entropy, over every position for a language model).
        balance: layer counts per stage, ``"equal"``, ``"params"``, ``"memory"`` or ``"time"`` (the last two
            profile the children on ``sample``; see :func:`dtrain.pipeline.partition.balance`).
        checkpoint: ``"never"``, ``"except_last"`` (recompute every micro-batch's activations in backward but
            the last's) or ``"always"`` (torch.utils.checkpoint).
        chunks: virtual stages per rank for ``"interleaved"`` (default 2).
        group: the process group (default: the whole job); or pass ``transport``.
        sample: one micro-batch of input for ``balance="time"`` / ``"memory"``, and, for a module that is not an
            ``nn.Sequential``, the forward that finds its blocks.
        split_points: names of the children (or blocks) that start the stages after the first, instead of
            ``balance`` (``["model.layers.2"]``).
        timeout: seconds any send or receive may block.
        transport: a :class:`~dtrain.comm.transport.Transport` to use instead of ``group``.
        tracer: a :class:`~dtrain.trace.Tracer` that gets a span per action (``"1F3"``, ``"2SB0"``: stage, op,
            micro-batch) on track 1.

    Attributes:
        module: this rank's stages, their children under the original names.
        stage / stages: this rank's first virtual stage and the number of virtual stages.
        sizes: children (or blocks) per virtual stage (the cut).
        stage_params: the parameters each virtual stage holds (elements; a tied tensor counted once a stage).
        schedule: the schedule played.
        last_stats: figures of the last step (:class:`~dtrain.pipeline.executor.StepStats`).
    """

    def __init__(
        self,
        model: nn.Module,
        microbatches: int,
        schedule: str | Schedule = "1f1b",
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        balance: str | Sequence[int] = "equal",
        checkpoint: str = "never",
        chunks: int = 2,
        group: Any = None,
        sample: torch.Tensor | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        transport: Transport | None = None,
        tracer: Tracer | None = None,
        split_points: Sequence[str] = (),
    ) -> None:
        if not isinstance(model, nn.Sequential) and sample is None:
            raise PipelineError(
                f"a pipeline of a {type(model).__name__} (not an nn.Sequential) needs sample=, one micro-batch "
                "of its input, to find the blocks it is cut between"
            )
        if not isinstance(microbatches, int) or microbatches < 1:
            raise PipelineError(f"microbatches must be a positive int, got {microbatches!r}")
        if checkpoint not in CHECKPOINTS:
            raise PipelineError(f"checkpoint {checkpoint!r} is not known; choose one of: {', '.join(CHECKPOINTS)}")
        self.transport = transport if transport is not None else TorchTransport(group, timeout)
        self.rank, ranks = self.transport.rank, self.transport.world_size
        self._space = next_space(self.transport)
        try:
            self.schedule = self._schedule(schedule, ranks, microbatches, chunks)
            validate(self.schedule)
        except ScheduleError as e:
            raise PipelineError(f"schedule: {e}") from None
        self.microbatches = microbatches
        self.stages = self.schedule.stages
        self.predicted_s: list[float] | None = None  # rank 0, balance="time": each stage's profiled time
        self._blocks: _blocks.Layout | None = None  # a module that is not an nn.Sequential: its blocks
        try:
            if isinstance(model, nn.Sequential):
                sizes = self._cut(model, balance, sample, split_points)
            else:
                assert sample is not None
                self._blocks = _blocks.trace(model, sample, profile=balance == "time" and self.rank == 0)
                sizes = self._cut_blocks(model, self._blocks, balance, split_points)
        except _partition.PartitionError as e:
            raise PipelineError(f"partition: {e}") from None
        self.sizes = self._agree(sizes)
        if self.predicted_s is not None and self.predicted_s:
            self.predicted_s = _partition.stage_costs(self.predicted_s, self.sizes)
        self._local = self.schedule.rank_stages(self.rank)
        self.stage = self._local[0]
        self._shared: list[tuple[int, nn.Parameter, list[int]]] = []  # (index, parameter, the ranks holding it)
        self.module: nn.Module
        if isinstance(model, nn.Sequential):
            parts = self._sequential(model, ranks)
        else:
            assert self._blocks is not None
            parts = self._any_module(model, ranks, self._blocks)
        self.channel = Channel(self.transport, self.schedule.stage_rank, self.stages, self._space)
        self.loss_fn = loss_fn if loss_fn is not None else _default_loss
        self.checkpoint = checkpoint
        self.executor = Executor(self.channel, parts, with_comms(self.schedule), self.rank, self.loss_fn, checkpoint)
        self.executor.tracer = tracer if tracer is not None and tracer.enabled else None
        self.last_stats: StepStats | None = None
        self.steps = 0

    def _sequential(self, model: nn.Sequential, ranks: int) -> dict[int, nn.Module]:
        """An ``nn.Sequential``'s stages (its children, under their names); sets the module and the layout."""
        children = self._children = list(model.named_children())
        offsets = [sum(self.sizes[:s]) for s in range(self.stages + 1)]
        blocks = [nn.Sequential(OrderedDict(children[offsets[s] : offsets[s + 1]])) for s in range(self.stages)]
        self._cut_names = [n for n, _ in children]
        self.stage_params = [sum(p.numel() for p in b.parameters()) for b in blocks]
        parts: dict[int, nn.Module] = {s: blocks[s] for s in self._local}
        self.module = nn.Sequential(OrderedDict(kv for s in self._local for kv in blocks[s].named_children()))
        self._layout = [
            [
                (n, tuple(t.shape), t.dtype)
                for s in self.schedule.rank_stages(r)
                for n, t in blocks[s].state_dict().items()
            ]
            for r in range(ranks)
        ]
        self._names = list(model.state_dict())
        return parts

    def _any_module(self, model: nn.Module, ranks: int, layout: _blocks.Layout) -> dict[int, nn.Module]:
        """A module's stages between its blocks (:mod:`dtrain.pipeline.staged`): prunes it in place; sets the
        module, the layout of every rank's state, the per-stage parameter counts and the shared parameters."""
        full = model.state_dict()
        named = list(model.named_parameters(remove_duplicate=False))
        hold = _staged.holders(layout, self.sizes, [*full, *(n for n, _ in named)])
        rank_of = self.schedule.stage_rank

        def ranks_of(name: str) -> set[int]:
            h = hold[name]
            return set(range(ranks)) if h is None else {rank_of(s) for s in h}

        self._layout = [
            [(n, tuple(t.shape), t.dtype) for n, t in full.items() if r in ranks_of(n)] for r in range(ranks)
        ]
        self._names = list(full)
        self._cut_names = layout.blocks
        held: dict[int, tuple[nn.Parameter, set[int]]] = {}
        for n, p in named:
            held.setdefault(id(p), (p, set()))[1].update(ranks_of(n))
        shared = [(p, sorted(rs)) for p, rs in held.values() if len(rs) > 1]
        self._shared = [(i, p, rs) for i, (p, rs) in enumerate(shared) if self.rank in rs]
        self.stage_params = [
            sum({id(p): p.numel() for n, p in named if hold[n] is None or s in (hold[n] or ())}.values())
            for s in range(self.stages)
        ]
        parts = _staged.cut_model(model, layout, self.sizes, self._local, _call)
        self.module = model
        kept, want = set(model.state_dict()), {n for n, _, _ in self._layout[self.rank]}
        if kept != want:  # pragma: no cover - the pruning and the layout disagree: a bug, said plainly
            raise PipelineError(f"rank {self.rank}: the stages hold {sorted(kept ^ want)} against the plan")
        return dict(parts)

    def _cut_blocks(
        self, model: nn.Module, layout: _blocks.Layout, spec: str | Sequence[int], points: Sequence[str]
    ) -> list[int]:
        """Blocks per virtual stage: the split points, or ``spec`` over the blocks' costs (rank 0's profile)."""
        n, where = len(layout.blocks), f"{layout.list_name} of {layout.model}"
        if n < self.stages:
            raise _partition.PartitionError(
                f"model {layout.model} has {n} blocks in {layout.list_name}, fewer than the {self.stages} stages: "
                "a pipeline cuts between blocks; use fewer stages (workers x chunks) or more layers"
            )
        if points:
            return _blocks.split_sizes(layout.blocks, points, self.stages, where)
        if spec == "time" and self.rank != 0:
            return [1] * self.stages  # replaced by rank 0's
        if spec == "time":
            self.predicted_s = [c.time_s for c in layout.costs]
        listed = model.get_submodule(layout.list_name)
        assert isinstance(listed, nn.ModuleList)
        blocks = nn.Sequential(*listed)  # named "0", "1", ... as the costs
        return _partition.balance(blocks, self.stages, spec, costs=layout.costs)

    def _cut(
        self, model: nn.Sequential, spec: str | Sequence[int], sample: torch.Tensor | None, points: Sequence[str]
    ) -> list[int]:
        """The cut (children per virtual stage); profiled on rank 0 only (the others take rank 0's)."""
        if points:
            names = [n for n, _ in model.named_children()]
            return _blocks.split_sizes(names, points, self.stages, f"the children of the {type(model).__name__}")
        if spec in ("time", "memory") and self.rank != 0:
            if len(model) < self.stages:
                raise _partition.PartitionError(f"model has {len(model)} layers, fewer than {self.stages} stages")
            return [1] * self.stages  # replaced by rank 0's
        if spec == "time" and sample is not None:
            costs = _partition.profile_children(model, sample)
            self.predicted_s = [c.time_s for c in costs]  # per layer until the cut is agreed
            return _partition.balance(model, self.stages, spec, costs=costs)
        return _partition.balance(model, self.stages, spec, sample=sample)

    def cut_table(self, measured: Sequence[float] | None = None) -> str:
        """The cut as a table: each stage's layers, its profiled time per micro-batch (balance="time", rank 0)
        and ``measured`` times if given."""
        names = self._cut_names
        predicted = self.predicted_s if self.predicted_s is not None else [float("nan")] * self.stages
        return _partition.describe(names, self.sizes, predicted, measured)

    def gather_floats(self, values: Sequence[float], dst: int = 0) -> list[list[float]] | None:
        """Every rank's ``values`` (the same length on every rank) on rank ``dst``, by rank; None elsewhere."""
        mine = torch.tensor(list(values), dtype=torch.float64)
        if self.rank != dst:
            self.channel.send_to(mine, dst, STATE, 1, 0)
            self.channel.wait_sends()
            return None
        out = []
        for r in range(self.transport.world_size):
            got = mine if r == dst else self.channel.recv_from(r, STATE, 1, 0, tuple(mine.shape), torch.float64)
            out.append([float(v) for v in got])
        return out

    def _agree(self, sizes: list[int]) -> list[int]:
        """Rank 0's cut on every rank (a measured balance differs from rank to rank by noise)."""
        t, n = self.transport, len(sizes)
        if t.world_size == 1:
            return sizes
        if self.rank == 0:
            msg = torch.tensor(sizes, dtype=torch.int64)
            works = [t.isend(msg, r, tag(STATE, 0, -1, self._space)) for r in range(1, t.world_size)]
            for w in works:
                w.wait()
            return sizes
        got = torch.empty(n, dtype=torch.int64)
        t.irecv(got, 0, tag(STATE, 0, -1, self._space)).wait()
        return [int(v) for v in got]

    @staticmethod
    def _schedule(schedule: str | Schedule, ranks: int, microbatches: int, chunks: int) -> Schedule:
        if isinstance(schedule, Schedule):
            if schedule.ranks != ranks or schedule.microbatches != microbatches:
                raise ScheduleError(
                    f"the schedule is for {schedule.ranks} ranks and {schedule.microbatches} "
                    f"micro-batches; this pipeline has {ranks} ranks and {microbatches}"
                )
            return schedule
        if schedule not in SCHEDULES:
            raise ScheduleError(f"schedule {schedule!r} is not known; choose one of: {', '.join(SCHEDULES)}")
        return generate(schedule, ranks, microbatches, chunks if schedule == "interleaved" else 1)

    # ------------------------------------------------------------------ training

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters (build the optimizer over them)."""
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters()

    @property
    def is_first(self) -> bool:
        """Whether this rank holds stage 0 (reads the input)."""
        return 0 in self._local

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the last stage (reads the target, computes the loss)."""
        return self.stages - 1 in self._local

    def _split(self, t: torch.Tensor | None, what: str) -> list[torch.Tensor]:
        if t is None:
            raise PipelineError(f"rank {self.rank}, stage {self.stage}: step() needs the {what} on this rank")
        n = t.shape[0]
        if n % self.microbatches:
            raise PipelineError(
                f"rank {self.rank}, stage {self.stage}: {self.microbatches} micro-batches do not "
                f"divide the batch of {n} ({what}); use a batch that is a multiple of "
                f"{self.microbatches}"
            )
        return list(t.chunk(self.microbatches))

    def step(self, x: torch.Tensor | None, y: torch.Tensor | None) -> float:
        """Forward and backward of the batch ``(x, y)`` through the schedule; the mean loss.

        Every rank of the group calls it. ``x`` is read on the first stage's rank (on every rank for a
        module that is not an ``nn.Sequential``: each stage runs the model's forward on it) and ``y`` on
        the last's (other ranks may pass None). Gradients accumulate into ``.grad`` (zero them
        between steps, as with any torch training loop); a parameter held on several ranks has the sum
        of their gradients on each.
        """
        side = self._split(x, "input (every stage runs the model's forward on it)") if self._blocks else None
        xs = side if side is not None else self._split(x, "input") if self.is_first else None
        ys = self._split(y, "target") if self.is_last else None
        t0 = time.perf_counter()
        stats = self.executor.run(xs, ys, self.steps, side)
        loss = self._share_loss(stats.loss_sum / self.microbatches if self.is_last else 0.0)
        self.channel.wait_sends(self.executor.carried)
        self._sum_shared()
        stats.step_s = time.perf_counter() - t0
        stats.loss = loss
        self.last_stats = stats
        self.steps += 1
        return loss

    def flush(self) -> bool:
        """2bw: run the backward passes deferred from the last step, leaving that batch's gradient in
        ``.grad`` (step the optimizer after it); whether there was such a batch (never for the other
        schedules). Every rank calls it."""
        ran = self.executor.flush(self.steps)
        self.channel.wait_sends()
        if ran:
            self._sum_shared()
        return ran

    def _sum_shared(self) -> None:
        """Each parameter held on several ranks (a tied embedding and head): the sum of their gradients on each,
        added in rank order so that every copy gets the same bits (and so stays equal after the update)."""
        for i, p, ranks in self._shared:
            g = p.grad.detach() if p.grad is not None else torch.zeros_like(p)
            for r in ranks:
                if r != self.rank:
                    self.channel.send_to(g, r, STATE, _TIED, i)
            total: torch.Tensor | None = None
            for r in ranks:
                part = g if r == self.rank else self.channel.recv_from(r, STATE, _TIED, i, tuple(g.shape), g.dtype)
                total = part.clone() if total is None else total.add_(part)
            self.channel.wait_sends(self.executor.carried)  # 2bw: not the gradients its next call receives
            p.grad = total

    def shared_parameters(self) -> list[tuple[nn.Parameter, list[int]]]:
        """This rank's parameters that other ranks hold too, with the ranks holding each (their gradients are
        summed over them; a global norm counts each once)."""
        return [(p, ranks) for _, p, ranks in self._shared]

    def _share_loss(self, value: float) -> float:
        """The last stage's loss on every rank (it sends; the others receive)."""
        last = self.schedule.stage_rank(self.stages - 1)
        if self.transport.world_size == 1:
            return value
        if self.rank == last:
            t = torch.tensor([value], dtype=torch.float64)
            for r in range(self.transport.world_size):
                if r != last:
                    self.channel.send_to(t, r, LOSS, self.stages - 1, 0)
            return value
        got = self.channel.recv_from(last, LOSS, self.stages - 1, 0, (1,), torch.float64)
        return float(got[0])

    # ------------------------------------------------------------------ evaluation and state

    @torch.no_grad()
    def forward(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """The model's output for ``x`` (evaluation: no gradients, the whole batch at once) on the last
        stage's rank; None on the others. Every rank calls it; ``x`` is read on the first stage's (on every rank
        for a module that is not an ``nn.Sequential``)."""
        out: torch.Tensor | None = None
        if self._blocks is not None and x is None:
            raise PipelineError(f"rank {self.rank}, stage {self.stage}: forward() needs the input on every rank")
        for s in self._local:
            if s == 0:
                if x is None:
                    raise PipelineError(f"rank {self.rank}, stage 0: forward() needs the input on this rank")
                inp = x
            elif self.schedule.stage_rank(s - 1) == self.rank:
                assert out is not None
                inp = out
            else:
                inp = self.channel.recv_eval(s)
            out = self.executor.parts[s](inp) if self._blocks is None else self.executor.parts[s](inp, x)
            if s < self.stages - 1 and self.schedule.stage_rank(s + 1) != self.rank:
                assert out is not None
                self.channel.send_eval(s, out)
        self.channel.wait_sends()
        return out if self.is_last else None

    __call__ = forward

    def train(self, mode: bool = True) -> Pipeline:
        self.module.train(mode)
        return self

    def eval(self) -> Pipeline:
        return self.train(False)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers under the original model's names."""
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> Any:
        """Load this rank's entries; a full-model state dict may be passed (other stages' entries are skipped)."""
        own = set(self.module.state_dict())
        return self.module.load_state_dict({k: v for k, v in state.items() if k in own}, strict=strict)

    def full_state_dict(self, dst: int = 0) -> dict[str, torch.Tensor] | None:
        """The whole model's state dict, assembled on rank ``dst`` (None on the others); every rank calls it."""
        mine = self.module.state_dict()
        if self.rank != dst:
            for i, (name, _, _) in enumerate(self._layout[self.rank]):
                self.channel.send_to(mine[name].detach(), dst, STATE, 0, i)
            self.channel.wait_sends()
            return None
        parts: dict[int, dict[str, torch.Tensor]] = {dst: {k: v.detach().clone() for k, v in mine.items()}}
        for r, entries in enumerate(self._layout):
            if r != dst:
                parts[r] = {
                    name: self.channel.recv_from(r, STATE, 0, i, shape, dtype)
                    for i, (name, shape, dtype) in enumerate(entries)
                }
        merged = {k: v for part in parts.values() for k, v in part.items()}
        return {n: merged[n] for n in self._names}  # in the original model's order

    def stats(self) -> dict[str, Any]:
        """Totals so far: bytes and messages sent, peak micro-batches in flight per local stage."""
        return {
            "bytes_sent": self.transport.stats.bytes_sent,
            "messages": self.transport.stats.messages,
            "peak_in_flight": dict(self.executor.peak_in_flight),
        }
