"""Scale groups of the quantizers: which elements share one scale (private).

A quantizer sends one (or two) fp32 scales per *group* of elements. Without a
layout a flat tensor of ``n`` elements is cut into groups of ``block`` consecutive
elements, the last one short. With a layout (the shapes of the tensors packed back
to back in a bucket or a parameter-server shard) groups never cross a tensor's
boundary, so a layer with small gradients is not scaled by its neighbour's large
ones, and they follow rows:

* a tensor of ``ndim >= 2`` has rows of ``L = numel / shape[0]`` elements (one row
  per output unit: the fan-in of a linear or convolution weight); a 1-D tensor is
  one row;
* rows shorter than ``block`` are grouped ``block // L`` whole rows at a time;
* rows longer than ``block`` are cut into pieces of ``block``, the last piece short.

So a group holds at most ``block`` elements, and there are at most ``2 n / block``
groups plus one per tensor and one per long row: on the default CNN 1.1 times
as many as plain blocks of ``block`` (82 instead of 75 for its 38,282 elements).

A *segment* is ``(length, row, phase)``: ``length`` elements of one tensor whose
rows have ``row`` elements, starting ``phase`` elements into the tensor. A slice of
a bucket (DataParallel's reduce-scatter cuts buckets anywhere) is a list of
segments; the groups of a slice are those of its tensors, cut at the slice's ends.
Segments travel with the payload as an ``int32`` table of three numbers each, so a
receiver needs neither the layout nor the slice.

Cost: building the group index is ``O(n)`` and cached per (segments, block).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

__all__ = ["Segments", "whole", "segments_of", "group_index", "to_table", "from_table"]

#: ``((length, row, phase), ...)``
Segments = tuple[tuple[int, int, int], ...]


def whole(n: int) -> Segments:
    """One flat tensor of ``n`` elements: groups of ``block`` consecutive elements."""
    return ((n, n, 0),) if n else ()


def segments_of(shapes: Sequence[Sequence[int]], offset: int = 0, length: int | None = None) -> Segments:
    """The segments of elements ``[offset, offset + length)`` of tensors of ``shapes`` packed back to back.

    Raises:
        ValueError: the slice reaches past the tensors' end.
    """
    sizes = [math.prod(int(d) for d in s) for s in shapes]
    total = sum(sizes)
    end = total if length is None else offset + length
    if offset < 0 or end > total or end < offset:
        raise ValueError(f"slice [{offset}, {end}) is outside the {total} elements the shapes describe")
    out: list[tuple[int, int, int]] = []
    start = 0
    for shape, size in zip(shapes, sizes):
        lo, hi = max(offset, start), min(end, start + size)
        if hi > lo:
            row = size // int(shape[0]) if len(shape) >= 2 and int(shape[0]) > 0 else size
            out.append((hi - lo, row, lo - start))
        start += size
    return tuple(out)


def _starts(seg: tuple[int, int, int], block: int) -> list[int]:
    """Offsets (within the segment) where a new group starts; the first is always 0."""
    length, row, phase = seg
    if row <= block:
        period = (block // row) * row
        first = -(phase % period)
        return [0] + [s for s in range(first + period, length, period)]
    # long rows: pieces of `block` from each row's start
    starts = [0]
    row0 = phase - phase % row  # start of the row the segment begins in (tensor coordinates)
    r = row0
    while r < phase + length:
        for p in range(r, min(r + row, phase + length), block):
            if p > phase:
                starts.append(p - phase)
        r += row
    return starts


@functools.lru_cache(maxsize=256)
def group_index(segments: Segments, block: int) -> tuple[torch.Tensor, int]:
    """``(ids, count)``: the group of each element (int64, non-decreasing) and the number of groups."""
    marks: list[int] = []
    off = 0
    for seg in segments:
        marks += [off + s for s in _starts(seg, block)]
        off += seg[0]
    if off == 0:
        return torch.zeros(0, dtype=torch.int64), 0
    flag = torch.zeros(off, dtype=torch.int64)
    flag[torch.tensor(marks, dtype=torch.int64)] = 1
    ids = torch.cumsum(flag, 0) - 1
    return ids, len(marks)


def to_table(segments: Segments) -> torch.Tensor:
    """The ``int32`` table that travels with a payload: three numbers per segment."""
    if any(v > 2**31 - 1 for seg in segments for v in seg):
        raise ValueError("a segment over 2**31-1 elements does not fit the int32 table")
    return torch.tensor([v for seg in segments for v in seg], dtype=torch.int32)


def from_table(table: torch.Tensor, n: int) -> Segments:
    """Inverse of :func:`to_table`; checks the segments cover ``n`` elements."""
    vals = [int(v) for v in table.tolist()]
    if len(vals) % 3:
        raise ValueError(f"corrupt layout table: {len(vals)} numbers, not a multiple of 3")
    segs = tuple((vals[i], vals[i + 1], vals[i + 2]) for i in range(0, len(vals), 3))
    if sum(s[0] for s in segs) != n or any(s[0] <= 0 or s[1] <= 0 or s[2] < 0 for s in segs):
        raise ValueError(f"corrupt layout table {segs} for {n} elements")
    return segs
