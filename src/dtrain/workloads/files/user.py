"""``MODULE:FN`` or ``FILE.py:FN``: the user's own function returns a torch ``Dataset`` or ``(train, validation)``.

Each sample is ``(x, y)``. What the model needs is found from the first sample unless the dataset
says it (attributes ``task``, ``num_classes``, ``input_shape``): ``y`` a single integer is a class
label (classes: the largest label plus one, found by reading the labels); ``x`` and ``y`` integer
sequences of the same length are token windows (task "lm"; vocabulary: the largest id plus one, or
``--vocab-size``).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Sized
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from dtrain.errors import ConfigError
from dtrain.workloads.files.common import Samples

__all__ = ["read_user"]


def read_user(spec: str, opts: Any) -> Samples:
    """The samples ``FN()`` returns (with its validation set, when it returns two)."""
    where, fn_name = spec.rsplit(":", 1)
    fn = getattr(_module(where, spec), fn_name, None)
    if not callable(fn):
        raise ConfigError(f"dataset {spec}: {where} has no function {fn_name!r}")
    got = fn()
    if isinstance(got, tuple) and len(got) == 2 and all(isinstance(d, Dataset) for d in got):
        train, val = (_describe(d, f"{spec}()[{i}]", opts.vocab_size) for i, d in enumerate(got))
        return Samples(
            train.dataset,
            train.input_shape,
            max(train.num_classes, val.num_classes),
            train.task,
            train.what,
            validation=val,
        )
    if not isinstance(got, Dataset):
        raise ConfigError(
            f"dataset {spec}: {fn_name}() returned {type(got).__name__}; it must return a torch "
            "Dataset or (train, validation) Datasets"
        )
    return _describe(got, f"{spec}()", opts.vocab_size)


def _module(where: str, spec: str) -> Any:
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ConfigError(f"dataset {spec}: the file {where!r} does not exist")
        found = importlib.util.spec_from_file_location(path.stem, path)
        assert found and found.loader
        mod = importlib.util.module_from_spec(found)
        sys.modules[path.stem] = mod
        found.loader.exec_module(mod)
        return mod
    try:
        return importlib.import_module(where)
    except ImportError as e:
        raise ConfigError(f"dataset {spec}: cannot import {where} ({e})") from None


def _describe(ds: Dataset[Any], name: str, vocab_size: int) -> Samples:
    if not isinstance(ds, Sized):
        raise ConfigError(f"dataset {name}: the Dataset has no length (__len__)")
    n = len(ds)
    if n == 0:
        raise ConfigError(f"dataset {name} is empty")
    sample = ds[0]
    if not (isinstance(sample, (tuple, list)) and len(sample) == 2):
        raise ConfigError(f"dataset {name}: a sample must be (x, y), got {type(sample).__name__}")
    x, y = (torch.as_tensor(v) for v in sample)
    task = getattr(ds, "task", None) or ("lm" if _is_windows(x, y) else "classify")
    shape = tuple(getattr(ds, "input_shape", None) or x.shape)
    if task == "classify" and (y.dim() != 0 or y.is_floating_point()):
        raise ConfigError(
            f"dataset {name}: y must be one integer class label a sample (or x and y integer "
            f"token windows of one length), got y of shape {tuple(y.shape)} {y.dtype}"
        )
    classes = int(getattr(ds, "num_classes", 0) or (vocab_size if task == "lm" else 0) or _largest(ds, task) + 1)
    return Samples(ds, shape, classes, task, f"{name}: {n} samples")


def _is_windows(x: torch.Tensor, y: torch.Tensor) -> bool:
    ints = not (x.is_floating_point() or y.is_floating_point())
    return ints and x.dim() == 1 and x.shape == y.shape


def _largest(ds: Dataset[Any], task: str) -> int:
    """The largest label (or token id), reading the set in batches."""
    hi = 0
    for x, y in DataLoader(ds, batch_size=1024):
        hi = max(hi, int(y.max()), int(x.max()) if task == "lm" else 0)
    return hi
