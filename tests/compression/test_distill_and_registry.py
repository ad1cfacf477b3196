from __future__ import annotations

import numpy as np
import pytest
import torch

from mopflow.compression.config import DistillConfig
from mopflow.compression.distill.distill import (
    StudentBudgetError,
    matching_epochs,
    plan_student,
    soft_targets,
    train_student,
    transfer_set,
)
from mopflow.compression.registry.model_registry import decide_promotion
from mopflow.training.models.builtin import ArchSpec, build_model, count_params
from mopflow.training.models.bundle import ProbabilityEnsemble
from mopflow.training.models.bundle import accuracy as student_accuracy
from mopflow.training.models.families import DataSpec
from tests.compression.helpers import fit, separable_blobs


def test_auto_sized_student_is_the_largest_within_budget() -> None:
    plan = plan_student(DistillConfig(), ensemble_params=100_000, data=DataSpec(40, 10))
    assert plan.num_params <= 10_000 == plan.budget
    bigger = ArchSpec(plan.arch.family, {**plan.arch.params, "width": plan.arch.params["width"] + 1}, 40, 10)
    assert count_params(bigger) > plan.budget


def test_configured_student_over_budget_is_refused() -> None:
    with pytest.raises(StudentBudgetError, match="student_width=64"):
        plan_student(DistillConfig(width=64), ensemble_params=20_000, data=DataSpec(40, 10))


def test_soft_targets_are_distributions_that_flatten_with_temperature() -> None:
    torch.manual_seed(0)
    teacher = ProbabilityEnsemble(
        [build_model(ArchSpec("mlp", {"width": 16, "depth": 1}, 40, 10)) for _ in range(2)]
    )
    x = np.random.default_rng(0).normal(size=(32, 40)).astype(np.float32) * 5
    cold, hot = soft_targets(teacher, x, 1.0), soft_targets(teacher, x, 8.0)
    assert torch.allclose(cold.sum(1), torch.ones(32), atol=1e-5)
    assert hot.max(1).values.mean() < cold.max(1).values.mean()


def test_student_learns_from_soft_targets_on_a_separable_problem() -> None:
    x, y = separable_blobs(600, seed=0)
    torch.manual_seed(0)
    teacher_model = build_model(ArchSpec("mlp", {"width": 32, "depth": 1}, 40, 3))
    fit(teacher_model, x, y, steps=200)
    teacher = ProbabilityEnsemble([teacher_model])
    cfg = DistillConfig(family="mlp", depth=1, epochs=5, max_param_ratio=1.0, batch_size=32)
    plan = plan_student(cfg, 10_000, DataSpec(40, 3))
    student, history = train_student(
        plan, cfg, x[:500], y[:500], x[500:], y[500:], [0.0] * 40, [1.0] * 40, teacher, 0
    )
    assert len(history) == 5
    assert student_accuracy(student, x[500:], y[500:]) > 0.9
    # The transfer set: the real rows first, then MUNGE rows carrying the teacher's class.
    munged = cfg.model_copy(update={"munge_multiplier": 2})
    x_t, y_t = transfer_set(x[:500], y[:500], teacher, munged, seed=0)
    assert x_t.shape == (1500, 40) and y_t.shape == (1500,) and y_t.dtype == y.dtype
    assert np.array_equal(x_t[:500], x[:500]) and np.array_equal(y_t[:500], y[:500])
    assert np.array_equal(y_t[500:], soft_targets(teacher, x_t[500:], 1.0).argmax(1).numpy())
    x_real = x[:500]
    off = cfg.model_copy(update={"munge_multiplier": 0})
    assert transfer_set(x_real, y[:500], teacher, off, 0)[0] is x_real
    # The hard-label baseline's override: as many epochs as asked, not cfg.epochs.
    _, short = train_student(
        plan, cfg, x[:500], y[:500], x[500:], y[500:], [0.0] * 40, [1.0] * 40, None, 0, epochs=2
    )
    assert len(short) == 2


def test_baseline_gets_as_many_steps_as_the_distilled_student() -> None:
    assert matching_epochs(48, transfer_rows=5 * 3569, train_rows=3569) == 240
    assert matching_epochs(120, transfer_rows=1000, train_rows=1000) == 120
    assert matching_epochs(1, transfer_rows=10, train_rows=1000) == 1
    with pytest.raises(ValueError, match="transfer_rows=0"):
        matching_epochs(10, 0, 100)


@pytest.mark.parametrize(
    ("policy", "new", "champ", "promote"),
    [
        ("accuracy", 0.90, None, True),
        ("accuracy", 0.90, 0.90, True),
        ("accuracy", 0.89, 0.90, False),
        ("never", 0.99, None, False),
        ("always", 0.10, 0.99, True),
    ],
)
def test_promotion_gate(policy: str, new: float, champ: float | None, promote: bool) -> None:
    decision = decide_promotion(policy, new, champ)
    assert decision.promote is promote
    assert decision.reason
