"""The config of a data-triggered retrain: what a new-shards event carries, and the retrain's defaults.

A sweep that shards data nobody had sharded before emits a ``mopflow_sharded_dataset`` event whose
extra holds the sweep's *data* keys and model name (:func:`event_conf`). The retrain it triggers runs
with its own Params for everything else (search, ensemble, distillation, promotion) and the event's
keys for the data and the model it registers (:func:`conf_with_data_events`), so "new data for model
X" retrains X on that data. The carried keys are validated like a trigger conf; nothing is evaluated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from mopflow.pipeline.config import CONF_FIELDS, ConfigError, PipelineConfig

EVENT_CONF_KEY = "conf"  # the key of the event's extra that holds the carried config keys


def carried_keys() -> frozenset[str]:
    """The config keys an event carries: every data key, and the registered model's name."""
    return frozenset(key for key, (stage, _) in CONF_FIELDS.items() if stage == "data") | {"model_name"}


def event_conf(conf: Mapping[str, Any]) -> dict[str, Any]:
    """The carried keys of a (validated) pipeline conf, for the extra of a new-shards event."""
    keys = carried_keys()
    return {key: value for key, value in conf.items() if key in keys}


def conf_with_data_events(conf: Mapping[str, Any], extras: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``conf`` with the carried keys of the newest event's extra (the last of ``extras``); ``conf``
    itself when no event carries any. A key outside :func:`carried_keys` or a bad value raises
    :class:`ConfigError` naming it."""
    carrying = [extra.get(EVENT_CONF_KEY) for extra in extras if extra.get(EVENT_CONF_KEY)]
    if not carrying:
        return dict(conf)
    carried = carrying[-1]
    if not isinstance(carried, Mapping):
        raise ConfigError(f"the data event's {EVENT_CONF_KEY!r} extra must be a mapping, got {carried!r}")
    foreign = sorted(set(carried) - carried_keys())
    if foreign:
        raise ConfigError(
            f"the data event carries key(s) {foreign}; it may carry only {sorted(carried_keys())}"
        )
    merged = {**conf, **carried}
    PipelineConfig.from_conf(merged)  # the merged conf must hold together (e.g. a student that fits the data)
    return merged


def _read_text(location: str, storage_options: Mapping[str, Any] | None) -> str:
    """The text at a local path or an fsspec URL."""
    if "://" not in location:
        return Path(location).read_text()
    from mopflow.base.storage import read_bytes

    return read_bytes(location, storage_options).decode()


def read_conf_file(path: str | Path, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A flat YAML (or JSON) pipeline conf from ``path``, validated; :class:`ConfigError` names what
    is wrong. ``path`` is a local path, or an fsspec URL (``s3://bucket/retrain.yaml``) read with
    ``storage_options``."""
    file = str(path)
    try:
        text = _read_text(file, storage_options)
    # A store's client raises errors of its own (credentials, endpoint, bucket): all "cannot read".
    except Exception as exc:
        raise ConfigError(f"cannot read config file {file}: {exc}") from exc
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {file} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {file} must hold a mapping of config keys, got {type(data).__name__}")
    try:
        PipelineConfig.from_conf(data)
    except ConfigError as exc:
        raise ConfigError(f"config file {file}: {exc}") from exc
    return data
