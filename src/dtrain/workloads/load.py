"""A model and one batch for it, by name: what the planner and calibration profile.

:func:`load_model` takes a dtrain model name ("cnn", "mlp", ...) built for a
dataset, or a user's ``FILE.py:FN`` / ``MODULE:FN`` returning
``(model, sample_batch)``. It starts nothing: the planner (``dtrain plan``,
``--strategy auto``) and the calibration runners both call it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dtrain.errors import ConfigError

if TYPE_CHECKING:
    from dtrain.workloads.data import DatasetSplit

__all__ = ["load_model"]


def _user_model(spec: str) -> tuple[nn.Module, Any, str]:
    where, fn_name = spec.rsplit(":", 1)
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ConfigError(f"model file {where!r} does not exist")
        mod_spec = importlib.util.spec_from_file_location(path.stem, path)
        assert mod_spec and mod_spec.loader
        mod = importlib.util.module_from_spec(mod_spec)
        sys.modules[path.stem] = mod
        mod_spec.loader.exec_module(mod)
    else:
        mod = importlib.import_module(where)
    fn = getattr(mod, fn_name, None)
    if fn is None:
        raise ConfigError(f"{where} has no function {fn_name!r}")
    model, sample = fn()
    return model, sample, fn_name


def load_model(spec: str, dataset: str = "digits", *, batch: int = 64, seed: int = 0, samples: int = 4096,
               seq_len: int = 64, data: DatasetSplit | None = None,
               **gpt_overrides: Any) -> tuple[nn.Module, Any, str]:  # fmt: skip
    """A model, one batch for it, and its name, from a dtrain model name or ``FILE.py:FN`` / ``MODULE:FN``.

    ``FN()`` must return ``(model, sample_batch)``; dtrain's own names ("cnn",
    "mlp", "gpt-small", ...) are built for ``dataset`` (a language model always
    for pytext, with ``seq_len`` and ``gpt_overrides``) and take ``batch`` samples
    from its training set; ``data``: an already loaded split (the user's own data, say) instead of
    ``dataset``.
    """
    if ":" in spec:
        return _user_model(spec)
    from dtrain.workloads.data import DATASETS, first_samples, load_dataset
    from dtrain.workloads.models import MODELS, build_model, is_language_model

    if spec not in MODELS:
        raise ConfigError(f"model {spec!r} is not known; use one of {', '.join(MODELS)} or FILE.py:FUNCTION")
    if data is None:
        bundled = "pytext" if is_language_model(spec) and dataset in DATASETS else dataset  # a gpt: text
        data = load_dataset(bundled, seed=seed, samples=samples, seq_len=seq_len)
    torch.manual_seed(seed)
    model = build_model(spec, data.input_shape, data.num_classes, **gpt_overrides)
    x, y = first_samples(data.train, batch)
    reps = -(-batch // len(y))
    return model, (x.repeat(reps, *([1] * (x.dim() - 1)))[:batch], y.repeat(reps, *([1] * (y.dim() - 1)))[:batch]), spec
