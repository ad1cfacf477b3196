"""The study's lease fences a superseded search attempt: once a later attempt (Airflow's retry on
another host) has taken the study, the earlier one, come back from a cut link, tells the study
nothing more and moves no checkpoint into place; the later attempt finishes every trial with each
epoch told once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest

from mopflow.base.fencing import Superseded
from mopflow.base.optuna_storage import make_storage
from mopflow.pipeline.context import permanent_errors
from mopflow.training.search.config import SearchConfig
from mopflow.training.search.lease import StudyLease, lease_of
from mopflow.training.search.sweep import run_search_with_executor
from tests.spaces import cnn_8x2_space

SPACE = cnn_8x2_space(
    {"lr": {"type": "categorical", "choices": [0.02]}, "batch_size": {"type": "categorical", "choices": [16]}}
)


def _study(journal: Path) -> optuna.Study:
    """One attempt's own handle on the study (another process, on another host)."""
    return optuna.create_study(
        study_name="leased", storage=make_storage(str(journal)), direction="maximize", load_if_exists=True
    )


def test_a_later_attempt_takes_the_lease_and_the_earlier_one_is_fenced(tmp_path: Path) -> None:
    journal = tmp_path / "journal.log"
    first = StudyLease.take(_study(journal), holder="w1:100")
    first.check()  # its own lease
    second = StudyLease.take(_study(journal), holder="w2:200")
    assert (first.generation, second.generation) == (1, 2)
    second.check()
    with pytest.raises(
        Superseded, match=r"w2:200, lease generation 2\); this attempt \(w1:100, generation 1\)"
    ):
        first.check()
    assert lease_of(_study(journal))["holder"] == "w2:200"
    assert issubclass(Superseded, permanent_errors())  # Airflow does not retry the fenced attempt


def test_a_search_taken_over_mid_sweep_writes_nothing_more_and_its_retry_tells_each_epoch_once(
    small_manifest: str, dask_client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mopflow.training.search.controller import SearchController

    cfg = SearchConfig(
        n_trials=2, epochs=3, strategy="task", model_slots=2, space=SPACE, sampler="random", pruner="none"
    )
    journal, checkpoints = tmp_path / "journal.log", tmp_path / "ckpt"
    real = SearchController.on_epoch_end
    heard: list[Any] = []
    at_takeover: dict[str, Any] = {}

    def taken_over_at_the_second_report(self: Any, report: Any) -> bool:
        heard.append(report)
        if len(heard) == 2:  # the retry starts on another host while this attempt is cut off
            study = _study(journal)
            StudyLease.take(study, holder="retry")
            at_takeover["reported"] = {t.number: dict(t.intermediate_values) for t in study.get_trials()}
            at_takeover["files"] = {p: p.stat().st_mtime_ns for p in checkpoints.rglob("*") if p.is_file()}
        return real(self, report)

    def search() -> Any:
        return run_search_with_executor(
            cfg, small_manifest, "leased", str(journal), str(tmp_path / "artifacts"), dask_client,
            checkpoint_root=str(checkpoints),
        )  # fmt: skip

    monkeypatch.setattr(SearchController, "on_epoch_end", taken_over_at_the_second_report)
    with pytest.raises(Superseded, match="later attempt"):
        search()
    study = _study(journal)
    # the fenced attempt reported nothing after the takeover, asked no trial, moved no checkpoint
    assert {t.number: dict(t.intermediate_values) for t in study.get_trials()} == at_takeover["reported"]
    assert {p: p.stat().st_mtime_ns for p in at_takeover["files"]} == at_takeover["files"]
    monkeypatch.setattr(SearchController, "on_epoch_end", real)
    outcome = search()  # the retry itself, holding the newest lease
    assert sorted(r.state for r in outcome.results) == ["COMPLETE", "COMPLETE"]
    assert all([h["epoch"] for h in r.history] == [0, 1, 2] for r in outcome.results)
    assert lease_of(study)["generation"] == 3
