"""The models a run trains: dtrain's own (a small CNN, the default; an MLP; GPT language models) and the user's.

dtrain's own models are ``nn.Sequential`` so pipeline partitioning and per-layer
profiling can walk them child by child.

* ``cnn``, ``mlp`` -- image classifiers (:mod:`dtrain.workloads.models.vision`).
* ``gpt``, ``gpt-tiny``, ``gpt-small``, ``gpt-medium`` -- decoder-only
  transformers over token ids (:mod:`dtrain.workloads.models.gpt`).
* a user's ``FILE.py:FN`` / ``MODULE:FN`` and transformers' ``hf:TYPE`` / ``hf:DIR``
  (:mod:`dtrain.workloads.models.specs`; :func:`make_model` builds any of them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from dtrain.workloads.models.gpt import GPT_MODELS, GPT_PRESETS, GPTConfig, build_gpt, generate, gpt_config
from dtrain.workloads.models.specs import build_spec, is_builtin, load_function
from dtrain.workloads.models.vision import VISION_MODELS, build_cnn, build_mlp

__all__ = [
    "MODELS",
    "build_model",
    "make_model",
    "task_loss",
    "logits_of",
    "run_loss",
    "GPTConfig",
    "GPT_PRESETS",
    "generate",
    "gpt_config",
    "is_language_model",
]

MODELS = (*VISION_MODELS, *GPT_MODELS)


def logits_of(output: Any) -> torch.Tensor:
    """A model's logits from what its forward returned: a tensor, a tuple or list (its first item), or an object
    with ``.logits`` (a transformers model's output)."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(
        f"a model's forward returned a {type(output).__name__}: dtrain takes a tensor of logits, a "
        "tuple whose first item is one, or an object with .logits; give --loss MODULE:FN otherwise"
    )


def task_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """The training loss of dtrain's models: cross entropy over classes, or over every position of a
    language model's ``(batch, seq, vocab)`` logits against ``(batch, seq)`` next tokens. ``output`` may be
    anything :func:`logits_of` reads."""
    output = logits_of(output)
    if output.dim() == 3 and target.dim() == 2:
        return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())
    return nn.functional.cross_entropy(output, target)


def run_loss(cfg: Any) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """A run's loss function: ``cfg.loss`` (``MODULE:FN`` / ``FILE.py:FN``, called as ``FN(output, target)``), or
    :func:`task_loss`."""
    if not getattr(cfg, "loss", ""):
        return task_loss
    fn: Callable[[Any, torch.Tensor], torch.Tensor] = load_function(cfg.loss, what="loss")
    return fn


def is_language_model(name: str) -> bool:
    """Whether ``name`` is a language model (takes token ids, predicts the next token at every position)."""
    return name in GPT_MODELS


def build_model(
    name: str = "cnn",
    input_shape: tuple[int, ...] = (1, 8, 8),
    num_classes: int = 10,
    *,
    width: int = 16,
    hidden: Sequence[int] = (128, 64),
    **gpt_overrides: Any,
) -> nn.Sequential:
    """Build a reference model.

    Args:
        name: one of :data:`MODELS`: "cnn" (two 3x3 convolutions, max-pool, two
            linear layers), "mlp", or a GPT: "gpt" (gpt-small's shape), "gpt-tiny",
            "gpt-small", "gpt-medium".
        input_shape: ``(channels, height, width)`` of one sample for cnn/mlp. For a
            GPT, a 1-D ``(seq_len,)`` sets ``seq_len`` unless it is given by keyword.
        num_classes: output logits; for a GPT the vocabulary size unless
            ``vocab_size`` is given by keyword.
        width: channels of the CNN's first convolution (default: 16).
        hidden: hidden layer sizes of the MLP (default: (128, 64)).
        **gpt_overrides: GPT only: any :class:`GPTConfig` field (``vocab_size``,
            ``seq_len``, ``layers``, ``d_model``, ``heads``, ``dropout``); 0 or None
            keeps the preset's value.

    Raises:
        ValueError: unknown name or keyword, a GPT keyword given a non-default
            value for cnn/mlp, or a bad shape or config.
    """
    if is_language_model(name):
        opts = dict(gpt_overrides)
        if not opts.get("seq_len") and len(input_shape) == 1:
            opts["seq_len"] = input_shape[0]
        if not opts.get("vocab_size"):
            opts["vocab_size"] = num_classes
        return build_gpt(name, **opts)
    if name not in VISION_MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    valid = GPTConfig.__dataclass_fields__
    unknown = sorted(set(gpt_overrides) - set(valid))
    if unknown:
        raise ValueError(f"unknown model option(s) {', '.join(unknown)}; valid GPT options are {', '.join(valid)}")
    used = sorted(k for k, v in gpt_overrides.items() if v is not None and v != 0)
    if used:
        raise ValueError(f"{', '.join(used)} only apply to GPT models ({', '.join(GPT_MODELS)}), not {name!r}")
    if name == "cnn":
        if len(input_shape) != 3:
            raise ValueError(f"cnn needs a (C, H, W) input shape, got {input_shape}")
        return build_cnn(input_shape, num_classes, width)
    return build_mlp(input_shape, num_classes, hidden)


def make_model(
    name: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    task: str = "classify",
    model_args: Mapping[str, Any] | None = None,
    seq_len: int = 64,
    **gpt_overrides: Any,
) -> nn.Module:
    """The model of any ``--model`` spec (:mod:`dtrain.workloads.models.specs`) for a dataset.

    A dtrain name goes to :func:`build_model` with ``model_args`` and ``gpt_overrides`` as its keywords; a
    function or transformers spec is built with ``model_args`` for the data's ``task``, shape and classes.
    """
    args = dict(model_args or {})
    if is_builtin(name):
        return build_model(name, input_shape, num_classes, **{**args, **gpt_overrides})
    model, _ = build_spec(name, args, task=task, input_shape=input_shape, num_classes=num_classes, seq_len=seq_len)
    return model
