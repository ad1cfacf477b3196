"""Growing the Dask cluster by a worker schedule: n_j worker processes in round j of a sweep."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from mopflow.training.compute.workers import worker_addresses
from mopflow.training.search.config import SearchConfig
from mopflow.training.search.scaling import (
    RoundScale,
    RoundScaling,
    log_worker_rounds,
    scaler_for,
)
from mopflow.training.volatile.schedules import WorkerSchedule
from tests.spaces import fixed_cnn_space

SPACE = fixed_cnn_space(batch_size=64)
STEP = WorkerSchedule(kind="step", n_start=1, increment=1, period=1, n_max=2, unit="epoch")


class CountingScaler:
    """A scaler that records the sizes asked for (the real ones are tested on a LocalCluster)."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def scale(self, n: int) -> int:
        self.asked.append(n)
        return n


def test_schedule_settings_are_validated() -> None:
    with pytest.raises(ValidationError, match="unit must be 'epoch'"):
        SearchConfig(worker_schedule=WorkerSchedule(kind="static", n_max=2))
    with pytest.raises(ValidationError, match="task or mop, not 'ddp'"):
        SearchConfig(strategy="ddp", worker_schedule=STEP)
    with pytest.raises(ValidationError, match="cannot be combined"):
        SearchConfig(worker_schedule=STEP, spot_trace="p.csv", spot_bids=[1.0])
    assert SearchConfig(worker_schedule=STEP, strategy="mop").worker_schedule == STEP


def test_task_rounds_start_n_j_trials_and_wait_for_them() -> None:
    scaler = CountingScaler()
    rounds = RoundScaling(WorkerSchedule(kind="exponential", eta=2.0, n_max=4, unit="epoch"), scaler)
    started = []
    in_flight = 0
    for _ in range(3):  # three rounds: 1, 2, 4 trials, each drained before the next
        count = 0
        while rounds.may_start(in_flight):
            rounds.started()
            in_flight += 1
            count += 1
        started.append(count)
        assert not rounds.may_start(in_flight), "the barrier holds while trials run"
        in_flight = 0
    assert started == [1, 2, 4] and scaler.asked == [1, 2, 4]
    assert [r.round for r in rounds.history] == [1, 2, 3]
    fixed = RoundScaling(None, None, fixed_workers=2)
    assert fixed.may_start(1) and not fixed.may_start(2) and fixed.round_hook() is None


@pytest.fixture()
def cluster_client() -> Iterator[object]:
    """A LocalCluster of its own (the shared one must keep its size)."""
    from mopflow.training.compute.cluster import dask_client

    with dask_client("", 1) as client:
        yield client


@pytest.mark.slow
def test_local_cluster_scaler_starts_and_stops_worker_processes(cluster_client: object) -> None:
    scaler = scaler_for(cluster_client, timeout_s=60)
    assert type(scaler).__name__ == "LocalClusterScaler"
    assert scaler.scale(3) == 3
    three = worker_addresses(cluster_client)
    assert len(three) == 3 and len(set(cluster_client.run(__import__("os").getpid).values())) == 3  # type: ignore[attr-defined]
    assert scaler.scale(1) == 1
    assert len(worker_addresses(cluster_client)) == 1


@pytest.mark.slow
def test_external_scheduler_retires_surplus_workers_and_waits_for_new_ones(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Connected by address (no cluster object): the surplus is retired; a scale-up can only wait
    for a deployment to add workers, and goes on with those present after the timeout."""
    from distributed import Client

    from mopflow.training.compute.cluster import dask_client

    with dask_client("", 2) as local, Client(local.cluster.scheduler_address, timeout="30s") as client:
        scaler = scaler_for(client, timeout_s=2)
        assert type(scaler).__name__ == "RetiringScaler"
        assert scaler.scale(1) == 1 and len(worker_addresses(client)) == 1
        with caplog.at_level("WARNING", logger="mopflow.training.search.scaling"):
            assert scaler.scale(2) == 1
        assert "wanted 2 workers, 1 present" in caplog.text


@pytest.mark.slow
def test_mop_sweep_scales_the_cluster_per_round(
    small_manifest: str, tmp_path: Path, cluster_client: object
) -> None:
    """n_j = 1, 2, 2 workers in rounds 1-3: each round's units ran on exactly n_j workers, and every
    trial completed all its epochs."""
    from mopflow.training.search.sweep import run_search_with_executor

    cfg = SearchConfig(
        n_trials=2, epochs=3, strategy="mop", model_slots=2, space=SPACE, pruner="none", worker_schedule=STEP
    )
    outcome = run_search_with_executor(
        cfg, small_manifest, "mop-scale", str(tmp_path / "j.log"), str(tmp_path / "art"), cluster_client
    )
    assert [(r.round, r.target, r.workers) for r in outcome.worker_rounds] == [
        (1, 1, 1),
        (2, 2, 2),
        (3, 2, 2),
    ]
    used = {j: {rec["worker"] for rec in recs} for j, recs in outcome.epoch_records.items()}
    assert [len(used[j]) for j in sorted(used)] == [1, 2, 2]
    assert [r.state for r in outcome.results] == ["COMPLETE", "COMPLETE"]
    assert all(len(r.history) == 3 for r in outcome.results)


@pytest.mark.slow
def test_task_sweep_runs_rounds_of_n_j_trials(
    small_manifest: str, tmp_path: Path, cluster_client: object
) -> None:
    from mopflow.training.search.sweep import run_strategy_search

    cfg = SearchConfig(
        n_trials=3, epochs=2, parallel_trials=1, space=SPACE, pruner="none", worker_schedule=STEP
    )
    outcome = run_strategy_search(
        cfg, small_manifest, "task-scale", str(tmp_path / "j.log"), str(tmp_path / "art"), cluster_client
    )
    assert [(r.target, r.workers) for r in outcome.worker_rounds] == [(1, 1), (2, 2)]
    assert [r.state for r in outcome.results] == ["COMPLETE"] * 3
    # The promise is n_j trials in flight at once, not where Dask places them: round 2's two
    # trials were both started before either finished.
    import optuna

    from mopflow.base.optuna_storage import make_storage

    study = optuna.load_study(study_name=outcome.study_name, storage=make_storage(outcome.storage_url))
    second = [t for t in study.trials if t.number in (1, 2)]
    assert len(second) == 2 and all(t.datetime_start and t.datetime_complete for t in second)
    assert max(t.datetime_start for t in second) < min(t.datetime_complete for t in second)


def test_worker_counts_are_logged_to_mlflow(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    from mopflow.base.tracking import MlflowTracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = MlflowTracker(uri, "scaling", str(tmp_path / "artifacts"))
    run_id = tracker.start_run("search", {})
    log_worker_rounds(
        tracker, run_id, [RoundScale(1, 1, 1, 0.1), RoundScale(2, 2, 2, 1.5), RoundScale(3, 4, 3, 60)]
    )
    history = MlflowClient(uri).get_metric_history(run_id, "workers_target")
    assert sorted((m.step, m.value) for m in history) == [(1, 1.0), (2, 2.0), (3, 4.0)]
    present = MlflowClient(uri).get_metric_history(run_id, "workers")
    assert sorted((m.step, m.value) for m in present) == [(1, 1.0), (2, 2.0), (3, 3.0)]
