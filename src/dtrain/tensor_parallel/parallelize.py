"""``parallelize(module, plan, group)``: split a model's layers over a tensor-parallel group by a plan.

A plan maps submodule names (or ``fnmatch`` patterns such as ``block*.mlp.fc1``) to a style,
the vocabulary of torch's ``parallelize_module``:

==============  ==========================================================================
``colwise``     ``nn.Linear`` -> :class:`ColumnParallelLinear` (output features split)
``colwise:N``   the same for a fused projection of ``N`` equal blocks (q, k, v: ``colwise:3``)
``rowwise``     ``nn.Linear`` -> :class:`RowParallelLinear` (input features split, outputs summed)
``vocab``       ``nn.Embedding`` -> :class:`VocabParallelEmbedding`; ``nn.Linear`` (an LM head) ->
                :class:`VocabParallelHead` (logits stay split; use :func:`vocab_parallel_cross_entropy`)
``replicate``   left whole on every rank (with ``sequence_parallel``: runs on sequence shards, its
                gradients summed over the group by :func:`sync_replicated_grads`)
``sequence``    ``sequence_parallel`` only: where a replicated activation enters the sequence-sharded
                region (each rank keeps its chunk of the module's input)
==============  ==========================================================================

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
from dtrain.tensor_parallel._functions import TPGroup, split_sequence
from dtrain.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
)

__all__ = [
    "Plan",
    "STYLES",
    "parallelize",
    "full_state_dict",
    "load_full_state_dict",
    "sync_replicated_grads",
    "tp_group_of",
]

STYLES = ("colwise", "rowwise", "vocab", "replicate", "sequence")


@dataclass(frozen=True)
class Plan:
    """A plan: styles by module name or pattern, and an optional hook run on the model first.

    Attributes:
        styles: module name or ``fnmatch`` pattern -> style (see the module docstring).
        prepare: called as ``prepare(module, tp_size)`` before splitting, e.g. to give attention
            modules their share of the heads; raises ConfigError for a size the model cannot take.
        name: for messages.
    """

    styles: Mapping[str, str]
    prepare: Callable[[nn.Module, int], None] | None = field(default=None, compare=False)
    name: str = "plan"


def _style(style: str) -> tuple[str, int]:
    kind, _, arg = style.partition(":")
    if kind not in STYLES:
        raise ConfigError(
            f"unknown tensor-parallel style {style!r}; choose one of {', '.join(STYLES)} "
            "(colwise:N for a fused projection of N blocks)"
        )
    try:
        n = int(arg) if arg else 1
    except ValueError:
        raise ConfigError(f"style {style!r}: the number of fused blocks must be an integer") from None
    return kind, n


def _resolve(module: nn.Module, styles: Mapping[str, str]) -> dict[str, tuple[str, int]]:
    names = [n for n, _ in module.named_modules() if n]
    out: dict[str, tuple[str, int]] = {}
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


def _check(module: nn.Module, styles: dict[str, tuple[str, int]], size: int, sequence_parallel: bool) -> None:
    mods = dict(module.named_modules())
    for name, (kind, n) in styles.items():
        m = mods[name]
        if kind in ("colwise", "rowwise") and not isinstance(m, nn.Linear):
            raise ConfigError(f"{name!r} is a {type(m).__name__}; {kind} splits an nn.Linear")
        if kind == "vocab" and not isinstance(m, (nn.Linear, nn.Embedding)):
            raise ConfigError(f"{name!r} is a {type(m).__name__}; vocab splits an nn.Embedding or an LM head Linear")
        if kind == "sequence" and not sequence_parallel:
            raise ConfigError(f"{name!r} has style 'sequence', which only applies with sequence_parallel=True")
        if kind == "colwise" and isinstance(m, nn.Linear) and m.out_features % (n * size):
            raise ConfigError(
                f"{name!r}: {m.out_features} output features do not divide over tensor-parallel "
                f"size {size}{f' in {n} fused blocks' if n > 1 else ''}"
            )
        if kind == "rowwise" and isinstance(m, nn.Linear) and m.in_features % size:
            raise ConfigError(
                f"{name!r}: {m.in_features} input features do not divide over tensor-parallel size {size}"
            )


def _agree(module: nn.Module, styles: dict[str, tuple[str, int]], g: TPGroup, sequence_parallel: bool) -> None:
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


def _split_input_hook(g: TPGroup) -> Callable[..., Any]:
    def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (split_sequence(args[0], g), *args[1:])

    return hook


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
    mods = dict(module.named_modules())
    for name, (kind, n) in styles.items():
        m = mods[name]
        new: nn.Module | None = None
        if kind == "colwise":
            assert isinstance(m, nn.Linear)
            new = ColumnParallelLinear(m, g, chunks=n, sequence_parallel=sequence_parallel, name=name)
        elif kind == "rowwise":
            assert isinstance(m, nn.Linear)
            new = RowParallelLinear(m, g, sequence_parallel=sequence_parallel, name=name)
        elif kind == "vocab":
            new = (
                VocabParallelEmbedding(m, g, sequence_parallel=False)
                if isinstance(m, nn.Embedding)
                else VocabParallelHead(m, g, sequence_parallel=sequence_parallel)
            )
        elif kind == "replicate" and sequence_parallel:
            _mark_partial(m)
        elif kind == "sequence":
            m.register_forward_pre_hook(_split_input_hook(g))
        if new is not None:
            _swap(module, name, new)
    object.__setattr__(module, "tp_group", g)
    return module


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
