from __future__ import annotations

import numpy as np
import pytest
from mnist1d.data import get_dataset_args, get_templates, make_dataset

from mopflow.training.data.sources.mnist1d import interp_rows, make_mnist1d, templates


def test_templates_are_the_packages() -> None:
    assert np.array_equal(templates(), get_templates()["x"])


@pytest.mark.parametrize(
    ("num_samples", "seed"),
    [(5000, 42), (1234, 7), (4100, 1_000_003)],  # the published set; a ragged size; a partition seed
)
def test_vectorized_generation_is_the_package_bit_for_bit(num_samples: int, seed: int) -> None:
    args = get_dataset_args()
    args.num_samples, args.seed = num_samples, seed
    expected = make_dataset(args)
    got = make_mnist1d(num_samples, seed)
    for key in ("x", "y", "x_test", "y_test"):
        want, have = expected[key], getattr(got, key)
        assert have.dtype == want.dtype, key
        assert have.shape == want.shape, key
        assert np.array_equal(have, want), f"{key}: max difference {np.abs(have - want).max()}"


def test_generation_does_not_touch_the_global_random_state() -> None:
    np.random.seed(3)
    expected = np.random.RandomState(3).random_sample(4)
    make_mnist1d(100, 0)
    assert np.array_equal(np.random.random_sample(4), expected)


def test_interp_rows_matches_numpy_interp_row_by_row() -> None:
    rng = np.random.default_rng(0)
    xp = np.linspace(0, 1, 13)
    fp = rng.normal(size=(5, 13))
    x_new = np.concatenate([np.linspace(0, 1, 40), xp[[0, 4, 12]]])
    got = interp_rows(x_new, xp, fp)
    for row, values in zip(fp, got, strict=True):
        assert np.array_equal(values, np.interp(x_new, xp, row))


def test_negative_size_is_refused() -> None:
    with pytest.raises(ValueError, match="num_samples must be >= 0, got -1"):
        make_mnist1d(-1, 0)
