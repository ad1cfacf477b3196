"""An example model family for mopflow: a temporal convolutional network (TCN).

Installing this package (``pip install examples/custom_family``) registers the family ``tcn``
through the ``mopflow.models`` entry point; a search space, a trigger conf or
``student_family`` can then name it. The family brings its own module and its own parameters
(``channels``, ``levels``, ``kernel``, ``dropout``); mopflow only sees the
:class:`mopflow.ModelFamily` below.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from mopflow import DataSpec, ModelFamily


class CausalBlock(nn.Module):
    """Two dilated causal convolutions with a residual connection."""

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int, dropout: float) -> None:
        super().__init__()
        self.pad = (kernel - 1) * dilation
        self.conv1 = nn.Conv1d(cin, cout, kernel, dilation=dilation)
        self.conv2 = nn.Conv1d(cout, cout, kernel, dilation=dilation)
        self.drop = nn.Dropout(dropout)
        self.skip = nn.Conv1d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.conv1(nn.functional.pad(x, (self.pad, 0)))))
        h = self.drop(torch.relu(self.conv2(nn.functional.pad(h, (self.pad, 0)))))
        return torch.relu(h + self.skip(x))


class TCN(nn.Module):
    """``levels`` causal blocks with dilations 1, 2, 4, ...; the last step feeds a linear head."""

    def __init__(self, data: DataSpec, channels: int, levels: int, kernel: int, dropout: float) -> None:
        super().__init__()
        self.shape = data.input_shape
        features = data.input_dim // self.shape[0] if len(self.shape) > 1 else 1
        blocks = [
            CausalBlock(features if i == 0 else channels, channels, kernel, 2**i, dropout)
            for i in range(levels)
        ]
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(channels, data.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps = self.shape[0]
        h = x.view(len(x), steps, -1).transpose(1, 2)  # (n, features, steps)
        return self.head(self.blocks(h)[:, :, -1])


def _check(params: Mapping[str, Any], data: DataSpec) -> None:
    reach = 1 + 2 * (int(params["kernel"]) - 1) * (2 ** int(params["levels"]) - 1)
    if len(data.input_shape) > 2:
        raise ValueError(f"a TCN reads sequences or rows, not shape {list(data.input_shape)}")
    if reach > 4 * data.input_shape[0]:
        raise ValueError(
            f"its receptive field ({reach} steps) is far longer than the {data.input_shape[0]} steps"
        )


TCN_FAMILY = ModelFamily(
    name="tcn",
    params={
        "channels": {"type": "int", "low": 4, "high": 256, "default": 16},
        "levels": {"type": "int", "low": 1, "high": 6, "default": 3},
        "kernel": {"type": "categorical", "choices": [3, 5, 7], "default": 3},
        "dropout": {"type": "float", "low": 0.0, "high": 0.5, "default": 0.0},
    },
    build=lambda p, d: TCN(d, int(p["channels"]), int(p["levels"]), int(p["kernel"]), float(p["dropout"])),
    check=_check,
    can_be_student=True,
    size_param="channels",
    modalities=frozenset({"table", "sequence"}),
    description="temporal CNN: dilated causal residual blocks, last step into a linear head",
)
