"""Model families as plugins: the registry, its entry points and modules, and its refusals."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from mopflow.training.models.builtin import ArchSpec, build_model
from mopflow.training.models.families import (
    DataSpec,
    FamilyError,
    ModelFamily,
    get_family,
    registered_families,
    reload_families,
)
from mopflow.training.search.space import SpaceError, parse_space


@pytest.fixture()
def extra_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A local project's module with one family (``tiny``), named in MOPFLOW_MODEL_MODULES."""
    (tmp_path / "my_families.py").write_text(
        textwrap.dedent(
            """
            from torch import nn
            from mopflow.training.models.families import ModelFamily

            def build(params, data):
                return nn.Sequential(nn.Linear(data.input_dim, params["hidden"]), nn.Tanh(),
                                     nn.Linear(params["hidden"], data.num_classes))

            TINY = ModelFamily(
                name="tiny",
                params={"hidden": {"type": "int", "low": 2, "high": 64},
                        "act": {"type": "categorical", "choices": ["tanh"]}},
                build=lambda p, d: build(p, d),
                size_param="hidden",
                can_be_student=True,
            )
            MODEL_FAMILIES = [TINY]
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("MOPFLOW_MODEL_MODULES", "my_families")
    reload_families()
    yield "tiny"
    monkeypatch.delenv("MOPFLOW_MODEL_MODULES")
    sys.modules.pop("my_families", None)
    reload_families()


def test_the_built_in_families_come_from_the_entry_points() -> None:
    from importlib.metadata import entry_points

    assert {e.name for e in entry_points(group="mopflow.models")} >= {"cnn", "mlp"}
    families = registered_families()
    assert {"cnn", "mlp"} <= set(families)
    assert families["cnn"].quantizable and families["cnn"].size_param == "width"


def test_a_module_named_in_the_setting_adds_a_family_with_its_own_params(extra_module: str) -> None:
    family = get_family(extra_module)
    arch = ArchSpec(extra_module, {"hidden": 5, "act": "tanh"}, 40, 3)
    model = build_model(arch, [0.0] * 40, [1.0] * 40)
    assert model(torch.randn(4, 40)).shape == (4, 3)
    assert family.params["hidden"]["high"] == 64
    space = parse_space(
        {
            "families": {
                "tiny": {
                    "hidden": {"type": "int", "low": 2, "high": 8},
                    "act": {"type": "categorical", "choices": ["tanh"]},
                }
            }
        }
    )
    assert set(space.families) == {"tiny"}


def test_unknown_families_and_params_are_refused_naming_what_is_registered() -> None:
    with pytest.raises(
        FamilyError,
        match=r"unknown model family 'vit'; registered: \['cnn', 'cnn2d', 'gru', 'mlp', 'rescnn', 'resnet'",
    ):
        get_family("vit")
    with pytest.raises(SpaceError, match="unknown model family 'vit'"):
        parse_space({"families": {"vit": {"width": {"type": "int", "low": 1, "high": 2}}}})
    with pytest.raises(SpaceError, match=r"cnn.width: values must lie within \[1, 4096\]"):
        parse_space(
            {
                "families": {
                    "cnn": {
                        "width": {"type": "int", "low": 1, "high": 9999},
                        "depth": {"type": "int", "low": 1, "high": 2},
                    }
                }
            }
        )
    with pytest.raises(
        FamilyError,
        match=r"family 'mlp' takes \['depth', 'width'\]; missing \['depth'\], unknown \['heads'\]",
    ):
        ArchSpec("mlp", {"width": 4, "heads": 2}, 40, 10)


def test_a_family_that_cannot_build_for_the_data_is_refused_with_its_own_reason() -> None:
    with pytest.raises(FamilyError, match="does not fit an input of length 6"):
        ArchSpec("cnn", {"width": 4, "depth": 3}, 6, 10)


def test_bad_registrations_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOPFLOW_MODEL_MODULES", "os; rm -rf /")
    with pytest.raises(FamilyError, match="is not a module name"):
        reload_families()
    monkeypatch.setenv("MOPFLOW_MODEL_MODULES", "json")
    with pytest.raises(FamilyError, match="defines no MODEL_FAMILIES"):
        reload_families()
    (tmp_path / "dup_families.py").write_text(
        "from dataclasses import replace\n"
        "from mopflow.training.models.builtin import CNN_FAMILY\n"
        "MODEL_FAMILIES = [replace(CNN_FAMILY, description='another')]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("MOPFLOW_MODEL_MODULES", "dup_families")
    with pytest.raises(FamilyError, match="'cnn' is registered twice"):
        reload_families()
    monkeypatch.delenv("MOPFLOW_MODEL_MODULES")
    reload_families()
    with pytest.raises(FamilyError, match="must match"):
        ModelFamily("Bad Name", {}, lambda p, d: nn.Identity())
    assert DataSpec(40, 10).input_dim == 40
