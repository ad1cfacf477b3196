"""The image demo config end to end (generated shapes, 2-D families, cnn2d student, mixup
transfer set), then the served model queried with a tensor payload."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.dags.serving import invoke, served
from tests.dags.test_end_to_end import quick_benchmark

TINY_IMAGES = [
    "num_samples=800",
    "n_trials=3",
    "epochs=2",
    "min_resource=1",
    "top_k=2",
    "distill_epochs=2",
    "munge_multiplier=1",
    "model_name=e2e-images",
    "max_gap_to_ensemble=100",
]


@pytest.fixture(scope="module")
def images_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The image benchmark's quick run (``benchmarks/images.py --quick``: the image demo config)
    with the tiny settings on top; one pipeline run serves both."""
    home = tmp_path_factory.mktemp("e2e-images") / "home"
    quick_benchmark(home, "images.py", TINY_IMAGES)
    return home, json.loads((home / "summary.json").read_text())


@pytest.mark.slow
def test_the_run_gives_the_image_benchmarks_quick_report(images_run: tuple[Path, dict]) -> None:
    from tests.benchmarks.test_quick import check_images

    home, summary = images_run
    report = json.loads((home.parent / "images.json").read_text())
    check_images(report, home.parent)
    assert report["accuracy"]["ensemble"] == summary["ensemble"]["test_acc"]


@pytest.mark.slow
def test_images_go_through_every_stage(images_run: tuple[Path, dict]) -> None:
    home, summary = images_run
    from mlflow import MlflowClient
    from mlflow.models import get_model_info

    assert summary["student"]["arch"]["family"] == "cnn2d"
    assert summary["student"]["arch"]["input_shape"] == [3, 16, 16]
    assert summary["best_trial"]["params"]["family"] in {"resnet", "cnn2d"}
    assert summary["student"]["num_params"] <= 0.1 * summary["ensemble"]["num_params"]
    assert "student int8 (static)" in {row["model"] for row in summary["evaluation"]}
    uri = f"sqlite:///{home / 'mlflow' / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    version = client.get_model_version_by_alias("e2e-images-student", "champion")
    import mlflow

    mlflow.set_tracking_uri(uri)
    (spec,) = get_model_info(version.source).signature.inputs.to_dict()
    assert spec["type"] == "tensor" and spec["tensor-spec"]["dtype"] == "float32"
    assert list(spec["tensor-spec"]["shape"]) == [-1, 3, 16, 16]


@pytest.mark.slow
def test_served_image_model_answers_a_tensor_payload(images_run: tuple[Path, dict]) -> None:
    home, _ = images_run
    from mopflow.training.data.sources.arrays import generate_shapes

    x, _ = generate_shapes(3, seed=7)
    with served(home, "models:/e2e-images-student@champion") as url:
        answer = invoke(url, {"inputs": x.reshape(3, 3, 16, 16).tolist()})
        rows = answer["predictions"]
        assert len(rows) == 3 and len(rows[0]) == 8
        assert np.allclose([sum(r.values()) for r in rows], 1.0, atol=1e-4)
        with pytest.raises(Exception, match="400|Bad Request"):
            invoke(url, {"inputs": x.reshape(3, 768).tolist()})  # flat rows are not images
