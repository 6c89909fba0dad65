"""``dtrain.models``: the reference models (the CNN, the MLP, the GPT family) under their public name.

They live in :mod:`dtrain.workloads.models` (what a run trains sits with its datasets); this module
is that package's names, so that ``import dtrain.models`` and ``from dtrain.models import build_model``
work as ``dtrain.models.build_model`` always has. A name not listed here is looked up there too.
"""

from __future__ import annotations

from typing import Any

import dtrain.workloads.models as _impl
from dtrain.workloads.models import (
    GPT_PRESETS,
    MODELS,
    GPTConfig,
    build_model,
    generate,
    gpt_config,
    is_language_model,
    task_loss,
)

__all__ = [
    "MODELS",
    "build_model",
    "task_loss",
    "GPTConfig",
    "GPT_PRESETS",
    "generate",
    "gpt_config",
    "is_language_model",
]


def __getattr__(name: str) -> Any:
    return getattr(_impl, name)
