"""``tensor`` and ``hybrid``: Megatron-style tensor parallelism, and DP x PP x TP on one set of processes.

``--strategy tensor --workers 4`` splits every block of a model over the four workers
(:mod:`dtrain.tensor_parallel`): dtrain's ``gpt`` models by the hand-written plan ``plans.gpt``, any other
(``hf:gpt2``, ``FILE.py:FN``) by the plan :func:`~dtrain.tensor_parallel.derive_plan` finds in it
(``--tp-plan auto``), or by a ``[tensor.plan]`` table of the run's TOML; ``--strategy hybrid --dp 2
--pp 2 --tp 2`` composes tensor parallelism inside each pipeline stage, the pipeline over
stages and data parallelism across pipelines (:func:`dtrain.hybrid` over a :class:`dtrain.Mesh`).
Both run as one ``WholeStep`` engine; the evaluated model is the whole unsplit model gathered
on rank 0. Metrics rows carry bytes and seconds per mesh dimension (``tp_bytes``, ``pp_bytes``,
``dp_bytes``, ``tp_s``, ``dp_s``). The options of both are :mod:`dtrain.strategies.hybrid_options`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dtrain.checkpoint.layout import CheckpointError
from dtrain.config.schema import ConfigHooks
from dtrain.errors import ConfigError
from dtrain.optim.guard import flagged_ranks
from dtrain.perfmodel.hooks import ModelHooks, PlanSpace
from dtrain.registry import Choice, Strategy, register
from dtrain.strategies._common import check_fp16_exchange
from dtrain.strategies.hybrid_options import HybridOptions, MeshOptions, TensorOptions
from dtrain.training.context import ProcessHooks, TrainContext
from dtrain.training.loop import Position, run_loop

if TYPE_CHECKING:
    from dtrain.config.schema import RunConfig
    from dtrain.perfmodel.collectives import CompressionModel
    from dtrain.perfmodel.predict import Memory, Prediction, StepInputs
    from dtrain.perfmodel.profile import ModelProfile
    from dtrain.perfmodel.spec import ClusterSpec
    from dtrain.training.checkpointing import RunCheckpointer

__all__ = ["TensorOptions", "HybridOptions", "HybridAdapter", "HybridEngine", "TENSOR", "HYBRID"]


def _check(o: MeshOptions, cfg: RunConfig) -> None:
    """Everything about the mesh and the model that would fail in a worker, before any process starts."""
    from dtrain.workloads.models import is_language_model
    from dtrain.workloads.models.gpt import resolve_gpt_config
    from dtrain.workloads.models.specs import is_builtin

    dp, pp, tp = o.mesh_shape(cfg.workers)
    if cfg.precision == "fp16" and isinstance(o, HybridOptions):
        check_fp16_exchange(o, cfg)
    if dp * pp * tp != cfg.workers:
        raise ConfigError(
            f"--dp {dp} x --pp {pp} x --tp {tp} = {dp * pp * tp} processes, but --workers is "
            f"{cfg.workers}; make them match"
        )
    micro, _, _ = o.pipeline()
    if cfg.batch_size % (dp * micro):
        raise ConfigError(
            f"the batch of {cfg.batch_size} does not divide into {dp} data-parallel shards of "
            f"{micro} micro-batches; use --batch-size a multiple of {dp * micro}"
        )
    if isinstance(o, TensorOptions) and tp > 1 and (not is_builtin(cfg.model) or o.plan or o.tp_plan == "derive"):
        from dtrain.strategies.tensor_plan import check_tensor_plan

        check_tensor_plan(o, cfg, tp)
        return
    if (tp > 1 or pp > 1) and not is_builtin(cfg.model):
        from dtrain.strategies.tensor_plan import check_user_mesh

        check_user_mesh(o, cfg, pp, tp)
        return
    if tp > 1 or pp > 1:
        if not is_language_model(cfg.model):
            if tp > 1:
                raise ConfigError(
                    f"tensor parallelism splits the gpt models' blocks (plans.gpt); --model {cfg.model} "
                    "has no plan: use --model gpt-tiny/gpt-small/... or --tp 1"
                )
            return
        g = resolve_gpt_config(cfg.model, **cfg.gpt_overrides(), seq_len=cfg.seq_len)
        for what, n in (("attention heads", g.heads), ("d_model", g.d_model), ("MLP width", g.mlp_hidden)):
            if n % tp:
                raise ConfigError(f"{cfg.model}: {n} {what} do not divide over tensor-parallel size {tp}")
        if o.sequence_parallel and cfg.seq_len % tp:
            raise ConfigError(f"sequence parallel: --seq-len {cfg.seq_len} does not divide over --tp {tp}")
        if pp > g.layers + 3:
            raise ConfigError(f"{cfg.model} has {g.layers + 3} layers (children), fewer than the {pp} stages")


def _check_checkpointing(o: MeshOptions, cfg: RunConfig) -> None:
    from dtrain.strategies.dp_options import STATELESS_WIRE

    comp = o.compressor_spec()
    if comp not in STATELESS_WIRE:
        raise ConfigError(
            f"checkpoints of a hybrid run with --compression {comp} are not supported: its "
            "per-rank residuals are not saved; use none, fp16 or bf16"
        )


class HybridAdapter:
    """One rank of a DP x PP x TP mesh for :func:`~dtrain.training.loop.run_loop` (a ``WholeStep`` engine)."""

    eval_note = " (the whole model gathered on rank 0)"

    def __init__(self, ctx: TrainContext, ckpt: RunCheckpointer | None = None) -> None:
        from dtrain.hybrid_parallel.engine import Hybrid
        from dtrain.hybrid_parallel.mesh import Mesh
        from dtrain.strategies.pipeline import parse_balance

        o = ctx.cfg.options
        assert isinstance(o, (TensorOptions, HybridOptions))
        self.ctx, self.ckpt = ctx, ckpt
        dp, pp, tp = o.mesh_shape(ctx.cfg.workers)
        self.mesh = Mesh(dp=dp, pp=pp, tp=tp)
        micro, schedule, balance = o.pipeline()
        self._train_model = ctx.make_model()
        from dtrain.workloads.data import first_samples

        plan = None
        if tp > 1:  # the plan the parent checked: derived on the same sample, for dtrain's gpt models plans.gpt
            from dtrain.tensor_parallel.plans import for_model

            x, _ = first_samples(ctx.data.train, 2)
            plan = for_model(
                self._train_model,
                tp,
                tp_plan=getattr(o, "tp_plan", "auto"),
                table=dict(getattr(o, "plan", ())),
                sequence_parallel=o.sequence_parallel,
                sample=x.to(ctx.device),
            )
            if ctx.rank == 0:
                print(plan.text(), flush=True)
        # one micro-batch of a dp shard: the forward that finds a module's blocks for the pipeline's cut
        sample = first_samples(ctx.data.train, max(1, ctx.cfg.batch_size // (dp * micro)))[0].to(ctx.device)
        self.h = Hybrid(
            self._train_model,
            self.mesh,
            plan=plan,
            microbatches=micro,
            schedule=schedule,
            balance=parse_balance(balance),
            loss_fn=ctx.loss,
            sequence_parallel=o.sequence_parallel,
            algorithm=o.dp_algorithm,
            timeout_s=ctx.cfg.timeout_s,
            tracer=ctx.tracer,
            compressor=ctx.make_compressor(),
            loss_scale=(lambda: ctx.loss_scale) if ctx.precision.scales_loss else None,
            sample=None if pp == 1 or isinstance(self._train_model, nn.Sequential) else sample,
        )
        self.optimizer = ctx.make_optimizer(list(self.h.parameters()))
        self.evaluator = ctx.rank == 0
        self.model: nn.Module = ctx.make_model() if self.evaluator else self._train_model  # unsplit, for evaluation
        self.shard, self.num_shards, self.samples_scale = self.mesh.index("dp"), dp, dp
        self.total_steps = ctx.total_steps(dp)
        self._counts = self.mesh.index("pp") == 0 and self.mesh.index("tp") == 0  # one rank per dp shard
        self._last = {"tp": 0, "pp": 0, "dp": 0}

    def start(self) -> Position:
        if self.ckpt is None or self.ckpt.resume_from is None:
            return Position()
        info, blob = self.ckpt.restore()  # this rank's own slices (the same mesh: check_resume saw to it)
        mine = dict(self.h.named_parameters())
        saved = blob["params"]
        if set(saved) != set(mine):
            raise CheckpointError(
                f"rank {self.ctx.rank}: {self.ckpt.resume_from} holds parameters "
                f"{sorted(set(saved) ^ set(mine))[:4]} that this rank's slice does not match"
            )
        with torch.no_grad():
            for name, p in mine.items():
                p.copy_(saved[name])
        self.optimizer.load_state_dict(blob["optimizer"])
        start = int(info["step"])
        return Position(start, *self.ctx.locate(start, self.num_shards), rng=blob)

    def done(self, step: int) -> bool:
        return step >= self.total_steps

    def before_step(self, step: int) -> None:
        self.ctx.schedule_lr(self.optimizer, step, self.total_steps)
        self.optimizer.zero_grad(set_to_none=True)

    def train_step(self, x: Any, y: Any) -> float:
        with self.ctx.tracer.span("hybrid"):
            return self.h.step(x, y)

    def forward(self, x: Any) -> torch.Tensor:
        raise ConfigError("a tensor/hybrid engine runs whole steps (train_step)")

    def update(self) -> None:
        with self.ctx.tracer.span("optimizer"):
            self.optimizer.step()

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.h.named_parameters())

    def agree(self, bad: bool) -> list[int]:
        return flagged_ranks(bad)  # every rank's slice: one tiny all-reduce over the world

    def skip(self) -> None:
        return None

    def clip_grad_norm(self, max_norm: float) -> float:
        """``--clip-grad-norm`` (``--strategy tensor``): the squares of this rank's slices of the split
        parameters, plus the replicated parameters' (the same on every rank) counted once, summed over the
        tensor-parallel group (the world: the tensor strategy's mesh is 1 x 1 x tp)."""
        import torch.distributed as dist

        from dtrain.training.accumulate import clip_

        split = self.h.split_parameters()
        own: list[torch.Tensor] = []
        same: list[torch.Tensor] = []
        for p in self.h.parameters():
            if p.grad is not None:
                (own if id(p) in split else same).append(p.grad)
        tp = self.mesh.size("tp")
        return clip_(own, max_norm, reduce=dist.all_reduce if tp > 1 else None, once=same, share=tp)

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def rows(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        dt = row.pop("step_s")
        now = self.h.bytes_by_dim()
        sent = {k: now[k] - self._last[k] for k in now}
        self._last = now
        secs = self.h.seconds_by_dim()
        row.update(
            compute_s=max(0.0, dt - secs["tp"] - secs["dp"]),
            comm_s=secs["tp"] + secs["dp"],
            wait_s=None,
            bytes_sent=sum(sent.values()),
            tp_bytes=sent["tp"],
            pp_bytes=sent["pp"],
            dp_bytes=sent["dp"],
            tp_s=secs["tp"],
            dp_s=secs["dp"],
            mesh=self.mesh.coords(self.ctx.rank),
        )
        return [row]

    def synchronize(self) -> list[dict[str, Any]]:
        full = self.h.full_state_dict(dst=0)
        if full is not None:
            self.model.load_state_dict(full)
        return []

    def save(self, ckpt: RunCheckpointer, step: int, epoch: int, batch: int) -> None:
        """Per rank, as Megatron-LM's checkpoints keep one file per tensor/pipeline rank: this rank's slices of
        its stage's parameters and its optimizer's state (DCP stores the tensors, one set per rank), and RNGs.
        So a resume needs the same mesh (the options are compared before any process starts)."""
        epoch, batch = self.ctx.locate(step, self.num_shards)  # the next batch to train on
        params = {n: p.detach() for n, p in self.h.named_parameters()}
        ckpt.save(
            step, rank_state={"params": params, "optimizer": self.optimizer.state_dict()}, epoch=epoch, batch=batch
        )

    def finish(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "bytes_sent": sum(self.h.bytes_by_dim().values()),
            "summary_extra": {"mesh": self.mesh.describe()},
        }
        if not self._counts:
            out["samples"] = 0  # a dp shard's batch is counted once, by its first stage's first tp rank
        return out


HybridEngine = HybridAdapter  # the name older scripts import


def _run(ctx: TrainContext) -> dict[str, Any]:
    from dtrain.training.checkpointing import RunCheckpointer

    ckpt = RunCheckpointer.create(ctx.cfg, ctx.out_dir)  # (its group before the mesh's, on every rank)
    return run_loop(ctx, HybridAdapter(ctx, ckpt), ckpt)


# ---------------------------------------------------------------------- performance model hooks


def _mesh_of(s: Choice) -> tuple[MeshOptions, tuple[int, int, int], tuple[int, str, str]]:
    o = s.options
    assert isinstance(o, (TensorOptions, HybridOptions))
    return o, o.mesh_shape(s.workers), o.pipeline()


def _predict(prof: ModelProfile, c: ClusterSpec, s: Choice, comp: CompressionModel, inputs: StepInputs) -> Prediction:
    """:func:`dtrain.perfmodel.mesh.predict_hybrid` on the gpt shape the profile recorded; the global batch is
    ``prof.batch * workers`` (every hook's profile is at the per-worker batch)."""
    import math

    from dtrain.perfmodel.mesh import predict_hybrid
    from dtrain.perfmodel.predict import Prediction

    o, (dp, pp, tp), (micro, schedule, balance) = _mesh_of(s)
    g = prof.extra.get("gpt")
    if g is None:
        return Prediction(
            s,
            math.inf,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            inputs.memory,
            False,
            "infeasible: the mesh model covers gpt models and models with a list of blocks whose attention and "
            "vocabulary the derived plan splits",
        )
    try:
        return predict_hybrid(
            prof,
            c,
            dp=dp,
            pp=pp,
            tp=tp,
            microbatches=micro if pp > 1 else 1,
            schedule=schedule,
            sequence_parallel=o.sequence_parallel,
            batch=prof.batch * s.workers,
            seq=g["seq"],
            hidden=g["hidden"],
            layers=g["layers"],
            heads=g["heads"],
            vocab=g["vocab"],
            algorithm=o.dp_algorithm,
            overhead_s=inputs.overhead,
            balance=balance if balance in ("equal", "params", "time") else "equal",
            strategy=s,
        )
    except ConfigError as e:  # a mesh this model cannot take: the planner lists it as rejected, saying why
        return Prediction(s, math.inf, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, inputs.memory, False, f"infeasible: {e}")


def _memory(prof: ModelProfile, s: Choice, comp: CompressionModel | None) -> Memory:
    """Per rank: :func:`~dtrain.perfmodel.tensor.tensor_memory` of the tp split, the model states over ``pp``
    stages, and the activations of the micro-batches a first stage holds at once (gpipe: all ``M``; 1f1b:
    ``min(M, pp)``), each ``1/pp`` of the model's."""
    import math

    from dtrain.perfmodel.mesh import mesh_reason
    from dtrain.perfmodel.predict import Memory
    from dtrain.perfmodel.tensor import TransformerShape, tensor_memory

    o, (dp, pp, tp), (micro, schedule, _) = _mesh_of(s)
    g = prof.extra.get("gpt")
    m = micro if pp > 1 else 1
    batch = prof.batch * s.workers // max(1, dp * m)
    if (
        g is None
        or batch < 1
        or mesh_reason(
            dp,
            pp,
            tp,
            heads=g["heads"],
            hidden=g["hidden"],
            layers=g["layers"],
            batch=prof.batch * s.workers,
            microbatches=m,
        )
    ):
        return Memory(buffers=math.inf)  # a mesh no run could use: the planner shows predict's reason
    shape = TransformerShape(
        batch=batch, seq=g["seq"], hidden=g["hidden"], layers=g["layers"], heads=g["heads"], vocab=g["vocab"]
    )
    whole = tensor_memory(prof, tp, o.sequence_parallel, shape=shape)
    held = m if schedule == "gpipe" else min(m, pp)
    return Memory(
        params=whole.params / pp,
        grads=whole.grads / pp,
        optimizer=whole.optimizer / pp,
        activations=whole.activations * held / pp,
        buffers=whole.buffers,
    )


def _tensor_candidates(space: PlanSpace) -> list[Choice]:
    w = space.workers
    return [Choice("tensor", w, TensorOptions())] if space.mesh and w > 1 else []


def _hybrid_candidates(space: PlanSpace) -> list[Choice]:
    """Every factorization of the workers but plain dp (``dp``'s own) and pure tp (``tensor``'s)."""
    from dtrain.perfmodel.mesh import factorizations

    w = space.workers
    if not space.mesh or w < 2:
        return []
    return [
        Choice("hybrid", w, HybridOptions(dp=d, pp=p, tp=t, microbatches=4 if p > 1 else 1))
        for d, p, t in factorizations(w)
        if (d, p, t) not in ((w, 1, 1), (1, 1, w))
    ]


TENSOR = register(
    Strategy(
        name="tensor",
        options=TensorOptions,
        help="tensor parallel (Megatron): every block of a gpt split over the workers",
        hooks=(
            ProcessHooks(run=_run),
            ConfigHooks(check=_check, check_checkpointing=_check_checkpointing),
            ModelHooks(predict=_predict, memory=_memory, candidates=_tensor_candidates),
        ),
    )
)
HYBRID = register(
    Strategy(
        name="hybrid",
        options=HybridOptions,
        help="DP x PP x TP on one mesh (--dp --pp --tp; workers = their product)",
        hooks=(
            ProcessHooks(run=_run),
            ConfigHooks(check=_check, check_checkpointing=_check_checkpointing),
            ModelHooks(predict=_predict, memory=_memory, candidates=_hybrid_candidates),
        ),
    )
)
