from __future__ import annotations

import numpy as np
import pytest

from mopflow.compression.distill.augment import mixup_points, random_shift


def test_image_shift_moves_pixels_and_brings_in_zeros() -> None:
    image = np.zeros((1, 2, 5, 5), dtype=np.float32)
    image[0, :, 2, 2] = [1.0, 2.0]
    rng = np.random.default_rng(0)
    shifted = random_shift(np.repeat(image.reshape(1, -1), 200, axis=0), (2, 5, 5), "image", 2, rng)
    out = shifted.reshape(200, 2, 5, 5)
    assert np.allclose(out.sum(axis=(2, 3)), [1.0, 2.0])  # the dot stays whole, in both channels
    positions = {tuple(np.argwhere(o[0] == 1.0)[0]) for o in out}
    assert len(positions) > 10 and all(0 <= r < 5 and 0 <= c < 5 for r, c in positions)
    assert np.array_equal(out[:, 0] * 2.0, out[:, 1])  # channels move together


def test_sequence_shift_moves_steps_and_tables_are_left_alone() -> None:
    rng = np.random.default_rng(1)
    seq = np.arange(1, 11, dtype=np.float32).reshape(1, 10)  # 5 steps x 2 features
    out = random_shift(np.repeat(seq, 50, axis=0), (5, 2), "sequence", 1, rng).reshape(50, 5, 2)
    for row in out:
        nonzero = row[np.abs(row).sum(axis=1) > 0]
        assert len(nonzero) >= 4 and np.all(np.diff(nonzero[:, 0]) == 2)  # whole steps, in order
    table = rng.normal(size=(4, 3)).astype(np.float32)
    assert random_shift(table, (3,), "table", 3, rng) is table


def test_mixup_points_stay_nearest_their_own_example() -> None:
    rng = np.random.default_rng(2)
    x = rng.normal(size=(64, 12)).astype(np.float32) * 10
    points = mixup_points(x, (12, 1), "sequence", 3, alpha=0.4, max_shift=0, seed=0)
    assert points.shape == (192, 12) and points.dtype == np.float32
    own = np.tile(np.arange(64), 3)
    distances = ((points[:, None, :] - x[None]) ** 2).sum(-1)
    assert (distances.argmin(axis=1) == own).mean() > 0.9
    assert np.array_equal(points, mixup_points(x, (12, 1), "sequence", 3, 0.4, 0, seed=0))
    assert mixup_points(x, (12, 1), "sequence", 0, 0.4, 0, seed=0).shape == (0, 12)
    with pytest.raises(ValueError, match="alpha=0"):
        mixup_points(x, (12, 1), "sequence", 1, alpha=0, max_shift=0, seed=0)


def test_auto_transfer_is_munge_for_a_table_of_columns_and_mixup_for_a_signal_table() -> None:
    from mopflow.compression.config import DistillConfig
    from mopflow.training.data.config import DataConfig
    from mopflow.training.data.sources.kinds import known_data_spec
    from mopflow.training.models.families import DataSpec

    auto = DistillConfig()
    assert auto.resolved("table").transfer == "munge"
    assert auto.resolved("table", ordered=True).transfer == "mixup"
    assert auto.resolved("image").transfer == auto.resolved("sequence").transfer == "mixup"
    assert DistillConfig(transfer="munge").resolved("table", ordered=True).transfer == "munge"  # as set
    mnist1d = known_data_spec(DataConfig())
    assert mnist1d is not None and mnist1d.ordered and mnist1d.modality == "table"
    # the manifest says so, and a manifest without the key is a table of columns
    manifest = {"feature_columns": ["a", "b"], "num_classes": 3, "ordered_features": True}
    assert DataSpec.from_manifest(manifest).ordered
    assert not DataSpec.from_manifest({"feature_columns": ["a", "b"], "num_classes": 3}).ordered
