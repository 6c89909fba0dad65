"""``parallelize(module, plan, group)``: split a model's layers over a tensor-parallel group by a plan.

A plan maps submodule names (or ``fnmatch`` patterns such as ``block*.mlp.fc1``) to a style,
the vocabulary of torch's ``parallelize_module``:

==============  ==========================================================================
``colwise``     ``nn.Linear`` (or transformers' ``Conv1D``) -> :class:`ColumnParallelLinear` (output
                features split)
``colwise:N``   the same for a fused projection of ``N`` equal blocks (q, k, v: ``colwise:3``)
``rowwise``     ``nn.Linear`` / ``Conv1D`` -> :class:`RowParallelLinear` (input features split, outputs
                summed)
``vocab``       ``nn.Embedding`` -> :class:`VocabParallelEmbedding`; ``nn.Linear`` (an LM head) ->
                :class:`VocabParallelHead` (logits stay split; use :func:`vocab_parallel_cross_entropy`)
``replicate``   left whole on every rank (with ``sequence_parallel``: runs on sequence shards, its
                gradients summed over the group by :func:`sync_replicated_grads`)
``sequence``    ``sequence_parallel`` only: where a replicated activation enters the sequence-sharded
                region (each rank keeps its chunk of the module's input)
``gather``      ``sequence_parallel`` only: a module that runs on the whole sequence inside the region
                (an attention or MLP module): its input is gathered from the shards (reduce-scattered
                in backward), and its column-parallel layers take that input as it is
``gather_end``  ``sequence_parallel`` only: the region ends at this module's input (gathered; it and what
                follows run replicated on the whole sequence, a ``vocab`` head after it too; backward
                keeps each rank's chunk of the gradient)
==============  ==========================================================================

``sequence``, ``gather`` and ``gather_end`` act on the module's first positional argument, or on the
one named after a colon: ``gather:1`` (the second positional), ``gather:hidden_states`` (a keyword, or
the positional argument of that name when it is passed by position: see :func:`_arg_hook`).

Everything is checked before any collective: a plan key that matches no module, a style
the module cannot take, a width the group does not divide -- each a :class:`ConfigError`
naming the module; then the ranks compare plan and model (one ``all_gather_object``), so
different plans on different ranks are an error, not a hang.
"""

from __future__ import annotations

import fnmatch
import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dtrain.errors import ConfigError
from dtrain.tensor_parallel._functions import TPGroup, gather_sequence, leave_sequence, split_sequence
from dtrain.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
    is_projection,
    projection_shape,
)

__all__ = [
    "Plan",
    "STYLES",
    "parallelize",
    "full_state_dict",
    "load_full_state_dict",
    "sync_replicated_grads",
    "tp_group_of",
    "check_plan",
    "check_styles",
]

STYLES = ("colwise", "rowwise", "vocab", "replicate", "sequence", "gather", "gather_end")
_SEQUENCE_STYLES = ("sequence", "gather", "gather_end")


@dataclass(frozen=True)
class Plan:
    """A plan: styles by module name or pattern, and an optional hook run on the model first.

    Attributes:
        styles: module name or ``fnmatch`` pattern -> style (see the module docstring).
        prepare: called as ``prepare(module, tp_size)`` before splitting, e.g. to give attention
            modules their share of the heads; raises ConfigError for a size the model cannot take.
        name: for messages.
        notes: lines :meth:`text` prints after the styles (a derived plan's heads per rank, say).
    """

    styles: Mapping[str, str]
    prepare: Callable[[nn.Module, int], None] | None = field(default=None, compare=False)
    name: str = "plan"
    notes: tuple[str, ...] = field(default=(), compare=False)

    def text(self) -> str:
        """The plan as lines ``pattern  style`` (TOML's ``[tensor.plan]`` keys and values), then its notes."""
        width = max((len(k) for k in self.styles), default=0)
        lines = [f"tensor-parallel plan {self.name}: {len(self.styles)} entries"]
        lines += [f"  {k:<{width}}  {v}" for k, v in self.styles.items()]
        return "\n".join([*lines, *(f"  {n}" for n in self.notes)])


def _style(style: str) -> tuple[str, int | str]:
    kind, _, arg = style.partition(":")
    if kind not in STYLES:
        raise ConfigError(
            f"unknown tensor-parallel style {style!r}; choose one of {', '.join(STYLES)} "
            "(colwise:N for a fused projection of N blocks)"
        )
    if kind in _SEQUENCE_STYLES:
        return kind, int(arg) if arg.isdigit() else (arg or 0)
    if arg and kind != "colwise":
        raise ConfigError(f"style {style!r}: only colwise:N, sequence, gather and gather_end take an argument")
    try:
        n = int(arg) if arg else 1
    except ValueError:
        raise ConfigError(f"style {style!r}: the number of fused blocks must be an integer") from None
    if n < 1:
        raise ConfigError(f"style {style!r}: the number of fused blocks must be >= 1")
    return kind, n


def check_styles(styles: Mapping[str, str]) -> None:
    """Every style of a plan is one this module knows (ConfigError naming the one that is not)."""
    for key, style in styles.items():
        if not isinstance(style, str):
            raise ConfigError(f"the tensor-parallel plan gives {key!r} the style {style!r}; styles are strings")
        _style(style)


def check_plan(
    module: nn.Module, plan: Plan | Mapping[str, str], size: int, *, sequence_parallel: bool = False
) -> None:
    """What :func:`parallelize` checks before any collective, for a group of ``size`` ranks, without splitting:
    a key that matches no module, a style the module cannot take, a width ``size`` does not divide."""
    p = plan if isinstance(plan, Plan) else Plan(dict(plan))
    _check(module, _resolve(module, p.styles), size, sequence_parallel)


def _resolve(module: nn.Module, styles: Mapping[str, str]) -> dict[str, tuple[str, int | str]]:
    names = [n for n, _ in module.named_modules() if n]
    out: dict[str, tuple[str, int | str]] = {}
    for key, style in styles.items():
        hits = [n for n in names if n == key or fnmatch.fnmatchcase(n, key)]
        if not hits:
            raise ConfigError(
                f"the tensor-parallel plan names {key!r}, which matches no module of the model "
                f"(it has e.g. {', '.join(repr(n) for n in names[:6])})"
            )
        parsed = _style(style)
        for n in hits:
            out[n] = parsed
    return out


def _check(module: nn.Module, styles: dict[str, tuple[str, int | str]], size: int, sequence_parallel: bool) -> None:
    mods = dict(module.named_modules())
    for name, (kind, n) in styles.items():
        m = mods[name]
        if kind in ("colwise", "rowwise") and not is_projection(m):
            raise ConfigError(f"{name!r} is a {type(m).__name__}; {kind} splits an nn.Linear or a Conv1D")
        if kind == "vocab" and not isinstance(m, (nn.Linear, nn.Embedding)):
            raise ConfigError(f"{name!r} is a {type(m).__name__}; vocab splits an nn.Embedding or an LM head Linear")
        if kind in _SEQUENCE_STYLES and not sequence_parallel:
            raise ConfigError(f"{name!r} has style {kind!r}, which only applies with sequence_parallel=True")
        if kind not in ("colwise", "rowwise") or not is_projection(m):
            continue
        out, inp = projection_shape(m)
        assert isinstance(n, int)
        if kind == "colwise" and out % (n * size):
            raise ConfigError(
                f"{name!r}: {out} output features do not divide over tensor-parallel "
                f"size {size}{f' in {n} fused blocks' if n > 1 else ''}"
            )
        if kind == "rowwise" and inp % size:
            raise ConfigError(f"{name!r}: {inp} input features do not divide over tensor-parallel size {size}")


def _agree(module: nn.Module, styles: dict[str, tuple[str, int | str]], g: TPGroup, sequence_parallel: bool) -> None:
    """Every rank of the group must split the same model the same way: compare digests, name what differs."""
    if g.size == 1:
        return
    import torch.distributed as dist

    shapes = [(n, tuple(p.shape)) for n, p in module.named_parameters()]
    mine = (sorted(styles.items()), sequence_parallel, hashlib.sha256(repr(shapes).encode()).hexdigest()[:16])
    got: list[Any] = [None] * g.size
    dist.all_gather_object(got, mine, group=g.group)
    for r, other in enumerate(got):
        if other == mine:
            continue
        if other[0] != mine[0]:
            a, b = dict(mine[0]), dict(other[0])
            diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            raise ConfigError(
                f"tensor-parallel rank {g.rank} and rank {r} pass different plans: they differ at "
                f"{', '.join(repr(d) for d in diff[:5])}"
            )
        if other[1] != mine[1]:
            raise ConfigError(f"tensor-parallel rank {g.rank} has sequence_parallel={mine[1]}, rank {r} {other[1]}")
        raise ConfigError(f"tensor-parallel rank {g.rank} and rank {r} hold models with different parameter shapes")


def _swap(module: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = module.get_submodule(parent_name) if parent_name else module
    setattr(parent, leaf, new)


def _mark_partial(m: nn.Module) -> None:
    for p in m.parameters():
        p.tp_partial_grad = True  # type: ignore[attr-defined]


def _arg_hook(fn: Callable[[torch.Tensor, TPGroup], torch.Tensor], g: TPGroup, which: int | str) -> Callable[..., Any]:
    """A forward pre-hook (``with_kwargs``) applying ``fn`` to one argument: positional ``which``, or the keyword
    ``which`` (when it is passed by position instead, the positional of that name in ``forward``'s signature)."""

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        if isinstance(which, str) and which in kwargs:
            return args, {**kwargs, which: fn(kwargs[which], g)}
        i = which if isinstance(which, int) else _position(module, which)
        if i >= len(args):
            raise ConfigError(f"{type(module).__name__} was called without its argument {which!r} to split")
        return (*args[:i], fn(args[i], g), *args[i + 1 :]), kwargs

    return hook


def _position(module: nn.Module, name: str) -> int:
    import inspect

    params = [p for p in inspect.signature(module.forward).parameters.values() if p.kind <= p.POSITIONAL_OR_KEYWORD]
    for i, p in enumerate(params):
        if p.name == name:
            return i
    raise ConfigError(f"{type(module).__name__}.forward has no argument {name!r}")


def _retie(module: nn.Module, tied: dict[str, list[str]]) -> None:
    """Vocabulary-split layers whose whole weights were one tensor (a tied embedding and LM head) share their
    slices as one parameter again: each rank's rows of the embedding are its rows of the head."""
    mods = dict(module.named_modules())
    for names in tied.values():
        first = mods[names[0]]
        for other in names[1:]:
            m = mods[other]
            if first.weight.shape != m.weight.shape:
                raise ConfigError(
                    f"{names[0]!r} and {other!r} share one weight, and their vocabulary slices differ in shape"
                )
            m.weight = first.weight


def parallelize(
    module: nn.Module,
    plan: Plan | Mapping[str, str],
    group: Any = None,
    *,
    sequence_parallel: bool = False,
    algorithm: str = "ring",
    timeout_s: float = 300.0,
) -> nn.Module:
    """Split ``module``'s layers over a tensor-parallel group in place, by ``plan``; returns ``module``.

    Every rank of the group builds the same model (same weights) and calls this; each keeps its
    slice. The forward then computes exactly the unsplit model's function; with a ``vocab`` LM
    head the output is this rank's slice of the logits (:func:`vocab_parallel_cross_entropy`).

    Args:
        module: the model (weights already initialised the same on every rank).
        plan: a :class:`Plan` or a mapping of module names/patterns to styles.
        group: the tensor-parallel process group (default: the default group).
        sequence_parallel: keep layer norms and residuals sharded along the sequence (dim 1)
            between the split layers (Korthikanti et al. 2022) (default: False).
        algorithm: allreduce algorithm of the ``f``/``g`` operators (default: ring).
        timeout_s: seconds any collective may wait (default: 300).

    Raises:
        ConfigError: a plan key matching no module, a style the module cannot take, a width the
            group does not divide (naming the module), or ranks passing different plans.
    """
    p = plan if isinstance(plan, Plan) else Plan(dict(plan))
    g = TPGroup(group, algorithm=algorithm, timeout_s=timeout_s)
    styles = _resolve(module, p.styles)
    _check(module, styles, g.size, sequence_parallel)
    if p.prepare is not None:
        p.prepare(module, g.size)
    _agree(module, styles, g, sequence_parallel)
    _split(module, styles, g, sequence_parallel)
    object.__setattr__(module, "tp_group", g)
    return module


def _split(module: nn.Module, styles: dict[str, tuple[str, int | str]], g: TPGroup, sequence_parallel: bool) -> None:
    mods = dict(module.named_modules())
    gathers = [n for n, (k, _) in styles.items() if k == "gather"]
    head_gathers = sequence_parallel and not any(k == "gather_end" for k, _ in styles.values())
    tied: dict[int, list[str]] = {}
    for name, (kind, n) in styles.items():
        m = mods[name]
        new: nn.Module | None = None
        if kind == "colwise":
            assert isinstance(n, int)
            inside = any(name.startswith(f"{a}.") for a in gathers)
            new = ColumnParallelLinear(m, g, chunks=n, sequence_parallel=sequence_parallel, gathered=inside, name=name)
        elif kind == "rowwise":
            new = RowParallelLinear(m, g, sequence_parallel=sequence_parallel, name=name)
        elif kind == "vocab":
            tied.setdefault(id(m.weight), []).append(name)
            if isinstance(m, nn.Embedding):
                new = VocabParallelEmbedding(m, g, sequence_parallel=False)
            else:
                assert isinstance(m, nn.Linear)
                new = VocabParallelHead(m, g, sequence_parallel=head_gathers)
        elif kind == "replicate" and sequence_parallel:
            _mark_partial(m)
        elif kind in _SEQUENCE_STYLES:
            fn = {"sequence": split_sequence, "gather": gather_sequence, "gather_end": leave_sequence}[kind]
            m.register_forward_pre_hook(_arg_hook(fn, g, n), with_kwargs=True)
        if new is not None:
            _swap(module, name, new)
    _retie(module, {str(k): v for k, v in tied.items() if len(v) > 1})


def tp_group_of(module: nn.Module) -> TPGroup:
    """The :class:`TPGroup` a parallelized module was split over."""
    g = getattr(module, "tp_group", None)
    if not isinstance(g, TPGroup):
        raise ConfigError("this module was not parallelized (dtrain.tensor_parallel.parallelize)")
    return g


def sync_replicated_grads(module: nn.Module) -> None:
    """Sum over the group the gradients of replicated parameters that ran on sequence shards (layer norms,
    row-parallel biases under ``sequence_parallel``): each rank saw only its chunk of the sequence. Call after
    backward, before the optimizer (a collective; nothing to do without sequence parallelism)."""
    g = tp_group_of(module)
    grads = [p.grad for p in module.parameters() if getattr(p, "tp_partial_grad", False) and p.grad is not None]
    if g.size == 1 or not grads:
        return
    flat = torch.cat([t.reshape(-1) for t in grads])
    g.allreduce(flat)
    off = 0
    for t in grads:
        t.copy_(flat[off : off + t.numel()].view_as(t))
        off += t.numel()


_SPLIT = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The unsplit state dict under the original names (a collective over the group)."""
    out: dict[str, torch.Tensor] = {}
    split = {n: m for n, m in module.named_modules() if isinstance(m, _SPLIT)}
    for key, t in module.state_dict().items():
        owner, _, leaf = key.rpartition(".")
        if owner in split:
            continue
        out[key] = t.detach().clone()
    for n, m in split.items():
        for leaf, t in m.full_weights().items():
            out[f"{n}.{leaf}"] = t
    order = {k: i for i, k in enumerate(module.state_dict())}
    return dict(sorted(out.items(), key=lambda kv: order.get(kv[0], len(order))))


def load_full_state_dict(module: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Load an unsplit state dict into a parallelized module: each rank takes its slices."""
    split = {n: m for n, m in module.named_modules() if isinstance(m, _SPLIT)}
    with torch.no_grad():
        for key, t in module.state_dict(keep_vars=True).items():
            owner, _, _ = key.rpartition(".")
            if owner in split:
                continue
            if key not in state:
                raise ConfigError(f"the state dict has no {key!r}")
            t.copy_(state[key])
        for n, m in split.items():
            leaves = ["weight"] + (["bias"] if getattr(m, "bias", None) is not None else [])
            m.load_full({leaf: state[f"{n}.{leaf}"] for leaf in leaves})
