"""Tensor-parallel plans for dtrain's models.

``gpt`` is Megatron's split of a transformer (Shoeybi et al. 2019, section 3): in each block
the fused q/k/v projection is column-parallel by heads (every rank gets its heads' q, k and v),
attention's output projection row-parallel, the MLP's ``fc1`` column-parallel and ``fc2``
row-parallel -- one allreduce per block in each direction for each of attention and MLP; the
token embedding and the LM head are split by vocabulary (the logits never gathered whole).
Layer norms and the position embedding are replicated. With ``sequence_parallel`` the blocks
take sequence shards (``block0``'s input is split) and the norms run on them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from dtrain.errors import ConfigError
from dtrain.tensor_parallel.parallelize import Plan

__all__ = ["gpt", "gpt_sequence_parallel", "for_model"]


def _gpt_heads(module: nn.Module, tp: int) -> None:
    """Give each attention module its share of the heads; a head count the group does not divide is an error."""
    from dtrain.workloads.models.gpt import CausalSelfAttention

    for name, m in module.named_modules():
        if isinstance(m, CausalSelfAttention):
            if m.heads % tp:
                raise ConfigError(f"{name!r}: {m.heads} attention heads do not divide over tensor-parallel size {tp}")
            m.heads //= tp


#: the plan for ``dtrain.workloads.models.build_model("gpt-*")`` (an nn.Sequential of embed, block0.., ln_f, head).
gpt = Plan(
    styles={
        "embed.tok": "vocab",
        "block*.attn.qkv": "colwise:3",
        "block*.attn.proj": "rowwise",
        "block*.mlp.fc1": "colwise",
        "block*.mlp.fc2": "rowwise",
        "block*.ln1": "replicate",
        "block*.ln2": "replicate",
        "ln_f": "replicate",
        "head": "vocab",
    },
    prepare=_gpt_heads,
    name="gpt",
)


def gpt_sequence_parallel() -> Plan:
    """:data:`gpt` with ``block0``'s input split along the sequence (for ``sequence_parallel=True``)."""
    return Plan(styles={**gpt.styles, "block0": "sequence"}, prepare=gpt.prepare, name="gpt+sp")


def _is_dtrain_gpt(model: nn.Module) -> bool:
    from dtrain.workloads.models.gpt import CausalSelfAttention

    return any(isinstance(m, CausalSelfAttention) for m in model.modules())


def for_model(
    model: nn.Module,
    tp: int,
    *,
    tp_plan: str = "auto",
    table: Mapping[str, str] | None = None,
    sequence_parallel: bool = False,
    sample: Any = None,
) -> Plan:
    """The plan a run splits ``model`` by over ``tp`` ranks.

    ``table`` (a ``[tensor.plan]`` of the run's TOML) when given, with the head counts of the plan it replaces;
    else, under ``tp_plan`` ``auto``, :data:`gpt` for dtrain's own gpt models and the derived plan
    (:func:`~dtrain.tensor_parallel.derive.derive_plan`) for any other; ``derive``: the derived plan always.
    """
    from dtrain.tensor_parallel.derive import derive_plan

    if tp_plan not in ("auto", "derive"):
        raise ConfigError(f"tp_plan {tp_plan!r}: choose auto or derive")
    if tp_plan == "auto" and _is_dtrain_gpt(model):
        base = gpt_sequence_parallel() if sequence_parallel else gpt
    else:
        # a table of one's own takes only the head counts from the derived plan (and its own sequence styles)
        base = derive_plan(model, tp, sample=sample, sequence_parallel=sequence_parallel and not table)
    if table:
        return Plan(styles=dict(table), prepare=base.prepare, name="[tensor.plan]")
    return base
