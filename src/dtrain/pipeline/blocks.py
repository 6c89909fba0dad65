"""Where a pipeline cuts a model that is not an ``nn.Sequential``: its list of repeated blocks and what runs
around it.

1. :func:`find_blocks`: the model's largest ``nn.ModuleList`` whose entries are all of one class (GPT-2's
   ``transformer.h``, Llama's ``model.layers``), not inside another such list's entry;
2. :func:`trace`: one forward of a sample micro-batch with a hook on every module records the call order.
   Each module beside the path from the root to the list (a child of an ancestor of the list) is placed by
   its calls: before the first block (the prologue: embeddings, rotary tables), after the last block (the
   epilogue: the final norm, the head), both (a module the head reuses), or never called. A module called
   between two blocks, or one that lives outside the blocks and is called from inside them while holding
   parameters, is refused: a cut could not place it. The trace also notes where a block takes the hidden
   state (its first positional argument, or a keyword), what it returns (a tensor, or a tuple whose first
   item is the hidden state), the shape of each prologue module's output (for the stand-ins of the stages
   that do not hold it) and each block's parameter and output bytes and, when asked, its forward + backward
   time alone on its recorded inputs (:func:`dtrain.pipeline.partition.profile_children`'s measure).

Everything here raises :class:`~dtrain.pipeline.partition.PartitionError` with one line naming the module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dtrain.pipeline import partition as _partition
from dtrain.pipeline.partition import LayerCost, PartitionError

__all__ = ["Layout", "Placed", "find_blocks", "trace", "split_sizes"]

PRE, POST, BOTH, UNUSED, ANYWHERE = "prologue", "epilogue", "both", "unused", "anywhere"


@dataclass(frozen=True)
class Placed:
    """A module beside the block list and where it runs.

    Attributes:
        name: its name in the model.
        where: ``"prologue"``, ``"epilogue"``, ``"both"``, ``"unused"`` (never called), or ``"anywhere"``
            (no parameters: kept on every stage, run wherever the model's code calls it).
        params: its parameters' elements.
        tail: a prologue module's output shape after its input's shape (``(64,)`` for an embedding of width
            64 taking ``(batch, seq)``), or None when the output does not extend the input's shape.
        shape: its output's shape at the trace (used, with the batch dimension replaced, when ``tail`` is None).
        dtype: its output's dtype (None: not a tensor).
    """

    name: str
    where: str
    params: int
    tail: tuple[int, ...] | None = None
    shape: tuple[int, ...] = ()
    dtype: torch.dtype | None = None


@dataclass
class Layout:
    """A model's block list and what runs around it (:func:`trace`).

    Attributes:
        model: the model's class name (for messages).
        list_name: the ``nn.ModuleList`` of blocks, e.g. ``"transformer.h"``.
        blocks: the blocks' names, in call order.
        ancestors: the modules from the root down to the list's parent (their own parameters are on every
            stage: the model's code may use them anywhere).
        placed: the modules beside the list, by name.
        hidden_key: where a block takes the hidden state: a positional index or a keyword.
        out_len: 0 when a block returns the hidden state as a tensor; else the length of the tuple it
            returns, the hidden state first.
        costs: one :class:`~dtrain.pipeline.partition.LayerCost` per block (named by index).
    """

    model: str
    list_name: str
    blocks: list[str]
    ancestors: list[str]
    placed: dict[str, Placed] = field(default_factory=dict)
    hidden_key: int | str = 0
    out_len: int = 0
    costs: list[LayerCost] = field(default_factory=list)


def _same_class(mod: nn.ModuleList) -> bool:
    return len(mod) > 0 and len({type(m) for m in mod}) == 1


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's list of repeated blocks: its largest ``nn.ModuleList`` of modules of one class, not nested in
    another such list's entries (a mixture of experts' list inside each layer is not the layers' list)."""
    lists = [(n, m) for n, m in model.named_modules() if n and isinstance(m, nn.ModuleList) and _same_class(m)]
    outer = [(n, m) for n, m in lists if not any(n.startswith(o + ".") for o, _ in lists)]
    if not outer:
        raise PartitionError(
            f"model {type(model).__name__} has no list of repeated blocks (an nn.ModuleList of modules of "
            "one class) to cut between; hold its layers in one, or give an nn.Sequential"
        )
    return max(outer, key=lambda nm: len(nm[1]))


def split_sizes(names: Sequence[str], points: Sequence[str], stages: int, where: str) -> list[int]:
    """Blocks per stage when each of ``points`` (block names) starts a stage after the first."""
    if len(points) != stages - 1:
        raise PartitionError(
            f"{len(points)} split point(s) for {stages} stages: give {stages - 1} block names of {where}"
        )
    index = {n: i for i, n in enumerate(names)}
    for p in points:
        if p not in index:
            span = f"{names[0]} .. {names[-1]}" if names else "none"
            raise PartitionError(f"split point {p!r} names no block of {where} (its {len(names)} blocks: {span})")
    starts = [0, *(index[p] for p in points), len(names)]
    if any(b <= a for a, b in zip(starts, starts[1:])):
        raise PartitionError(
            f"split points {', '.join(points)} must name blocks of {where} in order, after its first block "
            f"{names[0]}, each stage holding at least one block"
        )
    return [b - a for a, b in zip(starts, starts[1:])]


# ---------------------------------------------------------------------------------------------- the trace


@dataclass
class _Calls:
    """One module's calls during the trace: (start, end) event numbers, and whether inside a block's call."""

    spans: list[tuple[int, int, bool]] = field(default_factory=list)
    first_in: Any = None
    first_out: Any = None


def _first_tensor(args: Sequence[Any], kwargs: dict[str, Any]) -> torch.Tensor | None:
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            return v
    return None


class _Recorder:
    """Hooks on the blocks and on the modules beside the list, numbering each call's start and end."""

    def __init__(self, blocks: Sequence[nn.Module], others: dict[str, nn.Module], keep_inputs: bool) -> None:
        self.clock = 0
        self.in_block: int | None = None
        self.block_spans: list[tuple[int, int, int]] = []  # (block index, start, end)
        self.block_inputs: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.block_outputs: list[Any] = []
        self.calls = {n: _Calls() for n in others}
        self.keep = keep_inputs
        self.handles: list[Any] = []
        for i, b in enumerate(blocks):
            self.handles.append(b.register_forward_pre_hook(self._block_pre(i), with_kwargs=True))
            self.handles.append(b.register_forward_hook(self._block_post(i)))
        for n, m in others.items():
            self.handles.append(m.register_forward_pre_hook(self._pre(n), with_kwargs=True))
            self.handles.append(m.register_forward_hook(self._post(n), with_kwargs=True))

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def _block_pre(self, i: int) -> Callable[..., None]:
        def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self.in_block is None:
                self.in_block = i
                self.block_spans.append((i, self.tick(), 0))
                self.block_inputs.append((args, dict(kwargs)) if self.keep or not self.block_inputs else ((), {}))

        return hook

    def _block_post(self, i: int) -> Callable[..., None]:
        def hook(mod: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            if self.in_block == i:
                j, start, _ = self.block_spans[-1]
                self.block_spans[-1] = (j, start, self.tick())
                self.block_outputs.append(out)
                self.in_block = None

        return hook

    def _pre(self, name: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            c = self.calls[name]
            c.spans.append((self.tick(), 0, self.in_block is not None))
            if c.first_in is None:
                c.first_in = _first_tensor(args, kwargs)

        return hook

    def _post(self, name: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
            c = self.calls[name]
            start, _, inside = c.spans[-1]
            c.spans[-1] = (start, self.tick(), inside)
            if c.first_out is None:
                c.first_out = out

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _beside(model: nn.Module, list_name: str) -> tuple[list[str], dict[str, nn.Module]]:
    """The ancestors of the list (root first) and the modules beside the path to it (children of an ancestor)."""
    parts = list_name.split(".")
    ancestors = [".".join(parts[:k]) for k in range(len(parts))]
    on_path = set(ancestors) | {list_name}
    others: dict[str, nn.Module] = {}
    for a in ancestors:
        for child, mod in model.get_submodule(a).named_children():
            full = f"{a}.{child}" if a else child
            if full not in on_path:
                others[full] = mod
    return ancestors, others


def _numel(mod: nn.Module) -> int:
    return sum(p.numel() for p in mod.parameters())


def _place(layout: Layout, name: str, mod: nn.Module, calls: _Calls, first: int, last: int) -> Placed:
    """Where a module beside the list runs, from its calls (``first``: the first block's start, ``last``: the
    last block's end); PartitionError for one a cut could not place."""
    n = _numel(mod)
    inside = any(i for _, _, i in calls.spans)
    between = any(first < s and e < last and not i for s, e, i in calls.spans)
    where = f"model {layout.model}: module {name} ({type(mod).__name__}, {n} parameters)"
    if between:
        raise PartitionError(
            f"{where} runs between the blocks of {layout.list_name}; a pipeline cuts only between blocks "
            "with nothing else between them"
        )
    if inside and n:
        raise PartitionError(
            f"{where} lives outside the blocks of {layout.list_name} and is called from inside them; a "
            "pipeline cannot place its parameters on one stage"
        )
    if not n:
        return Placed(name, ANYWHERE, 0)
    pre = any(e < first for _, e, _ in calls.spans)
    post = any(s > last for s, _, _ in calls.spans)
    if not calls.spans:
        return Placed(name, UNUSED, n)
    if not pre:
        return Placed(name, POST, n)
    out, inp = calls.first_out, calls.first_in
    if not isinstance(out, torch.Tensor):
        raise PartitionError(
            f"{where} runs before the blocks and returns a {type(out).__name__}; the stages that do not hold "
            "it stand in for it with zeros of its output's shape, which needs one tensor"
        )
    shape = tuple(out.shape)
    tail = None
    if isinstance(inp, torch.Tensor) and shape[: inp.dim()] == tuple(inp.shape):
        tail = shape[inp.dim() :]
    return Placed(name, BOTH if post else PRE, n, tail, shape, out.dtype)


def _hidden_key(layout: Layout, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | str:
    if args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
        return 0
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return k
    raise PartitionError(
        f"model {layout.model}: block {layout.blocks[0]} takes no floating-point tensor (the hidden state) "
        "as its first argument or a keyword; a pipeline sends that between stages"
    )


def _out_len(layout: Layout, out: Any) -> int:
    if isinstance(out, torch.Tensor):
        return 0
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        return len(out)
    raise PartitionError(
        f"model {layout.model}: block {layout.blocks[0]} returns a {type(out).__name__}; a pipeline takes a "
        "block that returns the hidden state, alone or first in a tuple"
    )


def _check_order(layout: Layout, spans: list[tuple[int, int, int]]) -> None:
    order = [i for i, _, _ in spans]
    if order != list(range(len(layout.blocks))):
        raise PartitionError(
            f"model {layout.model}: its forward calls the blocks of {layout.list_name} in the order "
            f"{order[:8]}{'...' if len(order) > 8 else ''}, not each of its {len(layout.blocks)} once in order; "
            "a pipeline cuts a model whose blocks run one after the other"
        )


class _Bound(nn.Module):
    """A block as a function of its hidden state alone, its other inputs those of the trace (for timing)."""

    def __init__(self, block: nn.Module, key: int | str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.block, self.key, self.args, self.kw = block, key, args, kwargs

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        args, kw = list(self.args), dict(self.kw)
        if isinstance(self.key, int):
            args[self.key] = h
        else:
            kw[self.key] = h
        out = self.block(*args, **kw)
        return out if isinstance(out, torch.Tensor) else out[0]


def _costs(layout: Layout, blocks: nn.ModuleList, rec: _Recorder, profile: bool, repeats: int = 3) -> list[LayerCost]:
    out = []
    for i, block in enumerate(blocks):
        hidden = rec.block_outputs[i]
        hidden = hidden if isinstance(hidden, torch.Tensor) else hidden[0]
        t = 0.0
        if profile:
            args, kwargs = rec.block_inputs[i]
            h = args[layout.hidden_key] if isinstance(layout.hidden_key, int) else kwargs[layout.hidden_key]
            t = _partition._time_child(_Bound(block, layout.hidden_key, args, kwargs), h, repeats, 1)
        pbytes = sum(p.numel() * p.element_size() for p in block.parameters())
        out.append(LayerCost(str(i), t, pbytes, hidden.numel() * hidden.element_size()))
    return out


def trace(model: nn.Module, sample: torch.Tensor, profile: bool = False) -> Layout:
    """The model's :class:`Layout`, from one forward of ``sample`` (train mode, no autograd; afterwards the
    model's mode, gradients, buffers and the random state are as they were). ``profile``: time each block's
    forward + backward alone on its recorded inputs (the costs of ``balance="time"``)."""
    list_name, blocks = find_blocks(model)
    ancestors, others = _beside(model, list_name)
    layout = Layout(type(model).__name__, list_name, [f"{list_name}.{i}" for i in range(len(blocks))], ancestors)
    rec = _Recorder(list(blocks), others, keep_inputs=profile)
    with _partition._preserved(model, sample):
        try:
            with torch.no_grad():
                model(sample)
        finally:
            rec.remove()
        _check_order(layout, rec.block_spans)
        first, last = rec.block_spans[0][1], rec.block_spans[-1][2]
        args, kwargs = rec.block_inputs[0]
        layout.hidden_key = _hidden_key(layout, args, kwargs)
        layout.out_len = _out_len(layout, rec.block_outputs[0])
        layout.placed = {n: _place(layout, n, m, rec.calls[n], first, last) for n, m in others.items()}
        layout.costs = _costs(layout, blocks, rec, profile)
    return layout
