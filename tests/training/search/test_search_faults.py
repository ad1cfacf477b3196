"""Faults in the search: trials of a dead coordinator or a killed worker resume from their
checkpoint, tampered checkpoints are refused, and many workers on one study (journal file and
PostgreSQL) lose no trial."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from mopflow.base.optuna_storage import make_storage
from mopflow.training.executors.base import CHECKPOINT_FILE
from mopflow.training.search.config import SearchConfig
from mopflow.training.search.study import RESUME_ATTR, checkpoint_folder
from mopflow.training.search.sweep import run_strategy_search
from tests.dask_waits import wait_until_executing

REPO = Path(__file__).resolve().parents[3]
CNN = {"family": "cnn", "width": 8, "depth": 2, "lr": 0.01, "weight_decay": 0.0, "batch_size": 128}
SPACE = {
    "families": {
        "cnn": {"width": {"type": "int", "low": 4, "high": 8}, "depth": {"type": "int", "low": 2, "high": 3}}
    },
    "common": {"lr": {"type": "float", "low": 0.005, "high": 0.02, "log": True}},
}


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["PYTHONPATH"] = str(REPO)
    return env


class CoordinatorKilled(RuntimeError):
    """Stands for the search task's process dying mid-sweep."""


@pytest.mark.slow
def test_a_task_trial_whose_coordinator_died_is_retried_from_its_last_checkpoint(
    small_manifest: str, tmp_path: Path, dask_client: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault: the search task's process dies mid-sweep (a trial left RUNNING, its model
    checkpointed after every epoch) and the task restarts. Expected: the retry resumes the model
    after the last checkpointed epoch, keeps the earlier epochs' history, and only one trial
    counts towards n_trials."""
    from mopflow.training.executors import task
    from mopflow.training.search.controller import SearchController

    monkeypatch.setattr(task, "HEAR_EVERY_S", 0.0)  # every epoch heard, and checkpointed, as it ends
    storage_url, art, epochs = str(tmp_path / "journal.log"), str(tmp_path / "art"), 6
    cfg = SearchConfig(n_trials=1, epochs=epochs, parallel_trials=1, space=SPACE, pruner="none")
    real = SearchController.on_epoch_end
    heard: list[object] = []

    def dies_at_the_third_report(self: object, report: object) -> bool:
        heard.append(report)
        keep = real(self, report)  # type: ignore[arg-type]
        if len(heard) == 3:
            raise CoordinatorKilled("the search task's process died")
        return keep

    monkeypatch.setattr(SearchController, "on_epoch_end", dies_at_the_third_report)
    with pytest.raises(CoordinatorKilled):
        run_strategy_search(cfg, small_manifest, "k", storage_url, art, dask_client)
    monkeypatch.setattr(SearchController, "on_epoch_end", real)
    (left,) = optuna.load_study(study_name="k", storage=make_storage(storage_url)).trials
    assert left.state == TrialState.RUNNING and len(left.intermediate_values) == 3
    assert (Path(checkpoint_folder(art, "k", 0)) / CHECKPOINT_FILE).exists()

    outcome = run_strategy_search(cfg, small_manifest, "k", storage_url, art, dask_client)
    (result,) = outcome.results
    assert result.state == "COMPLETE" and result.number == 1
    assert result.resumed_from_epoch == 2  # after the third epoch, the last one checkpointed
    assert [h["epoch"] for h in result.history] == list(range(epochs))  # nothing lost, nothing twice
    trials = optuna.load_study(study_name="k", storage=make_storage(storage_url)).trials
    assert trials[1].user_attrs[RESUME_ATTR] == 0
    assert trials[1].user_attrs["resumed_from_epoch"] == 2
    # the retry carries the epochs done before the death as its own reports (pruning sees them)
    assert set(trials[1].intermediate_values) == set(range(epochs))


def test_tampered_trial_checkpoint_is_refused(
    small_manifest: str, tmp_path: Path, dask_client: object
) -> None:
    """Fault: a model's checkpoint replaced by a pickle payload. Expected: the trial fails with
    the reason; the payload never runs."""
    marker = tmp_path / "pwned"
    art = str(tmp_path / "art")
    folder = Path(checkpoint_folder(art, "t", 0))
    folder.mkdir(parents=True)

    class Payload:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    import torch

    torch.save({"state_dict": {}, "evil": Payload()}, folder / CHECKPOINT_FILE)
    cfg = SearchConfig(n_trials=1, epochs=2, parallel_trials=1, space=SPACE, pruner="none")
    outcome = run_strategy_search(cfg, small_manifest, "t", str(tmp_path / "j.log"), art, dask_client)
    first = outcome.results[0]
    assert first.state == "FAIL" and "not a safetensors blob" in (first.error or "")
    assert not marker.exists()
    assert [r.state for r in outcome.results[1:]] == ["COMPLETE"]  # an extra trial gives the member


WORKER = textwrap.dedent(
    """
    import json, sys
    import optuna
    from mopflow.base.optuna_storage import make_storage
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url, worker, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    study = optuna.load_study(study_name="crowd", storage=make_storage(url, writers=4))
    told = []
    for _ in range(n):
        trial = study.ask()
        x = trial.suggest_float("x", -1.0, 1.0)
        for step in range(3):
            trial.report(x * step, step)
        study.tell(trial, -x * x)
        told.append(trial.number)
    print(json.dumps({"worker": worker, "told": told}))
    """
)


def _crowd(url: str, workers: int = 4, per_worker: int = 12) -> None:
    optuna.create_study(study_name="crowd", storage=make_storage(url, writers=workers))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, url, str(w), str(per_worker)],
            env=_child_env(),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in range(workers)
    ]
    told: list[int] = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        assert "database is locked" not in err
        told += json.loads(out.strip().splitlines()[-1])["told"]
    trials = optuna.load_study(study_name="crowd", storage=make_storage(url)).trials
    assert len(told) == len(set(told)) == workers * per_worker  # no trial handed out twice
    assert sorted(t.number for t in trials) == sorted(told)  # none lost
    assert all(t.state == TrialState.COMPLETE and len(t.intermediate_values) == 3 for t in trials)


@pytest.mark.slow
def test_four_workers_on_a_journal_file_lose_no_trial(tmp_path: Path) -> None:
    _crowd(str(tmp_path / "crowd.log"))


@pytest.mark.slow
@pytest.mark.services
def test_four_workers_on_postgresql_lose_no_trial(pg_url: str) -> None:
    _crowd(pg_url)


@pytest.mark.slow
@pytest.mark.services
def test_search_on_postgresql_storage(
    small_manifest: str, tmp_path: Path, dask_client: object, pg_url: str
) -> None:
    cfg = SearchConfig(n_trials=3, epochs=2, parallel_trials=2, space=SPACE, pruner="none", sampler="random")
    outcome = run_strategy_search(cfg, small_manifest, "pg", pg_url, str(tmp_path / "art"), dask_client)
    assert [r.state for r in outcome.results] == ["COMPLETE"] * 3
    trials = optuna.load_study(study_name="pg", storage=make_storage(pg_url)).trials
    assert len(trials) == 3 and all(len(t.intermediate_values) == 2 for t in trials)


@pytest.mark.slow
def test_trial_whose_dask_worker_is_killed_resumes_on_the_restarted_worker(
    small_manifest: str, tmp_path: Path, recwarn: pytest.WarningsRecorder
) -> None:
    """Fault: the Dask worker process training a trial is SIGKILLed (a spot VM gone, no notice).
    Expected: Dask runs the lost chain again on the restarted worker from the last finished
    epoch's state (staged on the way, heard by the coordinator or not); the sweep completes with
    the same trial and the full epoch history."""
    import threading

    from mopflow.training.compute.cluster import dask_client

    storage_url, art, epochs = str(tmp_path / "journal.log"), str(tmp_path / "art"), 30
    cfg = SearchConfig(n_trials=1, epochs=epochs, parallel_trials=1, space=SPACE, pruner="none")
    ckpt = Path(checkpoint_folder(art, "dk", 0)) / CHECKPOINT_FILE
    with dask_client("", 1) as client:
        outcome: dict[str, object] = {}

        def search() -> None:
            outcome["result"] = run_strategy_search(cfg, small_manifest, "dk", storage_url, art, client)

        runner = threading.Thread(target=search)
        runner.start()
        deadline = time.monotonic() + 180

        def epoch_kept() -> bool:  # staged by the worker, or made the checkpoint
            return ckpt.exists() or any(ckpt.parent.glob("staged-*"))

        while not epoch_kept() and time.monotonic() < deadline and runner.is_alive():
            time.sleep(0.05)
        assert epoch_kept(), "the trial should have kept an epoch's state"
        # killed while an epoch runs: a finished epoch's result is fetched, not redone
        assert wait_until_executing(client, runner.is_alive), "the next epoch should be running"
        (pid,) = client.run(os.getpid).values()
        os.kill(pid, signal.SIGKILL)  # the nanny restarts the worker; the scheduler reschedules
        runner.join(timeout=300)
        assert not runner.is_alive()
    search_outcome = outcome["result"]
    (result,) = search_outcome.results  # type: ignore[attr-defined]
    assert result.state == "COMPLETE" and result.number == 0
    assert result.resumed_from_epoch is not None and 0 <= result.resumed_from_epoch < epochs - 1
    assert result.redone_s > 0  # the epoch lost with the worker, done again
    assert [h["epoch"] for h in result.history] == list(range(epochs))
    # each epoch reaches Optuna once: the redone epoch is not reported twice
    assert not [w for w in recwarn if "already reported" in str(w.message)]
