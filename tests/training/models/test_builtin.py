from __future__ import annotations

import pytest
import torch

from mopflow.training.models.builtin import ArchSpec, build_model, count_params, largest_size_within
from mopflow.training.models.families import DataSpec


# Width 16 on 40 features and 10 classes. The Standardize layer's mean/std are buffers, not
# parameters. A conv (k5, s2, p1) maps a length L to (L + 2 - 5) // 2 + 1: 40 -> 19 -> 9 -> 4 -> 1.
# cnn depth 2: conv 1->16 (16*1*5 + 16 = 96), conv 16->16 (16*16*5 + 16 = 1296),
#              head 16*9 -> 10 (144*10 + 10 = 1450): 96 + 1296 + 1450 = 2842
# cnn depth 4: 96 + 3 * 1296 = 3984, head 16*1 -> 10 (16*10 + 10 = 170): 3984 + 170 = 4154
# mlp depth 1: 40->16 (40*16 + 16 = 656), head 16->10 (170): 656 + 170 = 826
# mlp depth 3: 656 + 2 * (16*16 + 16 = 272) + 170 = 1370
@pytest.mark.parametrize(
    ("family", "depth", "params"), [("cnn", 2, 2842), ("cnn", 4, 4154), ("mlp", 1, 826), ("mlp", 3, 1370)]
)
def test_models_give_logits_per_class(family: str, depth: int, params: int) -> None:
    arch = ArchSpec(family, {"width": 16, "depth": depth}, 40, 10)
    model = build_model(arch, [0.5] * 40, [2.0] * 40)
    out = model(torch.randn(7, 40))
    assert out.shape == (7, 10)
    assert count_params(arch) == params


def test_count_params_of_the_smallest_mlp() -> None:
    # 3 inputs -> 4 hidden (3*4 weights + 4 biases = 16) -> 2 classes (4*2 + 2 = 10): 26
    assert count_params(ArchSpec("mlp", {"width": 4, "depth": 1}, 3, 2)) == 26


def test_standardize_is_saved_with_the_weights() -> None:
    model = build_model(ArchSpec("mlp", {"width": 4, "depth": 1}, 3, 2), [1.0, 2.0, 3.0], [1.0, 1.0, 2.0])
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
    params = {"width": base["width"], "depth": base["depth"]}
    with pytest.raises(ValueError, match=needle):
        ArchSpec(base["family"], params, base["input_dim"], base["num_classes"])


def test_arch_spec_round_trips_and_reads_the_width_depth_form() -> None:
    arch = ArchSpec("cnn", {"width": 8, "depth": 2}, 40, 10)
    assert ArchSpec.from_dict(arch.to_dict()) == arch
    legacy = {"family": "cnn", "width": 8, "depth": 2, "input_dim": 40, "num_classes": 10}
    assert ArchSpec.from_dict(legacy) == arch
    assert (
        ArchSpec.from_params({"family": "cnn", "width": 8, "depth": 2, "lr": 0.1}, DataSpec(40, 10)) == arch
    )
    assert len({arch, ArchSpec.from_dict(legacy)}) == 1


def test_largest_size_within_is_the_largest_that_fits() -> None:
    budget = 5000
    width = largest_size_within("cnn", {"depth": 3}, DataSpec(40, 10), budget)
    assert width is not None
    assert count_params(ArchSpec("cnn", {"width": width, "depth": 3}, 40, 10)) <= budget
    assert count_params(ArchSpec("cnn", {"width": width + 1, "depth": 3}, 40, 10)) > budget
    assert largest_size_within("mlp", {"depth": 2}, DataSpec(40, 10), 10) is None
