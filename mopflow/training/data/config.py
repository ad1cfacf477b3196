"""The data stage's frozen, validated config: what to shard and how."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from mopflow.training.config import StageConfig

KNOWN_DATASETS = ("mnist1d", "shapes")


DEFAULT_MAX_SHARD_MB = 256.0  # a shard any process reads whole; the default keeps datasets' addresses


class DataConfig(StageConfig):
    """What to shard and how: a generated dataset by name, or a user table by fsspec URL."""

    dataset: str = Field(
        "mnist1d",
        description="Dataset: a generated one by name (mnist1d, shapes), or a URL (file, folder, s3://) of "
        "parquet/CSV, an image folder (root/<class>/*.png|jpg) or a folder with x.npy and y.npy",
    )
    image_size: list[int] | None = Field(
        None,
        min_length=2,
        max_length=2,
        description="Image folders: resize every image to [height, width]; None = all must have one size",
    )
    mixed_channels: Literal["refuse", "convert"] = Field(
        "refuse",
        description="Images with different channel counts (grayscale among colour): refuse them, naming "
        "the odd ones, or convert every image to the largest channel count when it is read",
    )
    tensor_column: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        description="Parquet: the column holding each example as an Arrow fixed-shape tensor or as an encoded "
        "image (PNG/JPEG bytes); None = numeric feature columns",
    )
    num_classes: int | None = Field(
        None, ge=2, le=100_000, description="Number of classes; a label outside 0..num_classes-1 is refused"
    )
    label_column: str = Field(
        "label", min_length=1, max_length=128, description="Label column of a user table"
    )
    feature_columns: list[str] | None = Field(
        None,
        max_length=10_000,
        description="Feature columns of a user table; None = all other numeric columns",
    )
    n_shards: int = Field(4, ge=1, le=1024, description="Number of training shards")
    max_shard_mb: float = Field(
        DEFAULT_MAX_SHARD_MB,
        gt=0.0,
        le=65_536.0,
        description=(
            "Largest shard in MB of features and labels: more training shards than n_shards are "
            "written when theirs would be larger (validation and test shards are no larger); "
            "outside the training memory budgets a process reads one shard at a time"
        ),
    )
    val_fraction: float = Field(
        0.1, gt=0.0, lt=0.5, description="Share of train rows held out for validation"
    )
    test_fraction: float = Field(
        0.2, gt=0.0, lt=0.5, description="Share of a user table's rows held out for test"
    )
    seed: int = Field(42, ge=0, le=2**31 - 1, description="Generator seed (42 = the published split)")
    num_samples: int = Field(5000, ge=100, le=100_000_000, description="Rows generated (train+test)")
    partition_rows: int = Field(
        50_000, ge=100, le=10_000_000, description="Rows generated per Dask task (one seed per partition)"
    )
    nan_policy: Literal["fail", "drop"] = Field(
        "fail", description="Rows with NaN/inf features: fail or drop"
    )
    stratify: bool = Field(
        False,
        description=(
            "Stratify the hash split by label: per-class hash thresholds give every class the split "
            "fractions to one row; rows near a threshold may change split when rows are appended"
        ),
    )

    @field_validator("dataset")
    @classmethod
    def _known_dataset(cls, value: str) -> str:
        if value in KNOWN_DATASETS or is_table_url(value):
            return value
        raise ValueError(
            f"unknown dataset {value!r}; expected one of {list(KNOWN_DATASETS)} or a parquet/CSV URL "
            "(a path or s3://... ending in .parquet or .csv, or a folder of them)"
        )

    @field_validator("image_size")
    @classmethod
    def _image_size(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and not all(1 <= n <= 4096 for n in value):
            raise ValueError(f"image_size {value} must be two sizes between 1 and 4096 ([height, width])")
        return value

    @field_validator("feature_columns")
    @classmethod
    def _columns(cls, value: list[str] | None) -> list[str] | None:
        if value is not None:
            if not value:
                raise ValueError("feature_columns must name at least one column (or be null for all numeric)")
            duplicates = sorted({c for c in value if value.count(c) > 1})
            if duplicates:
                raise ValueError(f"feature_columns lists {duplicates} more than once")
        return value


def is_table_url(value: str) -> bool:
    """Whether a dataset string looks like a table location (path or URL), not a dataset name."""
    return "/" in value or value.endswith((".parquet", ".csv", ".pq"))
