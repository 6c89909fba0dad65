"""Reference models: a small CNN (the default) and an MLP.

Both are ``nn.Sequential`` so pipeline partitioning and per-layer profiling can
walk them layer by layer.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

__all__ = ["MODELS", "build_model"]

MODELS = ("cnn", "mlp")


def _cnn(input_shape: tuple[int, ...], num_classes: int, width: int) -> nn.Sequential:
    c, h, w = input_shape
    return nn.Sequential(
        nn.Conv2d(c, width, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * width * (h // 2) * (w // 2), 4 * width),
        nn.ReLU(),
        nn.Linear(4 * width, num_classes),
    )


def _mlp(input_shape: tuple[int, ...], num_classes: int, hidden: Sequence[int]) -> nn.Sequential:
    n_in = 1
    for s in input_shape:
        n_in *= s
    layers: list[nn.Module] = [nn.Flatten()]
    for h in hidden:
        layers += [nn.Linear(n_in, h), nn.ReLU()]
        n_in = h
    layers.append(nn.Linear(n_in, num_classes))
    return nn.Sequential(*layers)


def build_model(
    name: str = "cnn",
    input_shape: tuple[int, ...] = (1, 8, 8),
    num_classes: int = 10,
    *,
    width: int = 16,
    hidden: Sequence[int] = (128, 64),
) -> nn.Sequential:
    """Build a reference model.

    Args:
        name: "cnn" (two 3x3 convolutions, max-pool, two linear layers) or "mlp".
        input_shape: ``(channels, height, width)`` of one sample.
        num_classes: output logits.
        width: channels of the CNN's first convolution (default: 16).
        hidden: hidden layer sizes of the MLP (default: (128, 64)).
    """
    if name == "cnn":
        if len(input_shape) != 3:
            raise ValueError(f"cnn needs a (C, H, W) input shape, got {input_shape}")
        return _cnn(input_shape, num_classes, width)
    if name == "mlp":
        return _mlp(input_shape, num_classes, hidden)
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
