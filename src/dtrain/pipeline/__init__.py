"""Pipeline parallelism: a model cut into stages, micro-batches played through a schedule.

* :mod:`.actions` -- what a schedule is made of: :class:`~.actions.Action` (``"1F3"``) and
  :class:`~.actions.Schedule`;
* :mod:`.schedules` -- schedules as data (GPipe, 1F1B, interleaved, PipeDream-2BW), a printer,
  a simulator and a validator (their implementation: ``_simulate``);
* :mod:`.partition` -- balanced cuts of an ``nn.Sequential`` (by layer counts, parameters,
  memory or measured time);
* :mod:`.blocks` and :mod:`.staged` -- a model that is not an ``nn.Sequential``: its list of repeated blocks
  and what runs around it (found by a traced forward), and its stages, each running the model's own
  forward with only its blocks in place;
* :mod:`.executor` -- plays one rank's actions (forwards, backwards, sends and receives; the
  messages between stages are the private ``_channel``);
* :mod:`.pipe` -- :class:`Pipeline`, which runs a schedule over dtrain's transport.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Pipeline", "PipelineError", "Schedule", "Action", "generate", "balance"]

_LAZY = {
    "Pipeline": "dtrain.pipeline.pipe",
    "PipelineError": "dtrain.pipeline._channel",
    "Schedule": "dtrain.pipeline.schedules",
    "Action": "dtrain.pipeline.schedules",
    "generate": "dtrain.pipeline.schedules",
    "balance": "dtrain.pipeline.partition",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dtrain.pipeline' has no attribute {name!r}")
