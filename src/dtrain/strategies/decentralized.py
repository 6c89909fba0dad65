"""``local_sgd``, ``easgd`` and ``gossip``: workers train their own replicas and average models.

The third family beside allreduce and the parameter server (Ben-Nun & Hoefler's
model-consistency spectrum): each worker steps its own optimizer on its own shard,
and a wrapper of :mod:`dtrain.decentralized` mixes the replicas when its rule says so
-- every ``period`` steps with everyone (:class:`~dtrain.decentralized.LocalSGD`),
pulled towards a centre (:class:`~dtrain.decentralized.EASGD`), or with neighbours
through a mixing matrix (:class:`~dtrain.decentralized.Gossip`).

The evaluated model is the replicas' average (a collective every worker joins at the
same step; the summary says so and gives the consensus distance, the replicas' spread
around that average, at the end).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dtrain.config.schema import ConfigHooks
from dtrain.data_parallel.tunables import ALGORITHMS
from dtrain.errors import ConfigError, check_choice
from dtrain.perfmodel.decentralized import easgd_cost, gossip_cost, local_sgd_cost, predict_averaging, replica_memory
from dtrain.perfmodel.hooks import ModelHooks, PlanSpace
from dtrain.registry import Choice, Strategy, StrategyOptions, register
from dtrain.training.context import ProcessHooks, TrainContext
from dtrain.training.loop import Position, run_loop

if TYPE_CHECKING:
    from dtrain.decentralized.replica import ReplicaWrapper
    from dtrain.perfmodel.collectives import CompressionModel
    from dtrain.perfmodel.predict import Memory, Prediction, StepInputs
    from dtrain.perfmodel.profile import ModelProfile
    from dtrain.perfmodel.spec import ClusterSpec
    from dtrain.training.checkpointing import RunCheckpointer

__all__ = ["LocalSGDOptions", "EASGDOptions", "GossipOptions", "ReplicaAdapter", "ReplicaEngine", "hierarchy_levels"]


TOPOLOGIES = ("ring", "torus", "exponential", "random", "complete")
_SYNC_ASYNC = ("sync", "async")


def hierarchy_levels(spec: str) -> list[tuple[int, int]]:
    """``"2:4,8:16"`` -> ``[(2, 4), (8, 16)]``: (group size, period) per level ("" for none)."""
    out: list[tuple[int, int]] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        try:
            size, period = (int(x) for x in part.split(":"))
        except ValueError:
            raise ConfigError(f"hierarchy level {part!r} is not GROUP_SIZE:PERIOD (e.g. 2:4,8:16)") from None
        out.append((size, period))
    return out


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise ConfigError(f"{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class LocalSGDOptions(StrategyOptions):
    """Options of ``--strategy local_sgd`` (:class:`dtrain.decentralized.LocalSGD`).

    Attributes:
        period: average the replicas every this many steps (default: 8).
        local_warmup_steps: average gradients (plain DP) for the first steps: post-local SGD (default: 0;
            ``--warmup-steps`` is the learning-rate warmup every strategy has).
        hierarchy: ``GROUP_SIZE:PERIOD,...`` levels (hierarchical local SGD) instead of ``period``.
        algorithm: dtrain allreduce algorithm of the averaging (default: ring).
    """

    period: int = field(default=8, metadata={"help": "average the models every PERIOD steps (default: 8)"})
    local_warmup_steps: int = field(
        default=0, metadata={"help": "local_sgd: average gradients for the first steps (post-local SGD) (default: 0)"}
    )
    hierarchy: str = field(
        default="",
        metadata={
            "help": "local_sgd: GROUP_SIZE:PERIOD,... averaging within groups often, across rarely (default: none)"
        },
    )
    algorithm: str = field(default="ring", metadata={"choices": ALGORITHMS, "help": "allreduce algorithm"})

    def __post_init__(self) -> None:
        _positive("period", self.period)
        if self.local_warmup_steps < 0:
            raise ConfigError(f"local_warmup_steps must be >= 0, got {self.local_warmup_steps}")
        check_choice("algorithm", self.algorithm, ALGORITHMS)
        for size, period in hierarchy_levels(self.hierarchy):
            _positive(f"hierarchy group size (in {self.hierarchy!r})", size)
            _positive(f"hierarchy period (in {self.hierarchy!r})", period)

    def checkpoint_keys(self) -> dict[str, Any]:
        return {"period": self.period, "local_warmup_steps": self.local_warmup_steps, "hierarchy": self.hierarchy}

    def approximation(self) -> str:
        return f"approximate: models averaged every {self.period} steps" if self.period > 1 or self.hierarchy else ""

    def label(self, workers: int) -> str:
        h = f" hierarchy {self.hierarchy}" if self.hierarchy else ""
        w = f" warmup {self.local_warmup_steps}" if self.local_warmup_steps else ""
        return f"local_sgd period {self.period} {self.algorithm}{h}{w}"


@dataclass(frozen=True)
class EASGDOptions(StrategyOptions):
    """Options of ``--strategy easgd`` (:class:`dtrain.decentralized.EASGD`).

    Attributes:
        alpha: the elastic force's moving rate, in (0, 1) (default: 0.1).
        period: an elastic step every this many steps (the paper's tau) (default: 8).
        servers: 0: the centre is replicated and moved by an allreduce (synchronous); >= 1: the
            centre lives on that many parameter-server ranks (asynchronous) (default: 0).
    """

    alpha: float = field(default=0.1, metadata={"help": "easgd: elastic moving rate in (0, 1) (default: 0.1)"})
    period: int = field(default=8, metadata={"help": "average the models every PERIOD steps (default: 8)"})
    servers: int = field(default=0, metadata={"help": "parameter-server ranks (default: 1)"})

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha < 1.0:
            raise ConfigError(f"alpha must be in (0, 1), got {self.alpha}")
        _positive("period", self.period)
        if self.servers < 0:
            raise ConfigError(f"easgd servers must be >= 0 (0: the centre by allreduce), got {self.servers}")

    def processes(self, workers: int) -> int:
        return workers + self.servers

    @property
    def center(self) -> str:
        return "server" if self.servers else "allreduce"

    def checkpoint_keys(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "period": self.period, "servers": self.servers}

    def approximation(self) -> str:
        return f"approximate: replicas pulled towards a centre (alpha {self.alpha:g}) every {self.period} steps"

    def label(self, workers: int) -> str:
        where = f"{self.servers} server{'s' if self.servers > 1 else ''}" if self.servers else "allreduce"
        return f"easgd alpha {self.alpha:g} period {self.period} {where}"


@dataclass(frozen=True)
class GossipOptions(StrategyOptions):
    """Options of ``--strategy gossip`` (:class:`dtrain.decentralized.Gossip`).

    Attributes:
        topology: the graph whose mixing matrix averages neighbours (default: ring).
        mode: sync (D-PSGD: every step, every neighbour) or async (AD-PSGD: a random peer,
            no barrier) (default: sync). ``--async`` is ``--mode async``.
        seed: seed of the random topology and of the asynchronous peer choice (default: 0).
    """

    topology: str = field(default="ring", metadata={"choices": TOPOLOGIES, "help": "gossip: the graph (default: ring)"})
    mode: str = field(
        default="sync",
        metadata={
            "choices": _SYNC_ASYNC,
            "switch": ("async", "async"),
            "help": "gossip: sync (D-PSGD) or async (AD-PSGD) (default: sync)",
        },
    )
    gossip_seed: int = field(default=0, metadata={"help": "gossip: seed of the random topology and peers"})

    def __post_init__(self) -> None:
        check_choice("topology", self.topology, TOPOLOGIES)
        check_choice("mode", self.mode, _SYNC_ASYNC)

    def checkpoint_keys(self) -> dict[str, Any]:
        return {"topology": self.topology, "mode": self.mode}

    def approximation(self) -> str:
        return f"approximate: {self.mode} gossip averaging over a {self.topology}"

    def label(self, workers: int) -> str:
        return f"gossip {self.mode} {self.topology}"


# ---------------------------------------------------------------------- the engine


class ReplicaAdapter:
    """One worker with its own replica, for :func:`~dtrain.training.loop.run_loop`.

    ``model`` is what the loop evaluates: a copy that :meth:`synchronize` (every worker,
    at the same step) fills with the replicas' average.
    """

    eval_note = " (the replicas' average)"

    def __init__(
        self,
        ctx: TrainContext,
        ckpt: RunCheckpointer | None,
        build: Callable[[nn.Module], ReplicaWrapper],
        worker: int,
        workers: int,
        replica: nn.Module | None = None,
    ) -> None:
        self.ctx, self.ckpt = ctx, ckpt
        self.replica = replica if replica is not None else ctx.make_model()
        self.wrapper = build(self.replica)
        self.optimizer = ctx.make_optimizer(self.replica.parameters())
        self.model = copy.deepcopy(self.replica)
        self.evaluator = worker == 0
        self.shard, self.num_shards, self.samples_scale = worker, workers, workers
        self.total_steps = ctx.total_steps(workers)
        self._comm_s = 0.0
        self._sent = 0
        self._done = 0  # steps finished (this run and before a resume)
        self._consensus: list[dict[str, float]] = []  # {"step", "distance"} at each evaluation

    def start(self) -> Position:
        if self.ckpt is None or self.ckpt.resume_from is None:
            return Position()
        info, blob = self.ckpt.restore()
        self.replica.load_state_dict(blob["model"])
        self.optimizer.load_state_dict(blob["optimizer"])
        self.wrapper.load_wrapper_state(blob["wrapper"])
        step = self._done = int(info["step"])
        return Position(step, *self.ctx.locate(step, self.num_shards), rng=blob)

    def done(self, step: int) -> bool:
        return step >= self.total_steps

    def before_step(self, step: int) -> None:
        self.ctx.schedule_lr(self.optimizer, step, self.total_steps)
        self.optimizer.zero_grad(set_to_none=False)

    def forward(self, x: Any) -> torch.Tensor:
        out: torch.Tensor = self.wrapper(x)
        return out

    def update(self) -> None:
        with self.ctx.tracer.span("optimizer"):
            self.optimizer.step()
        t0 = time.perf_counter()
        with self.ctx.tracer.span("average"):
            self.wrapper.step()
        self._comm_s = time.perf_counter() - t0
        self._done += 1

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.replica.named_parameters())

    def agree(self, bad: bool) -> list[int]:
        return [self.ctx.rank] if bad else []  # this replica's own optimizer step: its own check decides

    def skip(self) -> None:
        """No optimizer step; the averaging still runs (the other replicas wait for it at this step)."""
        t0 = time.perf_counter()
        with self.ctx.tracer.span("average"):
            self.wrapper.step()
        self._comm_s = time.perf_counter() - t0
        self._done += 1

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def rows(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        dt = row.pop("step_s")
        sent = int(self.wrapper.stats()["bytes_sent"])
        row.update(compute_s=dt - self._comm_s, comm_s=self._comm_s, wait_s=0.0, bytes_sent=sent - self._sent)
        self._sent = sent
        return [row]

    def synchronize(self) -> list[dict[str, Any]]:
        """The replicas' average into ``model`` and their consensus distance (collectives: every
        worker at the same step)."""
        self.model.load_state_dict(self.wrapper.averaged_state_dict())
        self._consensus.append({"step": self._done, "distance": self.wrapper.consensus_distance()})
        return []

    def save(self, ckpt: RunCheckpointer, step: int, epoch: int, batch: int) -> None:
        state = {
            "model": self.replica.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "wrapper": self.wrapper.wrapper_state(),
        }
        ckpt.save(step, rank_state=state, epoch=epoch, batch=batch)

    def finish(self) -> dict[str, Any]:
        """Result keys: the last consensus distance (the loop synchronized after the last step) and
        its history over the evaluations, the averaging rounds and the bytes sent."""
        st = self.wrapper.stats()
        self.wrapper.close()
        extra = {
            "evaluated": "average of the replicas",
            "consensus_distance": self._consensus[-1]["distance"],
            "consensus_history": self._consensus,
            "averaging_rounds": int(st["rounds"]),
        }
        return {"bytes_sent": int(st["bytes_sent"]), "summary_extra": extra}


ReplicaEngine = ReplicaAdapter  # the name older scripts import


def _run_local_sgd(ctx: TrainContext) -> dict[str, Any]:
    from dtrain.decentralized.local_sgd import LocalSGD

    o = ctx.cfg.options
    assert isinstance(o, LocalSGDOptions)

    def build(model: nn.Module) -> ReplicaWrapper:
        return LocalSGD(
            model,
            period=o.period,
            warmup_steps=o.local_warmup_steps,
            hierarchy=hierarchy_levels(o.hierarchy) or None,
            algorithm=o.algorithm,
            timeout=ctx.cfg.timeout_s,
        )

    return _run_workers(ctx, build, ctx.rank, ctx.world_size)


def _run_gossip(ctx: TrainContext) -> dict[str, Any]:
    from dtrain.decentralized.gossip import Gossip

    o = ctx.cfg.options
    assert isinstance(o, GossipOptions)

    def build(model: nn.Module) -> ReplicaWrapper:
        return Gossip(model, topology=o.topology, mode=o.mode, seed=o.gossip_seed, timeout=ctx.cfg.timeout_s)

    return _run_workers(ctx, build, ctx.rank, ctx.world_size)


def _run_easgd(ctx: TrainContext) -> dict[str, Any]:
    from dtrain.decentralized.easgd import EASGD

    o = ctx.cfg.options
    assert isinstance(o, EASGDOptions)
    workers = ctx.world_size - o.servers
    if o.servers == 0:

        def build(model: nn.Module) -> ReplicaWrapper:
            return EASGD(model, alpha=o.alpha, period=o.period, center="allreduce", timeout=ctx.cfg.timeout_s)

        return _run_workers(ctx, build, ctx.rank, workers)
    from dtrain.training.checkpointing import RunCheckpointer

    ckpt = RunCheckpointer.create(ctx.cfg, ctx.out_dir)
    replica = ctx.make_model()
    easgd = EASGD(
        replica, alpha=o.alpha, period=o.period, center="server", servers=o.servers, timeout=ctx.cfg.timeout_s
    )
    if easgd.is_server:
        return {**easgd.serve(), "role": "server"}
    engine = ReplicaAdapter(ctx, ckpt, lambda m: easgd, ctx.rank - o.servers, workers, replica=replica)
    return run_loop(ctx, engine, ckpt)


def _run_workers(
    ctx: TrainContext, build: Callable[[nn.Module], ReplicaWrapper], worker: int, workers: int
) -> dict[str, Any]:
    from dtrain.training.checkpointing import RunCheckpointer

    ckpt = RunCheckpointer.create(ctx.cfg, ctx.out_dir)  # its group first: every rank creates groups in one order
    return run_loop(ctx, ReplicaAdapter(ctx, ckpt, build, worker, workers), ckpt)


# ---------------------------------------------------------------------- checks and performance model hooks


def _check_local_sgd(o: LocalSGDOptions, cfg: Any) -> None:
    levels = hierarchy_levels(o.hierarchy)
    if levels:
        from dtrain.decentralized.local_sgd import parse_hierarchy

        parse_hierarchy(levels, cfg.workers)  # ConfigError naming the level that does not fit the workers


def _check_gossip(o: GossipOptions, cfg: Any) -> None:
    from dtrain.decentralized.topology import topology

    if cfg.workers > 1:
        topology(o.topology, cfg.workers, seed=o.gossip_seed)  # ConfigError: a graph the workers cannot make


def _check_easgd(o: EASGDOptions, cfg: Any) -> None:
    from dtrain.decentralized.easgd import check_workers

    check_workers(o.alpha, cfg.workers, synchronous=o.servers == 0)  # the stability rule, before any process


def _check_easgd_checkpointing(o: EASGDOptions, cfg: Any) -> None:
    if o.servers:
        raise ConfigError(
            "checkpoints of easgd need the synchronous centre (--servers 0): with the centre on "
            "servers the workers never share a step to save at"
        )


def _check_gossip_checkpointing(o: GossipOptions, cfg: Any) -> None:
    if o.mode == "async":
        raise ConfigError("checkpoints of gossip need --mode sync: asynchronous workers never share a step to save at")


def _local_sgd_predict(
    prof: ModelProfile, c: ClusterSpec, s: Choice, comp: CompressionModel, inputs: StepInputs
) -> Prediction:
    o = s.opts
    assert isinstance(o, LocalSGDOptions)
    levels = hierarchy_levels(o.hierarchy) or [(s.workers, o.period)]
    return predict_averaging(prof, s, inputs, local_sgd_cost(c, levels, o.algorithm, prof.param_bytes, s.workers))


def _easgd_predict(
    prof: ModelProfile, c: ClusterSpec, s: Choice, comp: CompressionModel, inputs: StepInputs
) -> Prediction:
    o = s.opts
    assert isinstance(o, EASGDOptions)
    return predict_averaging(prof, s, inputs, easgd_cost(c, o.period, o.servers, prof.param_bytes, s.workers))


def _gossip_predict(
    prof: ModelProfile, c: ClusterSpec, s: Choice, comp: CompressionModel, inputs: StepInputs
) -> Prediction:
    from dtrain.decentralized.topology import topology

    o = s.opts
    assert isinstance(o, GossipOptions)
    degree = topology(o.topology, s.workers, seed=o.gossip_seed).degree if s.workers > 1 else 0
    return predict_averaging(prof, s, inputs, gossip_cost(c, degree, o.mode == "async", prof.param_bytes))


def _memory(prof: ModelProfile, s: Choice, comp: CompressionModel | None) -> Memory:
    return replica_memory(prof, 2 if isinstance(s.opts, EASGDOptions) else 1)


def _local_sgd_candidates(space: PlanSpace) -> list[Choice]:
    if space.workers < 2 or space.exact_only or not space.averaging:
        return []
    return [Choice("local_sgd", space.workers, LocalSGDOptions(period=p)) for p in (4, 16)]


def _easgd_candidates(space: PlanSpace) -> list[Choice]:
    w = space.workers
    if w < 2 or space.exact_only or not space.averaging:
        return []
    return [Choice("easgd", w, EASGDOptions(alpha=min(0.1, 0.9 / w), period=8))]  # N alpha < 1 (the paper's)


def _gossip_identity(o: GossipOptions, prof: ModelProfile) -> Hashable:
    return ("gossip", o.topology, o.mode)


def _gossip_candidates(space: PlanSpace) -> list[Choice]:
    w = space.workers
    if w < 2 or space.exact_only or not space.averaging:
        return []
    out = [Choice("gossip", w, GossipOptions(topology="ring", mode=m)) for m in _SYNC_ASYNC]
    return out + ([Choice("gossip", w, GossipOptions(topology="exponential"))] if w > 4 else [])


LOCAL_SGD = register(
    Strategy(
        name="local_sgd",
        options=LocalSGDOptions,
        help="local SGD: each worker trains alone, models averaged every --period steps (post-local, hierarchical)",
        hooks=(
            ProcessHooks(run=_run_local_sgd),
            ConfigHooks(check=_check_local_sgd),
            ModelHooks(predict=_local_sgd_predict, memory=_memory, candidates=_local_sgd_candidates),
        ),
    )
)
EASGD_ENTRY = register(
    Strategy(
        name="easgd",
        options=EASGDOptions,
        help="elastic averaging SGD: replicas pulled towards a centre (--alpha, --period, --servers for async)",
        hooks=(
            ProcessHooks(run=_run_easgd),
            ConfigHooks(_check_easgd, check_checkpointing=_check_easgd_checkpointing),
            ModelHooks(predict=_easgd_predict, memory=_memory, candidates=_easgd_candidates),
        ),
    )
)
GOSSIP = register(
    Strategy(
        name="gossip",
        options=GossipOptions,
        help="gossip: D-PSGD (sync) or AD-PSGD (--async) averaging with neighbours of a --topology",
        hooks=(
            ProcessHooks(run=_run_gossip),
            ConfigHooks(check=_check_gossip, check_checkpointing=_check_gossip_checkpointing),
            ModelHooks(
                predict=_gossip_predict, memory=_memory, candidates=_gossip_candidates, identity=_gossip_identity
            ),
        ),
    )
)
