from __future__ import annotations

import io
import pickle
from pathlib import Path

import pytest
import torch

from mopflow.compression.ensemble import Candidate, build_ensemble, select_top_k
from mopflow.training.models.builtin import ArchSpec, build_model
from mopflow.training.models.bundle import (
    BundleError,
    ProbabilityEnsemble,
    load_bundle,
    predict_proba,
    save_bundle,
)

COLUMNS = [f"x{i:03d}" for i in range(40)]


def _save_member(path: Path, family: str, seed: int) -> str:
    torch.manual_seed(seed)
    arch = ArchSpec(family, {"width": 8, "depth": 2}, 40, 10)
    model = build_model(arch, [0.1] * 40, [1.5] * 40)
    return save_bundle(str(path), [model], [arch], COLUMNS)


def test_top_k_takes_only_complete_trials_best_first() -> None:
    cands = [
        Candidate(0, "COMPLETE", 0.80, "a", {}),
        Candidate(1, "PRUNED", 0.99, "b", {}),
        Candidate(2, "COMPLETE", 0.90, "c", {}),
        Candidate(3, "FAIL", None, None, {}),
        Candidate(4, "COMPLETE", 0.90, "e", {}),
    ]
    assert [c.number for c in select_top_k(cands, 2)] == [2, 4]
    with pytest.raises(ValueError, match="only 3 COMPLETE"):
        select_top_k(cands, 4)


def test_ensemble_averages_member_probabilities(tmp_path: Path) -> None:
    uris = [_save_member(tmp_path / f"m{i}", fam, i) for i, fam in enumerate(["cnn", "mlp", "cnn"])]
    members = [Candidate(i, "COMPLETE", 0.5, u, {}) for i, u in enumerate(uris)]
    ensemble, archs, columns = build_ensemble(members)
    assert [a.family for a in archs] == ["cnn", "mlp", "cnn"] and columns == COLUMNS
    x = torch.randn(16, 40)
    probs = predict_proba(ensemble, x)
    assert probs.shape == (16, 10)
    assert torch.allclose(probs.sum(1), torch.ones(16), atol=1e-5)
    singles = torch.stack([predict_proba(load_bundle(u).module, x) for u in uris]).mean(0)
    assert torch.allclose(probs, singles, atol=1e-6)


def test_bundle_round_trip_gives_identical_predictions(tmp_path: Path) -> None:
    uri = _save_member(tmp_path / "m", "cnn", 3)
    torch.manual_seed(3)
    original = ProbabilityEnsemble(
        [build_model(ArchSpec("cnn", {"width": 8, "depth": 2}, 40, 10), [0.1] * 40, [1.5] * 40)]
    )
    x = torch.randn(5, 40)
    assert torch.allclose(predict_proba(original, x), predict_proba(load_bundle(uri).module, x))


class _Payload:
    def __reduce__(self) -> tuple:
        return (Path.touch, (Path(MARKER),))


MARKER = ""


def test_pickle_payload_in_place_of_weights_is_refused_and_never_runs(tmp_path: Path) -> None:
    global MARKER
    MARKER = str(tmp_path / "pwned")
    uri = _save_member(tmp_path / "m", "mlp", 0)
    buffer = io.BytesIO()
    pickle.dump({"m0.1.net.0.weight": _Payload()}, buffer)
    (tmp_path / "m" / "weights.safetensors").write_bytes(buffer.getvalue())
    with pytest.raises(BundleError, match="not valid safetensors"):
        load_bundle(uri)
    assert not Path(MARKER).exists()


def test_weights_that_do_not_match_the_spec_are_refused(tmp_path: Path) -> None:
    uri = _save_member(tmp_path / "m", "mlp", 0)
    other = _save_member(tmp_path / "o", "cnn", 0)
    (tmp_path / "m" / "weights.safetensors").write_bytes(
        (tmp_path / "o" / "weights.safetensors").read_bytes()
    )
    assert other
    with pytest.raises(BundleError, match="do not match"):
        load_bundle(uri)
