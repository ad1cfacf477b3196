from __future__ import annotations

import pytest
import torch

from training.models import ArchSpec, build_model, count_params, largest_width_within


@pytest.mark.parametrize(("family", "depth"), [("cnn", 2), ("cnn", 4), ("mlp", 1), ("mlp", 3)])
def test_models_give_logits_per_class(family: str, depth: int) -> None:
    arch = ArchSpec(family, 16, depth, 40, 10)
    model = build_model(arch, [0.5] * 40, [2.0] * 40)
    out = model(torch.randn(7, 40))
    assert out.shape == (7, 10)
    assert count_params(arch) == sum(p.numel() for p in model.parameters())


def test_standardize_is_saved_with_the_weights() -> None:
    model = build_model(ArchSpec("mlp", 4, 1, 3, 2), [1.0, 2.0, 3.0], [1.0, 1.0, 2.0])
    state = model.state_dict()
    assert torch.equal(state["0.mean"], torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(state["0.std"], torch.tensor([1.0, 1.0, 2.0]))


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"family": "rnn"}, "unknown model family"),
        ({"width": 0}, "width"),
        ({"depth": 9}, "depth"),
        ({"family": "cnn", "depth": 6, "input_dim": 40}, "does not fit"),
    ],
)
def test_arch_spec_rejects_bad_values(kwargs: dict, needle: str) -> None:
    base = {"family": "mlp", "width": 8, "depth": 2, "input_dim": 40, "num_classes": 10} | kwargs
    with pytest.raises(ValueError, match=needle):
        ArchSpec(**base)


def test_largest_width_within_is_the_largest_that_fits() -> None:
    budget = 5000
    width = largest_width_within("cnn", 3, 40, 10, budget)
    assert width is not None
    assert count_params(ArchSpec("cnn", width, 3, 40, 10)) <= budget
    assert count_params(ArchSpec("cnn", width + 1, 3, 40, 10)) > budget
    assert largest_width_within("mlp", 2, 40, 10, 10) is None
