"""A decoder-only transformer language model (GPT) written on ``torch.nn``.

The model is a plain ``nn.Sequential`` so a pipeline can cut it between any two
children and per-layer profiling can walk it. Its children, in order:

* ``embed`` -- :class:`Embedding`: token embedding ``tok`` plus learned position
  embedding ``pos``; int64 token ids ``(batch, seq)`` -> ``(batch, seq, d_model)``.
* ``block0``, ``block1``, ... -- one pre-norm :class:`Block` per layer:
  ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``, where ``attn`` is
  :class:`CausalSelfAttention` (``qkv``: Linear(d, 3d), ``proj``: Linear(d, d)) and
  ``mlp`` is :class:`MLP` (``fc1``: Linear(d, 4d), GELU, ``fc2``: Linear(4d, d)).
* ``ln_f`` -- the final LayerNorm.
* ``head`` -- Linear(d, vocab_size) giving float32 logits ``(batch, seq, vocab_size)``.
  Its weight is not tied to the token embedding, so every child owns its
  parameters and the Sequential stays cuttable.

So the state_dict has names like ``embed.tok.weight``, ``block1.attn.qkv.weight``,
``block1.mlp.fc1.weight`` and ``head.bias``. The configuration travels with the
model as the attribute ``gpt_config`` (see :func:`gpt_config`).

Example:
    >>> model = build_gpt("gpt-tiny", seq_len=32)
    >>> model(torch.zeros(2, 32, dtype=torch.long)).shape
    torch.Size([2, 32, 256])
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from types import MappingProxyType
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

__all__ = [
    "GPTConfig",
    "GPT_PRESETS",
    "GPT_MODELS",
    "Embedding",
    "CausalSelfAttention",
    "MLP",
    "Block",
    "resolve_gpt_config",
    "build_gpt",
    "gpt_config",
    "generate",
]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT model.

    Attributes:
        vocab_size: number of token ids (default: 256, one per byte).
        seq_len: longest input sequence (the position embedding's size).
        layers: transformer blocks.
        d_model: width of the residual stream.
        heads: attention heads; ``d_model`` must be a multiple of it.
        dropout: dropout probability on embeddings, attention weights and the
            residual branches, in ``[0, 1)``; active only in training mode.

    The MLP's hidden width is ``4 * d_model`` (:attr:`mlp_hidden`).
    """

    vocab_size: int = 256
    seq_len: int = 64
    layers: int = 6
    d_model: int = 256
    heads: int = 8
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "layers", "d_model", "heads"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"GPTConfig.{name} must be an int, got {v!r}")
            if v < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {v}; set it to a positive integer")
        if self.d_model % self.heads:
            raise ValueError(
                f"GPTConfig.d_model ({self.d_model}) must be divisible by heads ({self.heads}); "
                f"change d_model to a multiple of {self.heads} or heads to a divisor of {self.d_model}"
            )
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)):
            raise ValueError(f"GPTConfig.dropout must be a number, got {self.dropout!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must satisfy 0 <= dropout < 1, got {self.dropout}")

    @property
    def mlp_hidden(self) -> int:
        """Hidden width of each block's MLP: ``4 * d_model``."""
        return 4 * self.d_model

    @property
    def head_dim(self) -> int:
        """Width of one attention head: ``d_model // heads``."""
        return self.d_model // self.heads

    def num_params(self) -> int:
        """Number of parameters of the model this config builds, computed without building it."""
        d, h = self.d_model, self.mlp_hidden
        embed = (self.vocab_size + self.seq_len) * d
        layer_norm = 2 * d
        attn = (d * 3 * d + 3 * d) + (d * d + d)
        mlp = (d * h + h) + (h * d + d)
        block = 2 * layer_norm + attn + mlp
        head = d * self.vocab_size + self.vocab_size
        return embed + self.layers * block + layer_norm + head


#: The named shapes. ``gpt-small`` has about 4.9M parameters and ``gpt-medium``
#: about 38M (with the default vocabulary of 256 and seq_len of 64).
GPT_PRESETS: Mapping[str, GPTConfig] = MappingProxyType(
    {
        "gpt-tiny": GPTConfig(layers=2, d_model=64, heads=4),
        "gpt-small": GPTConfig(layers=6, d_model=256, heads=8),
        "gpt-medium": GPTConfig(layers=12, d_model=512, heads=8),
    }
)

_ALIASES = {"gpt": "gpt-small"}

#: Every name :func:`build_gpt` accepts: the plain ``gpt`` (gpt-small's shape,
#: meant to be resized by keyword) and the presets.
GPT_MODELS: tuple[str, ...] = ("gpt", *GPT_PRESETS)


class Embedding(nn.Module):
    """Token embedding plus learned position embedding.

    Maps int64 token ids ``(batch, seq)`` with ``seq <= seq_len`` to
    ``(batch, seq, d_model)``; position ``i`` of every sequence gets ``pos[i]``.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.seq_len = cfg.seq_len
        self.dropout = cfg.dropout
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Embed token ids.

        Args:
            idx: int64 token ids of shape ``(batch, seq)``.

        Raises:
            ValueError: ``idx`` is not 2-D, or its sequences are longer than ``seq_len``.
        """
        if idx.dim() != 2:
            raise ValueError(f"GPT input must be token ids of shape (batch, seq), got shape {tuple(idx.shape)}")
        t = idx.size(1)
        if t > self.seq_len:
            raise ValueError(f"sequence of length {t} is longer than the model's seq_len {self.seq_len}")
        positions = torch.arange(t, device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        return F.dropout(x, self.dropout, self.training)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position ``t`` sees only positions ``<= t``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over ``x`` of shape ``(batch, seq, d_model)``; returns the same shape."""
        qkv = self.qkv(x)
        # the width, heads and positions held here: all of them, or under tensor parallelism this rank's heads
        # (and with sequence parallelism the whole sequence, gathered by qkv, from this rank's chunk)
        b, t, w = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
        q, k, v = qkv.split(w, dim=2)
        # (b, t, w) -> (b, heads, t, head_dim)
        q, k, v = (z.view(b, t, self.heads, w // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(b, t, w)
        return F.dropout(self.proj(y), self.dropout, self.training)


class MLP(nn.Module):
    """Position-wise feed-forward network: ``fc2(gelu(fc1(x)))`` with hidden width ``4 * d_model``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.dropout = cfg.dropout
        self.fc1 = nn.Linear(cfg.d_model, cfg.mlp_hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(cfg.mlp_hidden, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to ``x`` of shape ``(..., d_model)``."""
        return F.dropout(self.fc2(self.act(self.fc1(x))), self.dropout, self.training)


class Block(nn.Module):
    """A pre-norm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``x`` of shape ``(batch, seq, d_model)``."""
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


def _init_weights(model: nn.Module, cfg: GPTConfig) -> None:
    """GPT-2 initialisation, drawn from torch's global RNG in module order.

    Linear and embedding weights are normal with std 0.02, biases zero, LayerNorms
    ones and zeros. The two projections that write into the residual stream
    (``attn.proj`` and ``mlp.fc2``) get std ``0.02 / sqrt(2 * layers)`` so the
    residual's variance does not grow with depth, following GPT-2 (Radford et al.
    2019, "Language Models are Unsupervised Multitask Learners", section 2.3).
    """
    residual_std = 0.02 / math.sqrt(2 * cfg.layers)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
    for m in model.modules():
        if isinstance(m, CausalSelfAttention):
            nn.init.normal_(m.proj.weight, mean=0.0, std=residual_std)
        elif isinstance(m, MLP):
            nn.init.normal_(m.fc2.weight, mean=0.0, std=residual_std)


def _from_config(cfg: GPTConfig) -> nn.Sequential:
    children: OrderedDict[str, nn.Module] = OrderedDict()
    children["embed"] = Embedding(cfg)
    for i in range(cfg.layers):
        children[f"block{i}"] = Block(cfg)
    children["ln_f"] = nn.LayerNorm(cfg.d_model)
    children["head"] = nn.Linear(cfg.d_model, cfg.vocab_size)
    model = nn.Sequential(children)
    _init_weights(model, cfg)
    # A plain (non-tensor, non-module) attribute: Module.__setattr__ would store it the same way.
    object.__setattr__(model, "gpt_config", cfg)
    return model


def resolve_gpt_config(name: str = "gpt", **overrides: Any) -> GPTConfig:
    """The config :func:`build_gpt` would build, without building the model.

    Args:
        name: one of :data:`GPT_MODELS`.
        **overrides: any :class:`GPTConfig` field; a value of 0 or None keeps the preset's value.

    Raises:
        ValueError: unknown name or keyword, or the resulting config is invalid.
    """
    key = _ALIASES.get(name, name)
    if key not in GPT_PRESETS:
        raise ValueError(f"unknown GPT model {name!r}; choose one of {', '.join(GPT_MODELS)}")
    valid = [f.name for f in fields(GPTConfig)]
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise ValueError(f"unknown GPT option(s) {', '.join(unknown)}; valid options are {', '.join(valid)}")
    changes: dict[str, Any] = {k: v for k, v in overrides.items() if v is not None and v != 0}
    return replace(GPT_PRESETS[key], **changes)


def build_gpt(name: str = "gpt", **overrides: Any) -> nn.Sequential:
    """Build a GPT by preset name, optionally resized.

    The weights are drawn from torch's global RNG, so the same ``torch.manual_seed``
    gives the same model.

    Args:
        name: "gpt" (gpt-small's shape), "gpt-tiny", "gpt-small" or "gpt-medium".
        **overrides: any :class:`GPTConfig` field (``vocab_size``, ``seq_len``,
            ``layers``, ``d_model``, ``heads``, ``dropout``). A value of 0 or None
            means "the preset's value", so CLI flags that default to 0 leave the
            preset alone.

    Returns:
        The model as an ``nn.Sequential`` (children ``embed``, ``block0``...,
        ``ln_f``, ``head``) carrying its config as ``model.gpt_config``.

    Raises:
        ValueError: unknown name or keyword, or an invalid resulting config.
    """
    return _from_config(resolve_gpt_config(name, **overrides))


def gpt_config(model: nn.Module) -> GPTConfig | None:
    """The :class:`GPTConfig` a model was built from, or None if it is not a GPT from :func:`build_gpt`."""
    cfg = getattr(model, "gpt_config", None)
    return cfg if isinstance(cfg, GPTConfig) else None


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: torch.Tensor,
    new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int = 0,
) -> torch.Tensor:
    """Sample a continuation of ``prompt`` one token at a time.

    Each step feeds the last ``seq_len`` tokens (the context is cropped to the
    model's ``seq_len``), divides the last position's logits by ``temperature``,
    keeps the ``top_k`` largest if given, and samples from the softmax with a
    CPU ``torch.Generator`` seeded with ``seed``, so the same seed gives the same
    tokens. The model runs in eval mode; its previous mode is restored after.

    Args:
        model: a GPT built by :func:`build_gpt` (its ``gpt_config`` gives ``seq_len``).
        prompt: 1-D int64 token ids, at least one.
        new_tokens: how many tokens to sample (>= 0).
        temperature: > 0; lower is greedier.
        top_k: sample only among the ``top_k`` most likely tokens (None: all).
        seed: seeds the sampling generator.

    Returns:
        1-D int64 tensor on the prompt's device: the prompt followed by the ``new_tokens`` sampled tokens.

    Raises:
        ValueError: the model has no ``gpt_config``, or an argument is out of range.
    """
    cfg = gpt_config(model)
    if cfg is None:
        raise ValueError("generate needs a model built by build_gpt (it reads model.gpt_config for seq_len)")
    if prompt.dim() != 1 or prompt.numel() == 0 or prompt.dtype != torch.int64:
        shape = tuple(prompt.shape)
        raise ValueError(f"prompt must be a non-empty 1-D int64 tensor, got {prompt.dtype} of shape {shape}")
    if new_tokens < 0:
        raise ValueError(f"new_tokens must be >= 0, got {new_tokens}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    out = prompt.detach().to("cpu")
    was_training = model.training
    model.eval()
    try:
        for _ in range(new_tokens):
            ctx = out[-cfg.seq_len :].unsqueeze(0).to(device)
            logits = model(ctx)[0, -1].float().cpu() / temperature
            if top_k is not None and top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=gen)
            out = torch.cat([out, nxt])
    finally:
        model.train(was_training)
    return out.to(prompt.device)
