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


# transformers GPT-2 (tied embedding) and Llama (rotary, grouped-query) of 2 layers, width 64, as dtrain run flags;
# GPT-2 with its dropout off (as dtrain's own models), so a step is the same computation in every process
GPT2 = [
    "--model",
    "hf:gpt2",
    "--model-arg",
    "n_layer=2",
    "--model-arg",
    "n_embd=64",
    "--model-arg",
    "n_head=4",
    "--model-arg",
    "n_positions=32",
    "--model-arg",
    "resid_pdrop=0.0",
    "--model-arg",
    "embd_pdrop=0.0",
    "--model-arg",
    "attn_pdrop=0.0",
]
LLAMA = [
    "--model",
    "hf:llama",
    "--model-arg",
    "num_hidden_layers=2",
    "--model-arg",
    "hidden_size=64",
    "--model-arg",
    "intermediate_size=128",
    "--model-arg",
    "num_attention_heads=4",
    "--model-arg",
    "num_key_value_heads=2",
    "--model-arg",
    "max_position_embeddings=32",
]
