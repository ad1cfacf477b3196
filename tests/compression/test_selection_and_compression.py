from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from mopflow.compression.distill.munge import munge, munge_chunks, nearest_neighbours
from mopflow.compression.ensemble import faster_form, greedy_selection
from mopflow.compression.evaluate import accuracy_of, evaluate, format_table, quantize_int8
from mopflow.registry.model_registry import decide_promotion
from mopflow.training.models.builtin import ArchSpec, build_model
from mopflow.training.models.bundle import ProbabilityEnsemble, StackedEnsemble, predict_proba
from mopflow.training.models.families import DataSpec
from tests.compression.helpers import fit, separable_blobs


def _onehot(labels: np.ndarray, confidence: float = 0.9, classes: int = 3) -> np.ndarray:
    probs = np.full((len(labels), classes), (1 - confidence) / (classes - 1))
    probs[np.arange(len(labels)), labels] = confidence
    return probs


def test_greedy_selection_picks_complementary_models_with_replacement() -> None:
    y = np.array([0, 1, 2, 0, 1, 2])
    right_first_half = _onehot(np.array([0, 1, 2, 1, 2, 0]))  # 3/6 right
    right_second_half = _onehot(np.array([1, 2, 0, 0, 1, 2]), confidence=0.8)  # 3/6 right
    always_zero = _onehot(np.zeros(6, dtype=int), confidence=0.95)  # 2/6 right
    picks = greedy_selection([always_zero, right_first_half, right_second_half], y, size=4)
    assert picks[0] in (1, 2)
    assert {1, 2} <= set(picks)  # together they are right everywhere
    assert 0 not in picks
    assert len(picks) == 4  # with replacement: repeats allowed


def test_stacked_ensemble_is_the_same_function_as_the_loop() -> None:
    torch.manual_seed(0)
    members = [
        build_model(ArchSpec("cnn", {"width": 8, "depth": 3}, 40, 10), [0.2] * 40, [1.5] * 40)
        for _ in range(3)
    ]
    members.append(build_model(ArchSpec("mlp", {"width": 12, "depth": 2}, 40, 10)))
    loop = ProbabilityEnsemble(members, [2.0, 1.0, 1.0, 3.0]).eval()
    stacked = StackedEnsemble(loop)
    assert sorted(stacked.group_sizes) == [1, 3]
    x = torch.randn(64, 40)
    assert torch.allclose(predict_proba(loop, x), predict_proba(stacked, x), atol=1e-6)
    assert torch.allclose(predict_proba(stacked, x).sum(1), torch.ones(64), atol=1e-5)
    with pytest.raises(ValueError, match="non-negative"):
        ProbabilityEnsemble(members, [1.0, -1.0, 1.0, 1.0])


class _CostPerCall(torch.nn.Module):
    """A classifier whose every call also takes ``seconds``, whatever the batch: run in a loop, an
    ensemble of n pays it n times; stacked, one call of the group pays it once."""

    def __init__(self, model: torch.nn.Module, seconds: float) -> None:
        super().__init__()
        self.model, self.seconds = model, seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        out: torch.Tensor = self.model(x)
        return out


def test_faster_form_stacks_members_that_cost_per_call_and_keeps_the_function() -> None:
    torch.manual_seed(1)
    n, cost_s = 5, 0.02
    members = [
        _CostPerCall(build_model(ArchSpec("mlp", {"width": 4, "depth": 1}, 40, 10)), cost_s) for _ in range(n)
    ]
    loop = ProbabilityEnsemble(members).eval()
    chosen, ms = faster_form(loop, 40, batches=(1,), repeats=1)
    # the loop calls the 5 members (5 x 20 ms = 100 ms at least), the stacked form its one
    # group once (20 ms plus vmap's overhead): stacking is the faster form by construction
    assert isinstance(chosen, StackedEnsemble)
    assert ms["loop_ms"] >= n * cost_s * 1e3
    assert ms["stacked_ms"] >= cost_s * 1e3
    x = torch.randn(16, 40)
    assert torch.allclose(predict_proba(chosen, x), predict_proba(loop, x), atol=1e-6)


def test_faster_form_keeps_the_loop_when_stacking_cannot_run_or_has_nothing_to_stack() -> None:
    torch.manual_seed(1)
    # Recurrent members share an architecture, but vmap cannot batch a GRU: the loop, its time
    # measured, the stacked form's not.
    data = DataSpec(8, 2, (4, 2), "sequence")
    recurrent = ProbabilityEnsemble(
        [build_model(ArchSpec.of("gru", {"width": 4, "depth": 1}, data)) for _ in range(2)]
    )
    chosen, ms = faster_form(recurrent, 8, batches=(1,), repeats=1)
    assert chosen is recurrent
    assert ms["loop_ms"] > 0 and ms["stacked_ms"] == 0.0
    # No architecture shared by two members: nothing to vectorise, the loop is kept unmeasured.
    distinct = ProbabilityEnsemble(
        [
            build_model(ArchSpec("cnn", {"width": 8, "depth": 3}, 40, 10)),
            build_model(ArchSpec("mlp", {"width": 12, "depth": 2}, 40, 10)),
        ]
    )
    assert faster_form(distinct, 40) == (distinct, {"loop_ms": 0.0, "stacked_ms": 0.0})
    with pytest.raises(ValueError, match="batches"):
        faster_form(recurrent, 8, batches=(0,))


def test_munge_points_are_near_the_data_and_reproducible() -> None:
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(0, 0.1, size=(50, 4)), rng.normal(10, 0.1, size=(50, 4))]).astype(
        np.float32
    )
    nn = nearest_neighbours(x)
    assert (nn != np.arange(100)).all()
    assert ((nn < 50) == (np.arange(100) < 50)).all()  # neighbours come from the same cluster
    points = munge(x, multiplier=2, swap_prob=0.5, spread=1.0, seed=1)
    assert points.shape == (200, 4) and points.dtype == np.float32
    assert np.array_equal(points, munge(x, multiplier=2, swap_prob=0.5, spread=1.0, seed=1))
    distance_to_data = np.abs(points[:, None, :] - x[None, :, :]).sum(-1).min(1)
    assert np.median(distance_to_data) < 1.0  # near the data, not between the clusters
    assert munge(x, 0).shape == (0, 4)


def test_tree_neighbours_match_brute_force_and_respect_classes_and_duplicates() -> None:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(400, 6)).astype(np.float32)
    z = (x - x.mean(0)) / (x.std(0) + 1e-8)
    distances = np.linalg.norm(z[:, None] - z[None], axis=-1)
    np.fill_diagonal(distances, np.inf)
    assert np.array_equal(nearest_neighbours(x), distances.argmin(1))
    labels = rng.integers(0, 3, size=400)
    same = nearest_neighbours(x, labels)
    assert (labels[same] == labels).all() and (same != np.arange(400)).all()
    twins = np.concatenate([x[:10], x[:10]])  # an identical row is the nearest one
    assert np.array_equal(nearest_neighbours(twins), np.r_[np.arange(10, 20), np.arange(10)])
    alone = nearest_neighbours(x[:3], np.array([0, 1, 1]))
    assert alone[0] == 0 and alone[1] == 2 and alone[2] == 1  # a class of one is its own


def test_large_groups_are_searched_in_bounded_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    import mopflow.compression.distill.munge as munge_module

    x = np.random.default_rng(1).normal(size=(1000, 3)).astype(np.float32)
    exact = nearest_neighbours(x)
    monkeypatch.setattr(munge_module, "TREE_ROWS", 100)
    blocks = munge_module._blocks(np.arange(1000))
    assert len(blocks) == 10 and max(len(b) for b in blocks) <= 100
    assert np.array_equal(np.sort(np.concatenate(blocks)), np.arange(1000))  # every row in one block
    approx = nearest_neighbours(x)
    block_of = np.empty(1000, dtype=int)
    for i, block in enumerate(blocks):
        block_of[block] = i
    assert (block_of[approx] == block_of).all() and (approx != np.arange(1000)).all()
    # within its block it is the nearest: never nearer than the exact neighbour over all rows
    z = munge_module.tree_coordinates(x)
    assert (np.linalg.norm(z[approx] - z, axis=1) >= np.linalg.norm(z[exact] - z, axis=1) - 1e-6).all()


def test_munge_in_chunks_is_bounded_and_deterministic() -> None:
    x = np.random.default_rng(0).normal(size=(1000, 5)).astype(np.float32)
    chunks = list(munge_chunks(x, 3, seed=2, chunk_rows=128))
    assert max(len(c) for c in chunks) == 3 * 128 and sum(len(c) for c in chunks) == 3000
    assert np.array_equal(
        np.concatenate(chunks), np.concatenate(list(munge_chunks(x, 3, seed=2, chunk_rows=128)))
    )
    with pytest.raises(ValueError, match="chunk_rows"):
        list(munge_chunks(x, 1, chunk_rows=0))


def test_int8_student_keeps_its_accuracy_and_report_has_every_row() -> None:
    x, y = separable_blobs(300, seed=0)
    model = build_model(ArchSpec("mlp", {"width": 32, "depth": 1}, 40, 3))
    fit(model, x, y, steps=150)
    model.eval()
    quantized = quantize_int8(model)
    assert any("quantized" in type(m).__module__ for m in quantized.modules())
    models = {"fp32": (model, 1000, 4000), "int8": (quantized, 1000, 1000)}
    shards = [(x[:120], y[:120]), (x[120:], y[120:])]  # the test split in two shards
    rows = evaluate(models, shards, repeats=3)
    assert [r["model"] for r in rows] == ["fp32", "int8"]
    assert rows[0]["test_acc"] == pytest.approx(accuracy_of(model, x, y))
    assert rows[0]["test_acc"] > 0.9 and abs(rows[0]["test_acc"] - rows[1]["test_acc"]) < 0.02
    assert all(r["latency_ms_b1"] > 0 and r["latency_ms_b256"] > 0 for r in rows)
    assert "| int8 |" in format_table(rows)


@pytest.mark.parametrize(
    ("student", "champion", "ensemble", "promote"),
    [
        (0.93, None, 0.94, True),
        (0.93, None, 0.96, False),  # 3 points below the ensemble
        (0.93, 0.94, 0.935, False),  # worse than the champion
        (0.95, 0.94, 0.96, True),
    ],
)
def test_gate_needs_champion_and_ensemble_conditions(
    student: float, champion: float | None, ensemble: float, promote: bool
) -> None:
    decision = decide_promotion("accuracy", student, champion, ensemble, max_gap_points=2.0)
    assert decision.promote is promote
    assert "ensemble" in decision.reason


def test_static_int8_quantizes_the_convolutions_and_keeps_accuracy() -> None:
    from mopflow.compression.evaluate import quantize_static_int8

    x, y = separable_blobs(400, seed=1)
    torch.manual_seed(0)
    model = build_model(
        ArchSpec("cnn", {"width": 8, "depth": 3}, 40, 3), x.mean(0).tolist(), x.std(0).tolist()
    )
    fit(model, x, y, steps=100)
    model.eval()
    engine_before = torch.backends.quantized.engine
    quantized = quantize_static_int8(model, x[:200])
    assert torch.backends.quantized.engine == engine_before  # packing engine is not left behind
    kinds = {type(m).__name__ for m in quantized.modules()}
    assert "ConvReLU1d" in kinds and "Linear" in kinds  # quantized (fused) convolutions and head
    fp32 = (predict_proba(model, x).argmax(1).numpy() == y).mean()
    int8 = (quantized(torch.from_numpy(x)).argmax(1).numpy() == y).mean()
    assert fp32 > 0.9 and abs(fp32 - int8) < 0.03
    with pytest.raises(ValueError, match="'no-such-engine' is not supported"):
        quantize_static_int8(model, x[:200], engine="no-such-engine")
    with pytest.raises(ValueError, match="calibration rows"):
        quantize_static_int8(model, x[:0])
