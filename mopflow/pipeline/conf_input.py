"""Config as people give it: values typed as text (``mopflow run --set KEY=VALUE``), and the
data roots a triggered run may read from."""

from __future__ import annotations

import json
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mopflow.pipeline.config import (
    RETRAIN_DEFAULTS,
    ConfigError,
    PipelineConfig,
    conf_json_schema,
    unknown_key_message,
)


def parse_text_value(key: str, text: str) -> Any:
    """A value typed as text (``mopflow run --set KEY=VALUE``) converted by ``key``'s type: text
    stays text (``yes`` is not True), ``none``/``null`` is None where the key allows it, lists are
    JSON or comma-separated, and numbers and booleans are left to the key's validation. An unknown
    key or an empty value raises :class:`ConfigError`."""
    schema = conf_json_schema().get(key)
    if schema is None:
        raise ConfigError(unknown_key_message(key))
    kinds = _json_types(schema)
    if not text.strip():
        default = schema.get("default")
        raise ConfigError(
            f"{key}: an empty value; give one, or leave {key} out for its default "
            f"({'none' if default is None else json.dumps(default)})"
        )
    if "null" in kinds and text.strip().lower() in {"none", "null"}:
        return None
    if kinds & {"array", "object"} and text.lstrip()[:1] in {"[", "{"}:
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{key}: {text!r} is not valid JSON ({exc})") from exc
    if "array" in kinds and "string" not in kinds:
        return [item.strip() for item in text.split(",") if item.strip()]
    return text  # numbers, booleans and choices: the key's validation converts and checks them


def _json_types(schema: Mapping[str, Any]) -> set[str]:
    """The JSON types a key's schema allows (its ``type``, or those of its ``anyOf``)."""
    kinds: set[str] = set()
    for part in [schema, *schema.get("anyOf", [])]:
        kind = part.get("type")
        kinds |= {kind} if isinstance(kind, str) else set(kind or [])
    return kinds


def check_data_roots(cfg: PipelineConfig, roots: Sequence[str]) -> None:
    """Refuse (:class:`ConfigError`) a config that reads a dataset or a spot price trace from
    outside ``roots`` (the settings' ``allowed_data_roots``); generated datasets read no file."""
    from mopflow.base.storage import within_roots
    from mopflow.training.data.config import KNOWN_DATASETS

    reads = {"dataset": None if cfg.data.dataset in KNOWN_DATASETS else cfg.data.dataset}
    reads["spot_trace"] = cfg.search.spot_trace or None
    outside = [f"{key}={value!r}" for key, value in reads.items() if value and not within_roots(value, roots)]
    if outside:
        raise ConfigError(
            f"{' and '.join(outside)} outside the data roots {list(roots)}: move the data under one "
            "of them, or add its folder to MOPFLOW_DATA_ROOTS (mopflow run: --data-root FOLDER)"
        )


def validate_trigger_conf(conf: Mapping[str, Any] | None, roots: Sequence[str]) -> PipelineConfig:
    """A triggered run's conf, validated, its data within ``roots``; or :class:`ConfigError`."""
    cfg = PipelineConfig.from_conf(conf)
    check_data_roots(cfg, roots)
    return cfg


RETRAIN_CONFIG_ENV = "MOPFLOW_RETRAIN_CONFIG"


def retrain_defaults(environ: Mapping[str, str]) -> dict[str, Any]:
    """mopflow_retrain's Param defaults: :data:`RETRAIN_DEFAULTS` and the keys of the YAML file
    ``MOPFLOW_RETRAIN_CONFIG`` names (validated; :class:`ConfigError` names what is wrong).

    Every host that parses the DAG files reads it (the dag-processor's, and each Celery worker's
    before it runs a task), so it is a local path present on each of them, or an fsspec URL
    (``s3://bucket/retrain.yaml``) on shared storage, read with ``MOPFLOW_STORAGE_OPTIONS``."""
    from mopflow.base.settings import SettingsError, parse_storage_options
    from mopflow.pipeline.data_events import read_conf_file

    location = environ.get(RETRAIN_CONFIG_ENV, "").strip()
    if not location:
        return dict(RETRAIN_DEFAULTS)
    if "://" in location:
        try:
            options = parse_storage_options(environ.get("MOPFLOW_STORAGE_OPTIONS", ""))
        except SettingsError as exc:
            raise ConfigError(f"{RETRAIN_CONFIG_ENV}={location!r}: {exc}") from exc
        return {**RETRAIN_DEFAULTS, **read_conf_file(location, options)}
    if not Path(location).is_file():
        raise ConfigError(
            f"{RETRAIN_CONFIG_ENV}={location!r}: no such file on host {socket.gethostname()!r}; every host "
            "that parses the DAG files (the dag-processor's, each Celery worker's) reads it: put it on "
            "shared storage (an fsspec URL such as s3://bucket/retrain.yaml) or at this path on every host"
        )
    return {**RETRAIN_DEFAULTS, **read_conf_file(location)}
