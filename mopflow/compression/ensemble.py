"""Top-k selection and the ensemble of the selected trials (one module averaging probabilities)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from mopflow.training.models.builtin import ArchSpec
from mopflow.training.models.bundle import (
    Bundle,
    ProbabilityEnsemble,
    StackedEnsemble,
    load_bundle,
    save_bundle,
)
from mopflow.training.models.metrics import top1_accuracy


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


def greedy_selection(val_probs: Sequence[np.ndarray], y: np.ndarray, size: int) -> list[int]:
    """Ensemble selection (Caruana et al. 2004): forward selection *with replacement*.

    At each of ``size`` steps, add the candidate that makes the running average most accurate
    on the validation set (log loss breaks ties). Returns the chosen indices, repeats included:
    a model chosen twice gets twice the weight.
    """
    if not val_probs:
        raise ValueError("greedy selection needs at least one candidate")
    rows = np.arange(len(y))
    chosen: list[int] = []
    running = np.zeros_like(val_probs[0], dtype=np.float64)
    for _ in range(size):
        best_key: tuple[float, float] | None = None
        best_index = 0
        for i, probs in enumerate(val_probs):
            candidate = (running * len(chosen) + probs) / (len(chosen) + 1)
            accuracy = top1_accuracy(candidate, y)
            log_loss = float(-np.log(candidate[rows, y] + 1e-12).mean())
            key = (accuracy, -log_loss)
            if best_key is None or key > best_key:
                best_key, best_index = key, i
        running = (running * len(chosen) + val_probs[best_index]) / (len(chosen) + 1)
        chosen.append(best_index)
    return chosen


def selection_pool(candidates: Sequence[Candidate], method: str, size: int) -> list[Candidate]:
    """The trials an ensemble is chosen from: the top ``size`` for ``top_k``, every COMPLETE trial
    with a saved model (best first) for ``greedy``."""
    if method == "top_k":
        return select_top_k(candidates, size)
    if method != "greedy":
        raise ValueError(f"unknown ensemble selection {method!r}; expected 'top_k' or 'greedy'")
    saved = sum(1 for c in candidates if c.state == "COMPLETE" and c.bundle_uri and c.value is not None)
    return select_top_k(candidates, saved)


def members_from_picks(
    pool: Sequence[Candidate], picks: Sequence[int]
) -> tuple[list[Candidate], list[float]]:
    """The members (in the order first picked) and their weights (how often each was picked)."""
    order = sorted(set(picks), key=list(picks).index)
    return [pool[i] for i in order], [float(list(picks).count(i)) for i in order]


def build_ensemble(
    members: Sequence[Candidate],
    storage_options: Mapping[str, Any] | None = None,
    weights: Sequence[float] | None = None,
) -> tuple[ProbabilityEnsemble, list[ArchSpec], list[str]]:
    """Load each member's bundle and combine them into one probability-averaging module."""
    bundles: list[Bundle] = [load_bundle(str(m.bundle_uri), storage_options) for m in members]
    columns = bundles[0].feature_columns
    for member, bundle in zip(members, bundles, strict=True):
        if bundle.feature_columns != columns:
            raise ValueError(f"trial {member.number} was trained on different feature columns")
    modules = [mod for b in bundles for mod in b.module.members]
    archs = [ArchSpec.from_dict(arch) for b in bundles for arch in b.spec["members"]]
    return ProbabilityEnsemble(modules, weights), archs, columns


def save_ensemble(
    url: str,
    ensemble: ProbabilityEnsemble,
    archs: Sequence[ArchSpec],
    feature_columns: Sequence[str],
    extra: Mapping[str, Any],
    storage_options: Mapping[str, Any] | None = None,
) -> str:
    """Write the ensemble as one bundle (all members' weights and their ensemble weights, one spec)."""
    return save_bundle(
        url,
        list(ensemble.members),
        archs,
        feature_columns,
        extra,
        storage_options,
        weights=ensemble.weights.tolist(),
    )


@torch.no_grad()
def _median_ms(module: nn.Module, x: torch.Tensor, repeats: int) -> float:
    module(x)  # warm-up: first calls allocate and pick kernels
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        module(x)
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e3)


def faster_form(
    ensemble: ProbabilityEnsemble, n_features: int, batches: Sequence[int] = (1, 256), repeats: int = 7
) -> tuple[nn.Module, dict[str, float]]:
    """The ensemble as its member loop or as :class:`StackedEnsemble` (members sharing an
    architecture stacked and run in one ``vmap`` call), whichever is faster here.

    Measured once, with the current thread settings, as the summed median latency over
    ``batches`` rows of random input. Which one wins depends on the CPU, the batch and the
    architectures: on small CPUs the vmap'd grouped convolutions can be slower than a plain loop.
    With no architecture shared by two members, stacking has nothing to vectorise: the loop is used.
    Returns the chosen module and the timings (``loop_ms``, ``stacked_ms``; 0 when not measured).
    """
    if not batches or any(b < 1 for b in batches) or repeats < 1:
        raise ValueError(f"batches={list(batches)} must be >= 1 rows each and repeats={repeats} >= 1")
    ensemble.eval()
    stacked = StackedEnsemble(ensemble).eval()
    if max(stacked.group_sizes) < 2:
        return ensemble, {"loop_ms": 0.0, "stacked_ms": 0.0}
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(b, n_features, generator=generator) for b in batches]
    loop_ms = sum(_median_ms(ensemble, x, repeats) for x in inputs)
    try:
        stacked_ms = sum(_median_ms(stacked, x, repeats) for x in inputs)
    except RuntimeError:  # a member whose layers vmap cannot batch (e.g. a recurrent one): the loop
        return ensemble, {"loop_ms": loop_ms, "stacked_ms": 0.0}
    chosen: nn.Module = stacked if stacked_ms < loop_ms else ensemble
    return chosen, {"loop_ms": loop_ms, "stacked_ms": stacked_ms}
