"""The options of ``--strategy tensor`` (:class:`TensorOptions`) and ``--strategy hybrid``
(:class:`HybridOptions`), the two strategies of :mod:`dtrain.strategies.hybrid`: the mesh each gives a
number of workers, its pipeline, its dp allreduce, what a checkpoint must match and what it refuses."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dtrain.comm.allreduce import ALGORITHMS
from dtrain.errors import ConfigError, check_choice
from dtrain.registry import StrategyOptions
from dtrain.strategies._common import CompressedOptions

__all__ = ["TensorOptions", "HybridOptions", "MeshOptions"]


_SCHEDULES = ("1f1b", "gpipe")
_TP_PLANS = ("auto", "derive")


@dataclass(frozen=True)
class TensorOptions(StrategyOptions):
    """Options of ``--strategy tensor`` (every worker a tensor-parallel rank of one model).

    Attributes:
        sequence_parallel: layer norms and residuals on sequence shards (Korthikanti et al. 2022).
        tp_plan: ``auto`` (dtrain's gpt models: the hand-written ``plans.gpt``; any other model: the derived
            plan) or ``derive`` (the derived plan for every model).
        plan: a plan of the user's own, module name or pattern -> style (TOML: a ``[tensor.plan]`` table);
            it replaces ``tp_plan``'s.
    """

    sequence_parallel: bool = field(
        default=False, metadata={"help": "tensor/hybrid: norms and residuals sharded along the sequence (default: off)"}
    )
    tp_plan: str = field(
        default="auto",
        metadata={
            "choices": _TP_PLANS,
            "help": "tensor: auto (the hand-written plan of dtrain's gpt models, else one derived from the model) "
            "or derive (derived for every model); a [tensor.plan] table in TOML gives one's own",
        },
    )
    plan: tuple[tuple[str, str], ...] = field(
        default=(), metadata={"table": True, "help": "tensor: module pattern -> style (TOML: [tensor.plan])"}
    )

    def __post_init__(self) -> None:
        check_choice("tp_plan", self.tp_plan, _TP_PLANS)
        plan = self.plan
        if isinstance(plan, Mapping):
            plan = tuple(plan.items())
        if not isinstance(plan, (tuple, list)) or not all(
            isinstance(p, (tuple, list)) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in plan
        ):
            raise ConfigError(f"[tensor.plan] must be a table of module pattern = style strings, got {plan!r}")
        from dtrain.tensor_parallel.parallelize import check_styles

        check_styles(dict(plan))
        object.__setattr__(self, "plan", tuple((str(k), str(v)) for k, v in plan))

    def to_table(self) -> dict[str, Any]:
        return {**super().to_table(), "plan": dict(self.plan)}

    def batch_shards(self, workers: int) -> int:
        return 1  # every tensor-parallel rank reads the whole batch

    def mesh_shape(self, workers: int) -> tuple[int, int, int]:
        return 1, 1, workers

    def pipeline(self) -> tuple[int, str, str]:
        return 1, "1f1b", "equal"

    @property
    def dp_algorithm(self) -> str:
        return "ring"

    def label(self, workers: int) -> str:
        which = " own plan" if self.plan else (" derived plan" if self.tp_plan == "derive" else "")
        return f"tensor tp{workers}{' sp' if self.sequence_parallel else ''}{which}"

    def checkpoint_keys(self) -> dict[str, Any]:
        keys: dict[str, Any] = {"sequence_parallel": self.sequence_parallel}
        if self.tp_plan != "auto":  # the defaults stay out: a checkpoint written without these keys resumes
            keys["tp_plan"] = self.tp_plan
        if self.plan:
            keys["plan"] = dict(self.plan)
        return keys

    def refuses_grad_accum(self, workers: int) -> str:
        if self.sequence_parallel:
            return (
                "--sequence-parallel all-reduces the norms' gradients inside each step, which micro-steps "
                "would reduce again; drop one of them"
            )
        return ""  # micro-steps of the whole step, one after the other (nothing to defer: no data parallelism)

    def refuses_clip_grad_norm(self, workers: int) -> str:
        return ""  # the sharded parameters' squares summed over the group, the replicated ones counted once


@dataclass(frozen=True)
class HybridOptions(CompressedOptions):
    """Options of ``--strategy hybrid`` (:func:`dtrain.hybrid` over ``Mesh(dp, pp, tp)``; workers = dp x pp x tp).

    Attributes:
        dp / pp / tp: the mesh's sizes.
        microbatches: per step through the pipeline.
        schedule: gpipe or 1f1b.
        balance: the pipeline's cut: equal, params, or layer counts "2,3".
        sequence_parallel: tensor parallelism with sequence-sharded norms.
        algorithm: the dp allreduce algorithm.
        compression / error_feedback: a compressor of the dp allreduce (``--compression``), as dp's.
    """

    dp: int = field(default=0, metadata={"help": "hybrid: data-parallel size (default: 0, workers / (pp x tp))"})
    pp: int = field(default=1, metadata={"help": "hybrid: pipeline stages (default: 1)"})
    tp: int = field(default=1, metadata={"help": "hybrid: tensor-parallel size (default: 1)"})
    microbatches: int = field(default=4, metadata={"help": "micro-batches per step (default: 4)"})
    schedule: str = field(default="1f1b", metadata={"choices": _SCHEDULES, "help": "pipeline schedule"})
    balance: str = field(default="equal", metadata={"help": "the pipeline's cut: equal, params or counts 2,3"})
    sequence_parallel: bool = field(
        default=False, metadata={"help": "tensor/hybrid: norms and residuals sharded along the sequence (default: off)"}
    )
    algorithm: str = field(default="ring", metadata={"choices": tuple(ALGORITHMS), "help": "allreduce algorithm"})

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp", "microbatches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "dp" else 1):
                raise ConfigError(
                    f"{name} must be a positive integer{' (or 0: the rest)' if name == 'dp' else ''}, got {v!r}"
                )
        check_choice("schedule", self.schedule, _SCHEDULES)
        check_choice("algorithm", self.algorithm, tuple(ALGORITHMS))
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("--sequence-parallel needs tensor parallelism: --tp 2 or more")
        super().__post_init__()

    def processes(self, workers: int) -> int:
        return workers

    def batch_shards(self, workers: int) -> int:
        return self.mesh_shape(workers)[0]

    def mesh_shape(self, workers: int) -> tuple[int, int, int]:
        """(dp, pp, tp); ``dp`` 0 takes the workers left: ``workers // (pp * tp)`` (at least 1)."""
        return self.dp or max(1, workers // (self.pp * self.tp)), self.pp, self.tp

    def pipeline(self) -> tuple[int, str, str]:
        return self.microbatches, self.schedule, self.balance

    @property
    def dp_algorithm(self) -> str:
        return self.algorithm

    def checkpoint_keys(self) -> dict[str, Any]:
        keys = ("dp", "pp", "tp", "microbatches", "schedule", "balance", "sequence_parallel")
        return {**super().checkpoint_keys(), **{k: getattr(self, k) for k in keys}}

    def refuses_grad_accum(self, workers: int) -> str:
        return (
            f"accumulates over its {self.microbatches} pipeline micro-batches and all-reduces over dp inside "
            f"each step: use --microbatches {self.microbatches} x N instead"
        )

    def refuses_clip_grad_norm(self, workers: int) -> str:
        return "has no global norm over a dp x pp x tp mesh yet; use --strategy tensor, pipeline or dp"

    def label(self, workers: int) -> str:
        sp = " sp" if self.sequence_parallel else ""
        dp, pp, tp = self.mesh_shape(workers)
        return f"hybrid dp{dp} pp{pp} tp{tp} M{self.microbatches} {self.schedule}{sp}{self._comp_label()}"


MeshOptions = TensorOptions | HybridOptions
