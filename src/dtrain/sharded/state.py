"""State of a sharded model and its optimizer: whole (by the unwrapped model's names) or per rank (for DCP).

* :func:`full_state_dict` / :func:`load_full_state_dict` -- the unsharded model state dict, under
  the names and shapes of the unwrapped model; loading one splits it again.
* :func:`full_optimizer_state_dict` -- what ``optimizer.state_dict()`` of an unsharded run over
  ``model.parameters()`` would hold: per-parameter state tensors gathered and cut back into the
  parameters' shapes, parameters numbered in the model's order.
* :func:`sharded_state` / :func:`load_sharded_state` -- for a distributed checkpoint: each unit's
  flat parameters and each optimizer-state tensor as a DTensor of the unit's ``L`` real elements,
  ``Shard(0)`` over the data-parallel ranks. A unit's segments are ``ceil(L / P)`` elements, the
  chunks that ``Shard(0)`` gives, so every rank writes only its own segment, and a checkpoint
  loads onto any number of ranks: DCP reshards.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from dtrain.comm.shard import segment
from dtrain.comm.waits import wait_work
from dtrain.errors import ConfigError

if TYPE_CHECKING:
    from dtrain.sharded._flat_units import Unit

__all__ = [
    "full_state_dict",
    "load_full_state_dict",
    "full_optimizer_state_dict",
    "sharded_state",
    "load_sharded_state",
    "init_optimizer_state",
    "clip_grad_norm",
    "memory_stats",
    "ShardedEngine",
]


class ShardedEngine(Protocol):
    """What these functions read and set of a :class:`~dtrain.sharded.ShardedDataParallel`.

    A protocol, so that the engine, whose methods call into this module, is the only one of the
    two that imports the other.
    """

    module: nn.Module
    stage: int
    step: int
    timeout_s: float
    _world: int
    _rank: int
    _grank: int
    _ranks: list[int]
    _ctl: Any
    _units: list[Unit]
    _shards: list[nn.Parameter | None]
    _dirty: bool
    _peak_gathered: int

    @property
    def units(self) -> list[Unit]: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def _allgather(self, flat: torch.Tensor) -> int: ...

    def _ensure_gathered(self) -> None: ...


def _flat_of(dp: ShardedEngine, u: Unit) -> torch.Tensor:
    """``u``'s whole flat parameters (a gathered copy)."""
    tmp = torch.zeros(u.padded, dtype=u.dtype(), device=u.device())
    assert u.shard is not None
    segment(tmp, dp._grank, dp._world).copy_(u.shard.detach())
    dp._allgather(tmp)
    return tmp


def full_state_dict(dp: ShardedEngine) -> dict[str, torch.Tensor]:
    """The unwrapped model's state dict, every parameter whole (a collective: every rank calls it)."""
    with torch.no_grad():
        whole: dict[str, torch.Tensor] = {}
        for u in dp.units:
            for name, v in zip(u.names, u.views(_flat_of(dp, u))):
                whole[name] = v.clone()
        out: dict[str, torch.Tensor] = {}
        by_id = {id(p): n for u in dp.units for n, p in zip(u.names, u.params)}
        for key, t in dp.module.state_dict(keep_vars=True).items():
            pname = by_id.get(id(t))
            out[key] = whole[pname] if pname is not None else t.detach().clone()
        return out


def load_full_state_dict(dp: ShardedEngine, state: dict[str, torch.Tensor]) -> None:
    """Load an unsharded state dict (the same on every rank): each rank keeps its segments.

    A parameter the model holds under several keys (tied) is one tensor: the state dict may
    list it under any of them or all, and where it lists several they must hold the same values.
    """
    by_id = {id(p): n for u in dp.units for n, p in zip(u.names, u.params)}
    keys = dp.module.state_dict(keep_vars=True)
    aliases: dict[int, list[str]] = {}
    for k, t in keys.items():
        aliases.setdefault(id(t), []).append(k)
    missing = [k for k in keys if k not in state and not any(a in state for a in aliases[id(keys[k])])]
    extra = [k for k in state if k not in keys]
    if missing or extra:
        raise ConfigError(f"the state dict does not match the model: missing {missing[:5]}, unexpected {extra[:5]}")
    name_to_key: dict[str, str] = {}
    for group in aliases.values():
        given = [k for k in group if k in state]
        for k in given[1:]:
            if not torch.equal(state[k], state[given[0]]):
                raise ConfigError(
                    f"{given[0]!r} and {k!r} are one tied parameter of the model but hold different "
                    "values in the state dict; give one of them, or the same tensor under both"
                )
        if id(keys[group[0]]) in by_id:
            name_to_key[by_id[id(keys[group[0]])]] = given[0]
    with torch.no_grad():
        for u in dp.units:
            flat = torch.zeros(u.padded, dtype=u.dtype(), device=u.device())
            for name, v in zip(u.names, u.views(flat)):
                src = state[name_to_key[name]]
                if tuple(src.shape) != tuple(v.shape):
                    raise ConfigError(
                        f"{name_to_key[name]!r} has shape {tuple(src.shape)} in the state dict, "
                        f"{tuple(v.shape)} in the model"
                    )
                v.copy_(src)
            assert u.shard is not None
            u.shard.copy_(segment(flat, dp._grank, dp._world))
            if dp.stage < 3:
                assert u.full is not None
                u.full.copy_(flat)
        for key, t in keys.items():
            if id(t) not in by_id and key in state:  # a tied buffer listed under another key is copied there
                t.copy_(state[key])


def _shard_index(dp: ShardedEngine, optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """Unit index -> the shard's position in the optimizer's state dict numbering."""
    pos: dict[int, int] = {}
    i = 0
    for g in optimizer.param_groups:
        for p in g["params"]:
            pos[id(p)] = i
            i += 1
    out = {}
    for u in dp.units:
        if id(u.shard) not in pos:
            raise ConfigError(
                f"the optimizer does not hold unit {u.name or '<root>'!r}'s shard: build it over dp.parameters()"
            )
        out[u.index] = pos[id(u.shard)]
    return out


def full_optimizer_state_dict(dp: ShardedEngine, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state an unsharded run would have (one param group), gathered (a collective)."""
    if len(optimizer.param_groups) != 1:
        raise ConfigError(
            "full_optimizer_state_dict supports one param group over dp.parameters(); "
            f"this optimizer has {len(optimizer.param_groups)}"
        )
    osd = optimizer.state_dict()
    idx = _shard_index(dp, optimizer)
    order = [n for n, p in dp.module.named_parameters() if p.requires_grad]
    number = {n: i for i, n in enumerate(order)}
    state: dict[int, dict[str, Any]] = {}
    for u in dp.units:
        st = osd["state"].get(idx[u.index], {})
        per: list[dict[str, Any]] = [{} for _ in u.names]
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == u.seg:
                flat = torch.zeros(u.padded, dtype=v.dtype, device=v.device)
                segment(flat, dp._grank, dp._world).copy_(v)
                dp._allgather(flat)
                for d, view in zip(per, u.views(flat)):
                    d[k] = view.clone()
            else:
                for d in per:
                    d[k] = v.clone() if isinstance(v, torch.Tensor) else v
        for name, d in zip(u.names, per):
            if d:
                state[number[name]] = d
    group = {k: v for k, v in osd["param_groups"][0].items() if k != "params"}
    group["params"] = list(range(len(order)))
    return {"state": dict(sorted(state.items())), "param_groups": [group]}


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create an optimizer's lazily built state (a step with zero gradients and zero learning rate)."""
    if optimizer.state:
        return
    kept = []
    for g in optimizer.param_groups:
        kept.append(g["lr"])
        g["lr"] = 0.0
        for p in g["params"]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, kept):
        g["lr"] = lr
        for p in g["params"]:
            p.grad = None


def _mesh(dp: ShardedEngine) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    device = "cuda" if dp.units[0].device().type == "cuda" else "cpu"
    return DeviceMesh(device, torch.tensor(dp._ranks))


def _dtensor(mesh: Any, u: Unit, local: torch.Tensor, rank: int) -> Any:
    from torch.distributed.tensor import DTensor, Shard

    a, b = u.own_range(rank)
    return DTensor.from_local(
        local[: b - a], mesh, [Shard(0)], run_check=False, shape=torch.Size((u.numel,)), stride=(1,)
    )


def sharded_state(dp: ShardedEngine, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """This rank's part of a checkpoint, as DTensors DCP can reshard: ``{"model": ..., "optim": ...}``."""
    mesh = _mesh(dp)
    model = {
        f"{u.name or '<root>'}.flat": _dtensor(mesh, u, u.shard.detach(), dp._grank)  # type: ignore[union-attr]
        for u in dp.units
    }
    out: dict[str, Any] = {"model": model}
    if optimizer is not None:
        init_optimizer_state(optimizer)
        idx = _shard_index(dp, optimizer)
        optim: dict[str, Any] = {}
        for u in dp.units:
            assert u.shard is not None
            for k, v in optimizer.state[u.shard].items():
                key = f"{u.name or '<root>'}.{k}"
                if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == u.seg:
                    optim[key] = _dtensor(mesh, u, v, dp._grank)
                else:
                    optim[key] = v.clone() if isinstance(v, torch.Tensor) else torch.tensor(v)
        del idx
        out["optim"] = optim
    return out


def load_sharded_state(dp: ShardedEngine, optimizer: torch.optim.Optimizer | None, loaded: dict[str, Any]) -> None:
    """Copy what DCP loaded into :func:`sharded_state`'s DTensors back into the shards and optimizer state."""
    with torch.no_grad():
        for u in dp.units:
            assert u.shard is not None
            # the template's local tensors may be views of the shard itself (DCP loads in place): copy first
            local = loaded["model"][f"{u.name or '<root>'}.flat"].to_local().clone()
            u.shard.zero_()
            u.shard[: local.numel()].copy_(local)
            if optimizer is None:
                continue
            for k, v in optimizer.state[u.shard].items():
                got = loaded["optim"][f"{u.name or '<root>'}.{k}"]
                if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == u.seg:
                    part = got.to_local().clone()
                    v.zero_()
                    v[: part.numel()].copy_(part)
                elif isinstance(v, torch.Tensor):
                    v.copy_(got)
                else:
                    optimizer.state[u.shard][k] = type(v)(got.item())
        if dp.stage < 3:
            dp._dirty = True
            dp._ensure_gathered()


def clip_grad_norm(dp: ShardedEngine, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """:meth:`ShardedDataParallel.clip_grad_norm_`: torch's rule on the global norm of every rank's shards."""
    grads = [p.grad for p in dp._shards if p is not None and p.grad is not None]
    inf = math.isinf(norm_type)
    if inf:
        local = torch.stack([g.abs().max() for g in grads]).max() if grads else torch.zeros(())
    else:
        local = sum((g.double().abs().pow(norm_type).sum() for g in grads), torch.zeros((), dtype=torch.float64))
    total = local.double().reshape(1)
    if dp._world > 1:
        op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
        wait_work(
            dist.all_reduce(total, op=op, group=dp._ctl, async_op=True),
            dp.timeout_s,
            dp._rank,
            "ShardedDataParallel clip_grad_norm_ allreduce",
            dp.step,
        )
    norm = total[0] if inf else total[0].pow(1.0 / norm_type)
    norm32 = norm.float()
    coef = torch.clamp(max_norm / (norm32 + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return norm32


def memory_stats(dp: ShardedEngine, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """:meth:`ShardedDataParallel.memory_stats`: bytes held now by kind, each storage counted once."""
    seen: set[int] = set()

    def size(ts: Any) -> int:
        n = 0
        for t in ts:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            if st.data_ptr() in seen or st.nbytes() == 0:
                continue
            seen.add(st.data_ptr())
            n += st.nbytes()
        return n

    params = size([*(u.full for u in dp._units), *dp._shards])
    grads = size([*(u.gbuf for u in dp._units), *(p.grad for p in dp._shards if p is not None)])
    opt = 0
    if optimizer is not None:
        opt = size([v for s in optimizer.state.values() for v in s.values()])
    return {"params": params, "grads": grads, "optimizer": opt, "gathered_peak": dp._peak_gathered}
