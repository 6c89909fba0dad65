"""Bad input to dtrain.Pipeline: a clear error naming the stage, the micro-batch and the cause, never a hang.

In-process cases run the ranks as threads (:class:`~dtrain.comm.transport.ThreadTransport`, the
same executor and channel); a rank killed mid-schedule needs real processes (gloo).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from _dist import spawn
from torch import nn

from dtrain.comm.transport import Transport, run_threads
from dtrain.pipeline import Pipeline, PipelineError


def _seq(n: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(6, 6) for _ in range(n)])


def test_a_model_that_is_not_sequential_is_refused() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2)

    with pytest.raises(PipelineError, match="nn.Sequential"):
        Pipeline(Net(), microbatches=2, transport=run_threads(1, lambda t: t)[0])


def test_fewer_layers_than_stages_is_refused() -> None:
    def rank(t: Transport) -> None:
        Pipeline(_seq(2), microbatches=2, transport=t)

    with pytest.raises(PipelineError, match="partition"):
        run_threads(3, rank, timeout=5)


def test_microbatches_that_do_not_divide_the_batch() -> None:
    def rank(t: Transport) -> None:
        pipe = Pipeline(_seq(), microbatches=3, transport=t)
        pipe.step(torch.randn(8, 6), torch.randn(8, 6).argmax(1))

    with pytest.raises(PipelineError, match=r"stage 0: 3 micro-batches do not divide the batch of 8"):
        run_threads(2, rank, timeout=3)


def test_a_stage_whose_output_shape_changes_between_steps() -> None:
    class Grow(nn.Module):  # stage 0's output gains a column at the second step
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.calls = nn.Linear(6, 6), 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            y = self.lin(x)
            return torch.cat([y, y[:, :1]], 1) if self.calls > 2 else y

    def rank(t: Transport) -> None:
        torch.manual_seed(0)
        pipe = Pipeline(nn.Sequential(Grow(), nn.Linear(6, 6)), microbatches=2, transport=t)
        for _ in range(2):
            pipe.step(torch.randn(4, 6), torch.randint(0, 6, (4,)))

    with pytest.raises(
        PipelineError,
        match=r"rank 0, stage 0, micro-batch 0: the output is .* \[2, 7\] but was "
        r".* \[2, 6\] at the first step",
    ):
        run_threads(2, rank, timeout=3)


def _killed(rank: int, world: int) -> Any:
    from dtrain.pipeline import Pipeline

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(6, 6) for _ in range(world)])
    pipe = Pipeline(model, microbatches=4, schedule="1f1b", timeout=30)
    if rank == 1:
        calls = [0]

        def die(mod: nn.Module, inp: Any) -> None:
            calls[0] += 1
            if calls[0] == 4 * 2 + 2:  # step 2, micro-batch 1
                os._exit(3)

        next(iter(pipe.module.children())).register_forward_pre_hook(die)
    for _ in range(5):
        pipe.step(torch.randn(8, 6), torch.randint(0, 6, (8,)))
    return "finished"


@pytest.mark.procs
def test_a_rank_killed_mid_schedule_is_an_error_on_the_others_not_a_hang() -> None:
    outs = spawn(_killed, 3, timeout=90, pg_timeout=60)
    assert outs[1].status == "died" and outs[1].exitcode == 3, outs[1]
    for o in (outs[0], outs[2]):
        assert o.status == "error", f"rank {o.rank}: {o.status} {o.value}"
        assert "PipelineError" in o.error and f"rank {o.rank}, stage {o.rank}, micro-batch" in o.error, o.error
        assert "stage 1 (rank 1)" in o.error, o.error
