""":mod:`dtrain.training.accumulate` in one process: micro-batches, micro-steps against one step of the whole
batch, and :func:`clip_` on a gradient held in pieces against ``torch.nn.utils.clip_grad_norm_`` on the whole.
The runs through ``dtrain run`` are in tests/test_accumulate_run.py."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from dtrain.training.accumulate import clip_, micro_batches, micro_steps, whole_micro_steps


def test_micro_batches_cut_tensors_and_tuples_along_the_batch():
    x, y = torch.arange(12.0).reshape(6, 2), torch.arange(6)
    parts = micro_batches((x, x + 1), y, 3)
    assert len(parts) == 3
    for i, ((a, b), t) in enumerate(parts):
        assert torch.equal(a, x[2 * i : 2 * i + 2]) and torch.equal(b, x[2 * i : 2 * i + 2] + 1)
        assert torch.equal(t, y[2 * i : 2 * i + 2])
    with pytest.raises(ValueError, match="a batch of 6 does not split into 4 equal micro-batches"):
        micro_batches(x, y, 4)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


@pytest.mark.parametrize("n", [2, 4])
def test_micro_steps_leave_the_whole_batch_gradient_and_mean_loss(n):
    x, y = torch.randn(8, 5, generator=torch.Generator().manual_seed(1)), torch.arange(8) % 3
    whole, parts = _net(), _net()
    loss = nn.functional.cross_entropy(whole(x), y)
    loss.backward()
    quiet: list[int] = []

    def no_sync() -> contextlib.AbstractContextManager[None]:
        quiet.append(1)
        return contextlib.nullcontext()

    def step(xi: torch.Tensor, yi: torch.Tensor, weight: float) -> float:
        li = nn.functional.cross_entropy(parts(xi), yi)
        (li * weight).backward()
        return float(li.detach())

    got = micro_steps(step, x, y, n, no_sync)
    assert got == pytest.approx(float(loss.detach()), rel=1e-6)
    assert len(quiet) == n - 1  # every micro-step but the last holds its exchange back
    for a, b in zip(whole.parameters(), parts.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7)

    again = _net()  # a whole-step engine: its steps add up, then the sum is divided

    def train_step(xi: torch.Tensor, yi: torch.Tensor) -> float:
        li = nn.functional.cross_entropy(again(xi), yi)
        li.backward()
        return float(li.detach())

    assert whole_micro_steps(train_step, again.parameters(), x, y, n) == pytest.approx(float(loss.detach()), rel=1e-6)
    for a, b in zip(whole.parameters(), again.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("max_norm", [0.1, 100.0])
def test_clip_of_pieces_is_torch_clip_of_the_whole(max_norm):
    g = torch.Generator().manual_seed(2)
    whole = [torch.randn(4, 3, generator=g), torch.randn(5, generator=g), torch.randn(2, 2, generator=g)]
    want = [t.clone() for t in whole]
    params = [nn.Parameter(torch.zeros_like(t)) for t in want]
    for p, t in zip(params, want):
        p.grad = t
    norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    # rank 0 of two: it holds half of the first tensor, and the other two as every rank does (counted once);
    # the all-reduce adds rank 1's sum of squares (its half, and its share of the replicated ones)
    halves = [whole[0][:2].clone(), whole[0][2:].clone()]
    replicated = [t.clone() for t in whole[1:]]
    other = float(halves[1].double().pow(2).sum()) + sum(float(t.double().pow(2).sum()) for t in replicated) / 2

    def reduce(t: torch.Tensor) -> None:
        t.add_(other)

    got = clip_([halves[0]], max_norm, reduce=reduce, once=replicated, share=2)
    assert got == pytest.approx(norm, rel=1e-6)
    assert torch.allclose(halves[0], want[0][:2], rtol=1e-6, atol=1e-8)  # torch's clipped values
    for a, b in zip(replicated, want[1:]):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-8)
    assert (max_norm < norm) == (not torch.allclose(whole[0], want[0]))  # 0.1 clips, 100 leaves it as it was
