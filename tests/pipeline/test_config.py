from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from pydantic import ValidationError

from mopflow.pipeline.config import CONF_FIELDS, ConfigError, PipelineConfig, conf_json_schema
from mopflow.training.models.families import MODULES_ENV, reload_families


@pytest.mark.parametrize(
    ("conf", "needles"),
    [
        ({"dataset": "imagenet"}, ["dataset", "imagenet"]),
        ({"n_trials": 0}, ["n_trials", "0"]),
        ({"n_trials": 2, "top_k": 3}, ["top_k=3", "n_trials=2"]),
        ({"student_width": 2000}, ["student_width=2000", "budget"]),
        ({"student_max_params": 0}, ["student_max_params", "greater than or equal to 1"]),
        ({"student_max_params": 20}, ["student_max_params=20: no cnn student of depth 3"]),
        ({"student_width": 64, "student_max_params": 5000}, ["student_width=64", "student_max_params=5000"]),
        ({"student_budget_ms": -1}, ["student_budget_ms", "greater than 0"]),
        ({"student_budget_ms": "fast"}, ["student_budget_ms", "fast"]),
        ({"student_batch": 0}, ["student_batch", "greater than or equal to 1"]),
        ({"no_such_knob": 1}, ["no_such_knob"]),
        ({"temperature": float("nan")}, ["temperature"]),
        ({"model_name": "bad name; drop table"}, ["model_name 'bad name; drop table' must match"]),
        (
            {"search_space": '{"families": {"cnn": {"width": {"type": "int", "low": 5, "high": 1}}}}'},
            ["search_space"],
        ),
        (  # a conf names families; only registered ones are taken, and it never names code
            {
                "search_space": '{"families": {"my.module:Evil": {"width": {"type": "int", "low": 1, "high": 2}}}}'
            },
            [
                "search_space",
                "unknown model family 'my.module:Evil'",
                "registered: ['cnn', 'cnn2d', 'gru', 'mlp'",
            ],
        ),
        # the volatile-worker keys
        ({"worker_schedule": "exp:2:4"}, ["worker_schedule", "'exp:2:4'", "exponential:<eta>:<n_max>"]),
        ({"worker_schedule": "exponential:0.5:4"}, ["worker_schedule", "eta=0.5"]),
        ({"worker_schedule": "step:1:x:4"}, ["worker_schedule", "increment='x'"]),
        ({"worker_schedule": "step:6:1:4"}, ["worker_schedule", "n_start=6 exceeds n_max=4"]),
        ({"worker_schedule": "static:2", "strategy": "ddp"}, ["worker_schedule", "'ddp'"]),
        ({"scale_timeout_s": 0}, ["scale_timeout_s", "0"]),
        ({"spot_speed": -1}, ["spot_speed", "-1"]),
        ({"spot_trace": "prices.txt", "spot_bids": [1.0]}, ["spot_trace", "prices.txt", ".csv"]),
        ({"spot_trace": "p.csv"}, ["spot_trace='p.csv'", "spot_bids=None"]),
        ({"spot_trace": "p.csv", "spot_bids": "1.0, x"}, ["spot_bids[1]='x'"]),
        ({"spot_trace": "p.csv", "spot_bids": [1.0, -2.0]}, ["spot_bids[1]=-2.0"]),
        ({"spot_trace": "p.csv", "spot_bids": [1.0], "strategy": "ddp"}, ["spot_trace", "'ddp'"]),
        (
            {"spot_trace": "p.csv", "spot_bids": [1.0], "worker_schedule": "static:2"},
            ["spot_trace and worker_schedule"],
        ),
        ({"n_workers": 4}, ["n_workers is now parallel_trials"]),
        # the data keys
        ({"image_size": [0, 4]}, ["image_size [0, 4] must be two sizes between 1 and 4096"]),
        ({"feature_columns": []}, ["feature_columns must name at least one column"]),
        ({"feature_columns": ["a", "b", "a", "c", "b"]}, ["feature_columns lists ['a', 'b'] more than once"]),
        # the search keys
        (
            {"worker_schedule": "exponential:2"},
            ["'exponential:2': exponential takes <eta>:<n_max>, got 1 value"],
        ),
        ({"worker_schedule": "exponential:fast:4"}, ["'exponential:fast:4': eta='fast' is not a number"]),
        (
            {"worker_schedule": {"kind": "static", "n_max": 2, "unit": "iteration"}},
            ["worker_schedule.unit must be 'epoch'", "got 'iteration'"],
        ),
        (
            {"spot_trace": "p\n.csv", "spot_bids": [1.0]},
            ["spot_trace 'p\\n.csv' must be a path or URL without"],
        ),
        ({"spot_trace": "   ", "spot_bids": [1.0]}, ["spot_trace '   ' must be a path or URL"]),
        (
            {"spot_trace": "p.csv", "spot_bids": []},
            ["spot_bids must hold one bid per LocalCluster worker, got []"],
        ),
        # the search space and the student against the data
        (
            {
                "search_space": {
                    "families": {
                        "cnn": {
                            "width": {"type": "int", "low": 4, "high": 8},
                            "depth": {"type": "categorical", "choices": [8]},
                        }
                    }
                }
            },
            ["family 'cnn' cannot be built for data of shape [40]", "depth 8"],
        ),
        (
            {"student_family": "vit"},
            ["student_family", "unknown model family 'vit'; student families: ['cnn'"],
        ),
        (
            {"student_family": "cnn2d"},
            ["student_family='cnn2d' takes ['image'] data; the dataset is 'table'"],
        ),
        (
            {"dataset": "shapes", "student_family": "gru"},
            ["student_family='gru' takes ['sequence'] data; the dataset is 'image'"],
        ),
        (
            {"dataset": "shapes", "student_width": 2},
            ["student_width=2 does not fit the student", "cnn2d.width=2 must be between 4 and 512"],
        ),
        (
            {"student_family": "cnn", "student_width": 64, "student_depth": 8},
            [
                "student_width=64 does not fit the student",
                "a CNN of depth 8 does not fit an input of length 40",
            ],
        ),
    ],
)
def test_bad_conf_is_refused_naming_the_value(conf: dict, needles: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        PipelineConfig.from_conf(conf)
    for needle in needles:
        assert needle in str(info.value)


@pytest.fixture()
def non_student_families(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A local module (MOPFLOW_MODEL_MODULES) with a family that cannot be a student (``teacher``)
    and a student family without a size parameter (``sizeless``)."""
    (tmp_path / "non_student_families.py").write_text(
        textwrap.dedent(
            """
            from mopflow.training.models.families import ModelFamily

            def build(params, data):
                raise NotImplementedError("never built: the config refuses it first")

            WIDTH = {"width": {"type": "int", "low": 1, "high": 8}}
            MODEL_FAMILIES = [
                ModelFamily(name="teacher", params=WIDTH, build=build),
                ModelFamily(name="sizeless", params=WIDTH, build=build, can_be_student=True),
            ]
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(MODULES_ENV, "non_student_families")
    reload_families()
    yield
    monkeypatch.delenv(MODULES_ENV)
    sys.modules.pop("non_student_families", None)
    reload_families()


@pytest.mark.parametrize(
    ("family", "needle"),
    [
        ("teacher", "family 'teacher' cannot be a student; student families: ['cnn'"),
        ("sizeless", "student family 'sizeless' has no size parameter to fit the budget"),
    ],
)
@pytest.mark.usefixtures("non_student_families")
def test_a_registered_family_that_cannot_be_the_student_is_refused_naming_it(
    family: str, needle: str
) -> None:
    with pytest.raises(ConfigError) as info:
        PipelineConfig.from_conf({"student_family": family})
    assert needle in str(info.value) and "student_family" in str(info.value)


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


def test_volatile_worker_keys_reach_the_search_config() -> None:
    cfg = PipelineConfig.from_conf(
        {
            "strategy": "mop",
            "worker_schedule": "exponential:2:4",
            "scale_timeout_s": 30,
        }
    )
    schedule = cfg.search.worker_schedule
    assert schedule is not None
    assert (schedule.kind, schedule.eta, schedule.n_max, schedule.unit) == ("exponential", 2.0, 4, "epoch")
    assert cfg.search.scale_timeout_s == 30.0
    assert cfg.to_conf()["worker_schedule"] == "exponential:2:4"
    assert PipelineConfig.from_conf(cfg.to_conf()) == cfg
    step = PipelineConfig.from_conf({"worker_schedule": "step:1:2:5"}).search.worker_schedule
    assert step is not None and (step.n_start, step.increment, step.n_max, step.period) == (1, 2, 5, 1)
    for fixed in ("", "static", "none"):
        assert PipelineConfig.from_conf({"worker_schedule": fixed}).search.worker_schedule is None
    static = PipelineConfig.from_conf({"worker_schedule": "static:3"}).search.worker_schedule
    assert static is not None and static.kind == "static" and static.n_max == 3

    spot = PipelineConfig.from_conf(
        {"strategy": "mop", "spot_trace": "s3://b/prices.csv", "spot_bids": "1.0, 0.5", "spot_speed": 120}
    )
    assert (spot.search.spot_trace, spot.search.spot_bids, spot.search.spot_speed) == (
        "s3://b/prices.csv",
        [1.0, 0.5],
        120.0,
    )
    assert PipelineConfig.from_conf({"spot_trace": "p.csv", "spot_bids": [0.4]}).search.spot_bids == [0.4]
    assert PipelineConfig.from_conf(spot.to_conf()) == spot


def test_volatile_keys_in_the_trigger_form_schema() -> None:
    schema = conf_json_schema()
    for key in ("worker_schedule", "spot_trace"):  # optional text: null (the default) or a string
        assert schema[key]["type"] == ["null", "string"] and schema[key]["default"] is None
        for value in (None, "", "exponential:2:4"):
            jsonschema.validate(value, schema[key])
    for bids in ("1.0, 0.5", [1.0, 0.5], None):
        jsonschema.validate(bids, schema["spot_bids"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"bid": 1}, schema["spot_bids"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(0, schema["spot_speed"])


def test_docs_config_table_is_the_generated_one() -> None:
    from pathlib import Path

    from mopflow.pipeline.config import CONF_FIELDS, conf_markdown_table

    page = Path(__file__).resolve().parents[2] / "docs" / "user-guide" / "configuration.md"
    text = page.read_text()
    start = text.index("<!-- config-keys:")
    block = text[text.index("\n", start) + 1 : text.index("\n<!-- /config-keys -->")]
    assert block == conf_markdown_table(), f"{page.name}'s config table is stale: paste `mopflow config-keys`"
    assert all(f"| `{key}` |" in block for key in CONF_FIELDS)


@pytest.mark.parametrize("name", ["demo.yaml", "images.yaml"])
def test_the_demo_configs_hold_only_what_they_change(name: str) -> None:
    """The config model is the one source of the defaults: a demo config restates none of them."""
    from pathlib import Path

    import yaml

    conf = yaml.safe_load((Path(__file__).resolve().parents[2] / "infra" / "configs" / name).read_text())
    defaults = PipelineConfig().to_conf()
    assert [key for key, value in conf.items() if defaults[key] == value] == []
    PipelineConfig.from_conf(conf)  # and it is valid


def test_a_conf_is_parsed_once_per_process_and_a_bad_one_is_refused_every_time() -> None:
    from mopflow.pipeline.config import ConfigError, PipelineConfig

    conf = {"n_trials": 3, "top_k": 2, "model_name": "parsed-once"}
    first = PipelineConfig.from_conf(conf)
    assert PipelineConfig.from_conf(dict(reversed(conf.items()))) is first  # the same conf, any order
    assert PipelineConfig.from_conf(conf | {"n_trials": 4}) is not first
    for _ in range(2):
        with pytest.raises(ConfigError, match="top_k=5 is larger than n_trials=3"):
            PipelineConfig.from_conf(conf | {"top_k": 5})
