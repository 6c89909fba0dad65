"""What every strategy builds alike: :class:`Factories` of the seeded model, the optimizer and the
gradient compressor."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dtrain.workloads.models import make_model

if TYPE_CHECKING:
    from dtrain.compress.base import Compressor
    from dtrain.config.schema import RunConfig
    from dtrain.optim.precision import Precision
    from dtrain.workloads.data import DatasetSplit

__all__ = ["Factories"]


@dataclass(frozen=True)
class Factories:
    """The run's model, optimizer and compressor, built the same way in every process.

    Attributes:
        cfg: the run configuration (``--model``, ``--optimizer`` and its settings, the strategy's options).
        data: the dataset (the model's input shape and classes).
        device: where the model goes.
        precision: the compute precision (16-bit compute sends 16-bit gradients).
    """

    cfg: RunConfig
    data: DatasetSplit
    device: torch.device
    precision: Precision

    def model(self) -> nn.Module:
        """The configured model (any ``--model`` spec), initialised identically on every rank (seeded), on
        :attr:`device`."""
        torch.manual_seed(self.cfg.seed)
        c = self.cfg
        model = make_model(
            c.model,
            self.data.input_shape,
            self.data.num_classes,
            task=self.data.task,
            model_args=c.model_args,
            seq_len=c.seq_len,
            **c.gpt_overrides(),
        )
        return model.to(self.device)  # initialised on the CPU: the same weights on any device

    def optimizer(self, params: Iterable[Any]) -> torch.optim.Optimizer:
        """The configured optimizer. SGD gets no momentum where the compressor applies it
        (:meth:`compressor`)."""
        c = self.cfg
        if c.optimizer == "adam":
            return torch.optim.Adam(params, lr=c.lr, weight_decay=c.weight_decay)
        if c.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=c.lr, weight_decay=c.weight_decay)
        if c.optimizer in ("lars", "lamb"):
            from dtrain.optim import LAMB, LARS

            if c.optimizer == "lars":
                return LARS(params, lr=c.lr, momentum=c.momentum, weight_decay=c.weight_decay)
            return LAMB(params, lr=c.lr, weight_decay=c.weight_decay)
        comp = self.compressor()
        momentum = 0.0 if comp is not None and comp.momentum else c.momentum
        return torch.optim.SGD(params, lr=c.lr, momentum=momentum, weight_decay=c.weight_decay)

    def compressor(self) -> Compressor | None:
        """The strategy's gradient compressor (None without one).

        Compressors that need SGD's momentum before them (sign, sign:mv, onebit)
        get it in their error feedback, and :meth:`optimizer` then builds SGD
        without momentum (``dtrain.compress.from_spec``'s ``momentum``).
        """
        opts = self.cfg.opts
        wire = self.precision.wire(opts.compressor_spec(), unscaled=opts.exchanges_unscaled())
        if wire != opts.compressor_spec():  # 16-bit compute: the gradients travel in 16 bits
            from dtrain.compress import from_spec

            return from_spec(wire)
        return opts.build_compressor(self.sgd_momentum)

    @property
    def sgd_momentum(self) -> float:
        """SGD's momentum (0 for other optimizers): what a sign/onebit compressor takes over."""
        return self.cfg.momentum if self.cfg.optimizer == "sgd" else 0.0
