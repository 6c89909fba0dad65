"""The pieces a pipeline and a tensor-parallel plan cut a model dtrain did not write into, for its profile.

A module that is not an ``nn.Sequential`` (a transformers ``LlamaForCausalLM``, a user's file) is profiled by
:func:`~dtrain.perfmodel.profile.profile_model` not by its top-level children but by the pieces a run cuts:

* the modules before its list of repeated blocks that hold parameters (the embedding), each block, and the
  modules after it (the final norm, the head), as :func:`dtrain.pipeline.blocks.trace` finds them on the sample;
* the cut units (``units``: pieces per unit) are what a pipeline may cut between: the prologue rides with the
  first block and the epilogue with the last, as :mod:`dtrain.pipeline.staged` places them;
* each piece's kind (``embed`` / ``head``: a vocabulary split, ``block``, ``ln``: no parameter split, else
  ``other``) and the fraction of its parameters the derived plan (:func:`dtrain.tensor_parallel.derive_plan`)
  splits over the tensor-parallel ranks (column-parallel weights and biases, row-parallel weights, vocabulary
  splits); the shape the tensor model's collectives are sized by: blocks, width (the prologue's output), the
  largest head count every split attention's heads and key/value heads share, vocabulary, sequence.

Nothing here runs a collective; the sample's forward runs on this process.
"""

from __future__ import annotations

import fnmatch
import math
from typing import Any

import torch
from torch import nn

from dtrain.errors import ConfigError

__all__ = ["model_pieces"]


def _split_params(model: nn.Module, name: str, styles: dict[str, str]) -> int:
    """The parameter elements under module ``name`` that ``styles`` split over the tensor-parallel ranks."""
    out = 0
    for sub, m in model.get_submodule(name).named_modules():
        full = f"{name}.{sub}" if sub else name
        style = next((v for k, v in styles.items() if full == k or fnmatch.fnmatchcase(full, k)), "")
        kind = style.partition(":")[0]
        for pname, p in m.named_parameters(recurse=False):
            if kind in ("colwise", "vocab") or (kind == "rowwise" and pname == "weight"):
                out += p.numel()
    return out


def _plan_shape(model: nn.Module, x: torch.Tensor, width: int, blocks: int) -> tuple[dict[str, str], dict[str, int]]:
    """The derived plan's styles and the shape of the split; empty when no plan splits the model."""
    from dtrain.tensor_parallel.derive import attention_heads, derive_plan

    try:
        styles = dict(derive_plan(model, 1, sample=x).styles)
        heads = attention_heads(model, sample=x)
    except ConfigError:
        return {}, {}
    vocab = [
        int(w.shape[0])
        for k, v in styles.items()
        if v == "vocab"
        for n, m in model.named_modules()
        if n == k and isinstance(w := getattr(m, "weight", None), torch.Tensor)
    ]
    if not heads or not vocab or width < 1 or x.dim() != 2:
        return styles, {}
    shared = math.gcd(*(c for _, h, kv in heads for c in (h, kv)))
    return styles, {"layers": blocks, "hidden": width, "heads": shared, "vocab": max(vocab), "seq": int(x.shape[1])}


def model_pieces(model: nn.Module, x: Any) -> tuple[list[tuple[str, nn.Module]], dict[str, Any]] | None:
    """The pieces of ``model`` (name, module) in forward order and what the profile keeps of them (``extra``:
    ``"pieces"`` with the kinds, split fractions and cut units; ``"gpt"``, the shape the tensor and mesh models
    size the split by, when the derived plan splits attention and a vocabulary); None for an ``nn.Sequential``,
    dtrain's own models, a module without a list of repeated blocks, or one on the meta device (each profiled by
    its children)."""
    from dtrain.pipeline.blocks import BOTH, POST, PRE, UNUSED, trace
    from dtrain.pipeline.partition import PartitionError

    if isinstance(model, nn.Sequential) or getattr(model, "gpt_config", None) is not None:
        return None
    if not isinstance(x, torch.Tensor) or x.is_meta or any(p.is_meta for p in model.parameters()):
        return None  # the trace and the derived plan run the forward: not on the meta device
    try:
        layout = trace(model, x)
    except PartitionError:
        return None
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    placed = sorted((p for p in layout.placed.values() if p.params), key=lambda p: order.get(p.name, 0))
    pre = [p.name for p in placed if p.where in (PRE, BOTH, UNUSED)]
    post = [p.name for p in placed if p.where == POST]
    names = [*pre, *layout.blocks, *post]
    n = len(layout.blocks)
    units = [len(pre) + n + len(post)] if n == 1 else [len(pre) + 1, *[1] * (n - 2), 1 + len(post)]
    width = next((p.tail[-1] for p in placed if p.where in (PRE, BOTH) and p.tail), 0)
    styles, shape = _plan_shape(model, x, width, n)
    kinds, split = [], []
    for name in names:
        total = sum(p.numel() for p in model.get_submodule(name).parameters())
        part = _split_params(model, name, styles)
        vocab = any(v == "vocab" and name == k for k, v in styles.items())
        if name in layout.blocks:
            kind = "block"
        elif vocab:
            kind = "embed" if name in pre else "head"
        else:
            kind = "ln" if part == 0 and name in post else "other"
        kinds.append(kind)
        split.append(part / total if total else 0.0)
    extra: dict[str, Any] = {"pieces": {"kinds": kinds, "split": split, "units": units}}
    if shape:
        extra["gpt"] = shape
    return [(name, model.get_submodule(name)) for name in names], extra
