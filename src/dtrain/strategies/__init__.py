"""Strategies: one registry entry each (see :mod:`dtrain.registry`).

The built-in strategies, registered the first time the registry is read (:mod:`.builtin` imports them):

- ``dp`` (dtrain's data parallelism; ``--shard`` makes it ZeRO stage 1-3, :mod:`.sharded_dp`) and
  ``ddp`` (torch's DDP, the peer), :mod:`.dp`;
- ``ps``, the parameter server, :mod:`.ps`;
- ``local_sgd``, ``easgd`` and ``gossip``, decentralized averaging, :mod:`.decentralized`;
- ``pipeline``, :mod:`.pipeline`;
- ``tensor`` and ``hybrid`` (a mesh of data, pipeline and tensor parallelism), :mod:`.hybrid` (their options:
  :mod:`.hybrid_options`);
- ``auto``, the planner's pick among the others, :mod:`.auto`.

Adding one is a module that defines its options dataclass, its loop adapter and a :func:`register` call (its
hooks: ``ProcessHooks``, ``ConfigHooks``, ``ModelHooks``), plus
one import line in :mod:`.builtin` (docs/architecture.md). Importing this package stays light: the built-in
modules (and their options classes, ``DPOptions``, ``DDPOptions``, ``PSOptions``) and the performance model's
``PlanSpace`` load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from dtrain.registry import Choice, Strategy, StrategyOptions, choice, get, register, registered

__all__ = [
    "Strategy",
    "StrategyOptions",
    "Choice",
    "PlanSpace",
    "register",
    "registered",
    "get",
    "choice",
    "DPOptions",
    "DDPOptions",
    "PSOptions",
    "AutoOptions",
]

_LAZY = {
    "DPOptions": "dtrain.strategies.dp_options",
    "DDPOptions": "dtrain.strategies.dp_options",
    "PSOptions": "dtrain.strategies.ps",
    "AutoOptions": "dtrain.strategies.auto",
    "PlanSpace": "dtrain.perfmodel.hooks",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dtrain.strategies' has no attribute {name!r}")
