"""dtrain.Pipeline across real processes (gloo on loopback) against single-process training.

One spawn per world size (3 and 4 stages) runs every (model, schedule, micro-batches)
scenario in sequence: 20 SGD steps through the pipeline and, in the same process, 20 steps
of the unsplit model on the whole batch; each rank returns the largest difference between
its stage's parameters and the reference's parameters of the same names.

Models: ``gpt-tiny`` (5 children: embed, 2 blocks, ln_f, head; for the interleaved schedule,
which needs ``stages * chunks`` children, gpt-tiny's shape with 6 layers) and an MLP whose
layers differ in size. Activation recomputation (``checkpoint="always"`` / ``"except_last"``) on three
of the scenarios. Micro-batches 1, 3 and 8 (the interleaved schedule needs M a multiple
of the stages, so it runs the M of those that are).

PipeDream-2BW is checked against its own rule: ``W(t+1) = W(t) - lr * grad(W(t-1))`` with the
gradient of batch t-1 (the first update has no gradient), plain SGD.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
import torch
from _dist import guard as _guard
from _dist import run_distributed
from _dist import scenario_result as _ok
from torch import nn

from dtrain.workloads.models import build_gpt, task_loss

pytestmark = pytest.mark.procs  # every test here starts processes

# 5 steps: every path of the equality (the optimizer's state, each step's exchanges) runs from the second
# step on; the 20 this file ran before repeated them at four times the cost
STEPS = 5
BATCH = 24
LR = 0.05
TOL = 1e-5
SEQ = 8


def _mlp() -> nn.Sequential:
    """Layers of unequal size (the widest 8x the narrowest)."""
    widths = [12, 64, 8, 96, 16, 32, 8, 48, 5]  # 8 layers: 4 ranks x 2 chunks
    layers: list[tuple[str, nn.Module]] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append((f"fc{i}", nn.Sequential(nn.Linear(a, b), nn.Tanh()) if i < len(widths) - 2 else nn.Linear(a, b)))
    return nn.Sequential(OrderedDict(layers))


def _model(name: str, layers: int = 0) -> nn.Sequential:
    torch.manual_seed(11)
    if name == "mlp":
        return _mlp()
    return build_gpt("gpt-tiny", seq_len=SEQ, **({"layers": layers} if layers else {}))


def _batches(name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    if name == "mlp":
        return [(torch.randn(BATCH, 12, generator=g), torch.randint(0, 5, (BATCH,), generator=g)) for _ in range(STEPS)]
    out = []
    for _ in range(STEPS):
        t = torch.randint(0, 256, (BATCH, SEQ + 1), generator=g)
        out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
    return out


def _reference(name: str, layers: int, twobw: bool) -> dict[str, torch.Tensor]:
    """Single-process SGD on the whole batch (2bw: each update with the previous batch's gradient
    computed on the weights one version older)."""
    model = _model(name, layers)
    data = _batches(name)
    if not twobw:
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for x, y in data:
            opt.zero_grad()
            task_loss(model(x), y).backward()
            opt.step()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    prev_w: dict[str, torch.Tensor] | None = None
    for k in range(STEPS):
        cur_w = {n: p.detach().clone() for n, p in params.items()}
        if k >= 1:  # the gradient of batch k-1 on the weights its forward used (version k-1)
            assert prev_w is not None
            old = {n: w.requires_grad_() for n, w in prev_w.items()}
            out = torch.func.functional_call(model, old, (data[k - 1][0],))
            grads = torch.autograd.grad(task_loss(out, data[k - 1][1]), list(prev_w.values()))
            with torch.no_grad():
                for p, g in zip(params.values(), grads):
                    p -= LR * g
        prev_w = cur_w
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _scenarios(world: int) -> list[tuple[str, str, int, int, str]]:
    out = [("gpt", "1f1b", 3, 0, "always"), ("mlp", "gpipe", 8, 0, "except_last"), ("gpt", "2bw", 3, 0, "always")]
    for name in ("gpt", "mlp"):
        for sched in ("gpipe", "1f1b", "interleaved", "2bw"):
            for m in (1, 3, 8):
                if sched == "interleaved" and m % world:
                    continue
                layers = 6 if (name == "gpt" and sched == "interleaved") else 0
                out.append((name, sched, m, layers, "never"))
    return out


def _run_scenario(name: str, sched: str, m: int, layers: int, ckpt: str) -> float:
    from dtrain.pipeline import Pipeline

    pipe = Pipeline(_model(name, layers), microbatches=m, schedule=sched, chunks=2, checkpoint=ckpt, timeout=60)
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    losses = []
    for x, y in _batches(name):
        opt.zero_grad(set_to_none=True)
        losses.append(pipe.step(x, y))
        opt.step()
    pipe.flush()  # 2bw: the last batch's deferred backwards (its update is not taken: 20 updates as the reference)
    ref = _reference(name, layers, sched == "2bw")
    mine = pipe.state_dict()
    assert mine, "no parameters on this stage"
    peak = pipe.stats()["peak_in_flight"][pipe.stage]
    bound = {"gpipe": m, "1f1b": min(m, pipe.stages - pipe.stage), "2bw": min(m + 1, pipe.stages - pipe.stage)}
    if sched in bound:  # the micro-batches whose activations the stage holds at most
        assert peak == bound[sched], f"stage {pipe.stage}: peak {peak} micro-batches in flight, expected {bound[sched]}"
    return max(float((v - ref[k]).abs().max()) for k, v in mine.items())


def _oracle(rank: int, world: int) -> list[Any]:
    torch.manual_seed(0)
    return [(s, _guard(lambda: _run_scenario(*s))) for s in _scenarios(world)]


@pytest.mark.parametrize("world", [3, 4])
def test_pipeline_equals_single_process_training(world: int) -> None:
    results = run_distributed(_oracle, world, timeout=400)
    for rank, rows in enumerate(results):
        for scenario, r in rows:
            diff = _ok(r)
            assert diff < TOL, f"rank {rank} {scenario}: max abs diff {diff:.3g} >= {TOL}"
