"""``dtrain.hybrid(model, mesh)``: data, pipeline and tensor parallelism on one set of processes (package
``hybrid_parallel``, so that ``dtrain.hybrid`` stays the function).

The three compose in a fixed order over one :class:`dtrain.Mesh` (torchtitan's recipe,
Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters"):

1. **Tensor** (``tp``, innermost: ranks that share a node): every rank builds the whole model
   and :func:`dtrain.tensor_parallel.parallelize` splits its layers over the tp group (for
   ``gpt``: :data:`dtrain.tensor_parallel.plans.gpt`).
2. **Pipeline** (``pp``): :class:`dtrain.Pipeline` cuts the split model over the pp group (the
   ranks with the same dp and tp index), so each tp rank of a stage sends its activations to the
   same tp rank of the next stage: an ``nn.Sequential`` between its children, any other module
   between the blocks of its list of repeated blocks (found by one forward of ``sample`` through
   the split model, :mod:`dtrain.pipeline.blocks`), every stage running the model's own forward.
3. **Data** (``dp``, across pipelines): after the step's micro-batches -- gradient
   accumulation deferred over them, no allreduce per micro-batch -- each rank averages its
   gradients over its dp group with one of dtrain's allreduce algorithms (one fused buffer).

``step(x, y)`` trains on a dp shard of the batch (every tp rank and stage of a pipeline
reads the same shard); ``.grad`` then holds the global batch's mean-loss gradient of this
rank's slice of its stage.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from dtrain.comm.waits import add_blocked
from dtrain.errors import ConfigError
from dtrain.hybrid_parallel.mesh import Mesh

__all__ = ["Hybrid", "hybrid"]


class Hybrid:
    """A model trained by DP x PP x TP over ``mesh``; see the module docstring.

    Args:
        model: the whole model, the same on every rank (an ``nn.Sequential``, or, when ``pp > 1``, any module with
            a list of repeated blocks: give ``sample``).
        mesh: the :class:`dtrain.Mesh`.
        plan: the tensor-parallel plan (default: :func:`dtrain.tensor_parallel.plans.for_model`'s: ``plans.gpt``
            for dtrain's gpt models, else the one derived from the model; ignored when ``tp == 1``).
        microbatches: per step, through the pipeline (default: 1).
        schedule: ``gpipe`` or ``1f1b`` (default: 1f1b).
        balance: the pipeline's cut: ``equal``, ``params`` or layer counts (default: equal).
        loss_fn: ``loss(output, target)`` without a vocabulary-split head (default: cross entropy
            over every position).
        sequence_parallel: tensor parallelism with sequence-sharded norms (default: False).
        algorithm: the dp allreduce algorithm (default: ring).
        timeout_s: seconds any wait may block (default: 300).
        tracer: a :class:`dtrain.trace.Tracer` for the pipeline's spans (default: None).
        compressor: a :mod:`dtrain.compress` compressor (or spec) of the dp allreduce, as DataParallel's
            (error feedback and all); None: exact (default: None).
        sample: one micro-batch of input: the forward that finds a module's blocks for the pipeline (needed when
            ``pp > 1`` and the model is not an ``nn.Sequential``), and the derived plan's (default: None).
        split_points: the blocks (or children) that start the stages after the first, instead of ``balance``.
        loss_scale: fp16 loss scaling: a function giving the current scale; the backward starts from the
            loss times it and :meth:`step` returns the unscaled loss (default: None, no scaling).
    """

    def __init__(
        self,
        model: nn.Module,
        mesh: Mesh,
        *,
        plan: Any = None,
        microbatches: int = 1,
        schedule: str = "1f1b",
        balance: Any = "equal",
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        sequence_parallel: bool = False,
        algorithm: str = "ring",
        timeout_s: float = 300.0,
        tracer: Any = None,
        compressor: Any = None,
        loss_scale: Callable[[], float] | None = None,
        sample: torch.Tensor | None = None,
        split_points: Sequence[str] = (),
    ) -> None:
        import dtrain.tensor_parallel as tp
        from dtrain.comm.allreduce import ALGORITHMS

        if algorithm not in ALGORITHMS:
            raise ConfigError(f"dp algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
        if sequence_parallel and mesh.size("tp") == 1:
            raise ConfigError("sequence_parallel needs tensor parallelism (tp > 1)")
        self.mesh, self.model, self.algorithm, self.timeout_s = mesh, model, algorithm, timeout_s
        self.tp_group: tp.TPGroup | None = self._split_over_tp(plan, sequence_parallel, sample)
        self.loss_fn = self._loss_of(loss_fn)
        self._scale = loss_scale or (lambda: 1.0)
        if loss_scale is not None:
            unscaled = self.loss_fn
            self.loss_fn = lambda out, y: unscaled(out, y) * self._scale()
        self.pipe: Any = None
        if mesh.size("pp") > 1:
            from dtrain.pipeline.pipe import Pipeline

            if schedule not in ("gpipe", "1f1b"):
                raise ConfigError(f"hybrid pipelines run gpipe or 1f1b, not {schedule!r}")
            self.pipe = Pipeline(
                model,
                microbatches,
                schedule,
                loss_fn=self.loss_fn,
                balance=balance,
                group=mesh.group("pp"),
                timeout=timeout_s,
                tracer=tracer,
                sample=sample,
                split_points=split_points,
            )
        self._partial = [p for p in self.parameters() if getattr(p, "tp_partial_grad", False)]
        self._reducer: Any = self._dp_reducer(compressor)
        self._dp_bytes, self._dp_s = 0, 0.0
        self._seen = {"tp": 0.0, "dp": 0.0}

    def _split_over_tp(self, plan: Any, sequence_parallel: bool, sample: torch.Tensor | None) -> Any:
        """Splits the model's layers over the tp group (when ``tp > 1``); returns its TPGroup, or None."""
        import dtrain.tensor_parallel as tp

        mesh, model = self.mesh, self.model
        if mesh.size("tp") == 1:
            return None
        sp = sequence_parallel
        chosen = plan or tp.plans.for_model(model, mesh.size("tp"), sequence_parallel=sp, sample=sample)
        tp.parallelize(model, chosen, mesh.group("tp"), sequence_parallel=sp, timeout_s=self.timeout_s)
        return tp.tp_group_of(model)

    def _loss_of(
        self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
    ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The loss: over a vocabulary-split head's logits where the model has one, else ``loss_fn``."""
        import dtrain.tensor_parallel as tp
        from dtrain.workloads.models import logits_of, task_loss

        heads = [m for m in self.model.modules() if isinstance(m, tp.VocabParallelHead)]
        if heads:  # the logits of a model's output (a transformers model's .logits), split by vocabulary
            head = heads[-1]
            return lambda out, y: tp.vocab_parallel_cross_entropy(logits_of(out), y, head)
        return loss_fn or task_loss

    def _dp_reducer(self, compressor: Any) -> Any:
        """What averages one flat buffer over dp (an algorithm, or a compressor's collective); None at dp 1."""
        mesh = self.mesh
        if mesh.size("dp") == 1:
            return None
        from dtrain.compress import resolve
        from dtrain.compress.reduce import BucketReducer

        self._shapes = tuple(tuple(p.shape) for p in self.parameters())
        return BucketReducer(
            self.algorithm,
            mesh.group("dp"),
            mesh.size("dp"),
            self.timeout_s,
            resolve(compressor, none_is_off=True, what="compressor"),
        )

    # ------------------------------------------------------------------ training

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters: its slice of its stage."""
        return iter(self.pipe.parameters()) if self.pipe is not None else self.model.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return iter(self.pipe.named_parameters()) if self.pipe is not None else self.model.named_parameters()

    def split_parameters(self) -> set[int]:
        """The ids of this rank's parameters that are slices split over tp (the column- and row-parallel
        weights, a column-parallel bias, the vocabulary-split embedding and head); the rest are whole on every
        tp rank (norms, a row-parallel bias, position embeddings)."""
        import dtrain.tensor_parallel as tp

        split: set[int] = set()
        for m in self.model.modules():
            if isinstance(m, tp.ColumnParallelLinear):
                split.update(id(p) for p in m.parameters(recurse=False))
            elif isinstance(m, (tp.RowParallelLinear, tp.VocabParallelEmbedding)):
                split.add(id(m.weight))
        return split

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Forward and backward of this rank's dp shard of the batch; gradients averaged over dp."""
        if self.pipe is not None:
            loss = float(self.pipe.step(x, y))
        else:
            out = self.loss_fn(self.model(x), y)
            out.backward()
            loss = float(out.detach())
        loss /= self._scale()
        if self._partial and self.tp_group is not None:  # sequence-parallel norms saw one chunk each
            self._allreduce([p.grad for p in self._partial if p.grad is not None], self.tp_group.allreduce, None)
        if self.mesh.size("dp") > 1:
            self._average_over_dp()
        return loss

    def _allreduce(
        self, grads: list[torch.Tensor], fn: Callable[[torch.Tensor], torch.Tensor], scale: float | None
    ) -> None:
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        if scale is not None:
            flat.mul_(scale)
        fn(flat)
        off = 0
        for g in grads:
            g.copy_(flat[off : off + g.numel()].view_as(g))
            off += g.numel()

    def _average_over_dp(self) -> None:
        """One flat buffer of every gradient, averaged over dp (pre-divided, as DataParallel's buckets)."""
        t0 = time.perf_counter()
        params = list(self.parameters())
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        t_reduce = time.perf_counter()
        self._dp_bytes += self._reducer(flat, "hybrid.dp", self._shapes)
        add_blocked(time.perf_counter() - t_reduce)  # the wait on the other dp ranks is in it: not own work
        off = 0
        for p, g in zip(params, grads):
            g.copy_(flat[off : off + g.numel()].view_as(g))
            if p.grad is None:
                p.grad = g
            off += g.numel()
        self._dp_s += time.perf_counter() - t0

    # ------------------------------------------------------------------ figures and state

    def bytes_by_dim(self) -> dict[str, int]:
        """Bytes this rank has sent so far on each mesh dimension: tp collectives, pp transfers, dp allreduces."""
        return {
            "tp": self.tp_group.bytes_sent() if self.tp_group is not None else 0,
            "pp": int(self.pipe.transport.stats.bytes_sent) if self.pipe is not None else 0,
            "dp": self._dp_bytes,
        }

    def seconds_by_dim(self) -> dict[str, float]:
        """Seconds in tp collectives and the dp allreduce since the last call (both on the critical path)."""
        now = {"tp": self.tp_group.seconds if self.tp_group is not None else 0.0, "dp": self._dp_s}
        out = {k: now[k] - self._seen[k] for k in now}
        self._seen = now
        return out

    def full_state_dict(self, dst: int = 0) -> dict[str, torch.Tensor] | None:
        """The whole unsplit model's state dict on global rank ``dst`` (None elsewhere); every rank calls it."""
        import torch.distributed as dist

        import dtrain.tensor_parallel as tp

        whole = (
            tp.full_state_dict(self.model)
            if self.tp_group is not None
            else {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        )
        mine = list(self.pipe.state_dict()) if self.pipe is not None else list(whole)
        first = self.mesh.index("dp") == 0 and self.mesh.index("tp") == 0
        part = {k: whole[k] for k in mine} if first else None
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return part
        got: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == dst else None
        dist.gather_object(part, got, dst=dst)
        if got is None:
            return None
        out: dict[str, torch.Tensor] = {}
        for p in got:
            out.update(p or {})
        return out


def hybrid(model: nn.Module, mesh: Mesh, **kwargs: Any) -> Hybrid:
    """:class:`Hybrid` (the DESIGN's ``dtrain.hybrid(model, mesh, ...)``)."""
    return Hybrid(model, mesh, **kwargs)
