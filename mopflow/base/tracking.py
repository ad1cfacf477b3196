"""Tracking at the edge: a small ``Tracker`` protocol and its MLflow implementation.

Runs are found again by tags, so every stage can be rerun without creating duplicates.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)

PARENT_TAG = "mlflow.parentRunId"


class Tracker(Protocol):
    """What the pipeline needs from experiment tracking."""

    def find_run(self, tags: Mapping[str, str]) -> str | None: ...

    def find_runs(self, tags: Mapping[str, str], max_results: int = 1000) -> list[Any]: ...

    def start_run(self, name: str, tags: Mapping[str, str], parent_run_id: str | None = None) -> str: ...

    def get_or_start_run(
        self, name: str, tags: Mapping[str, str], parent_run_id: str | None = None
    ) -> str: ...

    def log_params(self, run_id: str, params: Mapping[str, Any]) -> None: ...

    def log_metrics(self, run_id: str, metrics: Mapping[str, float], step: int | None = None) -> None: ...

    def log_metric_history(self, run_id: str, key: str, values: Iterable[tuple[int, float]]) -> None: ...

    def log_dict(self, run_id: str, obj: Any, artifact_file: str) -> None: ...

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None: ...

    def log_artifacts(self, run_id: str, local_dir: str, artifact_path: str | None = None) -> None: ...

    def log_figure(self, run_id: str, figure: Any, artifact_file: str) -> None: ...

    def log_remote_dir(
        self, run_id: str, url: str, artifact_path: str, storage_options: Mapping[str, Any] | None
    ) -> None: ...

    def set_tags(self, run_id: str, tags: Mapping[str, str]) -> None: ...

    def end_run(self, run_id: str, status: str = "FINISHED") -> None: ...


def bound_mlflow_retries() -> None:
    """MLflow's default HTTP retries can stall a call for minutes when the server is down: bound them."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    # No usage telemetry from pipeline tasks (machines may have no internet; nothing to report).
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


def route_mlflow_logs_to_root() -> bool:
    """Send MLflow's log records and event messages through the root logger, at level info and up.

    MLflow writes to stderr: its ``mlflow`` logger has a stderr handler of its own and does not
    propagate, and event messages (``Created version '1' of model ...``) are printed to stderr
    (``eprint``). In an Airflow task every stderr line reaches the task log at level *error*.
    Airflow's task runner configures the root logger, which keeps each record's level; so the
    logger propagates and the event messages become INFO records of the ``mlflow`` logger.
    Without a configured root logger (a plain script) MLflow is left as it is, so nothing is lost.
    True when MLflow's output was rerouted.
    """
    if not logging.getLogger().handlers:
        return False
    from mlflow.utils import logging_utils

    mlflow_log = logging.getLogger("mlflow")
    mlflow_log.handlers = [h for h in mlflow_log.handlers if not isinstance(h, logging.StreamHandler)]
    mlflow_log.propagate = True
    if not isinstance(logging_utils.MLFLOW_LOGGING_STREAM, _MlflowEvents):
        # eprint() looks the stream up at each call; disable_logging() still silences it.
        logging_utils.MLFLOW_LOGGING_STREAM = _MlflowEvents(mlflow_log)  # type: ignore[assignment]  # same duck type
    return True


class _MlflowEvents:
    """A text stream that turns each line MLflow prints as an event into an INFO record."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self.enabled = True
        self._pending = ""

    def write(self, text: str) -> int:
        if self.enabled:
            *lines, self._pending = (self._pending + text).split("\n")
            for line in lines:
                if line.strip():
                    self.logger.info(line)
        return len(text)

    def flush(self) -> None:
        if self._pending.strip() and self.enabled:
            self.logger.info(self._pending)
        self._pending = ""


def _ensure_local_parent(tracking_uri: str) -> None:
    if tracking_uri.startswith("sqlite:///"):
        Path(tracking_uri[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)


class MlflowTracker:
    """Tracker over ``mlflow.MlflowClient`` for one experiment."""

    def __init__(self, tracking_uri: str, experiment_name: str, artifact_location: str | None = None) -> None:
        bound_mlflow_retries()
        import mlflow
        from mlflow import MlflowClient

        route_mlflow_logs_to_root()
        _ensure_local_parent(tracking_uri)
        self.tracking_uri = tracking_uri
        mlflow.set_tracking_uri(tracking_uri)
        mlflow.set_registry_uri(tracking_uri)
        self.client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        experiment = self.client.get_experiment_by_name(experiment_name)
        if experiment is None:
            location = artifact_location or None  # None: the tracking server decides
            if location and "://" not in location:
                Path(location).mkdir(parents=True, exist_ok=True)
                location = Path(location).resolve().as_uri()
            try:
                self.experiment_id = self.client.create_experiment(
                    experiment_name, artifact_location=location
                )
            except Exception:  # created concurrently by another task
                found = self.client.get_experiment_by_name(experiment_name)
                if found is None:
                    raise
                self.experiment_id = found.experiment_id
        else:
            self.experiment_id = experiment.experiment_id
        self.experiment_name = experiment_name

    def find_runs(self, tags: Mapping[str, str], max_results: int = 1000) -> list[Any]:
        """Runs of this experiment carrying all ``tags``."""
        clauses = [f"tags.`{k}` = '{_quote(v)}'" for k, v in tags.items()]
        return list(
            self.client.search_runs(
                [self.experiment_id], filter_string=" and ".join(clauses), max_results=max_results
            )
        )

    def find_run(self, tags: Mapping[str, str]) -> str | None:
        runs = self.find_runs(tags, max_results=1)
        return runs[0].info.run_id if runs else None

    def start_run(self, name: str, tags: Mapping[str, str], parent_run_id: str | None = None) -> str:
        all_tags = dict(tags)
        if parent_run_id:
            all_tags[PARENT_TAG] = parent_run_id
        run = self.client.create_run(self.experiment_id, tags=all_tags, run_name=name)
        return str(run.info.run_id)

    def get_or_start_run(self, name: str, tags: Mapping[str, str], parent_run_id: str | None = None) -> str:
        """The run with these tags, created if missing (and reopened if it had ended)."""
        existing = self.find_run(tags)
        if existing:
            self.client.update_run(existing, status="RUNNING")
            return existing
        return self.start_run(name, tags, parent_run_id)

    def log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        current = self.client.get_run(run_id).data.params
        fresh = [Param(k, str(v)[:6000]) for k, v in params.items() if k not in current]
        if fresh:  # params are immutable in MLflow: reruns must not re-log them
            self.client.log_batch(run_id, params=fresh)

    def log_metrics(self, run_id: str, metrics: Mapping[str, float], step: int | None = None) -> None:
        from mlflow.entities import Metric

        now = _now_ms()
        self.client.log_batch(
            run_id, metrics=[Metric(k, float(v), now, step or 0) for k, v in metrics.items() if v is not None]
        )

    def log_metric_history(self, run_id: str, key: str, values: Iterable[tuple[int, float]]) -> None:
        from mlflow.entities import Metric

        now = _now_ms()
        metrics = [Metric(key, float(v), now, int(step)) for step, v in values]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(run_id, metrics=metrics[i : i + 1000])

    def log_dict(self, run_id: str, obj: Any, artifact_file: str) -> None:
        self.client.log_text(run_id, json.dumps(obj, indent=2, sort_keys=True, default=str), artifact_file)

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        self.client.log_text(run_id, text, artifact_file)

    def log_artifacts(self, run_id: str, local_dir: str, artifact_path: str | None = None) -> None:
        self.client.log_artifacts(run_id, local_dir, artifact_path)

    def log_figure(self, run_id: str, figure: Any, artifact_file: str) -> None:
        """A matplotlib figure as an image artifact (the file's suffix picks the format)."""
        self.client.log_figure(run_id, figure, artifact_file)

    def log_remote_dir(
        self, run_id: str, url: str, artifact_path: str, storage_options: Mapping[str, Any] | None
    ) -> None:
        """Copy a folder from any fsspec URL into the run's artifacts."""
        from mopflow.base.storage import filesystem

        fs, path = filesystem(url, storage_options)
        with tempfile.TemporaryDirectory() as tmp:
            fs.get(path.rstrip("/") + "/", tmp + "/", recursive=True)
            self.client.log_artifacts(run_id, tmp, artifact_path)

    def set_tags(self, run_id: str, tags: Mapping[str, str]) -> None:
        for k, v in tags.items():
            self.client.set_tag(run_id, k, str(v))

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)

    def run_status(self, run_id: str) -> str:
        return str(self.client.get_run(run_id).info.status)


def _quote(value: str) -> str:
    return str(value).replace("'", "\\'")


def _now_ms() -> int:
    import time

    return int(time.time() * 1000)
