"""The registered student is the better of the distilled and hard-label students by validation
accuracy (ties to the distilled one), and the evaluation report says which was kept and why."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from mopflow.compression.distill.keep import keep_student, kept_line, mark_kept
from mopflow.compression.evaluate import format_table


@pytest.mark.parametrize(
    ("distilled", "hard", "kept", "reason"),
    [
        (0.815, 0.892, "hard_label", "hard-label val_acc 0.8920 > distilled 0.8150"),
        (0.91, 0.88, "distilled", "distilled val_acc 0.9100 > hard-label 0.8800"),
        (
            0.88,
            0.88,
            "distilled",
            "distilled val_acc 0.8800 = hard-label 0.8800 (a tie keeps the distilled student)",
        ),
        # told apart by more digits when 4 cannot
        (0.88001, 0.880012, "hard_label", "hard-label val_acc 0.880012 > distilled 0.880010"),
        (
            math.nan,
            0.9,
            "distilled",
            "no validation accuracies to compare (distilled nan, hard-label 0.9); the distilled student is kept",
        ),
    ],
)
def test_the_student_with_the_better_validation_accuracy_is_kept(
    distilled: float, hard: float, kept: str, reason: str
) -> None:
    choice = keep_student(distilled, hard)
    assert choice.student == kept
    assert choice.reason == reason
    assert choice.val_acc == pytest.approx(hard if kept == "hard_label" else distilled, nan_ok=True)
    as_dict = choice.to_dict()
    assert as_dict["student"] == kept and as_dict["reason"] == choice.reason
    assert as_dict["val_acc"]["hard_label"] == hard
    assert as_dict["val_acc"]["distilled"] == (None if math.isnan(distilled) else distilled)


def test_the_report_marks_the_kept_student_and_shows_both_validation_accuracies() -> None:
    figures = {"params": 10, "size_kb": 1.0, "latency_ms_b1": 0.1, "latency_ms_b256": 1.0}
    names = ("ensemble", "student", "student int8 (dynamic)", "hard-label student")
    rows = [{"model": name, "test_acc": 0.8} | figures for name in names]
    choice = keep_student(0.815, 0.892)
    marked = {row["model"]: row for row in mark_kept(rows, choice)}
    assert marked["hard-label student"]["kept"] is True and marked["hard-label student"]["val_acc"] == 0.892
    assert marked["student"]["kept"] is False and marked["student"]["val_acc"] == 0.815
    assert "kept" not in marked["ensemble"] and "kept" not in marked["student int8 (dynamic)"]
    table = format_table(list(marked.values()))
    assert "| hard-label student (kept) | 0.8000 | 0.8920 |" in table
    assert "| student | 0.8000 | 0.8150 |" in table and "| ensemble | 0.8000 |  |" in table
    assert kept_line(choice) == "kept: the hard-label student, hard-label val_acc 0.8920 > distilled 0.8150"


def _one_class_teacher(manifest_uri: str, out: Path) -> str:
    """An ensemble bundle that answers class 3 whatever the input: a student that mimics it learns
    nothing, so its hard-label twin has the better validation accuracy."""
    from mopflow.training.data import load_manifest
    from mopflow.training.models.builtin import ArchSpec, build_model
    from mopflow.training.models.bundle import save_bundle

    columns = load_manifest(manifest_uri)["feature_columns"]
    arch = ArchSpec("mlp", {"width": 32, "depth": 1}, len(columns), 10)
    torch.manual_seed(0)
    model = build_model(arch)
    head = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1]
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        head.bias[3] = 20.0
    return save_bundle(str(out), [model], [arch], columns)


@pytest.mark.slow
def test_the_stage_registers_the_hard_label_student_when_distillation_lost(
    tmp_path: Path, dask_client: Any, small_manifest: str
) -> None:
    import mlflow
    import pandas as pd

    from mopflow.base.settings import Settings
    from mopflow.pipeline.distill import distill_stage
    from mopflow.pipeline.records import BestTrial, EnsembleRecord, ShardRecord
    from mopflow.pipeline.run import start_pipeline
    from mopflow.training.data import load_manifest, load_split
    from mopflow.training.models.bundle import load_bundle
    from mopflow.training.models.metrics import top1_accuracy

    teacher = _one_class_teacher(small_manifest, tmp_path / "teacher")
    settings = Settings.from_env(
        {"MOPFLOW_HOME": str(tmp_path / "home"), "MOPFLOW_DASK_ADDRESS": dask_client.scheduler.address}
    )
    conf = {
        "student_family": "mlp",
        "student_depth": 1,
        "student_max_param_ratio": 1.0,
        "alpha": 1.0,  # soft targets only: the distilled student learns the one class
        "temperature": 1.0,
        "distill_epochs": 3,
        "munge_multiplier": 0,
        "model_name": "kept",
    }
    ctx = start_pipeline(conf, "mopflow_retrain", "manual__kept", settings)
    manifest = load_manifest(small_manifest)
    shard = ShardRecord(manifest_uri=small_manifest, manifest_hash=manifest["manifest_hash"], reused=True)
    ensemble = EnsembleRecord(
        bundle_uri=teacher,
        model_uri="",
        run_id="",
        members=[0],
        member_weights=[1.0],
        best_trial_bundle=teacher,
        best_trial=BestTrial(number=0, params={}, val_acc=None, test_acc=None),
        val_acc=0.1,
        test_acc=0.1,
        best_trial_val_acc=None,
        best_trial_test_acc=None,
        num_params=0.0,
    )
    out = distill_stage(conf, ctx, shard, ensemble, settings)

    assert out.kept["student"] == "hard_label" and out.kept["model"] == "hard-label student"
    assert out.kept["reason"].startswith("hard-label val_acc ")
    assert out.bundle_uri.rstrip("/").endswith("hard-label-student")
    rows = {row["model"]: row for row in out.evaluation}
    assert rows["hard-label student"]["kept"] is True and rows["student"]["kept"] is False
    assert out.test_acc == rows["hard-label student"]["test_acc"] > rows["student"]["test_acc"]
    assert out.val_acc == out.hard_label_val_acc == rows["hard-label student"]["val_acc"]
    assert out.distilled_test_acc == rows["student"]["test_acc"]
    # the model logged for registration is the kept one: its accuracy on the validation split is
    # the stage's val_acc
    x_val, y_val = load_split(small_manifest, "validation")
    mlflow.set_tracking_uri(settings.tracking_uri)
    with warnings.catch_warnings(record=True) as seen:  # loading the champion is quiet
        warnings.simplefilter("always")
        probs = mlflow.pyfunc.load_model(out.model_uri).predict(
            pd.DataFrame(x_val, columns=manifest["feature_columns"])
        )
    assert not [str(w.message) for w in seen if issubclass(w.category, UserWarning)]
    assert top1_accuracy(probs.to_numpy(), y_val) == pytest.approx(out.val_acc)
    assert load_bundle(out.bundle_uri).spec["extra"]["soft_targets"] is False
    run = mlflow.MlflowClient(settings.tracking_uri).get_run(out.run_id)
    assert run.data.tags["mopflow.kept_student"] == "hard_label"
