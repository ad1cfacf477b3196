"""Search spaces as data: a JSON/YAML spec, validated, turned into Optuna suggestions.

Nothing in a spec is evaluated: names are allow-listed, numbers must be finite and bounded,
and JSON's non-standard NaN/Infinity literals are refused while parsing.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from importlib import resources
from typing import Annotated, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_ABS_VALUE = 1e9
MAX_CHOICES = 64
MAX_SPEC_BYTES = 64 * 1024

COMMON_PARAMS = frozenset({"lr", "weight_decay", "batch_size"})


class SpaceError(ValueError):
    """The search space spec is invalid; the message names the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _finite(value: float, what: str) -> float:
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{what} must be finite, got {value}")
    if abs(value) > MAX_ABS_VALUE:
        raise ValueError(f"{what}={value} is out of range (|value| <= {MAX_ABS_VALUE:g})")
    return value


def _check_range(low: float, high: float, log: bool) -> None:
    _finite(low, "low")
    _finite(high, "high")
    if low >= high:
        raise ValueError(f"low ({low}) must be < high ({high})")
    if log and low <= 0:
        raise ValueError(f"log scale needs low > 0, got low={low}")


class IntParam(_Strict):
    """An integer in [low, high], optionally log-uniform."""

    type: Literal["int"]
    low: int
    high: int
    log: bool = False

    @model_validator(mode="after")
    def _check(self) -> IntParam:
        _check_range(self.low, self.high, self.log)
        return self


class FloatParam(_Strict):
    """A float in [low, high], optionally log-uniform."""

    type: Literal["float"]
    low: float
    high: float
    log: bool = False

    @model_validator(mode="after")
    def _check(self) -> FloatParam:
        _check_range(self.low, self.high, self.log)
        return self


class CategoricalParam(_Strict):
    """One of a short list of scalar choices."""

    type: Literal["categorical"]
    choices: list[int | float | str | bool] = Field(min_length=1, max_length=MAX_CHOICES)

    @field_validator("choices")
    @classmethod
    def _check_choices(cls, choices: list[Any]) -> list[Any]:
        for choice in choices:
            if isinstance(choice, float):
                _finite(choice, "choice")
            if isinstance(choice, str) and len(choice) > 64:
                raise ValueError("string choices are limited to 64 characters")
        if len({json.dumps(c) for c in choices}) != len(choices):
            raise ValueError("choices must be distinct")
        return choices


ParamSpec = Annotated[IntParam | FloatParam | CategoricalParam, Field(discriminator="type")]


def _family_params(family: str) -> Mapping[str, Mapping[str, Any]]:
    """The registered family's parameter specs (an unknown family is refused naming the
    registered ones)."""
    from mopflow.training.models.families import FamilyError, get_family

    try:
        return get_family(family).params
    except FamilyError as exc:
        raise ValueError(str(exc)) from None


def _within(what: str, spec: IntParam | FloatParam | CategoricalParam, declared: Mapping[str, Any]) -> None:
    """A space's range for a family parameter must lie inside the family's own spec."""
    kind = declared["type"]
    if kind == "categorical":
        outside = [
            c
            for c in (spec.choices if isinstance(spec, CategoricalParam) else [])
            if c not in declared["choices"]
        ]
        if not isinstance(spec, CategoricalParam) or outside:
            raise ValueError(f"{what}: must be categorical among {declared['choices']}")
        return
    values = list(spec.choices) if isinstance(spec, CategoricalParam) else [spec.low, spec.high]
    if kind == "int" and (
        isinstance(spec, FloatParam)
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in values)
    ):
        raise ValueError(f"{what} must be an int or categorical of ints")
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{what}: choices must be numbers")
    if min(values) < declared["low"] or max(values) > declared["high"]:
        raise ValueError(
            f"{what}: values must lie within [{declared['low']}, {declared['high']}], got {values}"
        )


class SearchSpace(_Strict):
    """Model families with their own params, plus params common to every family."""

    families: dict[str, dict[str, ParamSpec]] = Field(min_length=1)
    common: dict[str, ParamSpec] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_names(self) -> SearchSpace:
        for family, params in self.families.items():
            declared = _family_params(family)
            unknown = set(params) - set(declared)
            if unknown:
                raise ValueError(
                    f"unknown parameter(s) {sorted(unknown)} for family {family!r}; expected {sorted(declared)}"
                )
            missing = set(declared) - set(params)
            if missing:
                raise ValueError(f"family {family!r} is missing parameter(s) {sorted(missing)}")
            for name, spec in params.items():
                _within(f"{family}.{name}", spec, declared[name])
        unknown_common = set(self.common) - COMMON_PARAMS
        if unknown_common:
            raise ValueError(
                f"unknown common parameter(s) {sorted(unknown_common)}; expected {sorted(COMMON_PARAMS)}"
            )
        lr = self.common.get("lr")
        if isinstance(lr, (IntParam, FloatParam)) and lr.low <= 0:
            raise ValueError(f"lr: low must be > 0, got {lr.low}")
        batch = self.common.get("batch_size")
        if batch is not None and (
            isinstance(batch, FloatParam)
            or (isinstance(batch, IntParam) and not 1 <= batch.low <= batch.high <= 65536)
            or (
                isinstance(batch, CategoricalParam)
                and not all(isinstance(c, int) and 1 <= c <= 65536 for c in batch.choices)
            )
        ):
            raise ValueError("batch_size must be integers between 1 and 65536")
        return self


DEFAULT_COMMON = {"lr": 1e-2, "weight_decay": 0.0, "batch_size": 128}


def _reject_constant(name: str) -> Any:
    raise SpaceError(f"non-finite number {name} is not allowed in a search space")


def parse_space(spec: str | Mapping[str, Any]) -> SearchSpace:
    """Parse and validate a search space from JSON text or an already-parsed mapping."""
    if isinstance(spec, str):
        if len(spec.encode()) > MAX_SPEC_BYTES:
            raise SpaceError(f"search space is {len(spec.encode())} bytes; the limit is {MAX_SPEC_BYTES}")
        try:
            data = json.loads(spec, parse_constant=_reject_constant)
        except json.JSONDecodeError as exc:
            raise SpaceError(f"search space is not valid JSON: {exc}") from exc
    else:
        data = dict(spec)
    try:
        return SearchSpace.model_validate(data)
    except ValidationError as exc:
        raise SpaceError(format_validation_error("search space", exc)) from exc


# the packaged default space of each modality: the families that fit it
DEFAULT_SPACE_FILES = {"table": "default.json", "sequence": "sequence.json", "image": "image.json"}


def default_space(modality: str = "table") -> SearchSpace:
    """The packaged default space for data of ``modality`` (the families that fit it)."""
    if modality not in DEFAULT_SPACE_FILES:
        raise SpaceError(
            f"no default search space for modality {modality!r}; expected {sorted(DEFAULT_SPACE_FILES)}"
        )
    text = resources.files("mopflow.training").joinpath(f"spaces/{DEFAULT_SPACE_FILES[modality]}").read_text()
    return parse_space(text)


def check_space_fits(space: SearchSpace, data: Any) -> None:
    """Refuse, before any training, a family of the space that does not take the data (its
    modality, or its own check or builder on the data's shape at the space's smallest values),
    with the family's own error."""
    from mopflow.training.models.families import FamilyError, get_family

    for name, params in sorted(space.families.items()):
        family = get_family(name)
        if not family.fits(data):
            raise SpaceError(
                f"family {name!r} takes {sorted(family.modalities)} data; the dataset is {data.modality!r} "
                f"of shape {list(data.input_shape)}"
            )
        smallest = {
            key: spec.choices[0] if isinstance(spec, CategoricalParam) else spec.low
            for key, spec in params.items()
        }
        try:
            family.validate(smallest, data)
            family.build(smallest, data)
        except (FamilyError, ValueError, RuntimeError, TypeError) as exc:
            raise SpaceError(
                f"family {name!r} cannot be built for data of shape {list(data.input_shape)}: {exc}"
            ) from exc


def format_validation_error(what: str, exc: ValidationError) -> str:
    """One line per problem, each naming the field path and the offending value."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(root)"
        value = err.get("input")
        shown = repr(value) if not isinstance(value, dict | list) else type(value).__name__
        lines.append(f"{what}: {loc}: {err['msg']} (got {shown[:80]})")
    return "; ".join(lines)


class Suggester(Protocol):
    """The part of ``optuna.Trial`` that sampling needs."""

    def suggest_int(self, name: str, low: int, high: int, *, log: bool = False) -> int: ...

    def suggest_float(self, name: str, low: float, high: float, *, log: bool = False) -> float: ...

    def suggest_categorical(self, name: str, choices: Any) -> Any: ...


def _suggest(trial: Suggester, name: str, spec: IntParam | FloatParam | CategoricalParam) -> Any:
    if isinstance(spec, IntParam):
        return trial.suggest_int(name, spec.low, spec.high, log=spec.log)
    if isinstance(spec, FloatParam):
        return trial.suggest_float(name, spec.low, spec.high, log=spec.log)
    return trial.suggest_categorical(name, list(spec.choices))


def sample_params(space: SearchSpace, trial: Suggester) -> dict[str, Any]:
    """Draw one configuration. Family params get family-prefixed Optuna names (conditional space)."""
    families = sorted(space.families)
    family = families[0] if len(families) == 1 else trial.suggest_categorical("family", families)
    params: dict[str, Any] = {"family": family}
    for name, spec in sorted(space.families[family].items()):
        params[name] = _suggest(trial, f"{family}_{name}", spec)
    for name, default in DEFAULT_COMMON.items():
        params[name] = _suggest(trial, name, space.common[name]) if name in space.common else default
    return params


def params_from_optuna(optuna_params: Mapping[str, Any]) -> dict[str, Any]:
    """Turn a trial's Optuna param names back into a model configuration."""
    from mopflow.training.models.families import registered_families

    family = str(optuna_params.get("family", ""))
    if not family:
        prefixed = [f for f in sorted(registered_families()) for k in optuna_params if k.startswith(f"{f}_")]
        family = prefixed[0] if prefixed else "cnn"
    params: dict[str, Any] = {"family": family}
    for key, value in optuna_params.items():
        if key.startswith(f"{family}_"):
            params[key[len(family) + 1 :]] = value
    for name, default in DEFAULT_COMMON.items():
        params[name] = optuna_params.get(name, default)
    return params


def _fits(spec: IntParam | FloatParam | CategoricalParam, value: Any) -> bool:
    if isinstance(spec, CategoricalParam):
        return value in spec.choices
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if isinstance(spec, IntParam) and int(value) != value:
        return False
    return spec.low <= value <= spec.high


def optuna_params_for(space: SearchSpace, params: Mapping[str, Any]) -> dict[str, Any]:
    """The Optuna parameters (names as ``sample_params`` suggests them) of a model configuration,
    e.g. to enqueue a known configuration as a trial. Raises ``SpaceError`` naming the first
    parameter that is missing or outside the space."""
    family = str(params.get("family", ""))
    if family not in space.families:
        raise SpaceError(f"family {family!r} is not in the search space {sorted(space.families)}")
    out: dict[str, Any] = {}
    if len(space.families) > 1:
        out["family"] = family
    for name, spec in sorted(space.families[family].items()):
        if name not in params or not _fits(spec, params[name]):
            raise SpaceError(f"{family}.{name}={params.get(name)!r} is outside the search space")
        out[f"{family}_{name}"] = params[name]
    for name, spec in sorted(space.common.items()):
        if name not in params or not _fits(spec, params[name]):
            raise SpaceError(f"{name}={params.get(name)!r} is outside the search space")
        out[name] = params[name]
    return out
