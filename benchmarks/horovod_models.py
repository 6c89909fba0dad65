"""VGG-16 and ResNet-101 (ImageNet, 224x224) as flat ``nn.Sequential`` models on the meta device.

Used by the Horovod reproduction (``benchmarks/horovod_scaling.py``): the
planner needs each layer's parameters and FLOPs in backward order, not the
weights, so the models are built on the meta device and never run. Each
function returns ``(model, sample_batch)`` as ``dtrain plan --model FILE:FN``
expects. Architectures: Simonyan & Zisserman 2014 (configuration D) and He et
al. 2015 (bottleneck blocks [3, 4, 23, 3]); each residual block is one layer.
"""

from __future__ import annotations

import torch
from torch import nn

BATCH = 64  # per GPU, as in Horovod's tf_cnn_benchmarks runs


class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        )
        self.down = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.down(x))


def _sample(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(batch, 3, 224, 224, device="meta"), torch.zeros(batch, dtype=torch.long, device="meta")


def resnet101(batch: int = BATCH) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    with torch.device("meta"):
        layers: list[nn.Module] = [
            nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        ]
        cin = 64
        for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 23, 2), (512, 3, 2)):
            for i in range(blocks):
                layers.append(Bottleneck(cin, width, stride if i == 0 else 1))
                cin = 4 * width
        layers.append(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 1000)))
        model = nn.Sequential(*layers)
    return model, _sample(batch)


def vgg16(batch: int = BATCH) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    cfg = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]
    with torch.device("meta"):
        layers: list[nn.Module] = []
        cin = 3
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(cin, int(v), 3, padding=1), nn.ReLU()]
                cin = int(v)
        layers += [
            nn.Flatten(),
            nn.Linear(512 * 7 * 7, 4096),
            nn.ReLU(),
            nn.Linear(4096, 4096),
            nn.ReLU(),
            nn.Linear(4096, 1000),
        ]
        model = nn.Sequential(*layers)
    return model, _sample(batch)
