"""A run's metric: :class:`Evaluation` (test accuracy, or a language model's validation loss)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Subset

from dtrain.workloads.models import logits_of, run_loss

if TYPE_CHECKING:
    from dtrain.config.schema import RunConfig
    from dtrain.workloads.data import DatasetSplit

__all__ = ["Evaluation"]


@dataclass(frozen=True)
class Evaluation:
    """How a run measures its model, and whether it reached ``--target``.

    Attributes:
        cfg: the run configuration (``--eval-samples``, ``--target``).
        data: the dataset (its test / validation set).
    """

    cfg: RunConfig
    data: DatasetSplit

    @property
    def language_model(self) -> bool:
        """Whether the run trains a language model (next-token prediction on text)."""
        return self.data.task == "lm"

    @property
    def metric_name(self) -> str:
        """``"val_loss"`` (nats per token) for a language model, else ``"test_accuracy"``."""
        return "val_loss" if self.language_model else "test_accuracy"

    def reached(self, metric: float) -> bool:
        """Whether ``metric`` meets ``--target`` (accuracy at or above it, a loss at or below it)."""
        if not self.cfg.target:
            return False
        return metric <= self.cfg.target if self.language_model else metric >= self.cfg.target

    def metric_text(self, metric: float) -> str:
        """The metric as ``dtrain run`` prints it."""
        if self.language_model:
            return f"validation loss {metric:.4f} nats/token (perplexity {math.exp(min(metric, 700.0)):.2f})"
        return f"test accuracy {metric:.4f}"

    @functools.cached_property
    def loss_fn(self) -> Callable[[Any, torch.Tensor], torch.Tensor]:
        """A language model's validation loss: ``--loss``, or cross entropy per token."""
        return run_loss(self.cfg)

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> float:
        """The run's metric of ``model`` (:attr:`metric_name`) on the test / validation set.

        A classifier's accuracy, or a language model's mean cross entropy per token
        (nats); over the first ``--eval-samples`` samples or windows (default: all), on
        the model's device.
        """
        was_training = model.training
        model.eval()
        total, count, chunk = 0.0, 0, 64 if self.language_model else 1024
        dev = next(model.parameters()).device  # the data stays on the CPU; a chunk goes where the model is
        for x, y in self.batches(chunk):
            out, target = model(x.to(dev)), y.to(dev)
            if self.language_model:
                total += float(self.loss_fn(out, target)) * target.numel()
            else:
                total += int((logits_of(out).argmax(1) == target).sum())
            count += target.numel()
        model.train(was_training)
        return total / max(1, count)

    def batches(self, chunk: int) -> DataLoader[Any]:
        """The evaluated samples in order, ``chunk`` at a time: the first ``--eval-samples`` (default: all) of
        the test / validation set, read as they are needed (a memory-mapped set is never loaded whole)."""
        test = self.data.test
        n = self.data.test_size
        if self.cfg.eval_samples and self.cfg.eval_samples < n:
            test = Subset(test, range(self.cfg.eval_samples))
        return DataLoader(test, batch_size=chunk, shuffle=False)
