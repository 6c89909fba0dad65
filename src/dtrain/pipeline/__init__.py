"""Pipeline parallelism: a model cut into stages, micro-batches played through a schedule.

* :mod:`.schedules` -- schedules as data (GPipe, 1F1B, interleaved, PipeDream-2BW), a printer,
  a simulator and a validator.
* :mod:`.partition` -- balanced cuts of an ``nn.Sequential`` (by layer counts, parameters,
  memory or measured time).
* :mod:`.pipe` -- :class:`Pipeline`, the executor that runs a schedule over dtrain's transport.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Pipeline", "PipelineError", "Schedule", "Action", "generate", "balance"]

_LAZY = {"Pipeline": "dtrain.pipeline.pipe", "PipelineError": "dtrain.pipeline._channel",
         "Schedule": "dtrain.pipeline.schedules", "Action": "dtrain.pipeline.schedules",
         "generate": "dtrain.pipeline.schedules", "balance": "dtrain.pipeline.partition"}  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dtrain.pipeline' has no attribute {name!r}")
