"""The pipeline config: one frozen, validated object per stage, built once from a flat mapping.

The flat mapping is what Airflow Params, ``mopflow run --config FILE`` and the REST API carry;
:data:`CONF_FIELDS` maps each flat key to its stage and field, :data:`FORM_KEYS` says which keys
the trigger form shows first, and :func:`conf_json_schema` derives the Params' JSON schema (and
:func:`conf_markdown_table` the docs' table) from the same definitions, so the trigger form, the
docs and the task-side validation can never drift apart.
"""

from __future__ import annotations

import difflib
import functools
import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from mopflow.compression.config import AUTO_STUDENT, DistillConfig, EnsembleConfig, RegistryConfig
from mopflow.training.config import StageConfig
from mopflow.training.data.config import DataConfig
from mopflow.training.data.sources.kinds import known_data_spec
from mopflow.training.search.config import SCHEDULE_SPEC_HELP, SearchConfig, format_worker_schedule
from mopflow.training.search.space import SearchSpace, SpaceError, check_space_fits

MAX_CONF_BYTES = 128 * 1024


class ConfigError(ValueError):
    """The pipeline config is invalid; the message names the key and the value."""


# flat key -> (stage, field)
CONF_FIELDS: dict[str, tuple[str, str]] = {
    "dataset": ("data", "dataset"),
    "label_column": ("data", "label_column"),
    "feature_columns": ("data", "feature_columns"),
    "n_shards": ("data", "n_shards"),
    "max_shard_mb": ("data", "max_shard_mb"),
    "val_fraction": ("data", "val_fraction"),
    "test_fraction": ("data", "test_fraction"),
    "data_seed": ("data", "seed"),
    "num_samples": ("data", "num_samples"),
    "partition_rows": ("data", "partition_rows"),
    "nan_policy": ("data", "nan_policy"),
    "stratify": ("data", "stratify"),
    "image_size": ("data", "image_size"),
    "mixed_channels": ("data", "mixed_channels"),
    "tensor_column": ("data", "tensor_column"),
    "num_classes": ("data", "num_classes"),
    "n_trials": ("search", "n_trials"),
    "epochs": ("search", "epochs"),
    "parallel_trials": ("search", "parallel_trials"),
    "trial_batches": ("search", "trial_batches"),
    "seed": ("search", "seed"),
    "augment": ("search", "augment"),
    "sampler": ("search", "sampler"),
    "pruner": ("search", "pruner"),
    "min_resource": ("search", "min_resource"),
    "timeout_minutes": ("search", "timeout_minutes"),
    "goal_val_acc": ("search", "goal_val_acc"),
    "epoch_budget": ("search", "epoch_budget"),
    "search_space": ("search", "space"),
    "strategy": ("search", "strategy"),
    "ddp_world_size": ("search", "ddp_world_size"),
    "ddp_collective_timeout_s": ("search", "ddp_collective_timeout_s"),
    "bf16_compress": ("search", "bf16_compress"),
    "model_slots": ("search", "model_slots"),
    "mop_schedule": ("search", "mop_schedule"),
    "mop_lookahead": ("search", "mop_lookahead"),
    "mop_ask_ahead": ("search", "mop_ask_ahead"),
    "grid_points": ("search", "grid_points"),
    "warm_start": ("search", "warm_start"),
    "warm_start_studies": ("search", "warm_start_studies"),
    "worker_schedule": ("search", "worker_schedule"),
    "scale_timeout_s": ("search", "scale_timeout_s"),
    "spot_trace": ("search", "spot_trace"),
    "spot_bids": ("search", "spot_bids"),
    "spot_speed": ("search", "spot_speed"),
    "top_k": ("ensemble", "top_k"),
    "ensemble_selection": ("ensemble", "selection"),
    "student_family": ("distill", "family"),
    "student_width": ("distill", "width"),
    "student_depth": ("distill", "depth"),
    "student_max_param_ratio": ("distill", "max_param_ratio"),
    "student_max_params": ("distill", "max_params"),
    "student_budget_ms": ("distill", "budget_ms"),
    "student_batch": ("distill", "request_rows"),
    "student_trials": ("distill", "trials"),
    "temperature": ("distill", "temperature"),
    "alpha": ("distill", "alpha"),
    "distill_epochs": ("distill", "epochs"),
    "distill_lr": ("distill", "lr"),
    "distill_batch_size": ("distill", "batch_size"),
    "transfer_set": ("distill", "transfer"),
    "munge_multiplier": ("distill", "munge_multiplier"),
    "munge_swap_prob": ("distill", "munge_swap_prob"),
    "munge_spread": ("distill", "munge_spread"),
    "mixup_alpha": ("distill", "mixup_alpha"),
    "mixup_shift": ("distill", "mixup_shift"),
    "model_name": ("registry", "model_name"),
    "promotion": ("registry", "promotion"),
    "max_gap_to_ensemble": ("registry", "max_gap_to_ensemble"),
}


# Trigger-form order: the keys a sweep is usually tuned by come first, the rest are grouped.
FORM_KEYS = (
    "dataset",
    "search_space",
    "strategy",
    "parallel_trials",
    "epochs",
    "n_trials",
    "timeout_minutes",
    "sampler",
    "pruner",
    "seed",
    "top_k",
    "student_max_param_ratio",
    "promotion",
)
# What mopflow_retrain (and so `mopflow run`) changes from the defaults: a retraining learns from
# the champion and the newest earlier study of the same data.
RETRAIN_DEFAULTS: dict[str, Any] = {"warm_start": True, "warm_start_studies": 1}
# Keys that were renamed: a conf that still uses the old name is told the new one.
RENAMED_KEYS = {"n_workers": "parallel_trials"}
ADVANCED_SECTION = "Advanced"  # the trigger form's section for the other keys

STAGE_MODELS: dict[str, type[StageConfig]] = {
    "data": DataConfig,
    "search": SearchConfig,
    "ensemble": EnsembleConfig,
    "distill": DistillConfig,
    "registry": RegistryConfig,
}


def max_member_params(space: SearchSpace, data: Any) -> int:
    """The most parameters one trial's model can have in this space (an upper bound for budgets):
    every family at each combination of its parameters' candidate values (categorical choices,
    every integer of a short range, else both ends)."""
    from itertools import product

    from mopflow.training.models.builtin import ArchSpec, count_params  # torch: imported only when validating

    best = 0
    for family, params in space.families.items():
        names = sorted(params)
        for values in product(*(_candidates(params[name]) for name in names)):
            try:
                best = max(
                    best,
                    count_params(ArchSpec.of(family, dict(zip(names, values, strict=True)), data)),
                )
            except ValueError:
                continue  # a combination that does not fit the input cannot be trained either
    return best


def _candidates(spec: Any) -> list[Any]:
    if spec.type == "categorical":
        return list(spec.choices)
    if spec.type == "int" and spec.high - spec.low <= 16:
        return list(range(int(spec.low), int(spec.high) + 1))
    return [spec.low, spec.high]


class PipelineConfig(BaseModel):
    """All stages' configs, validated together (cross-stage rules live here)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    data: DataConfig = DataConfig()
    search: SearchConfig = SearchConfig()
    ensemble: EnsembleConfig = EnsembleConfig()
    distill: DistillConfig = DistillConfig()
    registry: RegistryConfig = RegistryConfig()

    @model_validator(mode="after")
    def _cross_stage(self) -> PipelineConfig:
        if self.ensemble.top_k > self.search.n_trials:
            raise ValueError(
                f"top_k={self.ensemble.top_k} is larger than n_trials={self.search.n_trials}: "
                "the ensemble cannot have more members than there are trials"
            )
        data = known_data_spec(self.data)
        if data is not None:  # a user's data is checked once sharded (search_stage), before training
            self.check_fits_data(data)
        else:
            self.search.search_space("table")
        return self

    def check_fits_data(self, data: Any) -> None:
        """Refuse (ValueError) a config whose search space, student family or student width
        cannot take data of ``data``'s modality and shape (a DataSpec)."""
        from mopflow.training.models.builtin import ArchSpec, count_params, largest_size_within
        from mopflow.training.models.families import get_family
        from mopflow.training.trainable.augment import resolve

        space = self.search.search_space(data.modality)
        check_space_fits(space, data)
        resolve(self.search.augment, data.modality)  # an augmentation the data cannot take
        distill = self.distill.resolved(data.modality, data.ordered)
        student_family = get_family(distill.family)
        if not student_family.fits(data):
            raise ValueError(
                f"student_family={student_family.name!r} takes {sorted(student_family.modalities)} data; "
                f"the dataset is {data.modality!r} (student_family='auto' picks {AUTO_STUDENT[data.modality]!r})"
            )
        max_params = self.distill.max_params
        if self.distill.width is None:
            if (
                max_params is not None
                and largest_size_within(distill.family, distill.student_params(), data, max_params) is None
            ):
                raise ValueError(
                    f"student_max_params={max_params}: no {distill.family} student of depth "
                    f"{distill.depth} has so few parameters"
                )
            return
        try:
            student = count_params(ArchSpec.of(distill.family, distill.student_params(), data))
        except ValueError as exc:
            raise ValueError(f"student_width={self.distill.width} does not fit the student: {exc}") from exc
        if max_params is not None:
            ceiling, budget = max_params, f"student_max_params={max_params}"
        else:
            ceiling = int(self.distill.max_param_ratio * self.ensemble.top_k * max_member_params(space, data))
            budget = (
                f"student_max_param_ratio={self.distill.max_param_ratio} x the largest possible "
                f"ensemble ({self.ensemble.top_k} members)"
            )
        if student > ceiling:
            raise ValueError(
                f"student_width={self.distill.width} gives a student of {student} parameters, larger than the "
                f"budget: {budget} allows at most {ceiling}"
            )

    @classmethod
    def from_conf(cls, conf: Mapping[str, Any] | None) -> PipelineConfig:
        """Build from a flat mapping (Airflow conf / YAML). Unknown keys and bad values raise ConfigError.

        A conf already parsed in this process is not parsed again (``mopflow run`` runs every stage
        in one process; the config is frozen, so sharing it is safe)."""
        try:
            key = json.dumps(dict(conf or {}), sort_keys=True)
        except (TypeError, ValueError):  # not plain JSON (a caller's own objects): parsed each time
            return cls._parse(conf)
        return _parsed(key)

    @classmethod
    def _parse(cls, conf: Mapping[str, Any] | None) -> PipelineConfig:
        conf = dict(conf or {})
        size = len(json.dumps(conf, default=str))
        if size > MAX_CONF_BYTES:
            raise ConfigError(f"config is {size} bytes; the limit is {MAX_CONF_BYTES}")
        renamed = sorted(f"{old} is now {new}" for old, new in RENAMED_KEYS.items() if old in conf)
        if renamed:
            raise ConfigError(f"renamed config key(s): {'; '.join(renamed)}")
        unknown = [unknown_key_message(key) for key in sorted(set(conf) - set(CONF_FIELDS))]
        conf = {key: value for key, value in conf.items() if key in CONF_FIELDS}
        try:  # the known keys' errors are reported together with the unknown keys
            config = cls.model_validate(_sections(conf))
        except ValidationError as exc:
            raise ConfigError("; ".join([*unknown, _flat_error(exc)])) from exc
        except SpaceError as exc:
            raise ConfigError("; ".join([*unknown, str(exc)])) from exc
        if unknown:
            raise ConfigError("; ".join(unknown))
        return config

    def to_conf(self) -> dict[str, Any]:
        """The flat mapping that rebuilds this config."""
        out = {}
        for key, (stage, field) in CONF_FIELDS.items():
            out[key] = getattr(getattr(self, stage), field)
        out["worker_schedule"] = format_worker_schedule(self.search.worker_schedule)  # its text spec
        out["search_space"] = None if self.search.space is None else self.search.space.model_dump()
        return out


def unknown_key_message(key: str) -> str:
    """What to tell about an unknown config key: the known keys it resembles, if any."""
    close = difflib.get_close_matches(key, list(CONF_FIELDS), n=3, cutoff=0.6)
    if close:  # the nearest, and others only as near (n_trails: n_trials, not student_trials)
        ratio = {c: difflib.SequenceMatcher(None, key, c).ratio() for c in close}
        close = [c for c in close if ratio[c] >= ratio[close[0]] - 0.1]
        return f"unknown config key {key!r}; did you mean {' or '.join(repr(c) for c in close)}?"
    return f"unknown config key {key!r} (`mopflow config-keys` lists them all)"


def _sections(conf: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The flat conf split into the stages' sections; None is "the default" for most keys."""
    sections: dict[str, dict[str, Any]] = {name: {} for name in STAGE_MODELS}
    for key, value in conf.items():
        if value is None and key not in {
            "timeout_minutes",
            "goal_val_acc",
            "epoch_budget",
            "search_space",
            "student_width",
            "feature_columns",
        }:
            continue  # None means "use the default" for keys that have no null meaning
        stage, field = CONF_FIELDS[key]
        if key == "search_space" and isinstance(value, str) and not value.strip():
            value = None  # the trigger form's empty field: the default space
        sections[stage][field] = value
    return sections


def _flat_error(exc: ValidationError) -> str:
    reverse = {v: k for k, v in CONF_FIELDS.items()}
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        key = reverse.get((loc[0], loc[1])) if len(loc) >= 2 else None
        where = key or ".".join(loc) or "config"
        if key == "search_space" and len(loc) > 2:
            where = "search_space." + ".".join(loc[2:])
        value = err.get("input")
        shown = repr(value) if not isinstance(value, dict | list) else type(value).__name__
        msg = str(err["msg"]).removeprefix("Value error, ")
        whole = where == "config" or (where in STAGE_MODELS and len(loc) == 1)  # the message names values
        lines.append(f"{where}: {msg}" if whole else f"{where}: {msg} (got {shown[:80]})")
    return "; ".join(lines)


def conf_json_schema() -> dict[str, dict[str, Any]]:
    """Per flat key: a JSON schema (with default and description) for Airflow ``Param``s."""
    out: dict[str, dict[str, Any]] = {}
    # one schema per stage model (each model_json_schema() call builds the whole model's again)
    properties = {stage: model.model_json_schema()["properties"] for stage, model in STAGE_MODELS.items()}
    for key, (stage, field) in CONF_FIELDS.items():
        model = STAGE_MODELS[stage]
        schema = dict(properties[stage][field])
        schema.pop("title", None)
        info = model.model_fields[field]
        default = info.default
        if key == "search_space":
            schema = {
                "anyOf": [{"type": "null"}, {"type": "string", "maxLength": 65536}, {"type": "object"}],
                "description": "Search space as JSON (families and common params); empty = default space",
            }
        elif key == "worker_schedule":
            schema = {
                "type": "string",
                "maxLength": 200,
                "description": "Grow the Dask cluster by round (strategies task and mop): "
                + SCHEDULE_SPEC_HELP,
            }
            default = None
        elif key == "spot_bids":  # a list, or the same as text in the trigger form ("1.0, 0.5")
            schema["anyOf"] = [*schema["anyOf"], {"type": "string", "maxLength": 8192}]
        numbers = [part for part in schema.get("anyOf", []) if part.get("type") in ("integer", "number")]
        if numbers and len(schema["anyOf"]) == 2 and {"type": "null"} in schema["anyOf"]:
            # a number that may be empty: one type list, which the trigger form sends as a number
            # (with anyOf it sends the text typed, which the schema then refuses)
            schema = {k: v for k, v in schema.items() if k != "anyOf"} | numbers[0]
            schema["type"] = ["null", numbers[0]["type"]]
        if default in (None, "") and isinstance(schema.get("type"), str):
            # Optional text: null is "not set". Airflow's trigger form requires every field whose
            # type does not allow null, and an empty required field disables its Trigger button.
            schema["type"] = ["null", schema["type"]]
            default = None
        schema["default"] = default
        if "description" not in schema:
            schema["description"] = info.description or key
        out[key] = schema
    return out


def conf_markdown_table() -> str:
    """The config keys as a Markdown table (key, default, meaning), from the same definitions as
    the Params' JSON schema: the table in docs/user-guide/configuration.md is this output."""
    lines = ["| key | default | meaning |", "|---|---|---|"]
    for key, schema in conf_json_schema().items():
        default = schema.get("default")
        shown = (
            "none"
            if default in (None, "")
            else f"`{default if isinstance(default, str) else json.dumps(default)}`"
        )
        meaning = str(schema.get("description", "")).replace("|", "\\|")
        lines.append(f"| `{key}` | {shown} | {meaning} |")
    changed = ", ".join(f"`{key}={json.dumps(value)}`" for key, value in RETRAIN_DEFAULTS.items())
    lines += ["", f"`mopflow_retrain`, which `mopflow run` runs, defaults to {changed}."]
    return "\n".join(lines)


@functools.lru_cache(maxsize=16)
def _parsed(conf_json: str) -> PipelineConfig:
    """The config of a conf given as canonical JSON, parsed once per process (errors are not kept)."""
    return PipelineConfig._parse(json.loads(conf_json))
