"""What a ZeRO-3 rank holds after its steps, counted by a census of every tensor storage the garbage collector
reaches (an instrument the engine does not control): the shards, their gradients and Adam's moments, nothing
more: no full unit's gathered parameters, no full-size gradient buffer, no scratch kept by the reduce-scatter
(2 gloo ranks)."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _dist import run_distributed
from test_sharded_units import _LM


def _storages() -> dict[int, tuple[int, tuple[int, ...]]]:
    """data pointer -> (bytes, a shape) of every storage reachable now."""
    gc.collect()
    out: dict[int, tuple[int, tuple[int, ...]]] = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and not o.is_meta:
            st = o.untyped_storage()
            if st.data_ptr():
                out[st.data_ptr()] = (st.nbytes(), tuple(o.shape))
    return out


def _census(rank: int, world: int, algorithm: str) -> dict[str, Any]:
    from dtrain.sharded import ShardedDataParallel

    before = set(_storages())  # what the process held before: not the engine's
    torch.manual_seed(0)
    dp = ShardedDataParallel(_LM(d=64, n=3), shard="parameters", algorithm=algorithm)
    opt = torch.optim.Adam(dp.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(3 + rank)
    for _ in range(2):
        x, y = torch.randint(16, (4, 5), generator=g), torch.randint(16, (4, 5), generator=g)
        opt.zero_grad()
        F.cross_entropy(dp(x).reshape(-1, 16), y.reshape(-1)).backward()
        opt.step()
    del x, y
    states: set[int] = set()
    for p in dp.parameters():
        assert p.grad is not None
        states.update(t.untyped_storage().data_ptr() for t in (p, p.grad, *opt.state[p].values()))
    states.update(b.untyped_storage().data_ptr() for b in dp.module.buffers())
    extra = [v for k, v in _storages().items() if k not in before and k not in states]
    seg_bytes = {4 * u.seg for u in dp.units}
    grad_bytes = [p.grad.untyped_storage().nbytes() for p in dp.parameters() if p.grad is not None]
    dp.close()
    return {"extra": extra, "grad_bytes": grad_bytes, "seg_bytes": seg_bytes}


@pytest.mark.procs
@pytest.mark.parametrize("algorithm", ["ring", "native"])
def test_after_its_steps_a_stage_3_rank_holds_its_model_states_and_nothing_more(algorithm: str) -> None:
    for rank, r in enumerate(run_distributed(_census, 2, algorithm, timeout=120)):
        assert r["extra"] == [], f"rank {rank} holds tensors beyond its shards, gradients and Adam state: {r['extra']}"
        # each shard's gradient is one segment of its own, not a view that keeps a unit's full buffer
        assert set(r["grad_bytes"]) <= r["seg_bytes"], (rank, r)
