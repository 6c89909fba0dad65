"""The models the peer benchmarks train: dtrain's own by name, and a model dtrain did not write.

``hf-llama-small`` is a Hugging Face transformers Llama of gpt-small's size, built the way ``--model hf:llama``
builds one (``dtrain.workloads.models.make_model``: from a configuration, random weights, nothing downloaded):
6 decoder layers of width 256, 8 attention heads over 4 key-value heads (grouped-query attention), a SwiGLU
MLP of 688, rotary positions, RMSNorm, an untied head, dropout off; about 4.5M parameters on a vocabulary of
256. Its forward returns a transformers output whose ``.logits`` are read with
``dtrain.workloads.models.logits_of``.

Usage::

    net = build("hf-llama-small", seq_len=128, vocab_size=256)
    for layer in blocks(net):        # FSDP2's units: gpt's blocks, a transformers model's decoder layers
        fully_shard(layer, mesh=mesh)
"""

from __future__ import annotations

from typing import Any

from torch import nn

#: name -> the transformers model type and the fields of its configuration
HF_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "hf-llama-small": (
        "llama",
        dict(
            num_hidden_layers=6,
            hidden_size=256,
            num_attention_heads=8,
            num_key_value_heads=4,
            intermediate_size=688,
            attention_dropout=0.0,
            tie_word_embeddings=False,
        ),
    ),
}
GPT = ("gpt-tiny", "gpt-small", "gpt-medium")
LANGUAGE = (*GPT, *HF_MODELS)


def build(name: str, *, seq_len: int, vocab_size: int) -> nn.Module:
    """A language model of ``LANGUAGE`` for windows of ``seq_len`` tokens over ``vocab_size`` ids."""
    from dtrain.workloads.models import build_model, make_model

    if name in HF_MODELS:
        kind, fields = HF_MODELS[name]
        args = {**fields, "vocab_size": vocab_size, "max_position_embeddings": seq_len}
        return make_model(f"hf:{kind}", (seq_len,), vocab_size, task="lm", model_args=args, seq_len=seq_len)
    return build_model(name, seq_len=seq_len, vocab_size=vocab_size)


def blocks(net: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP2 shards one by one: gpt's ``block*`` children, or the decoder layers of a
    transformers model (its base model's ``layers`` or ``h``)."""
    found = [c for n, c in net.named_children() if n.startswith("block")]
    if found:
        return found
    base = getattr(net, "base_model", net)
    for attr in ("layers", "h"):
        layers = getattr(base, attr, None)
        if isinstance(layers, nn.ModuleList):
            return list(layers)
    raise ValueError(f"{type(net).__name__} has no block* children nor decoder layers to shard")


def preload(name: str) -> None:
    """Import what building ``name`` imports (transformers and its model's code), so that a memory probe's
    baseline taken after this holds the imported code and the figure holds the model alone."""
    if name in HF_MODELS:
        import importlib

        importlib.import_module(f"transformers.models.{HF_MODELS[name][0]}.modeling_{HF_MODELS[name][0]}")
