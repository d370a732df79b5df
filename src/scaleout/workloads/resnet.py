"""ResNet-18 / ResNet-50 for CIFAR-sized inputs, on learnable synthetic images.

The CIFAR variant of He et al. (2016): a 3x3 stride-1 stem without max-pool,
four stages of BasicBlocks (ResNet-18: 2-2-2-2) or Bottlenecks (ResNet-50:
3-4-6-3), global average pooling and a linear classifier. ResNet-18 has
11,173,962 parameters, ResNet-50 23,520,842 (for 10 classes).

The synthetic data are 3x32x32 images ``prototype[label] + noise``, with ten
fixed smooth class prototypes, so a model can actually learn them.

Note: the models use BatchNorm, whose statistics are per rank, so N-rank
training is *not* bitwise the single-process run on the concatenated batch.
Use the digits, transformer or DLRM workloads for exactness tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from scaleout.workloads.base import Batch, Workload, build_seeded, check_int, make_generator

__all__ = ["BasicBlock", "Bottleneck", "ResNet", "ResNetWorkload", "resnet18", "resnet50"]

_IMAGE_SHAPE = (3, 32, 32)
_PROTOTYPE_SALT = 0x2E5


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with an identity (or 1x1 projection) shortcut."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = _shortcut(in_planes, planes * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand (x4), with an identity or projection shortcut."""

    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.shortcut = _shortcut(in_planes, planes * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + self.shortcut(x))


def _shortcut(in_planes: int, out_planes: int, stride: int) -> nn.Module:
    if stride == 1 and in_planes == out_planes:
        return nn.Identity()
    return nn.Sequential(
        nn.Conv2d(in_planes, out_planes, 1, stride=stride, bias=False),
        nn.BatchNorm2d(out_planes),
    )


class ResNet(nn.Module):
    """CIFAR-style ResNet: ``(B, 3, H, W)`` images -> ``(B, num_classes)`` logits.

    Args:
        block: :class:`BasicBlock` or :class:`Bottleneck`.
        num_blocks: blocks per stage, four entries.
        num_classes: size of the classifier output.
    """

    def __init__(
        self, block: type[BasicBlock] | type[Bottleneck], num_blocks: tuple[int, int, int, int],
        num_classes: int = 10,
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        in_planes = 64
        stages = []
        for i, (planes, blocks) in enumerate(zip((64, 128, 256, 512), num_blocks)):
            layers = []
            for j in range(blocks):
                stride = 2 if (i > 0 and j == 0) else 1
                layers.append(block(in_planes, planes, stride))
                in_planes = planes * block.expansion
            stages.append(nn.Sequential(*layers))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(in_planes, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        out = torch.flatten(F.adaptive_avg_pool2d(out, 1), 1)
        return self.fc(out)


def resnet18(num_classes: int = 10) -> ResNet:
    """CIFAR ResNet-18 (BasicBlock, 2-2-2-2); 11.17M parameters for 10 classes."""
    return ResNet(BasicBlock, (2, 2, 2, 2), num_classes)


def resnet50(num_classes: int = 10) -> ResNet:
    """CIFAR ResNet-50 (Bottleneck, 3-4-6-3); 23.52M parameters for 10 classes."""
    return ResNet(Bottleneck, (3, 4, 6, 3), num_classes)


_DEPTHS = {18: resnet18, 50: resnet50}


@dataclass(frozen=True, kw_only=True)
class ResNetWorkload(Workload):
    """ResNet-18/50 on synthetic 3x32x32 class-prototype images.

    Args:
        depth: 18 or 50.
        num_classes: number of classes, >= 2.
        default_batch_size: per-rank batch size used by benchmarks.
        noise: standard deviation of the per-pixel noise around the prototype.

    Raises:
        ValueError, TypeError: on construction, for an unsupported depth or a
            non-positive size.
    """

    depth: int = 18
    num_classes: int = 10
    default_batch_size: int = 32
    noise: float = 1.0

    def __post_init__(self) -> None:
        if self.depth not in _DEPTHS:
            raise ValueError(f"depth must be one of {sorted(_DEPTHS)}, got {self.depth!r}")
        check_int("num_classes", self.num_classes, 2)
        check_int("default_batch_size", self.default_batch_size, 1)
        if not isinstance(self.noise, (int, float)) or self.noise < 0:
            raise ValueError(f"noise must be a number >= 0, got {self.noise!r}")

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"resnet{self.depth}"

    @property
    def description(self) -> str:  # type: ignore[override]
        return (
            f"CIFAR-style ResNet-{self.depth} on synthetic 3x32x32 images, "
            f"{self.num_classes} classes, batch {self.default_batch_size}/rank"
        )

    def build_model(self, seed: int) -> ResNet:
        return build_seeded(lambda: _DEPTHS[self.depth](self.num_classes), seed)

    def loss_fn(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs, targets)

    def _prototypes(self) -> torch.Tensor:
        # Smooth patterns: random 8x8 fields upsampled to 32x32, fixed for all seeds.
        coarse = torch.randn(
            self.num_classes, 3, 8, 8, generator=make_generator(_PROTOTYPE_SALT, self.num_classes)
        )
        return F.interpolate(coarse, size=_IMAGE_SHAPE[1:], mode="bilinear", align_corners=False)

    def _global_batch(self, batch_size: int, step: int, seed: int) -> Batch:
        generator = make_generator(seed, step)
        targets = torch.randint(self.num_classes, (batch_size,), generator=generator)
        noise = torch.randn(batch_size, *_IMAGE_SHAPE, generator=generator)
        inputs = self._prototypes()[targets] + self.noise * noise
        return inputs, targets
