"""Tensor (intra-layer) parallelism on dtrain's collectives: Megatron's column/row-parallel layers, a
vocabulary-split embedding, head and cross entropy, sequence parallelism, and ``parallelize`` by a plan."""

from __future__ import annotations

from dtrain.tensor_parallel import plans
from dtrain.tensor_parallel._functions import TPGroup
from dtrain.tensor_parallel.derive import derive_plan
from dtrain.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
    vocab_parallel_cross_entropy,
)
from dtrain.tensor_parallel.parallelize import (
    STYLES,
    Plan,
    check_plan,
    full_state_dict,
    load_full_state_dict,
    parallelize,
    sync_replicated_grads,
    tp_group_of,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "VocabParallelHead",
    "vocab_parallel_cross_entropy",
    "parallelize",
    "derive_plan",
    "Plan",
    "check_plan",
    "STYLES",
    "plans",
    "full_state_dict",
    "load_full_state_dict",
    "sync_replicated_grads",
    "tp_group_of",
    "TPGroup",
]
