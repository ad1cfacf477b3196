"""The scale-out profile's settings: what it moves where, and bad profiles refused.

The profile for real (Airflow metadata, MLflow backend and Optuna storage on PostgreSQL; MLflow
artifacts, shards and checkpoints on S3; an external Dask scheduler and workers) runs the whole
retraining pipeline across test hosts in ``test_across_hosts.py``, whose ``mop`` sweep also checks
every stage's lineage tags, the Airflow run on PostgreSQL and the objects on S3; the real Airflow
components in this profile (``mopflow up`` with the LocalExecutor and the CeleryExecutor) in
``test_airflow_executors.py`` and ``test_across_hosts.py``."""

from __future__ import annotations

import pytest

from mopflow.infra.stack.profile import apply_profile, parse_profile, read_profile


def test_scale_out_profile_moves_every_part_and_the_environment_wins() -> None:
    values = read_profile("scale-out")
    assert values["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("postgresql")
    assert values["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor"
    assert values["MOPFLOW_OPTUNA_STORAGE"].startswith("postgresql")
    assert values["MOPFLOW_TRACKING_URI"].startswith("http://")
    assert values["MOPFLOW_MLFLOW_BACKEND_STORE"].startswith("postgresql")
    assert values["MOPFLOW_DATA_ROOT"].startswith("s3://") and values["MOPFLOW_ARTIFACT_ROOT"].startswith(
        "s3://"
    )
    assert values["MOPFLOW_DASK_ADDRESS"].startswith("tcp://")
    env = {"MOPFLOW_PROFILE": "scale-out", "MOPFLOW_DASK_ADDRESS": "tcp://10.0.0.5:8786"}
    applied = apply_profile(env)
    assert env["MOPFLOW_DASK_ADDRESS"] == "tcp://10.0.0.5:8786" and "MOPFLOW_DASK_ADDRESS" not in applied
    assert env["MOPFLOW_OPTUNA_STORAGE"] == values["MOPFLOW_OPTUNA_STORAGE"]
    assert apply_profile({}) == {}  # no profile: the embedded defaults


def test_bad_profiles_are_refused_with_the_name_or_line() -> None:
    from mopflow.infra.stack.profile import ProfileError

    with pytest.raises(ProfileError, match="unknown profile 'cloud'"):
        apply_profile({"MOPFLOW_PROFILE": "cloud"})
    with pytest.raises(ProfileError, match="p.env:2: expected KEY=VALUE"):
        parse_profile("A=1\nnot a line\n", "p.env")
    with pytest.raises(ProfileError, match="A is set twice"):
        parse_profile("A=1\nA=2\n", "p.env")
