"""Built-in families beyond the MNIST-1D baselines: a residual 1-D CNN for signals, 2-D CNNs
for images and a GRU for sequences.

They register through the ``mopflow.models`` entry points like any user's family. Every
backbone takes flat rows ``(n, input_dim)`` and reshapes them to the data's ``input_shape``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from mopflow.training.models.families import DataSpec, ModelFamily


def as_signal(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Rows as ``(n, channels, length)``: a table ``(d,)`` is one channel of length d, a
    sequence ``(steps, features)`` has a channel per feature."""
    if len(shape) == 1:
        return x.view(len(x), 1, shape[0])
    steps, features = shape[0], int(torch.tensor(shape[1:]).prod())
    return x.view(len(x), steps, features).transpose(1, 2)


def as_image(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Rows as ``(n, channels, height, width)``."""
    return x.view(len(x), *shape)


class RandomShift(nn.Module):
    """Training-time augmentation: shift each signal by up to ``max_shift`` steps (zeros come in)."""

    def __init__(self, max_shift: int) -> None:
        super().__init__()
        self.max_shift = max_shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.max_shift == 0:
            return x
        n, _, length = x.shape
        shifts = torch.randint(-self.max_shift, self.max_shift + 1, (n, 1, 1), device=x.device)
        index = torch.arange(length, device=x.device).view(1, 1, length) - shifts
        valid = (index >= 0) & (index < length)
        shifted = torch.gather(x, 2, index.clamp(0, length - 1).expand_as(x))
        return shifted * valid


class ResBlock(nn.Module):
    """conv-BN-ReLU-conv-BN plus the input (projected when the shape changes), then ReLU; 1-D or
    2-D (``dims``)."""

    def __init__(self, cin: int, cout: int, stride: int, dims: int) -> None:
        super().__init__()
        conv, norm = (nn.Conv1d, nn.BatchNorm1d) if dims == 1 else (nn.Conv2d, nn.BatchNorm2d)
        self.body = nn.Sequential(
            conv(cin, cout, 3, stride=stride, padding=1, bias=False),
            norm(cout),
            nn.ReLU(),
            conv(cout, cout, 3, padding=1, bias=False),
            norm(cout),
        )
        self.skip: nn.Module = (
            nn.Identity()
            if stride == 1 and cin == cout
            else nn.Sequential(conv(cin, cout, 1, stride=stride, bias=False), norm(cout))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


class ResCNN1D(nn.Module):
    """A residual 1-D CNN: stem, ``depth`` residual blocks (every other one halves the length),
    global average pooling and a linear head; optional random shifts while training."""

    def __init__(self, data: DataSpec, width: int, depth: int, shift: int) -> None:
        super().__init__()
        self.shape = data.input_shape
        channels = self.shape[1] if len(self.shape) > 1 else 1
        self.augment = RandomShift(shift)
        self.stem = nn.Sequential(
            nn.Conv1d(channels, width, 5, padding=2, bias=False), nn.BatchNorm1d(width), nn.ReLU()
        )
        self.blocks = nn.Sequential(
            *(ResBlock(width, width, 2 if i % 2 else 1, dims=1) for i in range(depth))
        )
        self.head = nn.Linear(width, data.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.stem(self.augment(as_signal(x, self.shape))))
        return self.head(h.mean(dim=2))


class CNN2D(nn.Module):
    """A plain 2-D CNN: ``depth`` x (conv 3x3 stride 2, ReLU) then a linear head. Conv-ReLU pairs
    only, so it quantizes statically (a student for images)."""

    def __init__(self, data: DataSpec, width: int, depth: int) -> None:
        super().__init__()
        self.shape = data.input_shape
        layers: list[nn.Module] = []
        channels, height, breadth = self.shape
        for i in range(depth):
            layers += [nn.Conv2d(channels, width * 2 ** min(i, 2), 3, stride=2, padding=1), nn.ReLU()]
            channels = width * 2 ** min(i, 2)
            height, breadth = (height + 1) // 2, (breadth + 1) // 2
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(channels * height * breadth, data.num_classes)

    def reshape(self, x: torch.Tensor) -> torch.Tensor:
        return as_image(x, self.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(self.reshape(x)).flatten(1))


class ResNet2D(nn.Module):
    """A small ResNet: stem, ``depth`` residual blocks (the 2nd, 4th, ... halve the resolution
    and double the channels), global average pooling, linear head; optional random flips."""

    def __init__(self, data: DataSpec, width: int, depth: int, flip: bool) -> None:
        super().__init__()
        self.shape = data.input_shape
        self.flip = flip
        self.stem = nn.Sequential(
            nn.Conv2d(self.shape[0], width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        blocks: list[nn.Module] = []
        channels = width
        for i in range(depth):
            out = channels * 2 if i % 2 else channels
            blocks.append(ResBlock(channels, out, 2 if i % 2 else 1, dims=2))
            channels = out
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(channels, data.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = as_image(x, self.shape)
        if self.training and self.flip:
            flipped = torch.rand(len(h), 1, 1, 1, device=h.device) < 0.5
            h = torch.where(flipped, h.flip(3), h)
        h = self.blocks(self.stem(h))
        return self.head(h.mean(dim=(2, 3)))


class GRUClassifier(nn.Module):
    """A GRU over the sequence's steps; the last step's hidden state feeds a linear head."""

    def __init__(self, data: DataSpec, width: int, depth: int) -> None:
        super().__init__()
        self.shape = data.input_shape
        features = self.shape[1] if len(self.shape) > 1 else 1
        self.gru = nn.GRU(features, width, num_layers=depth, batch_first=True)
        self.head = nn.Linear(width, data.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps = as_signal(x, self.shape).transpose(1, 2)  # (n, steps, features)
        out, _ = self.gru(steps)
        return self.head(out[:, -1])


def _image_check(params: Mapping[str, Any], data: DataSpec) -> None:
    if len(data.input_shape) != 3:
        raise ValueError(f"expects (channels, height, width) images, got shape {list(data.input_shape)}")


_WIDTH = {"type": "int", "low": 4, "high": 512, "default": 32}

RESCNN_FAMILY = ModelFamily(
    name="rescnn",
    params={
        "width": _WIDTH,
        "depth": {"type": "int", "low": 1, "high": 8, "default": 4},
        "shift": {"type": "int", "low": 0, "high": 16, "default": 0},
    },
    build=lambda p, d: ResCNN1D(d, int(p["width"]), int(p["depth"]), int(p["shift"])),
    can_be_student=True,
    size_param="width",
    modalities=frozenset({"table", "sequence"}),
    description="residual 1-D CNN (BN, global pooling) with random shifts of up to `shift` steps in training",
)
CNN2D_FAMILY = ModelFamily(
    name="cnn2d",
    params={"width": _WIDTH, "depth": {"type": "int", "low": 1, "high": 6, "default": 3}},
    build=lambda p, d: CNN2D(d, int(p["width"]), int(p["depth"])),
    check=_image_check,
    can_be_student=True,
    quantizable=True,
    size_param="width",
    modalities=frozenset({"image"}),
    description="2-D CNN: depth x (conv 3x3 stride 2, ReLU), linear head; statically quantizable",
)
RESNET_FAMILY = ModelFamily(
    name="resnet",
    params={
        "width": _WIDTH,
        "depth": {"type": "int", "low": 1, "high": 8, "default": 4},
        "flip": {"type": "categorical", "choices": [False, True], "default": False},
    },
    build=lambda p, d: ResNet2D(d, int(p["width"]), int(p["depth"]), bool(p["flip"])),
    check=_image_check,
    can_be_student=True,
    size_param="width",
    modalities=frozenset({"image"}),
    description="small ResNet (BN, global pooling) with optional random horizontal flips in training",
)
GRU_FAMILY = ModelFamily(
    name="gru",
    params={"width": _WIDTH, "depth": {"type": "int", "low": 1, "high": 4, "default": 1}},
    build=lambda p, d: GRUClassifier(d, int(p["width"]), int(p["depth"])),
    can_be_student=True,
    size_param="width",
    modalities=frozenset({"sequence"}),
    description="GRU over the sequence's steps; last hidden state into a linear head",
)
