"""The backend's own allreduce as a registry entry (:func:`native`), charged what an unpipelined ring sends."""

from __future__ import annotations

import datetime

import torch

from dtrain.comm import cost as _cost
from dtrain.comm._kernel import AllreduceOptions, algorithm
from dtrain.comm.transport import TorchTransport, Transport
from dtrain.errors import CommError, CommTimeoutError, ConfigError

__all__ = ["native"]


@algorithm("native")
def native(t: Transport, flat: torch.Tensor, op: str, opts: AllreduceOptions) -> None:
    """The backend's own ``torch.distributed.all_reduce`` on the transport's group.

    ``avg`` is reduced as a sum and divided afterwards (gloo has no integer
    average). gloo and NCCL do not report what they send; ``stats`` is charged what
    an unpipelined ring sends (``2(P-1)`` messages, ``2(P-1)/P·n`` bytes), which is
    the algorithm gloo's and NCCL's default allreduce use for large tensors.
    Needs a :class:`TorchTransport`.
    """
    if not isinstance(t, TorchTransport):
        raise ConfigError(
            f"algorithm 'native' runs the backend's own allreduce and needs a TorchTransport, got {type(t).__name__}"
        )
    import torch.distributed as dist

    red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    try:
        work = dist.all_reduce(flat, op=red, group=t.group, async_op=True)
        ok = work.wait(timeout=datetime.timedelta(seconds=t.timeout))
    except RuntimeError as e:
        msg = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        cls = CommTimeoutError if "imeout" in msg or "timed out" in msg else CommError
        raise cls(t.rank, "allreduce(native)", msg) from e
    if ok is False:
        raise CommTimeoutError(t.rank, "allreduce(native)", f"not completed within {t.timeout:.0f}s")
    traffic = _cost.native_traffic(t.world_size, flat.numel(), flat.element_size())
    t.stats.messages += traffic.messages[t.rank]
    t.stats.bytes_sent += traffic.bytes_sent[t.rank]
