"""Predictions, greedy selection and accuracies made on the Dask workers shard by shard give what
the same computations give on a whole split held in memory."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from mopflow.compression.ensemble import Candidate, build_ensemble, greedy_selection
from mopflow.compression.shard_eval import ShardEvaluator, read_probabilities
from mopflow.training.data import load_manifest, load_split
from mopflow.training.models.builtin import ArchSpec, build_model
from mopflow.training.models.bundle import accuracy, load_bundle, predict_proba, save_bundle
from tests.compression.helpers import fit

SPLIT = "train"  # the split with more than one shard: the counts are added up over shards


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory, small_manifest: str) -> list[str]:
    """Four small models of different quality (trained for 2 to 60 steps)."""
    root = tmp_path_factory.mktemp("bundles")
    columns = load_manifest(small_manifest)["feature_columns"]
    x, y = load_split(small_manifest, "train")
    uris = []
    for seed, steps in enumerate([2, 15, 60, 60]):
        torch.manual_seed(seed)
        arch = ArchSpec("mlp", {"width": 16, "depth": 1}, len(columns), 10)
        model = build_model(arch, x.mean(axis=0).tolist(), (x.std(axis=0) + 1e-6).tolist())
        fit(model, x, y, steps)
        uris.append(save_bundle(str(root / f"m{seed}"), [model], [arch], columns))
    return uris


def test_greedy_selection_on_shards_matches_the_in_memory_one(
    tmp_path: Path, dask_client: object, small_manifest: str, bundles: list[str]
) -> None:
    assert len(load_manifest(small_manifest)["splits"][SPLIT]) >= 2
    evaluator = ShardEvaluator(dask_client, small_manifest, str(tmp_path / "predictions"))
    shards = evaluator.predictions(SPLIT, bundles)
    x, y = load_split(small_manifest, SPLIT)
    probs = [predict_proba(load_bundle(u).module, x).numpy() for u in bundles]
    expected = greedy_selection(probs, y, 6)
    assert len(set(expected)) > 1  # the case is not trivial: more than one model is chosen
    assert evaluator.greedy_selection(shards, 6) == expected


def test_accuracies_on_shards_are_the_whole_split_accuracies(
    tmp_path: Path, dask_client: object, small_manifest: str, bundles: list[str]
) -> None:
    evaluator = ShardEvaluator(dask_client, small_manifest, str(tmp_path / "predictions"))
    shards = evaluator.predictions(SPLIT, bundles)
    x, y = load_split(small_manifest, SPLIT)
    weights = [2.0, 0.0, 1.0, 1.0]
    members = [Candidate(i, "COMPLETE", 0.5, u, {}) for i, u in enumerate(bundles)]
    ensemble, _, _ = build_ensemble(members, None, weights)
    singles = [[float(i == j) for j in range(len(bundles))] for i in range(len(bundles))]
    got = evaluator.accuracies(shards, [weights, *singles])
    assert got[0] == pytest.approx(accuracy(ensemble, x, y), abs=1.0 / len(y))
    assert got[1:] == [accuracy(load_bundle(u).module, x, y) for u in bundles]
    assert got[3] > got[1]  # the trained model beats the barely trained one: the figures mean something


def test_predictions_are_kept_per_shard_and_reused(
    tmp_path: Path, dask_client: object, small_manifest: str, bundles: list[str]
) -> None:
    evaluator = ShardEvaluator(dask_client, small_manifest, str(tmp_path / "predictions"))
    shards = evaluator.predictions(SPLIT, bundles[:2])
    rows = [len(read_probabilities(s)[1]) for s in shards]
    assert sum(rows) == sum(e["rows"] for e in load_manifest(small_manifest)["splits"][SPLIT])
    probs, labels = read_probabilities(shards[0])
    assert probs.shape == (2, len(labels), 10) and np.allclose(probs.sum(axis=2), 1.0, atol=1e-5)
    written = [os.stat(s).st_mtime_ns for s in shards]
    assert evaluator.predictions(SPLIT, bundles[:2]) == shards  # a rerun reuses the files
    assert [os.stat(s).st_mtime_ns for s in shards] == written
    assert evaluator.predictions(SPLIT, bundles[2:]) != shards  # other models: other files
