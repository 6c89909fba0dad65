"""A model and one batch for it, by name: what the planner and calibration profile.

:func:`load_model` takes any ``--model`` spec: a dtrain model name ("cnn", "mlp", ...)
built for a dataset, a user's ``FILE.py:FN`` / ``MODULE:FN`` returning a model or
``(model, sample_batch)``, or a transformers ``hf:TYPE``. It starts nothing: the planner (``dtrain plan``,
``--strategy auto``) and the calibration runners both call it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dtrain.errors import ConfigError

if TYPE_CHECKING:
    from dtrain.workloads.data import DatasetSplit

__all__ = ["load_model"]


def _batch_of(data: DatasetSplit, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``batch`` training samples of ``data`` (repeated when the set is smaller)."""
    from dtrain.workloads.data import first_samples

    x, y = first_samples(data.train, batch)
    reps = -(-batch // len(y))
    return x.repeat(reps, *([1] * (x.dim() - 1)))[:batch], y.repeat(reps, *([1] * (y.dim() - 1)))[:batch]


def load_model(
    spec: str,
    dataset: str = "digits",
    *,
    batch: int = 64,
    seed: int = 0,
    samples: int = 4096,
    seq_len: int = 64,
    model_args: Mapping[str, Any] | None = None,
    data: DatasetSplit | None = None,
    **gpt_overrides: Any,
) -> tuple[nn.Module, Any, str]:
    """A model, one batch for it, and its name, from any ``--model`` spec.

    ``FILE.py:FN`` / ``MODULE:FN`` is called as ``FN(**model_args)`` and returns ``(model, sample_batch)``, or a
    model alone, which then gets ``batch`` samples of ``dataset``; ``hf:...`` is built for ``dataset``'s task
    (:mod:`dtrain.workloads.models.specs`). dtrain's own names ("cnn", "mlp", "gpt-small", ...) are built for
    ``dataset`` (a language model for pytext unless ``dataset`` is token windows already, with ``seq_len`` and
    ``gpt_overrides``) and take ``batch`` samples from its training set; ``data``: an already loaded split (the
    user's own data, say) instead of ``dataset``.
    """
    from dtrain.workloads.data import DATASETS, load_dataset
    from dtrain.workloads.models import MODELS, is_language_model, make_model
    from dtrain.workloads.models.specs import build_spec, is_builtin, is_transformers

    args = dict(model_args or {})
    if is_builtin(spec) and spec not in MODELS:
        raise ConfigError(
            f"model {spec!r} is not known; use one of {', '.join(MODELS)}, FILE.py:FUNCTION, MODULE:FUNCTION or hf:TYPE"
        )
    if not is_builtin(spec) and not is_transformers(spec):  # a function: its own sample, if it gives one
        model, sample = build_spec(spec, args, task="classify", input_shape=(), num_classes=0)
        if sample is not None:
            return model, sample, spec.rpartition(":")[2]
        if data is None:
            data = load_dataset(dataset, seed=seed, samples=samples, seq_len=seq_len)
        return model, _batch_of(data, batch), spec.rpartition(":")[2]
    if data is None:
        bundled = "pytext" if is_language_model(spec) and dataset in DATASETS else dataset  # a gpt: text
        data = load_dataset(bundled, seed=seed, samples=samples, seq_len=seq_len)
    torch.manual_seed(seed)
    model = make_model(
        spec,
        tuple(data.input_shape),
        data.num_classes,
        task=data.task,
        model_args=args,
        seq_len=seq_len,
        **gpt_overrides,
    )
    return model, _batch_of(data, batch), spec
