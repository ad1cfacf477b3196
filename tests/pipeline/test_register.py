"""The register stage's promotion gate on a real MLflow registry (SQLite): a less accurate student
leaves the champion where it is, a more accurate one takes its place, and rerunning the run that
made the champion changes nothing.

The students are genuinely different models: the same small MLP trained for a different number of
steps on the shared small dataset, so each one's test accuracy (what ``distill.test_acc`` carries
into the gate) is measured, not made up. Only the register stage runs; the shard, search and
ensemble outputs it reads are built here from the dataset and the models, which costs seconds
instead of a whole pipeline."""

from __future__ import annotations

from dataclasses import dataclass

import mlflow
import numpy as np
import pandas as pd
import pytest
import torch
from mlflow import MlflowClient

from mopflow.base.settings import Settings
from mopflow.pipeline.context import stage
from mopflow.pipeline.records import (
    BestTrial,
    DistillRecord,
    EnsembleRecord,
    RegisterRecord,
    RunContext,
    SearchRecord,
    ShardRecord,
)
from mopflow.pipeline.register import register_stage
from mopflow.pipeline.run import start_pipeline
from mopflow.registry.inputs import example_input
from mopflow.registry.model_registry import CHALLENGER, CHAMPION, log_bundle_model
from mopflow.training.data import load_manifest, load_split
from mopflow.training.models.builtin import ArchSpec, build_model, count_params
from mopflow.training.models.bundle import accuracy, load_bundle, save_bundle
from tests.compression.helpers import fit

# The ensemble-gap clause of the gate is not under test: at 100 points it always passes, so the
# comparison with the champion alone decides whether a student is promoted.
CONF = {"model_name": "gate", "promotion": "accuracy", "max_gap_to_ensemble": 100.0}
STUDENT = "gate-student"
ARCH_PARAMS = {"width": 32, "depth": 1}
# Full-batch Adam steps per student (seed 0): more steps, a more accurate student on this data.
STEPS = {"worse": 2, "champion": 20, "better": 80}


@dataclass(frozen=True)
class Gate:
    """One MLflow (SQLite under the test's folder) and what the register stage reads besides the
    student: the shard, search and ensemble outputs, shared by every pipeline run below."""

    settings: Settings
    client: MlflowClient
    shard: ShardRecord
    search: SearchRecord
    ensemble: EnsembleRecord
    arch: ArchSpec
    bundles: dict[str, str]
    val_accs: dict[str, float]
    test_accs: dict[str, float]


def _trained(x: np.ndarray, y: np.ndarray, arch: ArchSpec, steps: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = build_model(arch, x.mean(axis=0).tolist(), (x.std(axis=0) + 1e-6).tolist())
    fit(model, x, y, steps)
    return model


@pytest.fixture(scope="module")
def gate(tmp_path_factory: pytest.TempPathFactory, small_manifest: str) -> Gate:
    root = tmp_path_factory.mktemp("gate")
    settings = Settings.from_env({"MOPFLOW_HOME": str(root / "home")})
    manifest = load_manifest(small_manifest)
    columns = manifest["feature_columns"]
    x, y = load_split(small_manifest, "train")
    x_val, y_val = load_split(small_manifest, "validation")
    x_test, y_test = load_split(small_manifest, "test")
    arch = ArchSpec("mlp", ARCH_PARAMS, len(columns), 10)

    bundles, val_accs, test_accs = {}, {}, {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # models this small train fastest on one thread
    try:
        models = {quality: _trained(x, y, arch, steps, seed=0) for quality, steps in STEPS.items()}
    finally:
        torch.set_num_threads(threads)
    for quality in STEPS:
        bundles[quality] = save_bundle(str(root / quality), [models[quality]], [arch], columns)
        val_accs[quality] = accuracy(models[quality], x_val, y_val)
        test_accs[quality] = accuracy(models[quality], x_test, y_test)
    # The teacher: the two better-trained models together (no more training for it).
    members = [models["champion"], models["better"]]
    ensemble_bundle = save_bundle(str(root / "ensemble"), members, [arch, arch], columns)
    teacher = load_bundle(ensemble_bundle).module

    # The ensemble is logged once, in the ensemble stage of a pipeline run of its own.
    ctx = start_pipeline(CONF, "mopflow_retrain", "manual__ensemble", settings)
    with stage("ensemble", CONF, ctx, settings) as st:
        ensemble_uri = log_bundle_model(
            st.run_id, "ensemble", ensemble_bundle, example_input(small_manifest, manifest, {})
        )
    best = BestTrial(number=0, params={"family": "mlp", **ARCH_PARAMS}, val_acc=0.0, test_acc=0.0)
    return Gate(
        settings=settings,
        client=MlflowClient(tracking_uri=settings.tracking_uri, registry_uri=settings.tracking_uri),
        shard=ShardRecord(manifest_uri=small_manifest, manifest_hash=manifest["manifest_hash"], reused=True),
        search=SearchRecord(
            study_name="gate-study",
            storage_url=settings.optuna_storage,
            counts={"COMPLETE": 2, "PRUNED": 0, "FAIL": 0},
            best_trial=0,
            best_val_acc=0.0,
        ),
        ensemble=EnsembleRecord(
            bundle_uri=ensemble_bundle,
            model_uri=ensemble_uri,
            run_id=st.run_id,
            members=[1, 2],
            member_weights=[0.5, 0.5],
            best_trial_bundle=bundles["champion"],
            best_trial=best,
            val_acc=accuracy(teacher, x_val, y_val),
            test_acc=accuracy(teacher, x_test, y_test),
            best_trial_val_acc=0.0,
            best_trial_test_acc=0.0,
            num_params=2 * count_params(arch),
        ),
        arch=arch,
        bundles=bundles,
        val_accs=val_accs,
        test_accs=test_accs,
    )


def _pipeline_run(gate: Gate, airflow_run_id: str, quality: str) -> tuple[RunContext, DistillRecord]:
    """A pipeline run whose distill stage logged the ``quality`` student: its context and the
    distill stage's output (the student's measured test accuracy in ``test_acc``)."""
    ctx = start_pipeline(CONF, "mopflow_retrain", airflow_run_id, gate.settings)
    with stage("distill", CONF, ctx, gate.settings) as st:
        model_uri = log_bundle_model(
            st.run_id,
            "student",
            gate.bundles[quality],
            example_input(gate.shard.manifest_uri, load_manifest(gate.shard.manifest_uri), {}),
        )
    num_params = count_params(gate.arch)
    distill = DistillRecord(
        bundle_uri=gate.bundles[quality],
        model_uri=model_uri,
        run_id=st.run_id,
        arch={"family": "mlp", "params": ARCH_PARAMS},
        kept={},
        evaluation=[],
        val_acc=gate.val_accs[quality],
        test_acc=gate.test_accs[quality],
        num_params=float(num_params),
        param_ratio=num_params / gate.ensemble.num_params,
        distilled_val_acc=None,
        distilled_test_acc=None,
        hard_label_val_acc=None,
        hard_label_test_acc=None,
        int8_test_acc=None,
    )
    return ctx, distill


def _register(gate: Gate, ctx: RunContext, distill: DistillRecord) -> RegisterRecord:
    return register_stage(CONF, ctx, gate.shard, gate.search, gate.ensemble, distill, gate.settings)


def _alias(gate: Gate, alias: str) -> str:
    return str(gate.client.get_model_version_by_alias(STUDENT, alias).version)


def _version_accuracy(gate: Gate, version: str) -> float:
    """Test accuracy of one registered student version, through its pyfunc loaded from where the
    registry keeps that version, on the whole test split at once."""
    manifest_uri = gate.shard.manifest_uri
    model = mlflow.pyfunc.load_model(gate.client.get_model_version_download_uri(STUDENT, version))
    x, y = load_split(manifest_uri, "test")
    probs = np.asarray(model.predict(pd.DataFrame(x, columns=load_manifest(manifest_uri)["feature_columns"])))
    return int((probs.argmax(axis=1) == y).sum()) / len(y)


def _register_run_tags(gate: Gate, ctx: RunContext) -> dict[str, str]:
    experiment = gate.client.get_experiment_by_name(gate.settings.experiment_name)
    assert experiment is not None
    runs = gate.client.search_runs(
        [experiment.experiment_id],
        f"tags.`mopflow.run_key` = '{ctx.run_key}' and tags.`mopflow.stage` = 'register'",
    )
    assert len(runs) == 1
    return dict(runs[0].data.tags)


@pytest.fixture(scope="module")
def champion(gate: Gate) -> str:
    """The first pipeline run: no champion yet, so its student becomes the champion; its version."""
    assert gate.test_accs["worse"] < gate.test_accs["champion"] < gate.test_accs["better"]
    ctx, distill = _pipeline_run(gate, "manual__first", "champion")
    registered = _register(gate, ctx, distill)
    assert registered.promoted and registered.reason.startswith("there is no champion yet")
    assert registered.previous_champion_test_acc is None
    assert _alias(gate, CHAMPION) == registered.version
    return str(registered.version)


@dataclass(frozen=True)
class Promotion:
    """A pipeline run with the better student: the champion before it, that champion's accuracy
    measured before the run, the run's context and student, and the stage's record."""

    before: str
    before_acc: float
    ctx: RunContext
    distill: DistillRecord
    registered: RegisterRecord


@pytest.fixture(scope="module")
def promotion(gate: Gate, champion: str) -> Promotion:
    before = _alias(gate, CHAMPION)
    before_acc = _version_accuracy(gate, before)
    ctx, distill = _pipeline_run(gate, "manual__better", "better")
    return Promotion(before, before_acc, ctx, distill, _register(gate, ctx, distill))


@pytest.mark.slow
def test_a_less_accurate_student_leaves_the_champion_where_it_is(gate: Gate, champion: str) -> None:
    champion_acc = _version_accuracy(gate, champion)
    worse_acc = gate.test_accs["worse"]
    assert worse_acc < champion_acc

    ctx, distill = _pipeline_run(gate, "manual__worse", "worse")
    registered = _register(gate, ctx, distill)

    assert registered.version != champion
    assert _alias(gate, CHAMPION) == champion  # the champion did not move
    assert _alias(gate, CHALLENGER) == registered.version
    assert registered.promoted is False
    assert registered.aliases == [CHALLENGER]
    assert registered.model_uri == f"models:/{STUDENT}@{CHALLENGER}"
    assert registered.previous_champion_test_acc == pytest.approx(champion_acc, abs=1e-12)
    because = f"test accuracy {worse_acc:.4f} < champion's {champion_acc:.4f} on the same test set"
    assert registered.reason.startswith(because)
    tags = _register_run_tags(gate, ctx)
    assert tags["mopflow.promoted"] == "false"
    assert tags["mopflow.promotion_reason"] == registered.reason


@pytest.mark.slow
def test_a_more_accurate_student_becomes_the_champion(gate: Gate, promotion: Promotion) -> None:
    registered = promotion.registered
    better_acc = gate.test_accs["better"]
    assert better_acc > promotion.before_acc

    assert registered.version != promotion.before
    assert _alias(gate, CHAMPION) == _alias(gate, CHALLENGER) == registered.version
    assert registered.promoted is True
    assert registered.aliases == [CHALLENGER, CHAMPION]
    assert registered.model_uri == f"models:/{STUDENT}@{CHAMPION}"
    assert registered.previous_champion_test_acc == pytest.approx(promotion.before_acc, abs=1e-12)
    because = f"test accuracy {better_acc:.4f} >= champion's {promotion.before_acc:.4f} on the same test set"
    assert registered.reason.startswith(because)
    tags = _register_run_tags(gate, promotion.ctx)
    assert tags["mopflow.promoted"] == "true"
    assert tags["mopflow.promotion_reason"] == registered.reason
    # the new champion remembers the one it replaced, for a rollback
    new = gate.client.get_model_version(STUDENT, registered.version)
    assert new.tags["mopflow.previous_champion"] == promotion.before


@pytest.mark.slow
def test_rerunning_the_run_that_made_the_champion_keeps_it(gate: Gate, promotion: Promotion) -> None:
    champion = promotion.registered.version
    assert _alias(gate, CHAMPION) == champion
    versions = len(gate.client.search_model_versions(f"name='{STUDENT}'"))

    registered = _register(gate, promotion.ctx, promotion.distill)

    assert registered.version == champion
    assert len(gate.client.search_model_versions(f"name='{STUDENT}'")) == versions
    assert _alias(gate, CHAMPION) == champion
    assert registered.promoted is True
    assert registered.reason == "this version is already the champion"
    assert registered.previous_champion_test_acc is None
    tags = _register_run_tags(gate, promotion.ctx)
    assert tags["mopflow.promotion_reason"] == "this version is already the champion"


def test_a_signal_is_served_as_a_tensor_and_a_champion_logged_as_a_table_is_still_scored(gate: Gate) -> None:
    """MNIST-1D's features are one signal's steps: its models take a tensor ``(n, 40)`` (one
    TensorSpec for MLflow to check, not 40 columns), and a table of its columns still, in their
    order. A champion logged when signals were served as tables is scored on its own terms."""
    from mopflow.registry.model_registry import champion_accuracy

    manifest_uri = gate.shard.manifest_uri
    manifest = load_manifest(manifest_uri)
    x, _ = load_split(manifest_uri, "test")
    table = pd.DataFrame(x, columns=manifest["feature_columns"])
    as_tensor = example_input(manifest_uri, manifest, {})
    assert isinstance(as_tensor, np.ndarray) and as_tensor.shape[1:] == (len(manifest["feature_columns"]),)
    for name, example in (("signal-as-tensor", as_tensor), ("signal-as-table", table.iloc[:5])):
        with mlflow.start_run(
            experiment_id=gate.client.get_experiment_by_name(gate.settings.experiment_name).experiment_id
        ) as run:
            pass
        version = mlflow.register_model(
            log_bundle_model(run.info.run_id, "model", gate.bundles["better"], example), name
        )
        gate.client.set_registered_model_alias(name, CHAMPION, version.version)
        model = mlflow.pyfunc.load_model(f"models:/{name}@{CHAMPION}")
        assert model.metadata.get_input_schema().is_tensor_spec() == (name == "signal-as-tensor")
        assert np.allclose(
            model.predict(table).to_numpy(),
            model.predict(x if name == "signal-as-tensor" else table).to_numpy(),
        )
        assert champion_accuracy(name, manifest_uri, manifest, {}) == pytest.approx(gate.test_accs["better"])
