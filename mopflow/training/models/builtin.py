"""The built-in model families (1-D CNN, MLP) and models built from any registered family.

The families register through the ``mopflow.models`` entry points (``pyproject.toml``), as a
user's do (``training/models/families.py``).

Every model starts with a :class:`Standardize` layer holding the training set's feature
mean/std as buffers, so a saved model takes raw features and needs nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mopflow.training.models.families import DataSpec, FamilyError, ModelFamily, get_family


@dataclass(frozen=True)
class ArchSpec:
    """Architecture of one classifier: a registered family, its params and the data's shape (what
    is needed to rebuild it before loading weights). Refused at construction when the family is
    not registered, the params do not fit its specs, or it cannot build for the data."""

    family: str
    params: Mapping[str, Any]
    input_dim: int
    num_classes: int
    input_shape: tuple[int, ...] = ()
    modality: str = "table"

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", dict(self.params))
        object.__setattr__(self, "input_shape", self.data.input_shape)
        get_family(self.family).validate(self.params, self.data)

    def __hash__(self) -> int:
        return hash(
            (
                self.family,
                tuple(sorted(self.params.items())),
                self.input_dim,
                self.num_classes,
                self.input_shape,
                self.modality,
            )
        )

    @property
    def data(self) -> DataSpec:
        return DataSpec(self.input_dim, self.num_classes, tuple(self.input_shape), self.modality)

    def to_dict(self) -> dict[str, Any]:
        return {
            "family": self.family,
            "params": dict(self.params),
            "input_dim": self.input_dim,
            "num_classes": self.num_classes,
            "input_shape": list(self.input_shape),
            "modality": self.modality,
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ArchSpec:
        """Rebuild from :meth:`to_dict` (or the width/depth form of bundles written before
        families had their own params)."""
        params = raw.get("params")
        if params is None:
            params = {k: raw[k] for k in ("width", "depth") if k in raw}
        return cls(
            str(raw["family"]),
            dict(params),
            int(raw["input_dim"]),
            int(raw["num_classes"]),
            tuple(raw.get("input_shape") or ()),
            str(raw.get("modality", "table")),
        )

    @classmethod
    def of(cls, family: str, params: Mapping[str, Any], data: DataSpec) -> ArchSpec:
        """The architecture of ``family`` with ``params`` on ``data``."""
        return cls(family, params, data.input_dim, data.num_classes, data.input_shape, data.modality)

    @classmethod
    def from_params(cls, params: Mapping[str, Any], data: DataSpec) -> ArchSpec:
        """Take the architecture part of a trial's params (the family's own parameters)."""
        family = get_family(str(params["family"]))
        return cls.of(family.name, {k: params[k] for k in family.params if k in params}, data)


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


def _signal_shape(data: DataSpec) -> tuple[int, int]:
    """(channels, length) of a table row (one channel) or a sequence (a channel per feature)."""
    if len(data.input_shape) == 1:
        return 1, data.input_shape[0]
    return data.input_dim // data.input_shape[0], data.input_shape[0]


class CNN1D(nn.Module):
    """The MNIST-1D paper's convolutional baseline, generalised in width and depth."""

    def __init__(self, data: DataSpec, width: int, depth: int) -> None:
        super().__init__()
        self.shape = data.input_shape
        channels, length = _signal_shape(data)
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Conv1d(channels, width, kernel_size=5, stride=2, padding=1), nn.ReLU()]
            channels = width
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(width * _conv_out_len(length, depth), data.num_classes)

    def reshape(self, x: torch.Tensor) -> torch.Tensor:
        """Rows as (n, channels, length)."""
        if len(self.shape) == 1:
            return x.unsqueeze(1)
        return x.view(len(x), self.shape[0], -1).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.features(self.reshape(x))
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

    @property
    def features(self) -> nn.Module:
        return self.net[:-1]

    @property
    def head(self) -> nn.Module:
        return self.net[-1]

    def reshape(self, x: torch.Tensor) -> torch.Tensor:
        return x

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
    backbone = get_family(arch.family).build(arch.params, arch.data)
    return nn.Sequential(Standardize(mean, std), backbone)


def count_params(arch: ArchSpec) -> int:
    """Number of trainable parameters of a model of this architecture."""
    model = build_model(arch)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def largest_size_within(
    family: str, params: Mapping[str, Any], data: DataSpec, max_params: int
) -> int | None:
    """The largest value of the family's ``size_param`` (the others fixed at ``params``) whose
    model has at most ``max_params`` parameters; None if even the smallest is too big."""
    spec = get_family(family)
    if spec.size_param is None:
        raise FamilyError(f"family {family!r} has no size parameter: it cannot be sized to a budget")
    bounds = spec.params[spec.size_param]
    lo, hi, best = int(bounds["low"]), int(bounds["high"]), None
    while lo <= hi:
        mid = (lo + hi) // 2
        arch = ArchSpec.of(family, {**params, spec.size_param: mid}, data)
        if count_params(arch) <= max_params:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def _cnn_check(params: Mapping[str, Any], data: DataSpec) -> None:
    if len(data.input_shape) > 2:
        raise ValueError(f"a 1-D CNN takes rows or sequences, not shape {list(data.input_shape)}")
    length = _signal_shape(data)[1]
    if _conv_out_len(length, int(params["depth"])) < 1:
        raise ValueError(f"a CNN of depth {params['depth']} does not fit an input of length {length}")


CNN_FAMILY = ModelFamily(
    name="cnn",
    params={"width": {"type": "int", "low": 1, "high": 4096}, "depth": {"type": "int", "low": 1, "high": 8}},
    build=lambda p, d: CNN1D(d, int(p["width"]), int(p["depth"])),
    check=_cnn_check,
    can_be_student=True,
    quantizable=True,
    size_param="width",
    modalities=frozenset({"table", "sequence"}),
    description="1-D CNN (the MNIST-1D paper's baseline): depth x (conv k5 s2, ReLU), linear head",
)
MLP_FAMILY = ModelFamily(
    name="mlp",
    params={"width": {"type": "int", "low": 1, "high": 4096}, "depth": {"type": "int", "low": 1, "high": 8}},
    build=lambda p, d: MLP(d.input_dim, d.num_classes, int(p["width"]), int(p["depth"])),
    can_be_student=True,
    quantizable=True,
    size_param="width",
    modalities=frozenset({"table", "sequence", "image"}),
    description="ReLU MLP with depth hidden layers of width units",
)
