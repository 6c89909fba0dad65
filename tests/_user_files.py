"""The source of a user's model file, as the tests of user models write it to a temporary folder: a residual CNN
for the 8x8 digits, ``build(width=8, blocks=2)``."""

RESIDUAL_CNN = """
import torch
from torch import nn


class Residual(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv, self.norm = nn.Conv2d(c, c, 3, padding=1), nn.GroupNorm(2, c)

    def forward(self, x):
        return torch.relu(x + self.norm(self.conv(x)))


def build(width=8, blocks=2):
    return nn.Sequential(nn.Conv2d(1, width, 3, padding=1), *[Residual(width) for _ in range(blocks)],
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10))
"""
