"""Tensor fusion: pack many small tensors into a few flat buckets.

Collectives pay a latency ``alpha`` per message, so reducing a model's gradients
one tensor at a time costs ``k * alpha`` for ``k`` tensors. Fusion (Horovod's
"tensor fusion", DDP's gradient buckets; Sergeev & Del Balso, "Horovod: fast and
easy distributed deep learning in TensorFlow", arXiv 1802.05799) packs tensors
into buckets of about ``cap`` bytes and reduces each bucket as one message: the
latency term drops to ``ceil(n / cap) * alpha`` while the bandwidth term is
unchanged. Buckets stay small enough that the first one can start before the
whole backward pass has finished, which is what lets communication overlap
computation.

Three pieces, all pure torch (no communication here):

* :func:`assign_buckets` -- which tensors go together, in a given order;
* :class:`FlatBuffer` -- one flat tensor and a view of it per member tensor;
* :func:`flatten` / :func:`unflatten_into` -- one-shot packing (broadcasts).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

__all__ = ["assign_buckets", "FlatBuffer", "flatten", "unflatten_into", "MB"]

MB = 1024 * 1024


def assign_buckets(
    sizes: Sequence[int],
    keys: Sequence[Hashable] | None = None,
    *,
    cap_bytes: int,
    first_cap_bytes: int | None = None,
) -> list[list[int]]:
    """Group tensor indices into buckets, keeping the order they are given in.

    Steps:
        1. Walk the tensors in the given order (for gradients: the order backward
           produces them). Each key (e.g. ``(device, dtype)``) has one open bucket.
        2. Append the tensor to its key's open bucket; once the bucket holds at
           least its cap, close it. The first bucket of each key uses
           ``first_cap_bytes`` (a small first bucket starts communicating early).
        3. Close the remaining open buckets; order buckets by their first tensor.

    A bucket may exceed its cap by one tensor, and a tensor larger than the cap
    gets a bucket of its own. Cost: O(number of tensors).

    Args:
        sizes: bytes of each tensor.
        keys: tensors of different keys never share a bucket (default: one key).
        cap_bytes: bucket size at which a bucket closes (> 0).
        first_cap_bytes: cap of the first bucket of each key (default: ``cap_bytes``).

    Returns:
        Buckets as lists of indices into ``sizes``, each in the given order.
    """
    if cap_bytes <= 0:
        raise ValueError(f"cap_bytes must be > 0, got {cap_bytes}")
    first = cap_bytes if first_cap_bytes is None else first_cap_bytes
    if first <= 0:
        raise ValueError(f"first_cap_bytes must be > 0, got {first_cap_bytes}")
    keys = list(keys) if keys is not None else [None] * len(sizes)
    if len(keys) != len(sizes):
        raise ValueError(f"got {len(sizes)} sizes but {len(keys)} keys")
    open_: dict[Hashable, tuple[list[int], int]] = {}  # key -> (indices, bytes)
    closed_count: dict[Hashable, int] = {}
    done: list[list[int]] = []
    for i, (size, key) in enumerate(zip(sizes, keys)):
        idx, total = open_.get(key, ([], 0))
        idx.append(i)
        total += int(size)
        cap = first if closed_count.get(key, 0) == 0 else cap_bytes
        if total >= cap:
            done.append(idx)
            closed_count[key] = closed_count.get(key, 0) + 1
            open_.pop(key, None)
        else:
            open_[key] = (idx, total)
    done.extend(idx for idx, _ in open_.values())
    done.sort(key=lambda b: b[0])
    return done


class FlatBuffer:
    """A contiguous 1-D tensor holding several tensors back to back, with a view of each.

    Writing a view writes the buffer, so a collective on :attr:`flat` reduces
    every member at once without copies.

    Args:
        shapes: shapes of the member tensors, in packing order.
        dtype: element type (all members share it).
        device: where the buffer lives.
    """

    def __init__(self, shapes: Sequence[torch.Size], dtype: torch.dtype, device: torch.device) -> None:
        numels = [int(torch.Size(s).numel()) for s in shapes]
        self.offsets: list[int] = []
        o = 0
        for n in numels:
            self.offsets.append(o)
            o += n
        self.numel = o
        self.flat = torch.zeros(o, dtype=dtype, device=device)
        self.views: list[torch.Tensor] = [
            self.flat[off : off + n].view(s) for off, n, s in zip(self.offsets, numels, shapes)
        ]

    @property
    def nbytes(self) -> int:
        return self.numel * self.flat.element_size()


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate tensors (same dtype and device) into a new 1-D tensor."""
    if not tensors:
        raise ValueError("flatten needs at least one tensor")
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` back into ``tensors`` (in place, outside autograd)."""
    o = 0
    for t in tensors:
        n = t.numel()
        t.detach().copy_(flat[o : o + n].view_as(t))
        o += n
    if o != flat.numel():
        raise ValueError(f"flat tensor has {flat.numel()} elements but the tensors hold {o}")
