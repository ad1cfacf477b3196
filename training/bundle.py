"""Model bundles: architecture JSON + safetensors weights. Loading never unpickles anything."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import nn

from infra import storage
from training.models import ArchSpec, build_model

SPEC_NAME = "spec.json"
WEIGHTS_NAME = "weights.safetensors"


class BundleError(ValueError):
    """A bundle is missing, malformed or does not match its spec."""


class ProbabilityEnsemble(nn.Module):
    """Average of the members' softmax outputs (one member = a plain classifier's probabilities)."""

    def __init__(self, members: Sequence[nn.Module]) -> None:
        super().__init__()
        if not members:
            raise ValueError("an ensemble needs at least one member")
        self.members = nn.ModuleList(members)

    def forward(self, x: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        probs = [F.softmax(m(x) / temperature, dim=1) for m in self.members]
        return torch.stack(probs).mean(dim=0)


@dataclass(frozen=True)
class Bundle:
    """A loaded bundle: the module (returns class probabilities) and its metadata."""

    module: ProbabilityEnsemble
    spec: dict[str, Any]

    @property
    def feature_columns(self) -> list[str]:
        return list(self.spec["feature_columns"])

    @property
    def num_classes(self) -> int:
        return int(self.spec["members"][0]["num_classes"])

    def num_params(self) -> int:
        return sum(p.numel() for p in self.module.parameters())


def save_bundle(
    url: str,
    members: Sequence[nn.Module],
    archs: Sequence[ArchSpec],
    feature_columns: Sequence[str],
    extra: Mapping[str, Any] | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> str:
    """Write members (each ``Sequential(Standardize, backbone)``) as one bundle folder at ``url``."""
    if len(members) != len(archs):
        raise ValueError("one architecture per member is needed")
    tensors: dict[str, torch.Tensor] = {}
    for i, member in enumerate(members):
        for key, value in member.state_dict().items():
            tensors[f"m{i}.{key}"] = value.detach().cpu().contiguous().clone()
    spec = {
        "format": "mopflow-bundle/1",
        "members": [a.to_dict() for a in archs],
        "feature_columns": list(feature_columns),
        "extra": dict(extra or {}),
    }
    # Weights first, spec last: a folder with a spec always has its weights.
    storage.write_bytes_atomic(storage.join(url, WEIGHTS_NAME), save_safetensors(tensors), storage_options)
    storage.write_json_atomic(storage.join(url, SPEC_NAME), spec, storage_options)
    return url


def load_bundle(url: str, storage_options: Mapping[str, Any] | None = None) -> Bundle:
    """Rebuild the modules from the spec and load safetensors weights (strict)."""
    try:
        spec = json.loads(storage.read_bytes(storage.join(url, SPEC_NAME), storage_options))
        raw = storage.read_bytes(storage.join(url, WEIGHTS_NAME), storage_options)
    except FileNotFoundError as exc:
        raise BundleError(f"model bundle at {url} is incomplete: {exc}") from exc
    if spec.get("format") != "mopflow-bundle/1":
        raise BundleError(f"{url} is not a mopflow bundle (format {spec.get('format')!r})")
    try:
        tensors = load_safetensors(raw)
    except Exception as exc:  # safetensors raises its own error types for bad headers
        raise BundleError(f"weights at {url} are not valid safetensors: {exc}") from exc
    members: list[nn.Module] = []
    for i, arch_dict in enumerate(spec["members"]):
        arch = ArchSpec(**arch_dict)
        model = build_model(arch)
        prefix = f"m{i}."
        state = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as exc:
            raise BundleError(f"weights of member {i} at {url} do not match its architecture: {exc}") from exc
        model.eval()
        members.append(model)
    module = ProbabilityEnsemble(members)
    module.eval()
    return Bundle(module=module, spec=spec)


@torch.no_grad()
def predict_proba(module: nn.Module, x: Any, batch_size: int = 4096) -> torch.Tensor:
    """Class probabilities for a float array/tensor of features, in batches."""
    xt = torch.as_tensor(x, dtype=torch.float32)
    module.eval()
    outs = [module(xt[i : i + batch_size]) for i in range(0, len(xt), batch_size)]
    return torch.cat(outs) if outs else torch.empty(0)


def accuracy(module: nn.Module, x: Any, y: Any) -> float:
    """Top-1 accuracy of a probability-returning module."""
    probs = predict_proba(module, x)
    return float((probs.argmax(dim=1) == torch.as_tensor(y)).float().mean())
