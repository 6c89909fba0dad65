"""Datasets that ship with dtrain: scikit-learn's digits, a synthetic teacher task, and text.

All are small, deterministic by seed and need no download, so every run and test
works offline.

* ``digits`` -- the 1,797 8x8 handwritten digits bundled inside scikit-learn
  (UCI optical digits), scaled to [0, 1], split 80/20 stratified by a fixed seed.
* ``synthetic`` -- inputs drawn from a standard normal; labels are the argmax of
  a fixed random two-layer "teacher" network. Any size; the same seed gives the
  same data. Used by benchmarks that need more data or a larger input.
* ``pytext`` -- a language-modelling corpus: the Python documentation text that
  CPython ships for ``help()`` (``pydoc_data.topics``), as byte-level tokens
  (vocabulary 256). The first 90% of the bytes are for training, the last 10% for
  validation; samples are windows of ``seq_len + 1`` bytes, ``x`` the first
  ``seq_len`` and ``y`` the next byte at every position.

Any other ``--dataset`` is the user's own: a file, a folder or ``MODULE:FN``, read by
:mod:`dtrain.workloads.files` (text, token ids, images, arrays, tables). :class:`DatasetSplit`
holds any sized torch ``Dataset`` (a memory-mapped token file is never read whole), so code that
draws samples from it goes through a ``DataLoader`` or :func:`first_samples`, never ``.tensors``.
"""

from __future__ import annotations

import functools
from collections.abc import Sized
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

__all__ = ["DatasetSplit", "load_dataset", "DATASETS", "pytext_bytes", "unigram_entropy", "first_samples"]

DATASETS = ("digits", "synthetic", "pytext")


@dataclass(frozen=True)
class DatasetSplit:
    """A train/test pair and what a model needs to know about it.

    Attributes:
        train: training samples ``(x, y)``: any torch ``Dataset`` with a length (a ``TensorDataset`` for
            the bundled sets, a lazily read one for a file).
        test: held-out samples ``(x, y)`` (the validation split for ``pytext`` and the user's files).
        input_shape: shape of one ``x`` (``(seq_len,)`` for a language-modelling task).
        num_classes: classes, or the vocabulary size for a language-modelling task.
        task: "classify" (one label per sample) or "lm" (``x`` is a token sequence and
            ``y`` the next token at every position).
        source: one line saying where the data comes from and its size.
    """

    train: Dataset[Any]
    test: Dataset[Any]
    input_shape: tuple[int, ...]
    num_classes: int
    task: str = "classify"
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("train", "test"):
            if not isinstance(getattr(self, name), Sized):
                raise TypeError(f"DatasetSplit.{name} must be a Dataset with a length (__len__)")

    @property
    def train_size(self) -> int:
        """Samples (or windows) of the training set."""
        return len(cast(Sized, self.train))

    @property
    def test_size(self) -> int:
        """Samples (or windows) of the test / validation set."""
        return len(cast(Sized, self.test))


def first_samples(dataset: Dataset[Any], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` samples of ``dataset`` (all of them when it holds fewer), stacked as ``(x, y)``.

    Reads only those samples (through a ``DataLoader``): a memory-mapped set stays on disk.
    """
    size = len(cast(Sized, dataset))
    if size == 0:
        raise ValueError("first_samples of an empty dataset")
    part = Subset(dataset, range(min(n, size)))
    x, y = next(iter(DataLoader(part, batch_size=len(part))))
    return x, y


def _digits(seed: int) -> DatasetSplit:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8)
    y = torch.tensor(d.target, dtype=torch.long)
    idx_tr, idx_te = train_test_split(list(range(len(y))), test_size=0.2, random_state=seed, stratify=d.target)
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


@functools.lru_cache(maxsize=1)
def pytext_bytes() -> bytes:
    """The ``pytext`` corpus: every ``pydoc_data.topics`` text, in sorted-key order, joined by blank lines, as UTF-8.

    Its size depends on the Python version (about 466 KB on 3.11).
    """
    try:
        from pydoc_data.topics import topics
    except ImportError as e:  # some distributions split pydoc_data out of the standard library
        raise RuntimeError("the pytext dataset needs the standard library module pydoc_data.topics") from e
    return "\n\n".join(str(topics[k]) for k in sorted(topics)).encode("utf-8")


def _windows(tokens: torch.Tensor, offset: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping windows of ``seq_len + 1`` tokens from ``offset``: inputs and next-token targets."""
    n = (tokens.numel() - offset) // (seq_len + 1)
    w = tokens[offset : offset + n * (seq_len + 1)].view(n, seq_len + 1)
    return w[:, :-1].clone(), w[:, 1:].clone()


def _pytext(seed: int, seq_len: int) -> DatasetSplit:
    data = pytext_bytes()
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)
    n_train = 9 * len(data) // 10
    x_tr, y_tr = _windows(tokens[:n_train], seed % seq_len, seq_len)
    x_va, y_va = _windows(tokens[n_train:], 0, seq_len)
    if len(x_tr) == 0 or len(x_va) == 0:
        raise ValueError(f"seq_len {seq_len} is too long for pytext's validation split ({len(data) - n_train} bytes)")
    source = (
        f"pytext: the Python documentation text shipped with CPython (pydoc_data.topics), "
        f"{len(data)} bytes, byte-level tokens"
    )
    return DatasetSplit(TensorDataset(x_tr, y_tr), TensorDataset(x_va, y_va), (seq_len,), 256, task="lm", source=source)


def unigram_entropy(tokens: torch.Tensor, vocab: int = 256) -> float:
    """Entropy, in nats per token, of the token frequencies in ``tokens``.

    A model that predicts every token from these frequencies alone has this
    cross-entropy, so it is the baseline a language model must beat.

    Args:
        tokens: integer token ids of any shape, each in ``[0, vocab)``; at least one.
        vocab: vocabulary size (default: 256, bytes).

    Raises:
        ValueError: no tokens, a non-integer dtype, or an id outside ``[0, vocab)``.
    """
    if tokens.numel() == 0:
        raise ValueError("unigram_entropy needs at least one token")
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise ValueError(f"unigram_entropy needs integer token ids, got {tokens.dtype}")
    flat = tokens.flatten().to(torch.int64)
    lo, hi = int(flat.min()), int(flat.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"token ids must lie in [0, {vocab}), got values in [{lo}, {hi}]")
    counts = torch.bincount(flat, minlength=vocab).double()
    p = counts[counts > 0] / flat.numel()
    return float(-(p * p.log()).sum()) + 0.0  # + 0.0 turns the -0.0 of a single symbol into 0.0


def load_dataset(
    name: str = "digits",
    *,
    seed: int = 0,
    samples: int = 4096,
    side: int = 8,
    num_classes: int = 10,
    seq_len: int = 64,
    **file_options: Any,
) -> DatasetSplit:
    """Load a bundled dataset, or the user's own (a path or ``MODULE:FN``).

    Args:
        name: "digits", "synthetic" or "pytext" (default: "digits"); anything else is read by
            :func:`dtrain.workloads.files.load_files` (the reader chosen from the path).
        seed: fixes the train/test split (digits), the data itself (synthetic), or
            the offset ``seed % seq_len`` of the training windows (pytext; its
            validation windows do not depend on the seed).
        samples: training samples of the synthetic set; the test set is a fifth of it.
        side: synthetic images are ``1 x side x side``.
        num_classes: classes of the synthetic teacher.
        seq_len: tokens per pytext sample (>= 2), and per window of the user's text or tokens.
        **file_options: the user's data only: :class:`dtrain.workloads.files.FileOptions` fields
            (``text_field``, ``tokenizer``, ``token_dtype``, ``image_size``, ``val_fraction``,
            ``val_dataset``, ``vocab_size``).

    Returns:
        The train/test split with input shape and class count.

    Raises:
        ValueError: bad arguments for a bundled set.
        dtrain.errors.ConfigError: the user's data cannot be read (it names the file and why).
    """
    if name not in DATASETS:
        from dtrain.workloads.files import FileOptions, load_files

        p = load_files(name, FileOptions(seed=seed, seq_len=seq_len, **file_options))
        return DatasetSplit(p.train, p.test, p.input_shape, p.num_classes, task=p.task, source=p.source)
    if name == "digits":
        return _digits(seed)
    if name == "synthetic":
        if samples < 1 or side < 1 or num_classes < 2:
            raise ValueError("synthetic data needs samples >= 1, side >= 1, num_classes >= 2")
        return _synthetic(seed, samples, side, num_classes)
    if name == "pytext":
        if seq_len < 2:
            raise ValueError(f"pytext needs seq_len >= 2, got {seq_len}")
        return _pytext(seed, seq_len)
    raise AssertionError(name)  # every other name is the user's (above)
