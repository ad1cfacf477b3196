"""A run's paths: every output under ``<artifact root>/runs/<run key>/``, each with its own name."""

from __future__ import annotations

from pathlib import Path

from mopflow.base.settings import Settings
from mopflow.pipeline.context import summary_uri
from mopflow.pipeline.paths import RunPaths, run_paths


def test_every_output_of_a_run_is_in_its_folder_under_its_own_name(tmp_path: Path) -> None:
    settings = Settings.from_env({"MOPFLOW_HOME": str(tmp_path)})
    paths = run_paths(settings, "k1")
    outputs = [
        paths.summary,
        paths.failure,
        paths.ensemble,
        paths.predictions,
        paths.transfer,
        paths.student,
        paths.hard_label_student,
    ]
    root = Path(settings.artifact_root, "runs", "k1")
    assert Path(paths.root) == root
    assert all(Path(uri).parent == root for uri in outputs)
    assert len(set(outputs)) == len(outputs)
    assert Path(paths.summary).name == "summary.json" and paths.summary == summary_uri(settings, "k1")
    assert run_paths(settings, "k2") != paths


def test_a_remote_run_folder_keeps_its_scheme() -> None:
    assert RunPaths("s3://bucket/art/runs/k1").student == "s3://bucket/art/runs/k1/student"
