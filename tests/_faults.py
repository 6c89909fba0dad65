"""Fault injection for tests/test_faults.py, loaded in every process of a run through
``DTRAIN_STRATEGY_MODULES=_faults`` (the plugin hook; it registers no strategy).

``DTRAIN_TEST_INF="RANK:STEPS:PARAM"``: on global rank RANK, the gradient of parameter PARAM
(its name in the model) becomes inf in the backward passes numbered STEPS (``3`` or ``3+5``;
from 0, one backward per step for data parallelism and the parameter server) while the loss
stays finite -- an overflow in backward, the case a loss check alone misses.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from dtrain.training.context import TrainContext

SPEC = os.environ.get("DTRAIN_TEST_INF", "")


def _poison(model: nn.Module, steps: set[int], name: str) -> None:
    param = dict(model.named_parameters())[name]
    calls = [0]

    def hook(grad: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return torch.full_like(grad, float("inf")) if calls[0] - 1 in steps else grad

    param.register_hook(hook)


if SPEC:
    _rank, _step, _name = SPEC.split(":")
    _make_model = TrainContext.make_model

    def make_model(self: TrainContext) -> Any:
        model = _make_model(self)
        if self.rank == int(_rank):
            _poison(model, {int(k) for k in _step.split("+")}, _name)
        return model

    TrainContext.make_model = make_model  # type: ignore[method-assign]
