"""Fixtures of the compression tests: a small trained ensemble over the shared small dataset."""

from __future__ import annotations

import pytest
import torch

from mopflow.training.data import load_manifest, load_split
from mopflow.training.models.builtin import ArchSpec, build_model
from mopflow.training.models.bundle import save_bundle
from tests.compression.helpers import fit


@pytest.fixture(scope="session")
def teacher_uri(tmp_path_factory: pytest.TempPathFactory, small_manifest: str) -> str:
    """A two-member ensemble bundle that has learned something."""
    columns = load_manifest(small_manifest)["feature_columns"]
    x, y = load_split(small_manifest, "train")
    arch = ArchSpec("mlp", {"width": 32, "depth": 1}, len(columns), 10)
    members = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        member = build_model(arch, x.mean(axis=0).tolist(), (x.std(axis=0) + 1e-6).tolist())
        fit(member, x, y, 80)
        members.append(member)
    return save_bundle(str(tmp_path_factory.mktemp("teacher") / "ensemble"), members, [arch, arch], columns)
