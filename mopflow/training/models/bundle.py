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

from mopflow.base import storage
from mopflow.training.models.builtin import ArchSpec, build_model
from mopflow.training.models.metrics import top1_accuracy

SPEC_NAME = "spec.json"
WEIGHTS_NAME = "weights.safetensors"


class BundleError(ValueError):
    """A bundle is missing, malformed or does not match its spec."""


class ProbabilityEnsemble(nn.Module):
    """Weighted average of the members' softmax outputs (one member = a plain classifier's probabilities)."""

    weights: torch.Tensor

    def __init__(self, members: Sequence[nn.Module], weights: Sequence[float] | None = None) -> None:
        super().__init__()
        if not members:
            raise ValueError("an ensemble needs at least one member")
        w = torch.tensor(list(weights) if weights is not None else [1.0] * len(members), dtype=torch.float32)
        if w.shape != (len(members),) or bool((w < 0).any()) or float(w.sum()) <= 0:
            raise ValueError(
                f"weights {w.tolist()} must be {len(members)} non-negative numbers, not all zero"
            )
        self.members = nn.ModuleList(members)
        self.register_buffer("weights", w / w.sum())

    def forward(self, x: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        probs = torch.stack([F.softmax(m(x) / temperature, dim=1) for m in self.members])
        return (self.weights[:, None, None] * probs).sum(dim=0)


def _signature(module: nn.Module) -> tuple[Any, ...]:
    """Members with the same structure (module types and tensor shapes) can be stacked."""
    types = tuple(type(m).__name__ for m in module.modules())
    shapes = tuple((k, tuple(v.shape)) for k, v in module.state_dict().items())
    return types, shapes


class StackedEnsemble(nn.Module):
    """The same ensemble as one graph for inference: members that share an architecture are
    stacked (``torch.func.stack_module_state``) and run in one vectorised call (``vmap``)."""

    def __init__(self, ensemble: ProbabilityEnsemble) -> None:
        super().__init__()
        import copy

        from torch.func import stack_module_state

        groups: dict[tuple[Any, ...], list[int]] = {}
        for i, member in enumerate(ensemble.members):
            groups.setdefault(_signature(member), []).append(i)
        self._groups: list[tuple[nn.Module, dict[str, torch.Tensor], torch.Tensor]] = []
        for indices in groups.values():
            members = [ensemble.members[i] for i in indices]
            params, buffers = stack_module_state(members)  # type: ignore[arg-type]
            base = copy.deepcopy(members[0]).to("meta")
            stacked = {k: v.detach() for k, v in {**params, **buffers}.items()}
            self._groups.append((base, stacked, ensemble.weights[indices].detach().clone()))
        self.group_sizes = [len(v) for v in groups.values()]

    def forward(self, x: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        from torch.func import functional_call, vmap

        total = torch.zeros(())
        for base, stacked, weights in self._groups:

            def call(
                state: dict[str, torch.Tensor], inputs: torch.Tensor, module: nn.Module = base
            ) -> torch.Tensor:
                return functional_call(module, state, (inputs,))

            logits = vmap(call, in_dims=(0, None))(stacked, x)  # [members, batch, classes]
            probs = F.softmax(logits / temperature, dim=-1)
            total = total + (weights[:, None, None] * probs).sum(dim=0)
        return total


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

    @property
    def input_shape(self) -> tuple[int, ...]:
        """One example's shape (``(n_features,)`` for a table)."""
        return ArchSpec.from_dict(self.spec["members"][0]).input_shape

    @property
    def modality(self) -> str:
        return str(self.spec["members"][0].get("modality", "table"))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.module.parameters())


def save_bundle(
    url: str,
    members: Sequence[nn.Module],
    archs: Sequence[ArchSpec],
    feature_columns: Sequence[str],
    extra: Mapping[str, Any] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    weights: Sequence[float] | None = None,
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
        "weights": [float(w) for w in weights] if weights is not None else [1.0] * len(members),
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
        arch = ArchSpec.from_dict(arch_dict)
        model = build_model(arch)
        prefix = f"m{i}."
        state = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as exc:
            raise BundleError(f"weights of member {i} at {url} do not match its architecture: {exc}") from exc
        model.eval()
        members.append(model)
    module = ProbabilityEnsemble(members, spec.get("weights"))
    module.eval()
    return Bundle(module=module, spec=spec)


@torch.no_grad()
def predict_proba(module: nn.Module, x: Any, batch_size: int = 4096) -> torch.Tensor:
    """The module's output (class probabilities for bundles) for a float array of features, in batches."""
    xt = torch.as_tensor(x, dtype=torch.float32)
    module.eval()
    outs = [module(xt[i : i + batch_size]) for i in range(0, len(xt), batch_size)]
    return torch.cat(outs) if outs else torch.empty(0)


def accuracy(module: nn.Module, x: Any, y: Any) -> float:
    """Top-1 accuracy of a probability-returning module."""
    return top1_accuracy(predict_proba(module, x), y)
