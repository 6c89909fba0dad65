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

from torch import nn

from dtrain.errors import ConfigError
from dtrain.tensor_parallel.parallelize import Plan

__all__ = ["gpt"]


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
