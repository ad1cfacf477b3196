"""The pure rules that refuse a source before anything is written: its columns (from their
dtypes) and its per-partition counts (as the workers report them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import pytest

from mopflow.training.data import (
    DataValidationError,
    check_columns,
    partition_stats,
    prepare_table_partition,
    validate_stats,
)
from mopflow.training.data.config import DataConfig


def _frame(n: int, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame(rng.normal(size=(n, 3)), columns=["f0", "f1", "f2"])
    frame["name"] = "a"
    frame["target"] = np.arange(n) % 2
    return frame


@pytest.mark.parametrize(
    ("frame", "features", "needle"),
    [
        (
            _frame(4)[["name", "target"]],
            None,
            "the source has no numeric feature columns besides the label 'target'",
        ),
        (_frame(4), ["f0", "target"], "label column 'target' is also listed as a feature"),
    ],
)
def test_bad_columns_are_refused_naming_them(
    frame: pd.DataFrame, features: list[str] | None, needle: str
) -> None:
    with pytest.raises(DataValidationError) as info:
        check_columns(dict(frame.dtypes.items()), "target", features)
    assert needle in str(info.value)


def _stats(parts: Sequence[pd.DataFrame], cfg: DataConfig) -> list[dict[str, Any]]:
    """Each partition's counts, as a worker computes them from its rows."""
    features = ["f0", "f1", "f2"]
    prepared = [
        prepare_table_partition(
            part, features, "target", cfg.val_fraction, cfg.test_fraction, cfg.seed, cfg.nan_policy
        )
        for part in parts
    ]
    return [partition_stats(part, features) for part in prepared]


def _all_nan(frame: pd.DataFrame) -> pd.DataFrame:
    frame = frame.assign(f1=np.nan)
    frame.loc[3, "f1"] = np.inf
    return frame


@pytest.mark.parametrize(
    ("frame", "cfg", "needle"),
    [
        (
            _all_nan(_frame(20)),
            {"nan_policy": "drop"},
            "all 20 rows of 'data/t.parquet' have NaN/inf features",
        ),
        (
            _frame(24),
            {"val_fraction": 0.01, "test_fraction": 0.3},
            "the validation split is empty (24 usable rows); use more rows",
        ),
        (_frame(24), {"n_shards": 20}, "n_shards=20 is more than the 16 training rows"),
    ],
)
def test_counts_that_cannot_be_sharded_are_refused_naming_them(
    frame: pd.DataFrame, cfg: dict[str, Any], needle: str
) -> None:
    config = DataConfig(dataset="data/t.parquet", label_column="target", **({"n_shards": 1} | cfg))
    stats = _stats([frame.iloc[:12], frame.iloc[12:]], config)  # two partitions: their counts add up
    with pytest.raises(DataValidationError) as info:
        validate_stats(stats, config, ["f0", "f1", "f2"], config.n_shards)
    assert needle in str(info.value)
