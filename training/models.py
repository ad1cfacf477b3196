"""Model families (1-D CNN, MLP) built from plain configuration dicts.

Every model starts with a :class:`Standardize` layer holding the training set's feature
mean/std as buffers, so a saved model takes raw features and needs nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

FAMILIES = ("cnn", "mlp")


@dataclass(frozen=True)
class ArchSpec:
    """Architecture of one classifier (what is needed to rebuild it before loading weights)."""

    family: str
    width: int
    depth: int
    input_dim: int
    num_classes: int

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model family {self.family!r}; expected one of {list(FAMILIES)}")
        if not 1 <= self.width <= 4096:
            raise ValueError(f"width={self.width} must be between 1 and 4096")
        if not 1 <= self.depth <= 8:
            raise ValueError(f"depth={self.depth} must be between 1 and 8")
        if self.input_dim < 1 or self.num_classes < 2:
            raise ValueError(
                f"input_dim={self.input_dim} must be >= 1 and num_classes={self.num_classes} >= 2"
            )
        if self.family == "cnn" and _conv_out_len(self.input_dim, self.depth) < 1:
            raise ValueError(
                f"a CNN of depth {self.depth} does not fit an input of {self.input_dim} features"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "family": self.family,
            "width": self.width,
            "depth": self.depth,
            "input_dim": self.input_dim,
            "num_classes": self.num_classes,
        }

    @classmethod
    def from_params(cls, params: Mapping[str, Any], input_dim: int, num_classes: int) -> ArchSpec:
        """Take the architecture part of a trial's params."""
        return cls(str(params["family"]), int(params["width"]), int(params["depth"]), input_dim, num_classes)


class Standardize(nn.Module):
    """(x - mean) / std with the statistics stored as buffers (saved with the weights)."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        super().__init__()
        std_t = torch.tensor(list(std), dtype=torch.float32).clamp_min(1e-6)
        self.register_buffer("mean", torch.tensor(list(mean), dtype=torch.float32))
        self.register_buffer("std", std_t)

    mean: torch.Tensor
    std: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


def _conv_out_len(length: int, depth: int) -> int:
    for _ in range(depth):
        length = (length + 2 * 1 - 5) // 2 + 1
    return length


class CNN1D(nn.Module):
    """The MNIST-1D paper's convolutional baseline, generalised in width and depth."""

    def __init__(self, input_dim: int, num_classes: int, width: int, depth: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 1
        for _ in range(depth):
            layers += [nn.Conv1d(channels, width, kernel_size=5, stride=2, padding=1), nn.ReLU()]
            channels = width
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(width * _conv_out_len(input_dim, depth), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.features(x.unsqueeze(1))
        return self.head(h.flatten(1))


class MLP(nn.Module):
    """A ReLU multi-layer perceptron with ``depth`` hidden layers."""

    def __init__(self, input_dim: int, num_classes: int, width: int, depth: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        prev = input_dim
        for _ in range(depth):
            layers += [nn.Linear(prev, width), nn.ReLU()]
            prev = width
        layers.append(nn.Linear(prev, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


def build_model(
    arch: ArchSpec, mean: Sequence[float] | None = None, std: Sequence[float] | None = None
) -> nn.Module:
    """A classifier returning logits: standardisation followed by the family's backbone."""
    mean = list(mean) if mean is not None else [0.0] * arch.input_dim
    std = list(std) if std is not None else [1.0] * arch.input_dim
    if len(mean) != arch.input_dim or len(std) != arch.input_dim:
        raise ValueError(
            f"normalisation stats have {len(mean)}/{len(std)} entries; expected {arch.input_dim}"
        )
    backbone: nn.Module
    if arch.family == "cnn":
        backbone = CNN1D(arch.input_dim, arch.num_classes, arch.width, arch.depth)
    else:
        backbone = MLP(arch.input_dim, arch.num_classes, arch.width, arch.depth)
    return nn.Sequential(Standardize(mean, std), backbone)


def count_params(arch: ArchSpec) -> int:
    """Number of trainable parameters of a model of this architecture."""
    model = build_model(arch)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def largest_width_within(
    family: str, depth: int, input_dim: int, num_classes: int, max_params: int
) -> int | None:
    """The largest width whose model has at most ``max_params`` parameters (None if even width 1 is too big)."""
    lo, hi, best = 1, 4096, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if count_params(ArchSpec(family, mid, depth, input_dim, num_classes)) <= max_params:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best
