"""Every path a pipeline run writes, named in one place.

A run's outputs live under ``<artifact root>/runs/<run key>/`` (keyed by the run key, so a rerun
reuses them); the files the stages log to MLflow runs have their names here too. The shards
themselves are content-addressed under the data root (``mopflow.training.data``), the trials'
checkpoints under the study (``mopflow.training.search``).
"""

from __future__ import annotations

from dataclasses import dataclass

from mopflow.base import storage
from mopflow.base.settings import Settings

RUNS_FOLDER = "runs"
SUMMARY_FILE = "summary.json"  # a run's summary, written by the register stage last
FAILURE_FILE = "failure.json"  # a failed run's root cause, written by the failed stage

# files the stages log to their MLflow runs (artifact paths)
MANIFEST_ARTIFACT = "manifest.json"
CONFIG_ARTIFACT = "config.json"
SEARCH_SPACE_ARTIFACT = "search_space.json"
LEADERBOARD_ARTIFACT = "leaderboard.json"
EVALUATION_ARTIFACT = "evaluation.json"
EVALUATION_TABLE_ARTIFACT = "evaluation.md"
KEPT_STUDENT_ARTIFACT = "kept_student.json"
FIGURES_FOLDER = "figures"  # the search run's pictures of its study (training/search/figures.py)
MOP_FOLDER = "mop"  # the search run's Gantt charts and unit timings, per MOP epoch


@dataclass(frozen=True)
class RunPaths:
    """The outputs of one pipeline run, under its folder ``root``."""

    root: str

    def _at(self, name: str) -> str:
        return storage.join(self.root, name)

    @property
    def summary(self) -> str:
        """The run's summary: it exists once the run succeeded."""
        return self._at(SUMMARY_FILE)

    @property
    def failure(self) -> str:
        """The root cause of a failed run."""
        return self._at(FAILURE_FILE)

    @property
    def ensemble(self) -> str:
        """The ensemble's bundle."""
        return self._at("ensemble")

    @property
    def predictions(self) -> str:
        """The candidates' predictions on the validation and test shards, made on the workers."""
        return self._at("predictions")

    @property
    def transfer(self) -> str:
        """The distillation's transfer set (real and synthetic rows, with soft targets)."""
        return self._at("transfer")

    @property
    def student(self) -> str:
        """The distilled student's bundle."""
        return self._at("student")

    @property
    def student_candidates(self) -> str:
        """A student search's candidates, one bundle folder each."""
        return self._at("student-candidates")

    @property
    def hard_label_student(self) -> str:
        """The same student trained on the hard labels alone (the baseline)."""
        return self._at("hard-label-student")


def run_paths(settings: Settings, run_key: str) -> RunPaths:
    """The paths of the pipeline run ``run_key`` under the settings' artifact root."""
    return RunPaths(storage.join(settings.artifact_root, RUNS_FOLDER, run_key))
