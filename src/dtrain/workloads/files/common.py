"""What every reader of the user's data returns, and how a set of samples splits into training and validation.

A reader returns a :class:`Stream` (token ids, for a language model) or :class:`Samples` (a torch
``Dataset`` of ``(x, label)``); :func:`dtrain.workloads.files.load_files` turns either into a
:class:`~dtrain.workloads.data.DatasetSplit`. :func:`optional` imports a package of the ``hf`` extra
or says how to install it.
"""

from __future__ import annotations

import importlib
from collections.abc import Sized
from dataclasses import dataclass
from types import ModuleType
from typing import Any, cast

import torch
from torch.utils.data import Dataset, Subset

from dtrain.errors import ConfigError

__all__ = ["Stream", "Samples", "Parts", "split_samples", "optional", "PIP"]

PIP = "pip install 'dtrain[hf]'"


def optional(module: str, package: str, why: str) -> ModuleType:
    """``import module``, or a ConfigError saying which package ``why`` needs and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"{why} needs the {package} package, which is not installed: {PIP}") from None


@dataclass(frozen=True)
class Parts:
    """A split of the user's data: the fields of :class:`dtrain.workloads.data.DatasetSplit`, which
    :func:`dtrain.workloads.data.load_dataset` makes of it."""

    train: Dataset[Any]
    test: Dataset[Any]
    input_shape: tuple[int, ...]
    num_classes: int
    task: str
    source: str


@dataclass(frozen=True)
class Stream:
    """Token ids, one after the other: a text's tokens or a token file's.

    Attributes:
        tokens: a 1-D integer array (a ``np.memmap`` for a ``.bin`` / ``.npy`` file, else in memory).
        vocab: the vocabulary when the reader knows it (256 for bytes, a tokenizer's size), else 0.
        name: the file, for messages.
        what: one line: the file and its size.
        file: where to read the ids again in chunks (``(filename, offset in bytes)``; None: in memory).
    """

    tokens: Any
    vocab: int
    name: str
    what: str
    file: tuple[str, int] | None = None


@dataclass(frozen=True)
class Samples:
    """A set of labelled samples (or of ready-made token windows, ``task`` "lm").

    Attributes:
        dataset: a torch ``Dataset`` with a length, of ``(x, y)``.
        input_shape: one ``x``'s shape.
        num_classes: classes (the vocabulary for ``task`` "lm").
        task: "classify" or "lm".
        what: one line: where the samples come from and how many.
        validation: a validation set that came with the data (``FN()``'s second, a saved split), or None.
        labels: the class names, where the data names them (an image folder's subfolders).
    """

    dataset: Dataset[Any]
    input_shape: tuple[int, ...]
    num_classes: int
    task: str
    what: str
    validation: Samples | None = None
    labels: tuple[str, ...] = ()


def split_samples(spec: str, train: Samples, val: Samples | None, fraction: float, seed: int) -> Parts:
    """``train`` and ``val`` as a split, or ``train`` cut at random (by ``seed``): ``fraction`` validates.

    The cut is a permutation from ``torch.Generator().manual_seed(seed)``: the same seed, the same cut.
    """
    n = len(cast(Sized, train.dataset))
    if n == 0:
        raise ConfigError(f"dataset {spec} is empty")
    if val is None:
        if n < 2:
            raise ConfigError(f"dataset {spec} holds 1 sample: too few to keep a validation share")
        n_val = min(n - 1, max(1, round(n * fraction)))
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        tr: Dataset[Any] = Subset(train.dataset, sorted(order[n_val:].tolist()))
        va: Dataset[Any] = Subset(train.dataset, sorted(order[:n_val].tolist()))
        where = f"; {n_val} of its samples validate"
        classes = train.num_classes
    else:
        if len(cast(Sized, val.dataset)) == 0:
            raise ConfigError(f"the validation set of {spec} ({val.what}) is empty")
        if val.input_shape != train.input_shape or val.task != train.task:
            raise ConfigError(
                f"the validation set ({val.what}) does not match {spec}: samples of shape "
                f"{val.input_shape} ({val.task}) against {train.input_shape} ({train.task})"
            )
        if train.labels and val.labels and train.labels != val.labels:
            raise ConfigError(
                f"the validation set ({val.what}) has the classes {', '.join(val.labels)}, {spec} "
                f"has {', '.join(train.labels)}: the same names must be the same classes"
            )
        tr, va, where = train.dataset, val.dataset, f"; validation {val.what}"
        classes = max(train.num_classes, val.num_classes)
    return Parts(tr, va, train.input_shape, classes, task=train.task, source=train.what + where)
