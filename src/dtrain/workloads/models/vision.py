"""Reference vision models: a small CNN (the default model of dtrain) and an MLP.

Both are ``nn.Sequential`` so pipeline partitioning and per-layer profiling can
walk them layer by layer.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

__all__ = ["VISION_MODELS", "build_cnn", "build_mlp"]

VISION_MODELS = ("cnn", "mlp")


def build_cnn(input_shape: tuple[int, ...], num_classes: int, width: int) -> nn.Sequential:
    """Two 3x3 convolutions, a 2x2 max-pool and two linear layers.

    Args:
        input_shape: ``(channels, height, width)`` of one sample.
        num_classes: output logits.
        width: channels of the first convolution (the second has twice as many).
    """
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


def build_mlp(input_shape: tuple[int, ...], num_classes: int, hidden: Sequence[int]) -> nn.Sequential:
    """A flatten, then one ``Linear + ReLU`` per hidden size, then the output layer.

    Args:
        input_shape: shape of one sample (flattened).
        num_classes: output logits.
        hidden: hidden layer sizes.
    """
    n_in = 1
    for s in input_shape:
        n_in *= s
    layers: list[nn.Module] = [nn.Flatten()]
    for h in hidden:
        layers += [nn.Linear(n_in, h), nn.ReLU()]
        n_in = h
    layers.append(nn.Linear(n_in, num_classes))
    return nn.Sequential(*layers)
