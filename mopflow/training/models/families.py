"""Model families as plugins: the entry-point group ``mopflow.models``.

A family is a name, its own parameters (the family's part of the search space: any names, each
an ``int``, ``float`` or ``categorical`` spec as in a space file), a builder from (params, data
spec) to a torch module returning logits, and what it supports (being a distilled student,
static INT8 quantization). mopflow's built-in families register through the same entry-point
group as a user's package does::

    [project.entry-points."mopflow.models"]
    my_resnet = "my_package.models:RESNET"      # a ModelFamily, or a list of them

A local project can name extra modules in ``MOPFLOW_MODEL_MODULES`` (comma-separated module
names, each defining ``MODEL_FAMILIES``, a list of families). Both come from the installation
and the environment, never from a trigger conf: a conf only chooses among registered families
by name.
"""

from __future__ import annotations

import functools
import importlib
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

ENTRY_POINT_GROUP = "mopflow.models"
MODULES_ENV = "MOPFLOW_MODEL_MODULES"
MODULE_ATTR = "MODEL_FAMILIES"
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class FamilyError(ValueError):
    """A family that is not registered, is registered twice, or refuses its params or data."""


MODALITIES = ("table", "sequence", "image")


@dataclass(frozen=True)
class DataSpec:
    """What a builder needs to know of the data.

    A model always takes a batch of flat feature vectors ``(n, input_dim)`` (the shards' rows);
    ``input_shape`` is the shape of one example (``(input_dim,)`` for a table, ``(steps,
    features)`` for a sequence, ``(channels, height, width)`` for an image), which a builder
    reshapes to.
    """

    input_dim: int
    num_classes: int
    input_shape: tuple[int, ...] = ()
    modality: str = "table"
    # A table whose features are the steps of one signal, in order (MNIST-1D): shifting an
    # example along them keeps its class, so the student's transfer points may be shifted mixups.
    ordered: bool = False

    def __post_init__(self) -> None:
        shape = tuple(int(n) for n in self.input_shape) or (self.input_dim,)
        object.__setattr__(self, "input_shape", shape)
        if self.modality not in MODALITIES:
            raise FamilyError(f"modality {self.modality!r} is not one of {list(MODALITIES)}")
        size = 1
        for n in shape:
            size *= n
        if size != self.input_dim or min(shape) < 1:
            raise FamilyError(f"input_shape {list(shape)} does not hold input_dim={self.input_dim} features")

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any]) -> DataSpec:
        """The data spec of a shard manifest (manifests of tables carry no shape: ``(n_features,)``)."""
        example = manifest.get("example")  # one example column: its shape gives the size
        n_features = math.prod(example["shape"]) if example else len(manifest["feature_columns"])
        return cls(
            n_features,
            int(manifest["num_classes"]),
            tuple(manifest.get("input_shape") or (n_features,)),
            str(manifest.get("modality", "table")),
            bool(manifest.get("ordered_features", False)),
        )


@dataclass(frozen=True)
class ModelFamily:
    """One family of models: see the module docstring.

    ``params`` maps each parameter to its widest spec (``{"type": "int", "low": 1, "high":
    64}``): a search space's ranges for the family must lie inside it. ``check`` may refuse a
    (params, data) pair the builder cannot make (raise ``ValueError`` with the reason).
    ``size_param`` names the integer parameter a student's size grows with (for sizing it to a
    parameter budget).
    """

    name: str
    params: Mapping[str, Mapping[str, Any]]
    build: Callable[[Mapping[str, Any], DataSpec], Any]
    check: Callable[[Mapping[str, Any], DataSpec], None] | None = None
    can_be_student: bool = False
    quantizable: bool = False
    size_param: str | None = None
    description: str = ""
    modalities: frozenset[str] = field(default_factory=lambda: frozenset({"table"}))

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise FamilyError(f"family name {self.name!r} must match {_NAME.pattern}")
        for name, spec in self.params.items():
            if spec.get("type") not in ("int", "float", "categorical"):
                raise FamilyError(
                    f"family {self.name!r}: parameter {name!r} has no int/float/categorical type"
                )
        if self.size_param is not None and self.params.get(self.size_param, {}).get("type") != "int":
            raise FamilyError(
                f"family {self.name!r}: size_param {self.size_param!r} must be an int parameter"
            )

    def default_params(self) -> dict[str, Any]:
        """Each parameter's ``default`` (else its low end, or its first choice)."""
        return {
            name: spec.get("default", spec["choices"][0] if spec["type"] == "categorical" else spec["low"])
            for name, spec in self.params.items()
        }

    def fits(self, data: DataSpec) -> bool:
        """Whether the family takes data of this modality."""
        return data.modality in self.modalities

    def validate(self, params: Mapping[str, Any], data: DataSpec) -> None:
        """Refuse params that are missing, unknown or outside the family's specs, or that the
        family cannot build for ``data`` (its own reason)."""
        missing = sorted(set(self.params) - set(params))
        unknown = sorted(set(params) - set(self.params))
        if missing or unknown:
            raise FamilyError(
                f"family {self.name!r} takes {sorted(self.params)}; "
                + ", ".join(
                    part
                    for part in (
                        f"missing {missing}" if missing else "",
                        f"unknown {unknown}" if unknown else "",
                    )
                    if part
                )
            )
        for name, spec in self.params.items():
            value = params[name]
            if spec["type"] == "categorical":
                if value not in spec["choices"]:
                    raise FamilyError(f"{self.name}.{name}={value!r} is not one of {spec['choices']}")
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise FamilyError(f"{self.name}.{name}={value!r} is not a number")
            if spec["type"] == "int" and int(value) != value:
                raise FamilyError(f"{self.name}.{name}={value!r} is not an integer")
            if not spec["low"] <= value <= spec["high"]:
                raise FamilyError(
                    f"{self.name}.{name}={value} must be between {spec['low']} and {spec['high']}"
                )
        if data.input_dim < 1 or data.num_classes < 2:
            raise FamilyError(
                f"input_dim={data.input_dim} must be >= 1 and num_classes={data.num_classes} >= 2"
            )
        if not self.fits(data):
            raise FamilyError(
                f"family {self.name!r} takes {sorted(self.modalities)} data, not {data.modality!r}"
            )
        if self.check is not None:
            try:
                self.check(params, data)
            except ValueError as exc:
                raise FamilyError(
                    f"family {self.name!r} cannot take {dict(params)} on {data.modality} data of shape "
                    f"{list(data.input_shape)}: {exc}"
                ) from exc


_REGISTRY: dict[str, ModelFamily] = {}


def registered_families() -> dict[str, ModelFamily]:
    """Every registered family by name: the ``mopflow.models`` entry points, then the modules in
    ``MOPFLOW_MODEL_MODULES`` (loaded once per process)."""
    if not _REGISTRY:
        _REGISTRY.update(_load())
    return dict(_REGISTRY)


def reload_families() -> dict[str, ModelFamily]:
    """Load the registry again (after installing a package or changing the setting)."""
    _REGISTRY.clear()
    return registered_families()


def get_family(name: str) -> ModelFamily:
    """The family ``name``; an unknown name is refused naming the registered ones."""
    families = registered_families()
    if name not in families:
        raise FamilyError(f"unknown model family {name!r}; registered: {sorted(families)}")
    return families[name]


def _load() -> dict[str, ModelFamily]:
    from importlib.metadata import entry_points

    found: dict[str, tuple[ModelFamily, str]] = {}
    sources: list[tuple[str, Callable[[], Any]]] = [
        (f"entry point {entry.name!r} ({entry.value})", entry.load)
        for entry in entry_points(group=ENTRY_POINT_GROUP)
    ]
    for module in _extra_modules():
        sources.append((f"module {module!r} ({MODULES_ENV})", functools.partial(_module_families, module)))
    for origin, load in sources:
        loaded = load()
        for family in loaded if isinstance(loaded, list | tuple) else [loaded]:
            if not isinstance(family, ModelFamily):
                raise FamilyError(f"{origin} gave {type(family).__name__}, not a ModelFamily")
            if family.name in found and found[family.name][0] is not family:
                raise FamilyError(
                    f"model family {family.name!r} is registered twice: by {found[family.name][1]} and by {origin}"
                )
            found[family.name] = (family, origin)
    return {name: family for name, (family, _) in found.items()}


def _extra_modules() -> list[str]:
    raw = os.environ.get(MODULES_ENV, "")
    modules = [part.strip() for part in raw.split(",") if part.strip()]
    for module in modules:
        if not _MODULE.match(module):
            raise FamilyError(f"{MODULES_ENV}: {module!r} is not a module name (e.g. my_project.models)")
    return modules


def _module_families(module: str) -> Any:
    try:
        loaded = importlib.import_module(module)
    except ImportError as exc:
        raise FamilyError(f"{MODULES_ENV}: cannot import {module!r}: {exc}") from exc
    if not hasattr(loaded, MODULE_ATTR):
        raise FamilyError(f"{MODULES_ENV}: module {module!r} defines no {MODULE_ATTR} list of families")
    return getattr(loaded, MODULE_ATTR)
