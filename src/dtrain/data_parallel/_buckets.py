"""Gradient buckets: flat buffers whose views are the parameters' ``.grad``.

Each bucket owns one preallocated flat tensor (:class:`~dtrain.comm.fusion.FlatBuffer`);
the ``.grad`` of each member parameter is a view into it. Backward accumulates
straight into the bucket, the allreduce runs on the flat tensor in place, and the
optimizer reads the averaged views: no copies on the steady path (DDP's
``gradient_as_bucket_view``). A ``.grad`` that was replaced (``zero_grad()`` sets
it to ``None``, autograd then allocates a new tensor) is copied into its view
once and the view put back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dtrain.comm.fusion import FlatBuffer, assign_buckets

__all__ = ["Bucket", "build_buckets"]


class Bucket:
    """One fused group of gradients.

    Attributes:
        index: position in launch order (the order backward fills buckets).
        members: indices of the member parameters (registration order numbering).
        buffer: the flat storage; ``buffer.views[k]`` is member ``k``'s gradient.
        priority: smallest member index; lower means nearer the model's input,
            i.e. needed earlier by the next forward.
        key: names the bucket for per-bucket compressor state.
        shapes: the members' shapes, in packing order (PowerSGD factors each matrix).
        pending: members whose gradient has not arrived in this backward.
        ready: all members arrived (this backward).
    """

    __slots__ = ("index", "members", "buffer", "priority", "key", "shapes", "pending", "ready")

    def __init__(self, index: int, members: list[int], buffer: FlatBuffer, key: str) -> None:
        self.index = index
        self.members = members
        self.buffer = buffer
        self.priority = min(members)
        self.key = key
        self.shapes = tuple(tuple(v.shape) for v in buffer.views)
        self.pending = len(members)
        self.ready = False

    @property
    def flat(self) -> torch.Tensor:
        return self.buffer.flat

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    def reset(self) -> None:
        self.pending = len(self.members)
        self.ready = False

    def __repr__(self) -> str:
        return f"Bucket({self.index}, members={self.members}, {self.nbytes} bytes)"


def build_buckets(
    params: Sequence[torch.Tensor],
    order: Sequence[int],
    *,
    cap_bytes: int,
    first_cap_bytes: int,
    version: int = 0,
) -> list[Bucket]:
    """Fuse ``params`` (taken in ``order``) into buckets with zeroed flat buffers.

    Parameters of different device or dtype never share a bucket. Costs one
    allocation per bucket, done once (and once more if the order is rebuilt).

    Args:
        params: the trainable parameters, indexed as ``order`` refers to them.
        order: the order gradients are expected in (first produced first).
        cap_bytes: bucket size (see :func:`~dtrain.comm.fusion.assign_buckets`).
        first_cap_bytes: size of the first bucket.
        version: layout generation, part of each bucket's key.
    """
    order = list(order)
    if sorted(order) != list(range(len(params))):
        raise ValueError(f"order must be a permutation of 0..{len(params) - 1}")
    sizes = [params[i].numel() * params[i].element_size() for i in order]
    keys = [(params[i].device, params[i].dtype) for i in order]
    out: list[Bucket] = []
    for b, grp in enumerate(assign_buckets(sizes, keys, cap_bytes=cap_bytes, first_cap_bytes=first_cap_bytes)):
        members = [order[j] for j in grp]
        p0 = params[members[0]]
        buf = FlatBuffer([params[i].shape for i in members], p0.dtype, p0.device)
        out.append(Bucket(b, members, buf, key=f"dp.v{version}.bucket{b}"))
    return out
