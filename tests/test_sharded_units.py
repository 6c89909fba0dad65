"""ZeRO's default units on a model whose blocks sit in an ``nn.ModuleList`` (the shape of a transformers decoder):
each block is a unit, so stage 3 gathers one block at a time, not the whole decoder; a model without a list keeps
its top-level children; and stage 3 on the cut units trains as one process does (2 gloo ranks)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _dist import run_distributed
from _helpers import max_diff
from torch import nn

from dtrain.sharded._flat_units import plan_units


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class _Decoder(nn.Module):
    """A transformers-style base model: embedding, a list of blocks, a final norm, no parameters of its own."""

    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, d)
        self.layers = nn.ModuleList(_Block(d) for _ in range(n))
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


class _LM(nn.Module):
    def __init__(self, d: int = 8, n: int = 3, own: bool = False) -> None:
        super().__init__()
        self.model, self.head = _Decoder(d, n), nn.Linear(d, 16)
        if own:  # a parameter of the base model itself: it is not cut
            self.model.scale = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.model(x)
        return self.head(h * self.model.scale if hasattr(self.model, "scale") else h)


def test_a_list_of_blocks_is_cut_into_one_unit_a_block() -> None:
    names = [u.name for u in plan_units(_LM(), None, 2)]
    assert names == ["model.embed", "model.layers.0", "model.layers.1", "model.layers.2", "model.norm", "head"]
    # every parameter in exactly one unit
    units = plan_units(_LM(), None, 3)
    assert sum(u.numel for u in units) == sum(p.numel() for p in _LM().parameters())


def test_a_module_with_parameters_of_its_own_or_no_list_is_not_cut() -> None:
    assert [u.name for u in plan_units(_LM(own=True), None, 2)] == ["model", "head"]
    seq = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Linear(4, 2))
    assert [u.name for u in plan_units(seq, None, 2)] == ["0", "1", "2"]
    # a root holding only a list: its blocks, the list's name in theirs
    assert [u.name for u in plan_units(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]), None, 2)] == ["0", "1"]


def _train(rank: int, world: int) -> dict[str, Any]:
    from dtrain.sharded import ShardedDataParallel

    g = torch.Generator().manual_seed(3)
    batches = [
        (torch.randint(16, (4 * world, 5), generator=g), torch.randint(16, (4 * world, 5), generator=g))
        for _ in range(3)
    ]

    def steps(model: nn.Module, opt: torch.optim.Optimizer, data: Any) -> None:
        for x, y in data:
            opt.zero_grad()
            F.cross_entropy(model(x).reshape(-1, 16), y.reshape(-1)).backward()
            opt.step()

    torch.manual_seed(0)
    ref = _LM()
    steps(ref, torch.optim.Adam(ref.parameters(), lr=1e-2), batches)
    torch.manual_seed(0)
    dp = ShardedDataParallel(_LM(), shard="parameters")
    n = 4
    steps(
        dp,
        torch.optim.Adam(dp.parameters(), lr=1e-2),
        [(x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]) for x, y in batches],
    )
    full = dp.full_state_dict()
    out = {
        "diff": max_diff([full[k] for k in ref.state_dict()], list(ref.state_dict().values())),
        "gathered_peak": dp.memory_stats()["gathered_peak"],
        "units": [u.name for u in dp.units],
        "largest_two": 4 * sum(sorted((u.padded for u in dp.units), reverse=True)[:2]),
    }
    dp.close()
    return out


@pytest.mark.procs
def test_stage_3_on_the_cut_units_trains_as_one_process_and_gathers_a_block_at_a_time() -> None:
    res = run_distributed(_train, 2, timeout=120)
    total = 4 * sum(p.numel() for p in _LM().parameters())
    for rank, r in enumerate(res):
        assert r["units"][1] == "model.layers.0", r["units"]
        assert r["diff"] < 1e-5, f"rank {rank}: parameters differ from one process by {r['diff']:.3g}"
        # at most the unit computing and the one prefetched: below the whole model
        assert 0 < r["gathered_peak"] <= r["largest_two"] < total, (rank, r, total)


def _wrap_different(rank: int, world: int) -> dict[str, Any]:
    from dtrain.sharded import ShardedDataParallel

    out: dict[str, Any] = {}
    for shard in ("gradients", "parameters"):
        torch.manual_seed(rank)  # every rank builds other weights: wrapping takes rank 0's
        m = _LM()
        m.model.register_buffer("stat", torch.randn(3))
        m.model.frozen = nn.Parameter(torch.randn(5), requires_grad=False)  # in no unit: broadcast apart
        dp = ShardedDataParallel(m, shard=shard)
        torch.manual_seed(0)
        ref = _LM()
        ref.model.register_buffer("stat", torch.randn(3))
        ref.model.frozen = nn.Parameter(torch.randn(5), requires_grad=False)
        full = dp.full_state_dict()
        out[shard] = max_diff([full[k] for k in ref.state_dict()], list(ref.state_dict().values()))
        dp.close()
    return out


@pytest.mark.procs
def test_wrapping_takes_rank_0s_parameters_buffers_and_frozen_parameters() -> None:
    for rank, r in enumerate(run_distributed(_wrap_different, 2, timeout=120)):
        assert r == {"gradients": 0.0, "parameters": 0.0}, (rank, r)
