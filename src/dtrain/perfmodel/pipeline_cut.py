"""The cut of a pipeline's performance model (:mod:`dtrain.perfmodel.pipeline`): which layers each virtual
stage holds, and the checks that a pipeline is one the run would accept.

:func:`stage_cut` cuts a profile as the run's ``balance`` would (the exact minimal-max partition of
:func:`dtrain.pipeline.partition.block_partition` for ``params``, ``memory`` and ``time``); a model profiled
by its pieces (:mod:`dtrain.perfmodel.pieces`) is cut between its blocks only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from dtrain.errors import ConfigError
from dtrain.pipeline.partition import SPECS, block_partition
from dtrain.pipeline.pipe import CHECKPOINTS, SCHEDULES

if TYPE_CHECKING:
    from dtrain.perfmodel.profile import ModelProfile

__all__ = ["stage_cut"]


def _check(prof: ModelProfile, stages: int, microbatches: int, schedule: str, chunks: int, checkpoint: str) -> None:
    """ConfigError saying what to change unless the arguments describe a pipeline the run would accept."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"schedule {schedule!r} is not known; choose one of: {', '.join(SCHEDULES)}")
    if checkpoint not in CHECKPOINTS:
        raise ConfigError(f"checkpoint {checkpoint!r} is not known; choose one of: {', '.join(CHECKPOINTS)}")
    if stages < 1 or microbatches < 1:
        raise ConfigError(f"stages and microbatches must be >= 1, got {stages} and {microbatches}")
    if (schedule == "interleaved") != (chunks > 1) or chunks < 1:
        raise ConfigError(f"chunks must be >= 2 for the interleaved schedule and 1 for {schedule!r}, got {chunks}")
    if schedule == "interleaved" and microbatches % stages:
        raise ConfigError(
            f"the interleaved schedule needs micro-batches a multiple of the {stages} stages, got {microbatches}"
        )
    if prof.batch % microbatches:
        raise ConfigError(f"{microbatches} micro-batches do not divide the batch of {prof.batch}")
    if len(_units(prof)) < stages * chunks:
        raise ConfigError(
            f"the model has {_what(prof)}, fewer than the {stages * chunks} virtual stages "
            f"({stages} x {chunks}); use fewer stages"
        )


def _units(prof: ModelProfile) -> list[int]:
    """Profile layers per unit a pipeline may cut between: one each, or, for a model profiled by its pieces
    (:mod:`dtrain.perfmodel.pieces`), its blocks with the prologue on the first and the epilogue on the last."""
    units = prof.extra.get("pieces", {}).get("units")
    if isinstance(units, list) and sum(units) == len(prof.layers) and all(u >= 1 for u in units):
        return [int(u) for u in units]
    return [1] * len(prof.layers)


def _what(prof: ModelProfile) -> str:
    n = len(_units(prof))
    return f"{n} blocks to cut between" if "pieces" in prof.extra else f"{n} layers"


def _per_unit(values: Sequence[float], units: Sequence[int]) -> list[float]:
    spans = _spans(units)
    return [math.fsum(values[i] for i in span) for span in spans]


def _to_layers(counts: Sequence[int], units: Sequence[int]) -> tuple[int, ...]:
    """Units per virtual stage as profile layers per virtual stage."""
    out, at = [], 0
    for n in counts:
        out.append(sum(units[at : at + n]))
        at += n
    return tuple(out)


def _checked_sizes(sizes: Sequence[int], layers: int, parts: int) -> tuple[int, ...]:
    out = tuple(sizes)
    if len(out) != parts or any(not isinstance(n, int) or n < 1 for n in out) or sum(out) != layers:
        raise ConfigError(f"sizes {list(out)} must be {parts} layer counts >= 1 summing to the model's {layers}")
    return out


def _profile_times(prof: ModelProfile) -> list[float]:
    """Forward + backward per layer from the profile alone: measured seconds, else FLOPs (same proportions)."""
    if prof.measured:
        return [ly.fwd_s + ly.bwd_s for ly in prof.layers]
    return [ly.fwd_flops + ly.bwd_flops for ly in prof.layers]


def stage_cut(prof: ModelProfile, parts: int, balance: str = "time", microbatches: int = 1) -> tuple[int, ...]:
    """Layers per virtual stage as the run's ``balance`` would cut ``prof`` into ``parts``.

    ``equal``: counts as even as possible, earlier stages get the extra; ``params``,
    ``memory`` (parameter + activation bytes at the micro-batch, ``batch / microbatches``)
    and ``time`` (forward + backward): the exact minimal-max partition; layer counts
    ``"2,3,2"``: those. For ``time`` the run measures each layer on its machine; the
    profile's measured times stand in (its FLOPs when it was not measured).

    A model profiled by its pieces is cut between its blocks only (the counts are of blocks; the result, of
    profile layers).

    Raises:
        ConfigError: too few layers, or layer counts that do not fit the model.
    """
    units = _units(prof)
    n = len(units)
    if n < parts:
        raise ConfigError(f"the model has {_what(prof)}, fewer than the {parts} virtual stages; use fewer stages")
    if balance == "equal":
        q, extra = divmod(n, parts)
        return _to_layers([q + 1] * extra + [q] * (parts - extra), units)
    if balance == "params":
        params = [float(ly.param_bytes) for ly in prof.layers]
        return _to_layers(block_partition(_per_unit(params, units), parts), units)
    if balance == "memory":
        act = [ly.param_bytes + ly.activation_bytes / microbatches for ly in prof.layers]
        return _to_layers(block_partition(_per_unit(act, units), parts), units)
    if balance == "time":
        return _to_layers(block_partition(_per_unit(_profile_times(prof), units), parts), units)
    try:
        counts = [int(p) for p in balance.split(",")]
    except ValueError:
        raise ConfigError(f"balance {balance!r}: {', '.join(SPECS)} or layer counts such as 2,3,2") from None
    return _to_layers(_checked_sizes(counts, n, parts), units)


def _spans(sizes: Sequence[int]) -> list[range]:
    out, start = [], 0
    for n in sizes:
        out.append(range(start, start + n))
        start += n
    return out


def _boundary_bytes(prof: ModelProfile, spans: list[range], microbatches: int) -> list[float]:
    """Bytes of the activation crossing each boundary: the cut layer's output at the micro-batch."""
    return [prof.layers[span[-1]].activation_bytes / microbatches for span in spans[:-1]]
