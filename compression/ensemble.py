"""Top-k selection and the ensemble of the selected trials (one module averaging probabilities)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from training.bundle import Bundle, ProbabilityEnsemble, load_bundle, save_bundle
from training.models import ArchSpec


@dataclass(frozen=True)
class Candidate:
    """A finished trial that could join the ensemble."""

    number: int
    state: str
    value: float | None
    bundle_uri: str | None
    params: Mapping[str, Any]


def select_top_k(candidates: Sequence[Candidate], k: int) -> list[Candidate]:
    """The ``k`` COMPLETE trials with the best validation accuracy (ties: lower trial number first).

    Pruned and failed trials never join; fewer than ``k`` COMPLETE trials is an error.
    """
    complete = [c for c in candidates if c.state == "COMPLETE" and c.value is not None and c.bundle_uri]
    if len(complete) < k:
        raise ValueError(
            f"only {len(complete)} COMPLETE trial(s) with a saved model; top_k={k} needs at least {k}"
        )
    return sorted(complete, key=lambda c: (-(c.value or 0.0), c.number))[:k]


def build_ensemble(
    members: Sequence[Candidate], storage_options: Mapping[str, Any] | None = None
) -> tuple[ProbabilityEnsemble, list[ArchSpec], list[str]]:
    """Load each member's bundle and stack them into one probability-averaging module."""
    bundles: list[Bundle] = [load_bundle(str(m.bundle_uri), storage_options) for m in members]
    columns = bundles[0].feature_columns
    for member, bundle in zip(members, bundles, strict=True):
        if bundle.feature_columns != columns:
            raise ValueError(f"trial {member.number} was trained on different feature columns")
    modules = [mod for b in bundles for mod in b.module.members]
    archs = [ArchSpec(**arch) for b in bundles for arch in b.spec["members"]]
    return ProbabilityEnsemble(modules), archs, columns


def save_ensemble(
    url: str,
    ensemble: ProbabilityEnsemble,
    archs: Sequence[ArchSpec],
    feature_columns: Sequence[str],
    extra: Mapping[str, Any],
    storage_options: Mapping[str, Any] | None = None,
) -> str:
    """Write the ensemble as one bundle (all members' weights, one spec)."""
    return save_bundle(url, list(ensemble.members), archs, feature_columns, extra, storage_options)
