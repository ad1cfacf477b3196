from __future__ import annotations

import jsonschema
import pytest
from pydantic import ValidationError

from compression.config import CONF_FIELDS, ConfigError, PipelineConfig, conf_json_schema


@pytest.mark.parametrize(
    ("conf", "needles"),
    [
        ({"dataset": "imagenet"}, ["dataset", "imagenet"]),
        ({"n_trials": 0}, ["n_trials", "0"]),
        ({"n_trials": 2, "top_k": 3}, ["top_k=3", "n_trials=2"]),
        ({"student_width": 2000}, ["student_width=2000", "budget"]),
        ({"no_such_knob": 1}, ["no_such_knob"]),
        ({"temperature": float("nan")}, ["temperature"]),
        ({"model_name": "bad name; drop table"}, ["model_name"]),
        (
            {"search_space": '{"families": {"cnn": {"width": {"type": "int", "low": 5, "high": 1}}}}'},
            ["search_space"],
        ),
    ],
)
def test_bad_conf_is_refused_naming_the_value(conf: dict, needles: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        PipelineConfig.from_conf(conf)
    for needle in needles:
        assert needle in str(info.value)


def test_defaults_round_trip_through_the_flat_conf() -> None:
    cfg = PipelineConfig.from_conf({})
    assert PipelineConfig.from_conf(cfg.to_conf()) == cfg
    custom = PipelineConfig.from_conf({"n_trials": 7, "top_k": 2, "temperature": 2.5})
    assert (custom.search.n_trials, custom.ensemble.top_k, custom.distill.temperature) == (7, 2, 2.5)


def test_config_is_frozen() -> None:
    cfg = PipelineConfig.from_conf({})
    with pytest.raises(ValidationError, match="frozen"):
        cfg.search.n_trials = 5  # type: ignore[misc]


def test_json_schema_has_every_key_and_refuses_what_the_model_refuses() -> None:
    schema = conf_json_schema()
    assert set(schema) == set(CONF_FIELDS)
    for key, sub in schema.items():
        assert "description" in sub and "default" in sub, key
        jsonschema.validate(sub["default"], sub)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(0, schema["n_trials"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate("cmaes-or-whatever", schema["sampler"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(-1.0, schema["timeout_minutes"])


def test_oversized_conf_is_refused_before_parsing_the_space() -> None:
    big_space = '{"families": {}, "pad": "' + "x" * (200 * 1024) + '"}'
    with pytest.raises(ConfigError, match="limit is"):
        PipelineConfig.from_conf({"search_space": big_space})


def test_wrong_types_are_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="epochs"):
        PipelineConfig.from_conf({"epochs": "eighty"})
    with pytest.raises(ConfigError, match="feature_columns"):
        PipelineConfig.from_conf({"feature_columns": "a,b"})
