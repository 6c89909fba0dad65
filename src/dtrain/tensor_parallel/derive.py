"""``derive_plan(model, tp)``: a tensor-parallel plan found from a model's own structure and one forward.

Nothing here knows an architecture by name. One forward of a small sample, with hooks on every module,
records which projection (an ``nn.Linear`` or transformers' ``Conv1D``) reads which tensor, in what
order, and how each module was called. From that:

* **attention** is a module whose projections read one tensor -- three of them (query, key, value;
  the key and value narrower under grouped-query attention) or one fused projection three times the
  input's width -- followed by a projection back to the input's width inside the same module. Query,
  key and value are split column-wise by heads (``colwise``; a fused one ``colwise:3`` when its
  blocks are q | k | v, ``colwise`` when they are interleaved per head), the output projection
  row-wise (Shoeybi et al., "Megatron-LM", arXiv 1909.08053, section 3);
* an **MLP** is one or two projections (up, or gate and up) from the hidden width to another width,
  then one back: up/gate ``colwise``, down ``rowwise``;
* the **token embedding** (the embedding that reads the model's input) and the **LM head** (the last
  projection called, as wide as the vocabulary) are split by vocabulary (``vocab``); a tied pair stays
  one tensor (:func:`~dtrain.tensor_parallel.parallelize.parallelize` shares the slices);
* everything else stays replicated.

The head counts a model's forward reads are found by name and value: integer attributes of the
attention module and of its ``config`` whose name speaks of heads (``num_heads``, ``n_head``,
``num_attention_heads``, ``num_key_value_heads``, ...) and whose value is the query or key/value head
count become the rank's share, and the module's widths equal to the query width (``split_size``,
``embed_dim``) too; ``head_dim`` and ``num_key_value_groups`` stay. Each attention split is then
checked on the sample on one process: the module's copy on each rank's slice, its outputs summed as
the row-parallel all-reduce would, must give the whole module's output. A fused projection takes the
layout that passes; an attention no layout reproduces stays replicated (the plan's notes say so).
"""

from __future__ import annotations

import copy
import fnmatch
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dtrain.errors import ConfigError
from dtrain.tensor_parallel._functions import TPGroup
from dtrain.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, is_projection, projection_shape
from dtrain.tensor_parallel.parallelize import Plan, check_plan

__all__ = ["attention_heads", "derive_plan"]


class _Record:
    """What one hooked forward saw: each module's first call, the order of calls, each projection's input."""

    def __init__(self, model: nn.Module) -> None:
        self.calls: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}
        self.started: list[str] = []  # modules in the order their forward began (first call)
        self.ended: dict[str, int] = {}  # module -> len(started) when its first forward returned
        self.inputs: dict[str, int] = {}  # projection -> key of the tensor it read
        self.seen: dict[int, int] = {}
        self._alive: list[torch.Tensor] = []  # the tensors keyed, held so that no id is reused
        self._handles: list[Any] = []
        for name, m in model.named_modules():
            if name:
                self._handles.append(m.register_forward_pre_hook(self._pre(name, m), with_kwargs=True))
                self._handles.append(m.register_forward_hook(self._post(name)))

    def key(self, t: Any) -> int:
        if not isinstance(t, torch.Tensor):
            return -1
        if id(t) not in self.seen:
            self.seen[id(t)] = len(self.seen)
            self._alive.append(t)
        return self.seen[id(t)]

    def _pre(self, name: str, m: nn.Module) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if name in self.calls:
                return
            self.calls[name] = (args, dict(kwargs))
            self.started.append(name)
            if is_projection(m):
                self.inputs[name] = self.key(args[0] if args else next(iter(kwargs.values()), None))

        return hook

    def _post(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            self.ended.setdefault(name, len(self.started))

        return hook

    def close(self) -> None:
        for h in self._handles:
            h.remove()


@dataclass
class _Attention:
    name: str  # the attention module
    qkv: list[str]  # the projections reading its input (one when fused)
    out: str  # the projection back to the hidden width
    heads: int
    kv_heads: int
    width: int  # the query width (heads x head_dim)
    style: str = "colwise"  # of a fused projection
    split: bool = True


@dataclass
class _MLP:
    name: str  # the lowest module holding its projections
    up: list[str]
    down: str


@dataclass
class _Found:
    attention: list[_Attention] = field(default_factory=list)
    mlp: list[_MLP] = field(default_factory=list)
    embedding: str = ""
    head: str = ""
    notes: list[str] = field(default_factory=list)
    checked: dict[Any, tuple[str, bool]] = field(default_factory=dict)  # an attention's kind -> (style, split)


def _parent(names: list[str]) -> str:
    """The lowest module holding every one of ``names``."""
    parts = [n.split(".")[:-1] for n in names]
    common: list[str] = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def _sample_of(model: nn.Module) -> torch.Tensor:
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if emb is None:
        raise ConfigError("derive_plan: the model has no nn.Embedding to make token ids for; pass sample=")
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, emb.num_embeddings, (2, 8), generator=g).to(emb.weight.device)


def _record(model: nn.Module, sample: Any) -> _Record:
    rec = _Record(model)
    try:
        with torch.no_grad():
            model(*sample) if isinstance(sample, tuple) else model(sample)
    except Exception as e:
        raise ConfigError(f"derive_plan: the model's forward on the sample failed ({type(e).__name__}: {e})") from None
    finally:
        rec.close()
    return rec


# ---------------------------------------------------------------------------------------------- head counts


def _is_count(attr: str) -> bool:
    low = attr.lower()
    return "head" in low and "dim" not in low and "size" not in low


def _ints(obj: Any) -> dict[str, int]:
    return {k: v for k, v in vars(obj).items() if isinstance(v, int) and not isinstance(v, bool)}


def _head_dim(mod: nn.Module, width: int) -> int | None:
    """The attention's head width: an attribute of the module or its config naming a head's dim or size, else
    the query width over the largest head count found."""
    sources = [mod, getattr(mod, "config", None)]
    for src in sources:
        if src is None:
            continue
        for k, v in _ints(src).items():
            low = k.lower()
            if "head" in low and ("dim" in low or "size" in low) and v > 0 and width % v == 0:
                return v
    counts = [v for src in sources if src is not None for k, v in _ints(src).items() if _is_count(k) and v > 0]
    fits = [c for c in counts if width % c == 0]
    return width // max(fits) if fits else None


def _scale_heads(mod: nn.Module, a: _Attention, tp: int, seen: set[int]) -> list[str]:
    """Set the attention's head counts (on the module and, once, on its config) and its query-wide widths to the
    rank's share; returns what changed, as ``attr whole->local``."""
    changed = []
    objs: list[tuple[Any, bool]] = [(mod, True)]
    cfg = getattr(mod, "config", None)
    if cfg is not None and id(cfg) not in seen:
        seen.add(id(cfg))
        objs.append((cfg, False))
    for obj, widths in objs:
        for k, v in _ints(obj).items():
            low = k.lower()
            if _is_count(k) and v in (a.heads, a.kv_heads):
                new = v // tp
            elif widths and ("size" in low or "dim" in low) and "head" not in low and v == a.width:
                new = v // tp
            else:
                continue
            setattr(obj, k, new)
            changed.append(f"{'config.' if obj is cfg else ''}{k} {v}->{new}")
    return changed


# ---------------------------------------------------------------------------------------------- a split checked


class _OneRank(TPGroup):
    """Rank ``rank`` of ``size`` in one process: the collectives are identities (the caller sums the ranks)."""

    def __init__(self, size: int, rank: int) -> None:  # no torch.distributed
        self.group, self.algorithm, self.timeout_s = None, "ring", 0.0
        self.size, self.rank, self.ranks, self.seconds = size, rank, list(range(size)), 0.0

    def allreduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return t


def _reproduces(model: nn.Module, a: _Attention, rec: _Record, tp: int) -> bool | None:
    """Whether splitting ``a`` over ``tp`` ranks gives the module's output on the sample (None: not checkable)."""
    whole = model.get_submodule(a.name)
    args, kwargs = rec.calls[a.name]
    with torch.no_grad():
        want = _first_tensor(whole(*args, **kwargs))
        if want is None:
            return None
        total = torch.zeros_like(want)
        chunks = int(a.style.partition(":")[2] or 1)
        for r in range(tp):
            part = copy.deepcopy(whole)
            _scale_heads(part, a, tp, set())
            g = _OneRank(tp, r)
            for n in a.qkv:
                rel = n[len(a.name) + 1 :]
                _put(part, rel, ColumnParallelLinear(part.get_submodule(rel), g, chunks=chunks))
            rel = a.out[len(a.name) + 1 :]
            row = RowParallelLinear(part.get_submodule(rel), g)
            _put(part, rel, row)
            try:
                got = _first_tensor(part(*args, **kwargs))
            except Exception:  # a layout whose shapes do not fit the forward
                return False
            if got is None or got.shape != want.shape:
                return False
            total += got - (row.bias if row.bias is not None and r > 0 else 0.0)
    scale = float(want.abs().max()) or 1.0
    return bool(torch.allclose(total, want, rtol=1e-4, atol=1e-5 * scale))


def _put(root: nn.Module, rel: str, new: nn.Module) -> None:
    parent, _, leaf = rel.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, new)


# ---------------------------------------------------------------------------------------------- finding


def _last(rec: _Record, names: list[str]) -> str:
    return max(names, key=rec.started.index)


def _later(rec: _Record, after: str, under: str, proj: dict[str, nn.Module], want: tuple[int, int]) -> str:
    """The first projection called after ``after`` inside ``under`` with shape ``want`` (out, in)."""
    start = rec.started.index(after)
    for n in rec.started[start + 1 :]:
        if n in proj and n.startswith(f"{under}.") and projection_shape(proj[n]) == want:
            return n
    return ""


def _attention(
    model: nn.Module, names: list[str], rec: _Record, proj: dict[str, nn.Module], tp: int
) -> _Attention | None:
    shapes = [projection_shape(proj[n]) for n in names]
    hidden = shapes[0][1]
    if len(names) >= 3:
        names = sorted(names[:3], key=lambda n: -projection_shape(proj[n])[0])  # the query first
        q, k, v = (projection_shape(proj[n])[0] for n in names)
        if k != v or q < k:
            return None
        where, width = _parent(names), q
    elif len(names) == 1 and shapes[0][0] == 3 * hidden:
        where, width, q, k = names[0].rpartition(".")[0], hidden, hidden, hidden
    else:
        return None
    out = _later(rec, _last(rec, names), where, proj, (hidden, width)) if where else ""
    if not out or where not in rec.calls:
        return None
    mod = model.get_submodule(where)
    d = _head_dim(mod, width)
    if d is None or width % d or k % d:
        return None
    a = _Attention(where, names, out, width // d, k // d, width)
    for what, n in (("attention heads", a.heads), ("key/value heads", a.kv_heads)):
        if n % tp:
            raise ConfigError(f"{where!r}: {n} {what} do not divide over tensor-parallel size {tp}")
    return a


def _find(model: nn.Module, rec: _Record, sample: Any, tp: int) -> _Found:
    proj = {n: m for n, m in model.named_modules() if n and is_projection(m) and n in rec.inputs}
    groups: dict[int, list[str]] = {}
    for n in rec.started:
        if n in proj:
            groups.setdefault(rec.inputs[n], []).append(n)
    found, taken = _Found(), set()
    for group in groups.values():
        names = [n for n in group if n not in taken]
        a = _attention(model, names, rec, proj, tp) if names else None
        if a is not None:
            _choose_layout(model, a, rec, tp, found)
            if a.split:
                found.attention.append(a)
            taken.update([*a.qkv, a.out])
            names = [n for n in names if n not in taken]  # what else reads the input (a parallel MLP)
        if not names:
            continue
        shapes = {projection_shape(proj[n]) for n in names}
        if len(names) > 2 or len(shapes) != 1:
            continue
        ((inner, hidden),) = shapes
        if inner == hidden:
            continue
        where = _parent(names) if len(names) > 1 else names[0].rpartition(".")[0]
        down = _later(rec, _last(rec, names), where, proj, (hidden, inner)) if where else ""
        if down and down not in taken:
            found.mlp.append(_MLP(_parent([*names, down]), names, down))
            taken.update([*names, down])
    _vocab(model, rec, sample, proj, found)
    return found


def _choose_layout(model: nn.Module, a: _Attention, rec: _Record, tp: int, found: _Found) -> None:
    """A fused projection's layout (q | k | v blocks, or interleaved per head) by which split reproduces the
    module; separate projections are checked the same way. None reproducing it: the attention stays whole.
    An attention of the same class, projections and shapes as one checked before (the next layer's) takes its
    result without a check of its own."""
    mod = model.get_submodule(a.name)
    rel = [n[len(a.name) + 1 :] for n in (*a.qkv, a.out)]
    shapes = [projection_shape(mod.get_submodule(n)) for n in rel]
    kind = (type(mod), tuple(rel), tuple(shapes), a.heads, a.kv_heads)
    if kind in found.checked:
        a.style, a.split = found.checked[kind]
        return
    layouts = ["colwise:3", "colwise"] if len(a.qkv) == 1 else ["colwise"]
    a.split = False
    for style in layouts:
        a.style = style
        ok = _reproduces(model, a, rec, tp)
        if ok is None or ok:
            a.split = True
            break
    found.checked[kind] = (a.style, a.split)
    if not a.split:
        found.notes.append(f"{a.name}: no split of its projections reproduced its output on the sample; replicated")


def _vocab(model: nn.Module, rec: _Record, sample: Any, proj: dict[str, nn.Module], found: _Found) -> None:
    x = sample[0] if isinstance(sample, tuple) else sample

    def reads_input(n: str) -> bool:  # the embedding looks up the model's input (as it is, or reshaped)
        args = rec.calls[n][0]
        t = args[0] if args else None
        return (
            isinstance(model.get_submodule(n), nn.Embedding)
            and isinstance(t, torch.Tensor)
            and isinstance(x, torch.Tensor)
            and t.numel() == x.numel()
            and torch.equal(t.reshape(-1), x.reshape(-1))
        )

    emb = next((n for n in rec.started if reads_input(n)), "")
    if not emb:
        return
    e = model.get_submodule(emb)
    assert isinstance(e, nn.Embedding)
    vocab = e.num_embeddings
    called = [n for n in rec.started if n in proj]
    last = called[-1] if called else ""
    head = last if last and isinstance(proj[last], nn.Linear) and projection_shape(proj[last])[0] == vocab else ""
    if e.padding_idx is not None:  # its row's gradient is kept at zero, which the split embedding does not do
        found.notes.append(f"{emb}: has padding_idx {e.padding_idx}; replicated")
        if head and proj[head].weight is e.weight:
            return  # tied: the head stays whole with it
        emb = ""
    found.embedding, found.head = emb, head


# ---------------------------------------------------------------------------------------------- the plan


def _styles(found: _Found) -> dict[str, str]:
    styles: dict[str, str] = {}
    if found.embedding:
        styles[found.embedding] = "vocab"
    for a in found.attention:
        for n in a.qkv:
            styles[n] = a.style
        styles[a.out] = "rowwise"
    for m in found.mlp:
        for n in m.up:
            styles[n] = "colwise"
        styles[m.down] = "rowwise"
    if found.head:
        styles[found.head] = "vocab"
    return styles


def _arg_of(rec: _Record, name: str, want: Callable[[Any], bool]) -> str:
    """Which argument of ``name``'s call satisfies ``want``: its position, or its keyword."""
    args, kwargs = rec.calls[name]
    for i, a in enumerate(args):
        if want(a):
            return str(i)
    for k, a in kwargs.items():
        if want(a):
            return k
    raise ConfigError(f"sequence parallel: {name!r} is called without the hidden states it should split")


def _block_of(model: nn.Module, name: str) -> str:
    """The layer that holds ``name``: its nearest ancestor that is an element of an ``nn.ModuleList`` or
    ``nn.Sequential`` (a transformer's list of layers)."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        holder = model.get_submodule(".".join(parts[: i - 1]))
        if isinstance(holder, (nn.ModuleList, nn.Sequential)):
            return ".".join(parts[:i])
    raise ConfigError(f"sequence parallel: {name!r} lies in no layer of a list of layers to shard the sequence over")


def _sequence_styles(model: nn.Module, found: _Found, rec: _Record, styles: dict[str, str]) -> None:
    """The sequence-sharded region: from the first layer's input to the module after the last layer; inside
    attention and MLP modules the sequence is gathered, the layers' norms run on shards (``replicate``)."""
    if not found.attention:
        raise ConfigError("sequence parallel: the derived plan splits no attention to shard the sequence around")
    hidden = projection_shape(model.get_submodule(found.attention[0].out))[0]
    blocks = sorted({_block_of(model, a.name) for a in found.attention}, key=rec.started.index)
    for m in found.mlp:
        if m.name in blocks or any(a.name.startswith(f"{m.name}.") for a in found.attention):
            raise ConfigError(
                f"sequence parallel gathers the sequence at an MLP module's input; {m.name!r} holds "
                f"{', '.join(m.up)} and {m.down} beside its attention: run without --sequence-parallel"
            )
    stream = lambda t: isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[-1] == hidden  # noqa: E731
    styles[blocks[0]] = "sequence" + _suffix(_arg_of(rec, blocks[0], stream))
    end = rec.ended[blocks[-1]]
    after = [n for n in rec.started[end:] if not any(n.startswith(f"{b}.") or n == b for b in blocks)]
    if not after:
        raise ConfigError(f"sequence parallel: nothing runs after the last layer {blocks[-1]!r} to gather its output")
    styles[after[0]] = "gather_end" + _suffix(_arg_of(rec, after[0], stream))
    gathered = [a.name for a in found.attention] + [m.name for m in found.mlp]
    for n in gathered:
        styles[n] = "gather" + _suffix(_arg_of(rec, n, _is_input(rec, rec.inputs[_first_projection(found, n)])))
    for n, m in model.named_modules():
        inside = any(n.startswith(f"{b}.") for b in blocks) and not any(
            n == g or n.startswith(f"{g}.") for g in gathered
        )
        if inside and n not in styles and any(True for _ in m.parameters(recurse=False)):
            styles[n] = "replicate"


def _is_input(rec: _Record, key: int) -> Callable[[Any], bool]:
    """Whether an argument is the tensor recorded under ``key`` (what a module's projections read)."""

    def test(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and id(t) in rec.seen and rec.key(t) == key

    return test


def _first_projection(found: _Found, module: str) -> str:
    for a in found.attention:
        if a.name == module:
            return a.qkv[0]
    return next(m.up[0] for m in found.mlp if m.name == module)


def _suffix(arg: str) -> str:
    return "" if arg == "0" else f":{arg}"


def _compress(model: nn.Module, styles: dict[str, str]) -> dict[str, str]:
    """Exact names as patterns where one pattern (layer indices as ``*``) covers exactly the names of one style."""
    names = [n for n, _ in model.named_modules() if n]
    out: dict[str, str] = {}
    by_pattern: dict[str, list[str]] = {}
    for n in styles:
        by_pattern.setdefault(re.sub(r"(?<=\.)\d+(?=\.|$)", "*", n), []).append(n)
    for pattern, members in by_pattern.items():
        same = len({styles[n] for n in members}) == 1
        if same and pattern != members[0] and set(fnmatch.filter(names, pattern)) == set(members):
            out[pattern] = styles[members[0]]
        else:
            out.update({n: styles[n] for n in members})
    return out


def derive_plan(model: nn.Module, tp: int, *, sample: Any = None, sequence_parallel: bool = False) -> Plan:
    """A tensor-parallel :class:`Plan` for ``model`` over ``tp`` ranks, found from its structure and one forward of
    ``sample`` (default: a batch of 2 x 8 token ids for the model's first embedding); see the module docstring.

    The returned plan's ``prepare`` sets the head counts of each split attention to the rank's share (run by
    :func:`~dtrain.tensor_parallel.parallelize.parallelize`); its ``text()`` lists what is split and how.

    Raises:
        ConfigError: a head count the group does not divide (naming the attention module), a forward that fails
            on the sample, or (``sequence_parallel``) a model whose layers the sequence cannot be sharded over.
    """
    if tp < 1:
        raise ConfigError(f"tensor-parallel size must be >= 1, got {tp}")
    sample = _sample_of(model) if sample is None else sample
    was = model.training
    model.eval()  # no dropout: the checks on the sample compare outputs
    try:
        rec = _record(model, sample)
        found = _find(model, rec, sample, tp)
        styles = _styles(found)
        if sequence_parallel:
            _sequence_styles(model, found, rec, styles)
    finally:
        model.train(was)
    heads = [(a.name, a) for a in found.attention]

    def prepare(module: nn.Module, size: int) -> None:
        if size != tp:
            raise ConfigError(f"the tensor-parallel plan was derived for size {tp}; this group has {size} ranks")
        seen: set[int] = set()
        for name, a in heads:
            _scale_heads(module.get_submodule(name), a, size, seen)

    notes = _notes(model, found, tp)
    plan = Plan(styles=_compress(model, styles), prepare=prepare, name="auto", notes=tuple(notes))
    check_plan(model, plan, tp, sequence_parallel=sequence_parallel)  # the MLP widths, before any collective
    return plan


def attention_heads(model: nn.Module, *, sample: Any = None) -> list[tuple[str, int, int]]:
    """The attentions :func:`derive_plan` splits by heads, each as ``(module, heads, key/value heads)``, found as
    it finds them (one forward of ``sample``); a tensor-parallel size must divide every count."""
    sample = _sample_of(model) if sample is None else sample
    was = model.training
    model.eval()
    try:
        found = _find(model, _record(model, sample), sample, 1)
    finally:
        model.train(was)
    return [(a.name, a.heads, a.kv_heads) for a in found.attention if a.split]


def _notes(model: nn.Module, found: _Found, tp: int) -> list[str]:
    lines = []
    for pattern, group in _by_pattern([a.name for a in found.attention]).items():
        a = next(x for x in found.attention if x.name == group[0])
        probe = copy.deepcopy(model.get_submodule(a.name))
        changed = _scale_heads(probe, a, tp, set())
        kv = f", {a.kv_heads} key/value heads ({a.kv_heads // tp} per rank)" if a.kv_heads != a.heads else ""
        lines.append(
            f"{pattern}: {a.heads} heads ({a.heads // tp} per rank){kv}; set per rank: {', '.join(changed) or 'none'}"
        )
    lines += found.notes
    if not found.head:
        lines.append("no LM head split by vocabulary: the logits are whole on every rank")
    return lines


def _by_pattern(names: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for n in names:
        out.setdefault(re.sub(r"(?<=\.)\d+(?=\.|$)", "*", n), []).append(n)
    return out
