from __future__ import annotations

import json

import numpy as np
import optuna
import pytest

from mopflow.training.models.families import DataSpec
from mopflow.training.search.space import (
    SpaceError,
    check_space_fits,
    default_space,
    params_from_optuna,
    parse_space,
    sample_params,
)

VALID = {
    "families": {
        "cnn": {"width": {"type": "int", "low": 8, "high": 32}, "depth": {"type": "int", "low": 2, "high": 3}}
    },
    "common": {"lr": {"type": "float", "low": 1e-3, "high": 1e-1, "log": True}},
}


def _with(path: list[str], value: object) -> dict:
    spec = json.loads(json.dumps(VALID))
    node = spec
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return spec


def test_default_space_has_the_residual_cnn_and_the_mlp_for_tables() -> None:
    space = default_space()
    assert set(space.families) == {"rescnn", "mlp"}
    assert set(space.families["rescnn"]) == {"width", "depth", "shift"}
    assert {"lr", "weight_decay", "batch_size"} <= set(space.common)
    check_space_fits(space, DataSpec(40, 10))  # every family builds at the space's smallest values


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('{"families": {"cnn": {"width": {"type": "int", "low": NaN, "high": 3}}}}', "NaN"),
        ('{"families": {"cnn": {"width": {"type": "int", "low": 1, "high": Infinity}}}}', "Infinity"),
        ("{not json", "not valid JSON"),
    ],
)
def test_non_finite_and_malformed_json_are_refused(text: str, needle: str) -> None:
    with pytest.raises(SpaceError, match=needle):
        parse_space(text)


@pytest.mark.parametrize(
    ("path", "value", "needle"),
    [
        (["families", "cnn", "width", "low"], 64, "low"),  # low > high
        (["common", "lr", "low"], 0.0, "log scale needs low > 0"),
        (["common", "lr", "high"], 1e22, "out of range"),
        (["families", "cnn", "width", "type"], "__import__('os').system('x')", "type"),
        (["families", "cnn", "width", "extra"], 1, "extra"),
        (["common", "momentum"], {"type": "float", "low": 0.1, "high": 0.9}, "momentum"),
        (["families", "transformer"], {"width": {"type": "int", "low": 1, "high": 2}}, "transformer"),
        (["common", "batch_size"], {"type": "categorical", "choices": list(range(1, 200))}, "choices"),
    ],
)
def test_invalid_specs_name_the_field(path: list[str], value: object, needle: str) -> None:
    with pytest.raises(SpaceError) as info:
        parse_space(_with(path, value))
    assert needle in str(info.value)


def test_oversized_and_deeply_nested_text_is_refused() -> None:
    with pytest.raises(SpaceError, match="limit"):
        parse_space(" " * 70_000 + json.dumps(VALID))
    deep = "[" * 500 + "]" * 500
    with pytest.raises(SpaceError):
        parse_space(json.dumps({"families": {"cnn": {"width": json.loads(deep)}}}))


def test_sampled_params_respect_bounds_and_round_trip() -> None:
    space = parse_space(VALID)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(20):
        trial = study.ask()
        params = sample_params(space, trial)
        assert params["family"] == "cnn"
        assert 8 <= params["width"] <= 32 and 2 <= params["depth"] <= 3
        assert 1e-3 <= params["lr"] <= 1e-1
        assert params["batch_size"] == 128  # default when the space has no batch_size
        assert params_from_optuna(trial.params) == params
        study.tell(trial, 0.5)


def test_families_that_cannot_take_the_data_are_refused_before_training() -> None:
    from mopflow.training.models.families import DataSpec
    from mopflow.training.search.space import check_space_fits, default_space

    image = DataSpec(3 * 8 * 8, 4, (3, 8, 8), "image")
    with pytest.raises(
        SpaceError, match=r"family 'rescnn' takes \['sequence', 'table'\] data; the dataset is 'image'"
    ):
        check_space_fits(default_space("table"), image)
    check_space_fits(default_space("image"), image)
    deep = parse_space(
        {
            "families": {
                "cnn": {
                    "width": {"type": "int", "low": 4, "high": 8},
                    "depth": {"type": "int", "low": 6, "high": 8},
                }
            }
        }
    )
    with pytest.raises(SpaceError, match="a CNN of depth 6 does not fit an input of length 40"):
        check_space_fits(deep, DataSpec(40, 10))
    assert {"cnn2d", "resnet"} == set(default_space("image").families)
    with pytest.raises(SpaceError, match="no default search space for modality 'audio'"):
        default_space("audio")


def test_each_modality_s_default_space_offers_the_families_that_fit_it() -> None:
    from mopflow.training.models.families import DataSpec, get_family
    from mopflow.training.search.space import check_space_fits

    shapes = {"table": (40,), "sequence": (20, 2), "image": (3, 16, 16)}
    for modality, shape in shapes.items():
        data = DataSpec(int(np.prod(shape)), 5, shape, modality)
        space = default_space(modality)
        check_space_fits(space, data)
        assert all(get_family(name).fits(data) for name in space.families)
    assert "gru" in default_space("sequence").families
