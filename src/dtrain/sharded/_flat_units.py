"""Units: the groups of parameters that a sharded engine flattens, shards, gathers and reduces together.

A unit is a submodule (a block of ``gpt``, a child of a Sequential, a decoder layer of a
transformers model, or one the user names) with every parameter it holds that no earlier unit took; what no unit takes
(parameters of the root or of modules left out) forms the root unit, unit 0. A parameter
that several modules hold (an embedding tied to the LM head) is one tensor and goes to one
unit: the innermost unit whose module holds every one of its users, else the root unit, which
stage 3 keeps gathered through the whole forward and backward; so no user runs while its
unit's storage is freed, and it is sharded, gathered and reduced once. Each unit
owns one flat buffer of ``P * s`` elements (its ``L`` parameter elements, padded to
a multiple of the world size ``P``) whose views are the module's parameters, so a
whole unit travels as one message per ring step; rank ``r`` owns segment ``r`` of
it (``s = ceil(L / P)`` elements, the last ones padding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dtrain.comm.shard import segment
from dtrain.errors import ConfigError

__all__ = ["Unit", "plan_units"]


@dataclass
class Unit:
    """One flattened group of parameters.

    Attributes:
        index: position in module order.
        name: the submodule's qualified name ("" for the root unit).
        module: the submodule whose forward uses the parameters (the root module for the root unit).
        names: qualified names of the parameters (as in the unwrapped model's ``named_parameters``).
        params: the parameters, in that order.
        offsets: where each starts in the flat buffer.
        numel: elements of the parameters together (``L``).
        seg: elements of each rank's segment (``s``).
        world: ranks (``P``).
    """

    index: int
    name: str
    module: nn.Module
    names: list[str]
    params: list[nn.Parameter]
    offsets: list[int] = field(default_factory=list)
    numel: int = 0
    seg: int = 0
    world: int = 1
    # run-time state, owned by the engine
    full: torch.Tensor | None = None  # the gathered flat parameters (stage 3: storage freed between uses)
    shard: nn.Parameter | None = None  # this rank's segment: what the optimizer steps
    gbuf: torch.Tensor | None = None  # the unsharded flat gradient of the current accumulation window
    gviews: list[torch.Tensor] = field(default_factory=list)
    reduced: torch.Tensor | None = None  # stages 2-3: this rank's reduced segment, until handed to shard.grad
    stash: torch.Tensor | None = None  # stage 1: a shard gradient the user kept across a step (accumulated)
    gjob: Any = None  # the allgather in flight
    gathered: bool = True
    fresh: bool = True  # the next gradient starts a new accumulation window
    arrived: int = 0
    ready: bool = False
    bw_prepared: bool = False

    def layout(self, world: int) -> None:
        self.world = world
        off = 0
        self.offsets = []
        for p in self.params:
            self.offsets.append(off)
            off += p.numel()
        self.numel = off
        self.seg = -(-off // world)

    @property
    def padded(self) -> int:
        return self.seg * self.world

    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    def device(self) -> torch.device:
        return self.params[0].device

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's view into a flat buffer of this unit."""
        return [flat[o : o + p.numel()].view(p.shape) for o, p in zip(self.offsets, self.params)]

    def own_range(self, rank: int) -> tuple[int, int]:
        """The unpadded part of ``rank``'s segment: ``[start, end)`` within the ``L`` real elements."""
        a = min(rank * self.seg, self.numel)
        return a, min((rank + 1) * self.seg, self.numel)

    def open_window(self, rank: int, world: int) -> None:
        """Stage 1: a new accumulation window in the kept buffer; a shard gradient the user kept is stashed."""
        assert self.gbuf is not None and self.shard is not None
        own = segment(self.gbuf, rank, world)
        if self.shard.grad is not None and self.shard.grad.data_ptr() == own.data_ptr():
            self.stash = own.clone()
        self.gbuf.zero_()

    def hand_over(self, stage: int, rank: int, world: int) -> None:
        """The reduced segment becomes the shard's ``.grad``, or is added to the one the user kept."""
        shard = self.shard
        assert shard is not None
        if stage == 1:
            assert self.gbuf is not None
            own = segment(self.gbuf, rank, world)
            if self.stash is not None:
                own.add_(self.stash)
                self.stash = None
            if shard.grad is None:
                shard.grad = own
            elif shard.grad.data_ptr() != own.data_ptr():
                shard.grad.add_(own)
            return
        red, self.reduced = self.reduced, None
        assert red is not None
        if shard.grad is None:
            shard.grad = red
        else:
            shard.grad.add_(red)


def _holders(m: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
    """``m``'s children that hold parameters, by qualified name."""
    return [(prefix + n, c) for n, c in m.named_children() if any(True for _ in c.parameters())]


def _cut_at_lists(name: str, m: nn.Module) -> list[tuple[str, nn.Module]]:
    """``m`` as one unit, or, where a ``nn.ModuleList`` of blocks lies below it (a transformers model's decoder
    layers), cut down to that list: each block of the list one unit, each other child holding parameters on
    the way one unit (cut the same way). A module with parameters of its own is not cut, nor is a block."""
    if any(True for _ in m.parameters(recurse=False)):
        return [(name, m)]
    if not any(isinstance(d, nn.ModuleList) for d in m.modules()):
        return [(name, m)]
    if isinstance(m, nn.ModuleList):
        return _holders(m, f"{name}.")
    return [piece for n, c in _holders(m, f"{name}.") for piece in _cut_at_lists(n, c)]


def _default_units(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Top-level children that hold parameters (a root with one such child and none of its own is descended),
    each cut at the list of blocks below it, if any (:func:`_cut_at_lists`): ``embed``, ``block0``.. of
    ``gpt``; ``model.embed_tokens``, ``model.layers.0``.., ``model.norm``, ``lm_head`` of a transformers Llama
    (its whole decoder as one unit would be gathered whole at stage 3)."""
    prefix, m = "", module
    while True:
        kids = _holders(m, prefix)
        own = any(True for _ in m.parameters(recurse=False))
        if len(kids) == 1 and not own:
            prefix = f"{kids[0][0]}."
            m = kids[0][1]
            continue
        return [piece for n, c in kids for piece in _cut_at_lists(n, c)]


def _homes_of_shared(module: nn.Module, quals: Sequence[str]) -> dict[int, int]:
    """``id(p) -> index in quals`` (or -1, the root unit) for each parameter held under several names.

    Its home is the innermost unit module that contains every module holding it (the
    holders' common prefix of qualified names); a parameter held once is left to the usual
    first-come rule.
    """
    holders: dict[int, list[list[str]]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        holders.setdefault(id(p), []).append(name.split(".")[:-1])
    home: dict[int, int] = {}
    for pid, paths in holders.items():
        if len(paths) < 2:
            continue
        common = paths[0]
        for path in paths[1:]:
            k = 0
            while k < min(len(common), len(path)) and common[k] == path[k]:
                k += 1
            common = common[:k]
        best, depth = -1, -1
        for i, q in enumerate(quals):
            parts = q.split(".") if q else []
            if len(parts) > depth and common[: len(parts)] == parts:
                best, depth = i, len(parts)
        home[pid] = best
    return home


def plan_units(module: nn.Module, units: Sequence[str] | None, world: int) -> list[Unit]:
    """Cut ``module``'s trainable parameters into units (see the module docstring).

    Args:
        module: the model.
        units: qualified submodule names, or None for the default (top-level children holding parameters).
        world: ranks the units are sharded over.

    Raises:
        ConfigError: a named unit does not exist, or a unit mixes dtypes or devices.
    """
    mods = dict(module.named_modules())
    if units is None:
        chosen = _default_units(module)
    else:
        missing = [u for u in units if u not in mods]
        if missing:
            raise ConfigError(
                f"units name module(s) that the model does not have: {', '.join(map(repr, missing))} "
                f"(some it has: {', '.join(repr(n) for n in list(mods)[1:6])})"
            )
        chosen = [(u, mods[u]) for u in units]
    names_of = {id(p): n for n, p in module.named_parameters()}
    home = _homes_of_shared(module, [q for q, _ in chosen])
    taken: set[int] = set()
    out: list[Unit] = []
    for i, (qual, m) in enumerate(chosen):
        ps = [p for p in m.parameters() if p.requires_grad and id(p) not in taken and home.get(id(p), i) == i]
        if not ps:
            continue
        taken.update(id(p) for p in ps)
        out.append(Unit(len(out), qual, m, [names_of[id(p)] for p in ps], ps))
    rest = [p for p in module.parameters() if p.requires_grad and id(p) not in taken]
    if rest:  # first: parameters of the root are mostly used first (an embedding), so their gradients come last
        out.insert(0, Unit(0, "", module, [names_of[id(p)] for p in rest], rest))
        for i, u in enumerate(out):
            u.index = i
    if not out:
        raise ConfigError("the module has no trainable parameters (requires_grad=True); nothing to train")
    for u in out:
        kinds = {(p.dtype, p.device) for p in u.params}
        if len(kinds) > 1:
            raise ConfigError(
                f"unit {u.name or '<root>'!r} mixes parameter dtypes/devices {sorted(map(str, kinds))}; "
                "a sharded unit is one flat buffer: cast the model to one dtype first"
            )
        u.layout(world)
    return out
