"""Datasets that ship with dtrain: scikit-learn's digits, and a synthetic teacher task.

Both are small, deterministic by seed and need no download, so every run and test
works offline.

* ``digits`` -- the 1,797 8x8 handwritten digits bundled inside scikit-learn
  (UCI optical digits), scaled to [0, 1], split 80/20 stratified by a fixed seed.
* ``synthetic`` -- inputs drawn from a standard normal; labels are the argmax of
  a fixed random two-layer "teacher" network. Any size; the same seed gives the
  same data. Used by benchmarks that need more data or a larger input.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import TensorDataset

__all__ = ["DatasetSplit", "load_dataset", "DATASETS"]

DATASETS = ("digits", "synthetic")


@dataclass(frozen=True)
class DatasetSplit:
    """A train/test pair and what a model needs to know about it."""

    train: TensorDataset
    test: TensorDataset
    input_shape: tuple[int, ...]
    num_classes: int


def _digits(seed: int) -> DatasetSplit:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8)
    y = torch.tensor(d.target, dtype=torch.long)
    idx_tr, idx_te = train_test_split(
        list(range(len(y))), test_size=0.2, random_state=seed, stratify=d.target
    )
    tr, te = torch.tensor(idx_tr), torch.tensor(idx_te)
    return DatasetSplit(TensorDataset(x[tr], y[tr]), TensorDataset(x[te], y[te]), (1, 8, 8), 10)


def _synthetic(seed: int, samples: int, side: int, num_classes: int) -> DatasetSplit:
    g = torch.Generator().manual_seed(seed)
    dim = side * side
    w1 = torch.randn(dim, 4 * num_classes, generator=g) / dim**0.5
    w2 = torch.randn(4 * num_classes, num_classes, generator=g) / (4 * num_classes) ** 0.5
    n_test = max(num_classes, samples // 5)
    x = torch.randn(samples + n_test, 1, side, side, generator=g)
    y = (torch.tanh(x.flatten(1) @ w1) @ w2).argmax(dim=1)
    return DatasetSplit(
        TensorDataset(x[:samples], y[:samples]),
        TensorDataset(x[samples:], y[samples:]),
        (1, side, side),
        num_classes,
    )


def load_dataset(
    name: str = "digits", *, seed: int = 0, samples: int = 4096, side: int = 8, num_classes: int = 10
) -> DatasetSplit:
    """Load a bundled dataset.

    Args:
        name: "digits" or "synthetic" (default: "digits").
        seed: fixes the train/test split (digits) or the data itself (synthetic).
        samples: training samples of the synthetic set; the test set is a fifth of it.
        side: synthetic images are ``1 x side x side``.
        num_classes: classes of the synthetic teacher.

    Returns:
        The train/test split with input shape and class count.
    """
    if name == "digits":
        return _digits(seed)
    if name == "synthetic":
        if samples < 1 or side < 1 or num_classes < 2:
            raise ValueError("synthetic data needs samples >= 1, side >= 1, num_classes >= 2")
        return _synthetic(seed, samples, side, num_classes)
    raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
