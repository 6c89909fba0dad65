"""A run's global batch as it goes: :class:`BatchControl`.

It holds the batch plan (``--batch-size``, ``--batch-schedule``), the gradient noise scale and the step's
cost that ``--batch-schedule auto`` decides from, the decisions made, and what a checkpoint keeps of them.
The rules themselves are :mod:`dtrain.optim.large_batch` and :mod:`dtrain.training.noise_scale`.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from dtrain.optim.large_batch import BatchPlan
from dtrain.training.noise_scale import NoiseScale, StepCost, next_batch

if TYPE_CHECKING:
    from dtrain.config.schema import RunConfig
    from dtrain.workloads.data import DatasetSplit

__all__ = ["BatchControl"]


class BatchControl:
    """The global batch of every epoch and step of a run, and ``auto``'s decisions about it.

    Attributes:
        cfg: the run configuration.
        data: the dataset (its training set's size bounds the batch).
        decisions: ``auto``'s decisions, one per epoch (or per ``--auto-every`` change).
    """

    def __init__(self, cfg: RunConfig, data: DatasetSplit) -> None:
        self.cfg, self.data = cfg, data
        self.decisions: list[dict[str, Any]] = []

    @functools.cached_property
    def plan(self) -> BatchPlan:
        """Every epoch's global batch (``--batch-size``, ``--batch-schedule``; ``auto`` decides as it goes; a
        run resumed at another batch changes it at the checkpoint's step)."""
        from dtrain.training.checkpointing import batch_plan

        return batch_plan(self.cfg, self.data.train_size)

    @property
    def shards(self) -> int:
        """The shards a global batch splits into (the strategy's data-parallel width)."""
        return self.cfg.opts.batch_shards(self.cfg.workers)

    @functools.cached_property
    def noise(self) -> NoiseScale | None:
        """The gradient noise scale (``--noise-scale``, ``--batch-schedule auto``; the engine feeds it every
        step), else None."""
        return NoiseScale(self.cfg.noise_beta) if self.cfg.noise_scale or self.plan.auto else None

    @functools.cached_property
    def step_cost(self) -> StepCost | None:
        """``--auto-rule time``: the step's fixed and per-sample seconds (the loop feeds this rank's rows, the
        engine's noise-scale all-reduce agrees them over the ranks), else None."""
        return StepCost() if self.plan.auto and self.cfg.auto_rule == "time" else None

    @property
    def cap(self) -> int:
        """The largest global batch ``auto`` grows to (``--max-batch``, else a quarter of the training set)."""
        shards = self.shards
        return self.cfg.max_batch or max(shards, self.data.train_size // 4 // shards * shards)

    def observe(self, row: dict[str, Any]) -> None:
        """A written metrics row: its step time and compute feed :attr:`step_cost` (``--auto-rule time``)."""
        if self.step_cost is not None and row.get("compute_s") and row.get("step_s") and row.get("batch"):
            local = int(row["batch"]) // self.shards
            self.step_cost.observe(float(row["step_s"]), float(row["compute_s"]), local)

    def begin_epoch(self, epoch: int) -> None:
        """Before ``epoch``'s data: ``--batch-schedule auto`` doubles the batch while the smoothed noise scale
        exceeds it by the margin (:func:`dtrain.training.noise_scale.next_batch`). Every rank computes the
        same noise scale (from all-reduced norms), so every rank makes the same decision."""
        if self.plan.auto and self.plan.within_epochs and not self.decisions:  # --auto-every: after_step decides
            self.decisions.append({"step": 0, "batch": self.plan.current, "b_simple": None})
        if (
            not self.plan.auto
            or self.plan.within_epochs
            or self.noise is None
            or any(d["epoch"] == epoch for d in self.decisions)
        ):
            return  # decided already (a run resumed mid-epoch keeps the decision made at its start)
        b = self.plan.batch(epoch)
        if epoch > 0:
            b = next_batch(b, self.noise.b_simple, maximum=max(b, self.cap), multiple=self.shards)
            self.plan.set_from(epoch, b)
        self.decisions.append({"epoch": epoch, "batch": b, "b_simple": self.noise.b_simple})

    def after_step(self, steps: int) -> None:
        """After ``steps`` steps, ``--batch-schedule auto --auto-every N`` decides every N steps the batch of the
        steps that follow (the same on every rank: the noise scale and the step's cost are all-reduced); the
        loader's next batch takes it (:class:`dtrain.training.loaders.ShardLoaders`)."""
        plan = self.plan
        if not (plan.auto and plan.within_epochs) or self.noise is None or steps % plan.every:
            return
        b, ratio = plan.current, 1.0
        if self.step_cost is not None:  # --auto-rule time
            r = self.step_cost.ratio(b // self.shards)
            if r is None:
                return  # no step measured yet
            ratio = r
        nb = next_batch(b, self.noise.b_simple, maximum=max(b, self.cap), multiple=self.shards, ratio=ratio)
        if nb != b:
            plan.change(steps, nb)
            self.decisions.append({"step": steps, "batch": nb, "b_simple": self.noise.b_simple, "ratio": ratio})

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the plan (``auto``'s decisions), the noise scale's averages, the step's
        cost."""
        out: dict[str, Any] = {
            "plan": list(self.plan.batches),
            "decisions": list(self.decisions),
            "changes": [list(c) for c in self.plan.changes],
        }
        if self.noise is not None:
            out["noise"] = self.noise.state_dict()
        if self.step_cost is not None:
            out["cost"] = self.step_cost.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """:meth:`state_dict` back (a resumed run), before the engine locates its position in the data. A
        fixed or scheduled plan came whole from the configuration and the checkpoint's marker
        (:func:`dtrain.training.checkpointing.batch_plan`); ``auto``'s decisions come from here."""
        if self.plan.auto:
            self.plan.batches[: len(state["plan"])] = state["plan"]
            self.plan.changes = [(int(s), int(b)) for s, b in state.get("changes", [])]
        self.decisions = list(state["decisions"])
        if self.noise is not None and "noise" in state:
            self.noise.load_state_dict(state["noise"])
        if self.step_cost is not None and "cost" in state:
            self.step_cost.load_state_dict(state["cost"])
