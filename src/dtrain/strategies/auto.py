"""``auto``: the planner picks the strategy before any process starts.

The entry has no process body: its ``resolve`` hook ranks every registered
strategy's candidates for the run's model, batch and cluster
(:func:`dtrain.planning.pick_plan`) and returns the run configuration of the first
choice, which ``dtrain run`` then runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dtrain.config.schema import ConfigHooks
from dtrain.errors import ConfigError
from dtrain.registry import Strategy, StrategyOptions, register

if TYPE_CHECKING:
    from dtrain.config.schema import RunConfig

__all__ = ["AutoOptions", "AUTO"]


@dataclass(frozen=True)
class AutoOptions(StrategyOptions):
    """``--strategy auto`` has no options of its own: the planner chooses them."""

    def label(self, workers: int) -> str:
        return "auto (the planner's first choice)"

    def refuses_grad_accum(self, workers: int) -> str:
        return ""  # the planner's choice is validated again once picked

    def refuses_clip_grad_norm(self, workers: int) -> str:
        return ""


def _check(options: AutoOptions, cfg: RunConfig) -> None:
    if cfg.resume:
        raise ConfigError("--resume continues the checkpoint's strategy; pass it (e.g. --strategy dp) instead of auto")


def _resolve(cfg: RunConfig) -> RunConfig:
    from dtrain.job.validate import validate
    from dtrain.planning import pick_plan

    best = pick_plan(cfg)
    return validate(cfg.replace(strategy=best.strategy, workers=best.workers, options=best.options))


AUTO = register(
    Strategy(
        name="auto",
        options=AutoOptions,
        help="the planner's first choice for this model, batch and cluster",
        hooks=(ConfigHooks(check=_check, resolve=_resolve),),
    )
)
