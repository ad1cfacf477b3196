"""Faults in the search: killed trials resume from their checkpoint, stale heartbeats, and many
workers on one study (journal file and PostgreSQL) losing no trial."""

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

from infra.optuna_storage import make_storage
from training.config import SearchConfig
from training.search import RESUME_ATTR, checkpoint_folder, fail_stale_heartbeats, retried_trial
from training.space import parse_space, sample_params
from training.task_search import run_search
from training.trial import CHECKPOINT_FILE, CHECKPOINT_META, _params_key

REPO = Path(__file__).resolve().parents[2]
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


@pytest.mark.slow
def test_killed_trial_is_retried_from_its_last_checkpoint(
    small_manifest: str, tmp_path: Path, dask_client: object
) -> None:
    """Fault: the process training a trial is SIGKILLed mid-sweep and the coordinator restarts.
    Expected: the retry resumes after the last checkpointed epoch, keeps the earlier epochs'
    history, and only one trial counts towards n_trials."""
    storage_url, art, epochs = str(tmp_path / "journal.log"), str(tmp_path / "art"), 30
    study = optuna.create_study(study_name="k", storage=make_storage(storage_url), direction="maximize")
    study.enqueue_trial({"cnn_width": 8, "cnn_depth": 2, "lr": 0.01})
    trial = study.ask()  # the coordinator starts the trial, then everything dies
    assert sample_params(parse_space(SPACE), trial) == CNN
    ckpt = Path(checkpoint_folder(art, "k", trial.number)) / CHECKPOINT_FILE
    script = textwrap.dedent(
        f"""
        from training.trial import TrialSpec, train_trial
        spec = TrialSpec({trial.number}, {trial._trial_id}, {CNN!r}, {epochs}, 0, {small_manifest!r},
                         {str(tmp_path / "b0")!r}, study_name="k", optuna_storage={storage_url!r},
                         pruner="none", checkpoint_uri={str(ckpt.parent)!r})
        train_trial(spec)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], env=_child_env(), cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while not ckpt.exists() and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.05)
        time.sleep(0.3)  # let it get a few epochs further than the first checkpoint
        assert ckpt.exists() and child.poll() is None, "the trial should be training with a checkpoint"
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    reported = optuna.load_study(study_name="k", storage=make_storage(storage_url)).trials[0]
    assert reported.state == TrialState.RUNNING and reported.intermediate_values

    cfg = SearchConfig(n_trials=1, epochs=epochs, n_workers=1, space=SPACE, pruner="none")
    outcome = run_search(cfg, small_manifest, "k", storage_url, art, dask_client)

    (result,) = outcome.results
    assert result.state == "COMPLETE" and result.number == 1
    assert result.resumed_from_epoch is not None and 0 <= result.resumed_from_epoch < epochs - 1
    assert [h["epoch"] for h in result.history] == list(range(epochs))  # nothing lost, nothing twice
    trials = optuna.load_study(study_name="k", storage=make_storage(storage_url)).trials
    assert trials[1].user_attrs[RESUME_ATTR] == 0
    assert trials[1].user_attrs["resumed_from_epoch"] == result.resumed_from_epoch
    # the retry carries the epochs done before the kill as its own reports (pruning sees them)
    assert set(trials[1].intermediate_values) == set(range(epochs))


def test_tampered_trial_checkpoint_is_refused(small_manifest: str, tmp_path: Path) -> None:
    """Fault: a checkpoint replaced by a pickle payload. Expected: the trial fails with the reason;
    the payload never runs."""
    from training.trial import TrialSpec, train_trial

    marker = tmp_path / "pwned"
    folder = tmp_path / "ckpt"
    folder.mkdir()

    class Payload:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    import torch

    torch.save({"state_dict": {}, "evil": Payload()}, folder / CHECKPOINT_FILE)
    spec = TrialSpec(0, 0, CNN, 2, 0, small_manifest, str(tmp_path / "b"), checkpoint_uri=str(folder))
    # the checkpoint's metadata is intact (only the weights file was swapped)
    (folder / CHECKPOINT_META).write_text(json.dumps({"params_key": _params_key(spec)}))
    result = train_trial(spec)
    assert result.state == "FAIL" and "not a safetensors blob" in (result.error or "")
    assert not marker.exists()


WORKER = textwrap.dedent(
    """
    import json, sys
    import optuna
    from infra.optuna_storage import make_storage
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url, worker, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    study = optuna.load_study(study_name="crowd", storage=make_storage(url, n_workers=4))
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
    optuna.create_study(study_name="crowd", storage=make_storage(url, n_workers=workers))
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


@pytest.mark.services
def test_trial_whose_heartbeat_stops_is_failed_and_retried(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault: a worker stops beating (killed or hung). Expected: the trial is failed and a retry
    with the same params is enqueued, pointing back at it (so it resumes from its checkpoint)."""
    monkeypatch.setenv("MOPFLOW_OPTUNA_HEARTBEAT_S", "1")  # grace period 3 s
    study = optuna.create_study(study_name="hb", storage=make_storage(pg_url, n_workers=2))
    alive, dead = study.ask(), study.ask()
    for trial in (alive, dead):
        trial.suggest_int("w", 1, 9)
        study._storage.record_heartbeat(trial._trial_id)  # type: ignore[attr-defined]
    for _ in range(8):  # only one worker keeps beating
        time.sleep(0.5)
        study._storage.record_heartbeat(alive._trial_id)  # type: ignore[attr-defined]
    assert fail_stale_heartbeats(study) == {dead.number}
    trials = study.get_trials()
    assert trials[dead.number].state == TrialState.FAIL
    assert trials[alive.number].state == TrialState.RUNNING
    retry = study.ask()
    assert retried_trial(retry) == dead.number
    assert retry.params == trials[dead.number].params


@pytest.mark.slow
@pytest.mark.services
def test_search_on_postgresql_storage(
    small_manifest: str, tmp_path: Path, dask_client: object, pg_url: str
) -> None:
    cfg = SearchConfig(n_trials=3, epochs=2, n_workers=2, space=SPACE, pruner="none", sampler="random")
    outcome = run_search(cfg, small_manifest, "pg", pg_url, str(tmp_path / "art"), dask_client)
    assert [r.state for r in outcome.results] == ["COMPLETE"] * 3
    trials = optuna.load_study(study_name="pg", storage=make_storage(pg_url)).trials
    assert len(trials) == 3 and all(len(t.intermediate_values) == 2 for t in trials)


@pytest.mark.slow
def test_trial_whose_dask_worker_is_killed_resumes_on_the_restarted_worker(
    small_manifest: str, tmp_path: Path
) -> None:
    """Fault: the Dask worker process training a trial is SIGKILLed (a spot VM gone, no notice).
    Expected: Dask runs the trial again on the restarted worker, which resumes after the last
    checkpointed epoch; the sweep completes with the same trial and the full epoch history."""
    import threading

    from training.cluster import dask_client

    storage_url, art, epochs = str(tmp_path / "journal.log"), str(tmp_path / "art"), 30
    cfg = SearchConfig(n_trials=1, epochs=epochs, n_workers=1, space=SPACE, pruner="none")
    ckpt = Path(checkpoint_folder(art, "dk", 0)) / CHECKPOINT_FILE
    with dask_client("", 1) as client:
        outcome: dict[str, object] = {}

        def search() -> None:
            outcome["result"] = run_search(cfg, small_manifest, "dk", storage_url, art, client)

        runner = threading.Thread(target=search)
        runner.start()
        deadline = time.monotonic() + 180
        while not ckpt.exists() and time.monotonic() < deadline and runner.is_alive():
            time.sleep(0.05)
        assert ckpt.exists(), "the trial should have checkpointed an epoch"
        time.sleep(0.3)
        (pid,) = client.run(os.getpid).values()
        os.kill(pid, signal.SIGKILL)  # the nanny restarts the worker; the scheduler reschedules
        runner.join(timeout=300)
        assert not runner.is_alive()
    search_outcome = outcome["result"]
    (result,) = search_outcome.results  # type: ignore[attr-defined]
    assert result.state == "COMPLETE" and result.number == 0
    assert result.resumed_from_epoch is not None and 0 <= result.resumed_from_epoch < epochs - 1
    assert [h["epoch"] for h in result.history] == list(range(epochs))
