"""What :class:`~dtrain.decentralized.LocalSGD`, :class:`~dtrain.decentralized.EASGD` and
:class:`~dtrain.decentralized.Gossip` share: a wrapper around the replica a worker trains.

Every worker holds its own replica and steps its own optimizer; ``wrapper.step()``,
called after ``optimizer.step()``, mixes the replicas when the wrapper's rule says so.
The base class does what all three need:

* at wrap time the replicas start equal (rank 0's parameters and buffers, broadcast);
* ``forward`` is the replica's;
* :meth:`consensus_distance` (collective): ``sqrt(1/n sum_i ||x_i - mean||^2)`` over the
  flattened trainable parameters, the spread that the averaging rule shrinks;
* :meth:`averaged_state_dict` (collective): the state dict of the replicas' average
  (floating parameters and buffers averaged, others rank 0's), the model a run evaluates;
* :meth:`stats`: averaging rounds and this rank's bytes and messages sent by the wrapper.

Collectives go through dtrain's own transport (:func:`dtrain.comm.get_transport`), so
their bytes are counted like every other strategy's.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtrain.comm.allreduce import allreduce_over, get_transport
from dtrain.comm.replicas import broadcast_tensors
from dtrain.comm.transport import DEFAULT_TIMEOUT_S, CommStats, Transport
from dtrain.errors import ConfigError

__all__ = ["ReplicaWrapper", "flatten_params", "assign_flat"]


def flatten_params(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous float copy of ``params`` (detached)."""
    return torch.cat([p.detach().reshape(-1) for p in params]) if params else torch.zeros(0)


def assign_flat(params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy ``flat`` back into ``params`` (in place, in order)."""
    off = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.copy_(flat[off : off + n].view_as(p))
            off += n


class ReplicaWrapper(nn.Module, abc.ABC):
    """Base of the decentralized wrappers (see the module docstring).

    Args:
        module: this worker's replica (the same architecture on every rank).
        group: the process group of the workers that mix (default: the default group).
        algorithm: dtrain allreduce algorithm for the wrapper's averaging collectives.
        timeout: seconds any wait may block before a CommTimeoutError naming rank and operation.
    """

    def __init__(
        self, module: nn.Module, *, group: Any = None, algorithm: str = "ring", timeout: float | None = None
    ) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise ConfigError(f"{type(self).__name__} needs torch.distributed initialized (call dtrain.init() first)")
        self.module = module
        self.group = group
        self.algorithm = algorithm
        self.timeout_s = float(timeout if timeout is not None else DEFAULT_TIMEOUT_S)
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.global_rank = dist.get_rank()
        self.transport: Transport = get_transport(group, self.timeout_s)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.steps = 0
        self.rounds = 0
        self._sent = CommStats()
        src = dist.get_global_rank(group, 0) if group is not None else 0
        tensors = [p.data for p in module.parameters()] + [b for b in module.buffers()]
        broadcast_tensors(
            tensors,
            src=src,
            group=group,
            rank=self.global_rank,
            cap_bytes=25 << 20,
            timeout_s=self.timeout_s,
            op=f"{type(self).__name__} initial broadcast",
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @abc.abstractmethod
    def step(self) -> None:
        """Called after ``optimizer.step()``: mix the replicas when the wrapper's rule says so."""

    # -- what the subclasses use ---------------------------------------------------------
    def _allreduce(self, t: torch.Tensor, op: str = "avg", transport: Transport | None = None) -> torch.Tensor:
        """dtrain allreduce of ``t`` in place, its bytes counted in :meth:`stats`."""
        tr = transport or self.transport
        before = tr.stats.snapshot()
        allreduce_over(tr, t, op, self.algorithm)
        self.count_sent(tr.stats.snapshot() - before)
        return t

    def count_sent(self, delta: CommStats) -> None:
        """Add ``delta`` (a transport's counters after minus before) to :meth:`stats`."""
        self._sent = CommStats(self._sent.messages + delta.messages, self._sent.bytes_sent + delta.bytes_sent)

    # -- collectives every wrapper offers --------------------------------------------------
    def consensus_distance(self) -> float:
        """``sqrt(1/n sum_i ||x_i - mean||^2)`` over the workers (collective; every rank gets it)."""
        x = flatten_params(self.params).double()
        mean = x.clone()
        allreduce_over(self.transport, mean, "avg", self.algorithm)
        sq = torch.tensor([float(((x - mean) ** 2).sum())], dtype=torch.float64)
        allreduce_over(self.transport, sq, "avg", self.algorithm)
        return math.sqrt(max(0.0, float(sq.item())))

    def averaged_state_dict(self) -> dict[str, torch.Tensor]:
        """The replicas' average as a state dict of ``module`` (collective): floating entries averaged,
        one allreduce per dtype over the entries flattened end to end.

        A tensor the state dict lists under several keys (a parameter tied between two modules)
        is averaged once, and its keys share the one result, as they share one tensor in the module."""
        own = self.module.state_dict(keep_vars=True)
        first: dict[int, str] = {}  # id of a tensor -> the first key that lists it
        for k, t in own.items():
            first.setdefault(id(t), k)
        out = {k: own[k].detach().clone() for k in first.values()}
        by_dtype: dict[torch.dtype, list[str]] = {}
        for k, t in out.items():
            if t.is_floating_point():
                by_dtype.setdefault(t.dtype, []).append(k)
        for keys in by_dtype.values():
            flat = torch.cat([out[k].reshape(-1) for k in keys])
            allreduce_over(self.transport, flat, "avg", self.algorithm)
            off = 0
            for k in keys:
                n = out[k].numel()
                out[k] = flat[off : off + n].view_as(out[k]).clone()
                off += n
        return {k: out[first[id(t)]] for k, t in own.items()}

    def stats(self) -> dict[str, Any]:
        """``rounds`` of mixing so far, ``bytes_sent`` and ``messages`` by this rank for them."""
        return {
            "steps": self.steps,
            "rounds": self.rounds,
            "bytes_sent": self._sent.bytes_sent,
            "messages": self._sent.messages,
        }

    def close(self) -> None:
        """Release what the wrapper holds (background threads of a subclass); idempotent."""
        return None

    def wrapper_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the wrapper beyond the replica and its optimizer (the step
        counters; a subclass adds its own, e.g. EASGD's centre)."""
        return {"steps": self.steps, "rounds": self.rounds}

    def load_wrapper_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`wrapper_state` (a resumed run continues the averaging schedule)."""
        self.steps, self.rounds = int(state["steps"]), int(state["rounds"])

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.load_state_dict(*args, **kwargs)
