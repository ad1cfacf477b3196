"""MLflow Model Registry: log bundles as pyfunc models, register idempotently, gate promotion."""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from infra.storage import filesystem

log = logging.getLogger(__name__)

PYFUNC_FILE = Path(__file__).with_name("pyfunc_model.py")
CHALLENGER = "challenger"
CHAMPION = "champion"
RUN_KEY_TAG = "mopflow.run_key"


@dataclass(frozen=True)
class PromotionDecision:
    """Whether the challenger becomes champion, and why."""

    promote: bool
    reason: str


def decide_promotion(policy: str, challenger_acc: float, champion_acc: float | None) -> PromotionDecision:
    """The gate: with ``accuracy``, promote when the challenger is at least as accurate as the champion."""
    if policy == "never":
        return PromotionDecision(False, "promotion policy is 'never'")
    if policy == "always":
        return PromotionDecision(True, "promotion policy is 'always'")
    if champion_acc is None:
        return PromotionDecision(True, "there is no champion yet")
    if challenger_acc >= champion_acc:
        return PromotionDecision(
            True, f"test accuracy {challenger_acc:.4f} >= champion's {champion_acc:.4f} on the same test set"
        )
    return PromotionDecision(
        False, f"test accuracy {challenger_acc:.4f} < champion's {champion_acc:.4f} on the same test set"
    )


def _pip_requirements() -> list[str]:
    import torch

    return [f"torch=={torch.__version__.split('+')[0]}", "safetensors", "pandas", "numpy", "fsspec"]


def log_bundle_model(
    run_id: str,
    name: str,
    bundle_uri: str,
    example: pd.DataFrame,
    storage_options: Mapping[str, Any] | None = None,
) -> str:
    """Log a bundle as a pyfunc model (models-from-code) in ``run_id``; return its model URI."""
    import mlflow
    from mlflow.models import infer_signature

    from compression.pyfunc_model import BundleProbabilities

    repo = Path(__file__).resolve().parent.parent
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
                artifacts={"bundle": str(local)},
                signature=signature,
                input_example=example,
                pip_requirements=_pip_requirements(),
                code_paths=[str(repo / "training"), str(repo / "infra")],
            )
    return str(info.model_uri)


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
        if version.tags.get(RUN_KEY_TAG) == run_key:
            log.info("register: %s version %s already exists for this run; reusing it", name, version.version)
            return version
    version = mlflow.register_model(model_uri, name, tags={RUN_KEY_TAG: run_key, **tags})
    log.info("register: %s version %s registered from %s", name, version.version, model_uri)
    return version


def alias_version(client: Any, name: str, alias: str) -> Any | None:
    """The version an alias points to, or None."""
    try:
        return client.get_model_version_by_alias(name, alias)
    except Exception:
        return None


def set_alias(client: Any, name: str, alias: str, version: str) -> None:
    """Point ``alias`` at ``version`` (idempotent)."""
    current = alias_version(client, name, alias)
    if current is not None and str(current.version) == str(version):
        return
    client.set_registered_model_alias(name, alias, str(version))
    if alias == CHAMPION and current is not None:
        # Remember the previous champion so that a rollback can bring it back.
        client.set_model_version_tag(name, str(version), "mopflow.previous_champion", str(current.version))
