"""What every stage shares: the run's tags and study name, and one stage context that parses the config once,
owns the stage's MLflow run through the :class:`~mopflow.base.tracking.Tracker`, sets the lineage tags,
logs the stage's peak memory, and records the root cause when the stage fails."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from mopflow.base import progress, storage
from mopflow.base.settings import Settings
from mopflow.base.stopping import PipelineStopped, ended_status, raise_if_stopped
from mopflow.base.tag_names import AIRFLOW_RUN_ID, DAG_ID, RUN_KEY, STAGE
from mopflow.base.tracking import MlflowTracker, Tracker
from mopflow.pipeline.config import ConfigError, PipelineConfig
from mopflow.pipeline.memory import peak_memory_logged
from mopflow.pipeline.paths import RunPaths, run_paths
from mopflow.pipeline.records import RecordError, RunContext
from mopflow.pipeline.version import code_version

log = logging.getLogger(__name__)


class PipelineFailed(RuntimeError):
    """A pipeline run ended without its summary (an upstream stage failed)."""


def permanent_errors() -> tuple[type[BaseException], ...]:
    """Errors that a retry cannot fix (bad config, bad data): the task fails at once."""
    from mopflow.base.fencing import Superseded
    from mopflow.base.hosts import AcrossHostsError
    from mopflow.base.optuna_storage import StorageConfigError
    from mopflow.compression.distill.distill import StudentBudgetError
    from mopflow.training.data import DataValidationError, ShardIntegrityError
    from mopflow.training.models.families import FamilyError
    from mopflow.training.search.space import SpaceError

    return (
        PipelineStopped,
        PipelineFailed,
        Superseded,
        ConfigError,
        SpaceError,
        ShardIntegrityError,
        DataValidationError,
        StudentBudgetError,
        FamilyError,  # a model the family cannot build: the same on every try
        StorageConfigError,
        RecordError,
        AcrossHostsError,
    )


def lineage_tags(run: RunContext) -> dict[str, str]:
    """The lineage tags every MLflow run of the pipeline run ``run`` carries."""
    return run_tags(run.dag_id, run.airflow_run_id, run.run_key)


def run_tags(dag_id: str, airflow_run_id: str, run_key: str) -> dict[str, str]:
    """Tags naming the DAG run, the pipeline run key and the code that ran."""
    return {
        DAG_ID: dag_id,
        AIRFLOW_RUN_ID: airflow_run_id,
        RUN_KEY: run_key,
        "mopflow.code_version": code_version(),
    }


def make_run_key(dag_id: str, airflow_run_id: str) -> str:
    """Stable key of a pipeline run (logical_date may be null in Airflow 3: never key on it)."""
    return hashlib.sha256(f"{dag_id}/{airflow_run_id}".encode()).hexdigest()[:12]


def tracker_for(settings: Settings) -> MlflowTracker:
    """The MLflow tracker of ``settings`` (tracking URI, experiment, artifact location)."""
    return MlflowTracker(settings.tracking_uri, settings.experiment_name, settings.mlflow_artifact_location)


def summary_uri(settings: Settings, run_key: str) -> str:
    """Where a pipeline run's summary is: it exists once the run succeeded."""
    return run_paths(settings, run_key).summary


def study_name_for(cfg: PipelineConfig, run: RunContext) -> str:
    """One study per pipeline run: rerunning the run resumes it instead of starting another."""
    return f"{cfg.registry.model_name}-{run.run_key}"


def read_failure(settings: Settings, run_key: str) -> dict[str, Any] | None:
    """The root cause recorded for a failed pipeline run (None if none was recorded)."""
    uri = run_paths(settings, run_key).failure
    if not storage.exists(uri, settings.storage_options):
        return None
    failure: dict[str, Any] = storage.read_json(uri, settings.storage_options)
    return failure


# a stage's own lineage tags: given, or computed from the config and the run
Lineage = Mapping[str, str] | Callable[[PipelineConfig, RunContext], Mapping[str, str]]


@dataclass(frozen=True)
class Stage:
    """One running stage: its validated config, the settings, the pipeline run it belongs to, the
    tracker and the stage's own MLflow run (nested under the pipeline's parent run)."""

    name: str
    cfg: PipelineConfig
    settings: Settings
    run: RunContext
    tracker: Tracker
    run_id: str

    @property
    def storage_options(self) -> Mapping[str, Any]:
        return self.settings.storage_options

    @property
    def paths(self) -> RunPaths:
        """Where this pipeline run keeps its outputs (keyed by the run key: reruns reuse them)."""
        return run_paths(self.settings, self.run.run_key)

    def tag_lineage(self, tags: Mapping[str, str]) -> None:
        """Lineage learned during the stage (e.g. the manifest hash), on this run and the parent."""
        self.tracker.set_tags(self.run_id, tags)
        self.tracker.set_tags(self.run.parent_run_id, tags)


@contextmanager
def stage(
    name: str,
    conf: Mapping[str, Any] | None,
    run: RunContext,
    settings: Settings | None = None,
    lineage: Lineage | None = None,
) -> Iterator[Stage]:
    """Run the body as stage ``name`` of the pipeline run ``run``.

    Parses ``conf`` once, opens (or reopens, on a retry) the stage's MLflow run with the run's
    lineage tags plus ``lineage`` (tags, or a function of the config and the run giving them),
    and logs the task process's peak memory. The run ends FINISHED
    when the body returns; when it raises, the run ends FAILED (KILLED when the pipeline run was
    asked to stop) and the error is recorded as the run's root cause.
    """
    settings = settings or Settings.from_env()
    cfg = PipelineConfig.from_conf(conf)
    tracker = tracker_for(settings)
    raise_if_stopped()  # a stage does not start in a run asked to stop (its retry neither)
    progress.publish("stage", stage=name)
    extra = lineage(cfg, run) if callable(lineage) else (lineage or {})
    tags = {**lineage_tags(run), STAGE: name, **extra}
    run_id = tracker.get_or_start_run(name, tags, parent_run_id=run.parent_run_id)
    with peak_memory_logged(name):
        try:
            yield Stage(name, cfg, settings, run, tracker, run_id)
        except Exception as exc:
            tracker.end_run(run_id, ended_status())
            _record_failure(settings, run, name, exc)
            raise
        tracker.end_run(run_id)


def _record_failure(settings: Settings, run: RunContext, stage_name: str, exc: Exception) -> None:
    """Write the error as the run's root cause (``failure.json``; a stage's last attempt writes it,
    and no stage runs after a failed one), so the end of the run can name it."""
    failure = {
        "stage": stage_name,
        "error": type(exc).__name__,
        "message": str(exc)[:4000],
        "permanent": isinstance(exc, permanent_errors()),
    }
    storage.write_json_atomic(run_paths(settings, run.run_key).failure, failure, settings.storage_options)
