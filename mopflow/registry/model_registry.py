"""MLflow Model Registry: log bundles as pyfunc models, register idempotently, gate promotion."""

from __future__ import annotations

import logging
import tempfile
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from mopflow.base.storage import filesystem
from mopflow.base.tag_names import PROMOTION_REASON, RUN_KEY
from mopflow.training.data.examples import EXAMPLE_COLUMN

log = logging.getLogger(__name__)

PYFUNC_FILE = Path(__file__).with_name("pyfunc_model.py")
CHALLENGER = "challenger"
CHAMPION = "champion"


def index_installed_packages() -> bool:
    """Have MLflow index the installed distributions now; whether it did.

    Logging a model, MLflow checks its requirements against the installed packages, and indexes
    every installed distribution for it once per process (``importlib.metadata``'s
    ``packages_distributions``: 1.9 s of CPU in mopflow's environment). A process that forks task
    processes (the warm executors) indexes them once, before it forks, instead of every task
    that logs a model. The index is MLflow's own (a private function): if it is gone, nothing is
    indexed ahead and each task indexes on its own, as without this."""
    try:
        from mlflow.utils import requirements_utils

        requirements_utils._init_packages_to_modules_map()
    except Exception as exc:  # noqa: BLE001 - a speed-up only
        log.debug("MLflow's package index not built ahead: %s", exc)
        return False
    return True


@dataclass(frozen=True)
class PromotionDecision:
    """Whether the challenger becomes champion, and why."""

    promote: bool
    reason: str


def decide_promotion(
    policy: str,
    challenger_acc: float,
    champion_acc: float | None,
    ensemble_acc: float | None = None,
    max_gap_points: float | None = None,
) -> PromotionDecision:
    """The gate. With ``accuracy``: promote when the student is at least as accurate as the current
    champion on the same test set *and* within ``max_gap_points`` of the ensemble it came from."""
    if policy == "never":
        return PromotionDecision(False, "promotion policy is 'never'")
    if policy == "always":
        return PromotionDecision(True, "promotion policy is 'always'")
    reasons: list[str] = []
    ok = True
    if champion_acc is None:
        reasons.append("there is no champion yet")
    elif challenger_acc >= champion_acc:
        reasons.append(
            f"test accuracy {challenger_acc:.4f} >= champion's {champion_acc:.4f} on the same test set"
        )
    else:
        ok = False
        reasons.append(
            f"test accuracy {challenger_acc:.4f} < champion's {champion_acc:.4f} on the same test set"
        )
    if ensemble_acc is not None and max_gap_points is not None:
        gap = 100 * (ensemble_acc - challenger_acc)
        if gap <= max_gap_points:
            reasons.append(f"{gap:.2f} points below the ensemble (allowed {max_gap_points:g})")
        else:
            ok = False
            reasons.append(f"{gap:.2f} points below the ensemble, more than the allowed {max_gap_points:g}")
    return PromotionDecision(ok, "; ".join(reasons))


def _pip_requirements(takes_encoded_images: bool = False) -> list[str]:
    """What serving the model needs; Pillow when its requests carry encoded images."""
    import torch

    needs = [f"torch=={torch.__version__.split('+')[0]}", "safetensors", "pandas", "numpy", "fsspec"]
    return needs + (["Pillow"] if takes_encoded_images else [])


def log_bundle_model(
    run_id: str,
    name: str,
    bundle_uri: str,
    example: pd.DataFrame | Any,
    storage_options: Mapping[str, Any] | None = None,
) -> str:
    """Log a bundle as a pyfunc model (models-from-code) in ``run_id``; return its model URI."""
    import mlflow
    from mlflow.models import infer_signature

    from mopflow.registry.pyfunc_model import CODE_ARTIFACT, BundleProbabilities

    with tempfile.TemporaryDirectory() as tmp:
        fs, path = filesystem(bundle_uri, storage_options)
        local = Path(tmp) / "bundle"
        local.mkdir()
        for fname in ("spec.json", "weights.safetensors"):
            fs.get(f"{path.rstrip('/')}/{fname}", str(local / fname))
        model = BundleProbabilities()

        class _Ctx:
            artifacts = {"bundle": str(local)}

        model.load_context(_Ctx())
        signature = infer_signature(example, model.predict(None, example))
        with mlflow.start_run(run_id=run_id):
            info = mlflow.pyfunc.log_model(
                name=name,
                python_model=str(PYFUNC_FILE),
                artifacts={"bundle": str(local), CODE_ARTIFACT: str(zip_package(Path(tmp) / "mopflow.zip"))},
                signature=signature,
                input_example=example,
                pip_requirements=_pip_requirements(model.bundle.feature_columns == [EXAMPLE_COLUMN]),
            )
    return str(info.model_uri)


# A fixed time stamp for every entry: the same code zips to the same bytes.
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)


def zip_package(dest: Path) -> Path:
    """The ``mopflow`` package's files (no bytecode caches) zipped at ``dest`` as ``mopflow/...``,
    importable with ``dest`` on ``sys.path``. A logged model ships its code as this one file: as a
    folder (MLflow's ``code_paths``) it was some 200 files, each a request of its own to an
    artifact store such as S3, at every log and every load."""
    import mopflow

    package = Path(mopflow.__file__).resolve().parent
    files = sorted(
        f for f in package.rglob("*") if f.is_file() and "__pycache__" not in f.parts and f.suffix != ".pyc"
    )
    with zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as archive:
        for file in files:
            entry = zipfile.ZipInfo(f"mopflow/{file.relative_to(package).as_posix()}", _ZIP_TIME)
            entry.compress_type = zipfile.ZIP_DEFLATED
            entry.external_attr = 0o644 << 16
            archive.writestr(entry, file.read_bytes())
    return dest


def register_version(client: Any, name: str, model_uri: str, run_key: str, tags: Mapping[str, str]) -> Any:
    """Register ``model_uri`` under ``name`` once per pipeline run (a rerun returns the existing version)."""
    import mlflow

    try:
        client.get_registered_model(name)
    except Exception:
        try:
            client.create_registered_model(name, description="mopflow model (class probabilities)")
        except Exception:  # created concurrently
            client.get_registered_model(name)
    for version in client.search_model_versions(f"name='{name}'"):
        if version.tags.get(RUN_KEY) == run_key:
            log.info("register: %s version %s already exists for this run; reusing it", name, version.version)
            return version
    version = mlflow.register_model(model_uri, name, tags={RUN_KEY: run_key, **tags})
    log.info("register: %s version %s registered from %s", name, version.version, model_uri)
    return version


def alias_version(client: Any, name: str, alias: str) -> Any | None:
    """The version an alias points to, or None."""
    try:
        return client.get_model_version_by_alias(name, alias)
    except Exception:
        return None


HISTORY_TAG = "mopflow.champion_history"


class RegistryError(ValueError):
    """A promotion or rollback cannot be done (unknown model or version, nothing to roll back to)."""


def _history(client: Any, name: str) -> list[str]:
    model = client.get_registered_model(name)
    raw = model.tags.get(HISTORY_TAG, "")
    return [v for v in raw.split(",") if v]


def set_alias(client: Any, name: str, alias: str, version: str) -> None:
    """Point ``alias`` at ``version`` (idempotent). Champion changes are remembered for rollback."""
    current = alias_version(client, name, alias)
    if current is not None and str(current.version) == str(version):
        return
    client.set_registered_model_alias(name, alias, str(version))
    if alias == CHAMPION and current is not None:
        history = _history(client, name) + [str(current.version)]
        client.set_registered_model_tag(name, HISTORY_TAG, ",".join(history[-50:]))
        client.set_model_version_tag(name, str(version), "mopflow.previous_champion", str(current.version))


def promote(client: Any, name: str, version: str) -> str:
    """Make ``version`` the champion (by hand); returns a description of what changed."""
    try:
        client.get_model_version(name, str(version))
    except Exception as exc:
        raise RegistryError(f"registered model {name!r} has no version {version!r}") from exc
    previous = alias_version(client, name, CHAMPION)
    set_alias(client, name, CHAMPION, str(version))
    client.set_model_version_tag(name, str(version), PROMOTION_REASON, "promoted by hand")
    before = previous.version if previous is not None else "none"
    return f"{name}: champion {before} -> {version}"


def rollback(client: Any, name: str) -> str:
    """Bring the previous champion back; returns a description of what changed."""
    try:
        history = _history(client, name)
    except Exception as exc:
        raise RegistryError(f"registered model {name!r} does not exist") from exc
    current = alias_version(client, name, CHAMPION)
    while history and current is not None and history[-1] == str(current.version):
        history.pop()
    if not history:
        raise RegistryError(f"{name} has no previous champion to roll back to")
    target = history.pop()
    client.set_registered_model_alias(name, CHAMPION, target)
    client.set_registered_model_tag(name, HISTORY_TAG, ",".join(history))
    before = current.version if current is not None else "none"
    return f"{name}: champion {before} -> {target} (rolled back)"


def registry_client(settings: Any | None = None) -> Any:
    """An ``MlflowClient`` on the configured tracking and registry URI (``Settings.from_env()`` by default)."""
    from mopflow.base.settings import Settings
    from mopflow.base.tracking import MlflowTracker

    settings = settings or Settings.from_env()
    return MlflowTracker(
        settings.tracking_uri, settings.experiment_name, settings.mlflow_artifact_location
    ).client


def champion_accuracy(
    name: str, manifest_uri: str, manifest: Mapping[str, Any], storage_options: Mapping[str, Any]
) -> float:
    """The current champion of model ``name``'s test accuracy on the test set of ``manifest``
    (through its pyfunc, as it is served), one test shard in memory at a time."""
    import mlflow

    from mopflow.registry.inputs import served_examples
    from mopflow.training.data import read_shard
    from mopflow.training.data.reading import shard_arrays
    from mopflow.training.models.metrics import top1_correct

    champion = mlflow.pyfunc.load_model(f"models:/{name}@{CHAMPION}")
    takes_columns = _takes_columns(champion)
    correct = rows = 0
    for entry in manifest["splits"]["test"]:
        frame = read_shard(manifest_uri, manifest, entry, storage_options)
        x, y = shard_arrays(frame, manifest)
        request = served_examples(frame, x, manifest)
        # a signal's champion logged when signals were served as tables takes its columns
        if isinstance(request, np.ndarray) and takes_columns:
            request = pd.DataFrame(x, columns=manifest["feature_columns"])
        probs = champion.predict(request)
        correct, rows = correct + top1_correct(probs.to_numpy(), y), rows + len(y)
    return correct / rows if rows else 0.0


def _takes_columns(model: Any) -> bool:
    """Whether a loaded pyfunc's signature asks for named columns (a table's), not a tensor."""
    schema = model.metadata.get_input_schema()
    return schema is not None and not schema.is_tensor_spec()
