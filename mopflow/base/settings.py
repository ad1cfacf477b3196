"""Deployment settings: where data, artifacts, tracking and search state live.

Settings say *where* things are (they change between the embedded default and the
scale-out profile); the pipeline config says *what* to run. Every setting has an
environment variable; nothing else is hard-coded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, cast, get_args

# The Airflow pool the training tasks (search, distill) share: at most its slots train at once.
TRAINING_POOL = "mopflow_training"


class SettingsError(ValueError):
    """A setting has a value mopflow cannot use."""


Accelerator = Literal["auto", "cpu", "gpu"]  # where training runs (training/compute/devices.py resolves auto)
Precision = Literal["32", "bf16-mixed"]  # Lightning precisions mopflow trains with
ACCELERATORS: tuple[Accelerator, ...] = get_args(Accelerator)
PRECISIONS: tuple[Precision, ...] = get_args(Precision)


def _default_home() -> Path:
    return Path.home() / ".mopflow"


# name -> (environment variable, help text). Defaults depending on MOPFLOW_HOME are filled in
# from_env; this table is what docs/user-guide/configuration.md documents and what the deployment files must pass.
SETTING_ENV: dict[str, tuple[str, str]] = {
    "home": ("MOPFLOW_HOME", "Root folder for everything local (default ~/.mopflow)"),
    "data_root": ("MOPFLOW_DATA_ROOT", "fsspec URL where shards and manifests are written"),
    "artifact_root": ("MOPFLOW_ARTIFACT_ROOT", "fsspec URL for checkpoints and model bundles"),
    "data_roots": (
        "MOPFLOW_DATA_ROOTS",
        "Comma-separated folders and URL prefixes (s3://bucket/datasets/) a trigger's dataset and "
        "spot_trace may read from, besides the data root; generated datasets are always allowed",
    ),
    "tracking_uri": (
        "MOPFLOW_TRACKING_URI",
        "MLflow tracking URI (default sqlite:///<home>/mlflow/mlflow.db)",
    ),
    "mlflow_artifact_location": (
        "MOPFLOW_MLFLOW_ARTIFACTS",
        "Artifact location for a new MLflow experiment (local default <home>/mlflow/artifacts)",
    ),
    "experiment_name": ("MOPFLOW_EXPERIMENT", "MLflow experiment name"),
    "optuna_storage": (
        "MOPFLOW_OPTUNA_STORAGE",
        "Optuna storage: a journal file path or journal:///path, or an RDB URL (postgresql://...)",
    ),
    "dask_address": ("MOPFLOW_DASK_ADDRESS", "Address of an existing Dask scheduler; empty = LocalCluster"),
    "dask_workers": ("MOPFLOW_DASK_WORKERS", "Worker processes of the LocalCluster (CPU workers)"),
    "accelerator": (
        "MOPFLOW_ACCELERATOR",
        "auto | cpu | gpu: where training runs (auto: GPU workers when CUDA is visible or the cluster has "
        "workers with the Dask resource GPU)",
    ),
    "trials_per_gpu": (
        "MOPFLOW_TRIALS_PER_GPU",
        "LocalCluster worker processes per visible GPU, each training one trial or unit at a time (default 1)",
    ),
    "precision": (
        "MOPFLOW_PRECISION",
        "32 | bf16-mixed: training precision (bf16-mixed where the device has it)",
    ),
    "storage_options": (
        "MOPFLOW_STORAGE_OPTIONS",
        "JSON object of fsspec storage options (e.g. s3 endpoint); a Dask worker that sets its own uses those",
    ),
    "airflow_home": ("MOPFLOW_AIRFLOW_HOME", "AIRFLOW_HOME used by `mopflow run` (default <home>/airflow)"),
}

# Environment variables read outside Settings: DAG-file defaults (read when a DAG file is parsed),
# worker-side knobs and the Sweeps page. Like SETTING_ENV, the deployment files (infra/deploy) pass
# every one to the Airflow and Dask containers. tests/infra/test_deploy.py fails when code reads a
# MOPFLOW_ variable listed in none of SETTING_ENV, RUNTIME_ENV, LOCAL_ENV (and the local stack's
# PORT_ENV / STACK_ENV), or when a deployment file does not pass one of the first two through.
RUNTIME_ENV: dict[str, str] = {
    "MOPFLOW_RETRAIN_SCHEDULE": "Timetable of mopflow_retrain (default @weekly; none = only on new shards)",
    "MOPFLOW_RETRAIN_CONFIG": "YAML file of config keys (a path on every host, or an fsspec URL): the defaults of mopflow_retrain's Params (validated at parse)",
    "MOPFLOW_TASK_RETRIES": "Retries of every pipeline task (default 2)",
    "MOPFLOW_RETRY_DELAY_S": "First retry delay in seconds, doubling per retry up to 10 min (default 30)",
    "MOPFLOW_TRAINING_POOL_SLOTS": "Slots of the Airflow pool mopflow_training (default 1)",
    "MOPFLOW_MODEL_MODULES": "Comma-separated modules of a local project defining MODEL_FAMILIES (extra model families)",
    "MOPFLOW_PREEMPT_GRACE_S": "Seconds a worker given a spot notice (SIGTERM) has to checkpoint and leave (default 30)",
    "MOPFLOW_SHARD_CACHE": "Local folder where a worker caches remote shards: the worker's own (default its temp folder)",
    "MOPFLOW_TRAIN_MEMORY_MB": "Training rows a worker process holds in memory; a larger partition streams (default 2048)",
    "MOPFLOW_MODEL_POOL_MB": "Built models a worker process keeps between units, for the next state to load into (default 256; 0: none)",
    "MOPFLOW_DISTILL_MEMORY_MB": "Training rows a worker training a distillation student holds in memory; more streams (default 256)",
    "MOPFLOW_SHUFFLE_BUFFER_ROWS": "Rows of the shuffle buffer of a streamed pass (default 65536)",
    "MOPFLOW_MLFLOW_UI_URL": "MLflow UI address the Sweeps page links to",
    "MOPFLOW_OPTUNA_DASHBOARD_URL": "optuna-dashboard address the Sweeps page links to",
    # mopflow.base.connections: the Airflow Connections a task takes settings from (empty = none)
    "MOPFLOW_MLFLOW_CONN_ID": "Airflow Connection giving the MLflow tracking URI and user (default mopflow_mlflow)",
    "MOPFLOW_STORAGE_CONN_ID": "Airflow Connection giving the storage options: S3 keys, endpoint (default mopflow_storage)",
    "MOPFLOW_OPTUNA_CONN_ID": "Airflow Connection giving the Optuna storage URL (default mopflow_optuna)",
    "MOPFLOW_DASK_CONN_ID": "Airflow Connection giving the Dask scheduler address (default mopflow_dask)",
}

# Read only by local tooling (`mopflow run`, `mopflow up`), never inside a deployed container.
LOCAL_ENV: frozenset[str] = frozenset(
    {
        "MOPFLOW_DAGS_FOLDER",
        "MOPFLOW_STOP_TIMEOUT_S",  # how long `mopflow run` may take to stop on SIGINT/SIGTERM
        "MOPFLOW_PROFILE",  # infra/stack/profile.py fills the environment before anything else runs
        "MOPFLOW_MLFLOW_BACKEND_STORE",  # the backend store `mopflow up` gives its MLflow server
        "MOPFLOW_MLFLOW_ARTIFACTS_DESTINATION",  # and its artifact destination
        "MOPFLOW_PORT_RANGE",  # where free ports are drawn on one host (mopflow/base/ports.py; the test suite's workers)
    }
)


def parse_storage_options(raw: str) -> dict[str, Any]:
    """The fsspec storage options a ``MOPFLOW_STORAGE_OPTIONS`` value gives (empty: none)."""
    try:
        options = json.loads(raw or "{}")
    except json.JSONDecodeError as exc:
        raise SettingsError(f"MOPFLOW_STORAGE_OPTIONS is not valid JSON: {exc}") from exc
    if not isinstance(options, dict):
        raise SettingsError("MOPFLOW_STORAGE_OPTIONS must be a JSON object")
    return options


def _default_mlflow_artifacts(tracking_uri: str, home: Path) -> str:
    """A local folder for a local tracking store; none for a tracking server, whose own artifact
    destination (proxied ``mlflow-artifacts:``) is then used: a client's local path would not be
    reachable from the other machines."""
    if tracking_uri.startswith(("http://", "https://")):
        return ""
    return str(home / "mlflow" / "artifacts")


@dataclass(frozen=True)
class Settings:
    """Where mopflow reads and writes. Build with :meth:`from_env`."""

    home: str
    data_root: str
    artifact_root: str
    tracking_uri: str
    mlflow_artifact_location: str
    experiment_name: str
    optuna_storage: str
    dask_address: str
    dask_workers: int
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    airflow_home: str = ""
    data_roots: tuple[str, ...] = ()  # the operator's, besides data_root (allowed_data_roots)
    accelerator: Accelerator = "auto"
    trials_per_gpu: int = 1
    precision: Precision = "32"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Read settings from environment variables, filling in the embedded defaults."""
        env = os.environ if environ is None else environ
        home = Path(env.get("MOPFLOW_HOME") or _default_home()).expanduser().resolve()
        workers_raw = env.get("MOPFLOW_DASK_WORKERS", "2")
        try:
            workers = int(workers_raw)
        except ValueError as exc:
            raise SettingsError(f"MOPFLOW_DASK_WORKERS={workers_raw!r} is not an integer") from exc
        if not 1 <= workers <= 256:
            raise SettingsError(f"MOPFLOW_DASK_WORKERS={workers} must be between 1 and 256")
        options = parse_storage_options(env.get("MOPFLOW_STORAGE_OPTIONS", ""))
        accelerator = (env.get("MOPFLOW_ACCELERATOR", "") or "auto").strip().lower()
        if accelerator not in ACCELERATORS:
            raise SettingsError(f"MOPFLOW_ACCELERATOR={accelerator!r} is not one of {list(ACCELERATORS)}")
        precision = (env.get("MOPFLOW_PRECISION", "") or "32").strip()
        if precision not in PRECISIONS:
            raise SettingsError(f"MOPFLOW_PRECISION={precision!r} is not one of {list(PRECISIONS)}")
        per_gpu_raw = env.get("MOPFLOW_TRIALS_PER_GPU", "1") or "1"
        if not per_gpu_raw.strip().isdigit() or not 1 <= int(per_gpu_raw) <= 64:
            raise SettingsError(f"MOPFLOW_TRIALS_PER_GPU={per_gpu_raw!r} must be an integer from 1 to 64")
        return cls(
            home=str(home),
            data_root=env.get("MOPFLOW_DATA_ROOT") or str(home / "data"),
            artifact_root=env.get("MOPFLOW_ARTIFACT_ROOT") or str(home / "artifacts"),
            tracking_uri=env.get("MOPFLOW_TRACKING_URI") or f"sqlite:///{home / 'mlflow' / 'mlflow.db'}",
            mlflow_artifact_location=env.get("MOPFLOW_MLFLOW_ARTIFACTS")
            or _default_mlflow_artifacts(env.get("MOPFLOW_TRACKING_URI", ""), home),
            experiment_name=env.get("MOPFLOW_EXPERIMENT") or "mopflow",
            optuna_storage=env.get("MOPFLOW_OPTUNA_STORAGE") or str(home / "optuna" / "journal.log"),
            dask_address=env.get("MOPFLOW_DASK_ADDRESS", ""),
            dask_workers=workers,
            storage_options=options,
            airflow_home=env.get("MOPFLOW_AIRFLOW_HOME") or str(home / "airflow"),
            data_roots=tuple(
                root.strip() for root in env.get("MOPFLOW_DATA_ROOTS", "").split(",") if root.strip()
            ),
            accelerator=cast(Accelerator, accelerator),
            trials_per_gpu=int(per_gpu_raw),
            precision=cast(Precision, precision),
        )

    @property
    def allowed_data_roots(self) -> tuple[str, ...]:
        """Where a trigger's dataset may be read from: the data root and the operator's roots."""
        return (self.data_root, *self.data_roots)

    def describe(self) -> dict[str, str]:
        """Settings as printable strings; secrets (storage options, database passwords) masked."""
        out: dict[str, str] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "storage_options":
                value = {
                    k: ("***" if "secret" in k or "key" in k or "token" in k else v) for k, v in value.items()
                }
            if f.name in ("optuna_storage", "tracking_uri"):  # database URLs may hold a password
                from mopflow.base.optuna_storage import redact_url

                value = redact_url(str(value))
            out[f.name] = ",".join(value) if isinstance(value, tuple) else str(value)
        return out
