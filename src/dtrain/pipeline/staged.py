"""The stages of a model that is not an ``nn.Sequential``, each running the model's own forward.

Given a :class:`~dtrain.pipeline.blocks.Layout` and the cut (blocks per virtual stage), :func:`cut_model`
prunes the model in place down to what this rank's stages hold and returns one :class:`ModelStage` per
local stage:

* a block of another rank's stage becomes a :class:`_PassThrough` (it returns the hidden state it is given);
* a prologue module with parameters (an embedding) becomes, on a rank without stage 0, a
  :class:`_StandIn` that returns zeros of its output's shape (the masks and positions the model's code
  derives from it keep their shapes and dtypes); an epilogue module, or one never called, becomes an
  :class:`_Absent` on a rank without the last stage (resp. stage 0). A module the prologue and the
  epilogue share stays on both stages' ranks;
* the ancestors' own parameters stay on every rank.

A stage's call runs ``model(ids)`` on the micro-batch's token ids (every stage gets them), with its range's
blocks in place, the blocks of the rank's other stages as pass-throughs, its first block's hidden input
replaced by what the previous stage sent, and, after its last block, an exception that ends the forward
and carries the hidden state out (the last stage returns the model's output). :func:`holders` says which
stages hold each state-dict entry; a parameter held on several ranks has its gradient summed over them by
:class:`dtrain.pipeline.pipe.Pipeline`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from dtrain.pipeline._channel import PipelineError
from dtrain.pipeline.blocks import BOTH, POST, PRE, UNUSED, Layout, Placed

__all__ = ["ModelStage", "cut_model", "holders", "stage_ranges"]


def _plain_attributes(block: nn.Module) -> dict[str, Any]:
    """A block's plain attributes (``attention_type = "full"``): the model's code may read them off the list."""
    base = set(vars(nn.Module()))
    return {
        k: v
        for k, v in vars(block).items()
        if k not in base and not k.startswith("_") and (v is None or isinstance(v, (str, int, float, bool)))
    }


def _replace(args: tuple[Any, ...], kwargs: dict[str, Any], key: int | str, value: Any) -> tuple[Any, ...]:
    if isinstance(key, int):
        return (*args[:key], value, *args[key + 1 :])
    kwargs[key] = value
    return args


def _take(args: tuple[Any, ...], kwargs: dict[str, Any], key: int | str) -> Any:
    return args[key] if isinstance(key, int) else kwargs[key]


class _PassThrough(nn.Module):
    """A block this stage does not run: returns the hidden state it is given, as the block returns it."""

    def __init__(self, name: str, key: int | str, out_len: int, attrs: dict[str, Any]) -> None:
        super().__init__()
        for k, v in attrs.items():
            setattr(self, k, v)
        self.name, self.key, self.out_len = name, key, out_len

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        h = _take(args, kwargs, self.key)
        return h if not self.out_len else (h, *([None] * (self.out_len - 1)))

    def extra_repr(self) -> str:
        return f"{self.name}: on another stage"


class _Stop(Exception):  # noqa: N818 - control flow, not an error
    """Ends a stage's forward after its last block, carrying the hidden state."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden


class _Edge(nn.Module):
    """A stage's first or last block during its call: the hidden input replaced, and/or the forward ended."""

    def __init__(self, block: nn.Module, key: int | str, inject: torch.Tensor | None, stop: bool) -> None:
        super().__init__()
        for k, v in _plain_attributes(block).items():
            setattr(self, k, v)
        self.block, self.key, self.inject, self.stop = block, key, inject, stop

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.inject is not None:
            args = _replace(args, kwargs, self.key, self.inject)
        out = self.block(*args, **kwargs)
        if self.stop:
            raise _Stop(out if isinstance(out, torch.Tensor) else out[0])
        return out


class _StandIn(nn.Module):
    """A prologue module held by another stage: zeros of its output's shape, without its weights."""

    def __init__(self, placed: Placed) -> None:
        super().__init__()
        self.placed = placed

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        p = self.placed
        x = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)
        if x is not None and p.tail is not None:
            shape = (*x.shape, *p.tail)
        elif x is not None and p.shape:
            shape = (x.shape[0], *p.shape[1:])
        else:
            shape = p.shape
        return torch.zeros(shape, dtype=p.dtype, device=None if x is None else x.device)

    def extra_repr(self) -> str:
        return f"{self.placed.name}: on stage 0 (zeros of its output's shape here)"


class _Absent(nn.Module):
    """An epilogue module (or one never called) that another stage holds."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError(f"module {self.name} is held by another pipeline stage and was called on this one")

    def extra_repr(self) -> str:
        return f"{self.name}: on another stage"


def stage_ranges(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Each stage's blocks ``[lo, hi)`` from the blocks per stage."""
    out, lo = [], 0
    for n in sizes:
        out.append((lo, lo + n))
        lo += n
    return out


def _owners(layout: Layout, sizes: Sequence[int], module: str) -> set[int] | None:
    """The stages that hold ``module`` (None: every stage)."""
    last = len(sizes) - 1
    ranges = stage_ranges(sizes)
    for i, block in enumerate(layout.blocks):
        if module == block or module.startswith(block + "."):
            return {s for s, (lo, hi) in enumerate(ranges) if lo <= i < hi}
    for name, placed in layout.placed.items():
        if module == name or module.startswith(name + "."):
            where = {PRE: {0}, UNUSED: {0}, POST: {last}, BOTH: {0, last}}
            return where.get(placed.where)  # a module without parameters: everywhere
    return None  # an ancestor's own parameters and buffers


def holders(layout: Layout, sizes: Sequence[int], state_names: Sequence[str]) -> dict[str, set[int] | None]:
    """For each state-dict entry, the stages holding it (None: every stage)."""
    return {n: _owners(layout, sizes, n.rpartition(".")[0]) for n in state_names}


class ModelStage(nn.Module):
    """One virtual stage: the model's forward with blocks ``[lo, hi)`` in place (see the module docstring).

    Its registered modules (so its ``parameters()``) are what this stage holds; the model it calls is kept
    beside them, unregistered, and shared with the rank's other stages.
    """

    def __init__(
        self,
        model: nn.Module,
        layout: Layout,
        stage: int,
        sizes: Sequence[int],
        local_blocks: Sequence[int],
        call: Callable[[nn.Module, torch.Tensor], Any],
    ) -> None:
        super().__init__()
        self.__dict__["_model"] = model
        self.layout, self.stage, self.last = layout, stage, len(sizes) - 1
        self.lo, self.hi = stage_ranges(sizes)[stage]
        self.call = call
        blocks = model.get_submodule(layout.list_name)
        assert isinstance(blocks, nn.ModuleList)
        self.held = nn.ModuleList(blocks[i] for i in range(self.lo, self.hi))
        own = [n for n, p in layout.placed.items() if p.params and stage in (_owners(layout, sizes, n) or set())]
        self.around = nn.ModuleList(model.get_submodule(n) for n in own)
        self.direct = nn.ParameterList(
            p for a in layout.ancestors for p in model.get_submodule(a).parameters(recurse=False)
        )
        self.others = {
            i: _PassThrough(layout.blocks[i], layout.hidden_key, layout.out_len, _plain_attributes(blocks[i]))
            for i in local_blocks
            if not self.lo <= i < self.hi
        }

    def forward(self, inp: torch.Tensor, ids: torch.Tensor) -> Any:
        model: nn.Module = self.__dict__["_model"]
        blocks = model.get_submodule(self.layout.list_name)
        assert isinstance(blocks, nn.ModuleList)
        swaps: dict[int, nn.Module] = dict(self.others)
        key = self.layout.hidden_key
        first, end = self.lo, self.hi - 1
        stop = self.stage < self.last
        if self.stage > 0 or stop:
            inject = inp if self.stage > 0 else None
            swaps[first] = _Edge(blocks[first], key, inject, stop and first == end)
            if stop and end != first:
                swaps[end] = _Edge(blocks[end], key, None, True)
        kept = {i: blocks[i] for i in swaps}
        for i, m in swaps.items():
            blocks[i] = m
        try:
            out = self.call(model, ids)
        except _Stop as s:
            return s.hidden
        finally:
            for i, m in kept.items():
                blocks[i] = m
        if stop:
            raise PipelineError(
                f"stage {self.stage}: the forward of {self.layout.model} returned before its block "
                f"{self.layout.blocks[end]} ran"
            )
        return out


def cut_model(
    model: nn.Module,
    layout: Layout,
    sizes: Sequence[int],
    local: Sequence[int],
    call: Callable[[nn.Module, torch.Tensor], Any],
) -> dict[int, ModelStage]:
    """Prune ``model`` in place to what the stages ``local`` hold; their :class:`ModelStage`, by stage."""
    ranges = stage_ranges(sizes)
    mine = {i for s in local for i in range(*ranges[s])}
    blocks = model.get_submodule(layout.list_name)
    assert isinstance(blocks, nn.ModuleList)
    for i, name in enumerate(layout.blocks):
        if i not in mine:
            blocks[i] = _PassThrough(name, layout.hidden_key, layout.out_len, _plain_attributes(blocks[i]))
    for name, placed in layout.placed.items():
        owners = _owners(layout, sizes, name)
        if not placed.params or owners is None or owners & set(local):
            continue
        model.set_submodule(name, _StandIn(placed) if placed.where in (PRE, BOTH) else _Absent(name))
    return {s: ModelStage(model, layout, s, sizes, sorted(mine), call) for s in local}
