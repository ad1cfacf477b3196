"""A price trace replayed against a real LocalCluster: workers are stopped (spot notice) when the
price rises above their bid and started again when it falls back; the run is accounted."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from pydantic import ValidationError

from mopflow.training.compute.workers import cluster_workers
from mopflow.training.search.config import SearchConfig
from mopflow.training.volatile.cost import bill_interval
from mopflow.training.volatile.price_trace import PriceTrace
from mopflow.training.volatile.prices import PriceError
from tests.spaces import fixed_cnn_space

SPACE = fixed_cnn_space(batch_size=64)


def test_spot_settings_are_validated_early(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="go together"):
        SearchConfig(spot_trace=str(tmp_path / "p.csv"))
    with pytest.raises(ValidationError, match=r"spot_bids\[1\]=-1.0"):
        SearchConfig(spot_trace="p.csv", spot_bids=[1.0, -1.0])
    with pytest.raises(ValidationError, match="strategy 'task' or 'mop'.*not 'ddp'"):
        SearchConfig(spot_trace="p.csv", spot_bids=[1.0], strategy="ddp")
    assert SearchConfig(spot_trace="p.csv", spot_bids="1.0, 0.5", strategy="mop").spot_bids == [1.0, 0.5]
    with pytest.raises(ValidationError, match="spot_trace 'prices.txt' must name a timestamp,price CSV"):
        SearchConfig(spot_trace="prices.txt", spot_bids=[1.0])


@pytest.mark.slow
def test_bad_replay_input_fails_before_training(tmp_path: Path, small_manifest: str) -> None:
    from mopflow.training.compute.cluster import dask_client
    from mopflow.training.search.sweep import run_strategy_search

    csv = tmp_path / "prices.csv"
    csv.write_text("timestamp,price\n0,0.3\n60,oops\n")
    args = (small_manifest, "bad", str(tmp_path / "j.log"), str(tmp_path / "art"))
    with dask_client("", 1) as client:
        cfg = SearchConfig(
            n_trials=1, epochs=1, parallel_trials=1, space=SPACE, spot_trace=str(csv), spot_bids=[1.0]
        )
        with pytest.raises(PriceError, match="line 3: price 'oops'"):
            run_strategy_search(cfg, *args, client)
        csv.write_text("timestamp,price\n0,0.3\n60,0.5\n")
        with pytest.raises(PriceError, match="2 bid\\(s\\) for a LocalCluster of 1 worker"):
            run_strategy_search(cfg.model_copy(update={"spot_bids": [1.0, 2.0]}), *args, client)
        with pytest.raises(PriceError, match="below the trace's lowest price"):
            run_strategy_search(cfg.model_copy(update={"spot_bids": [0.1]}), *args, client)
    assert not (tmp_path / "j.log").exists(), "no study was opened"


@pytest.mark.slow
def test_sweep_under_a_replayed_trace_stops_and_restarts_a_worker(
    tmp_path: Path, small_manifest: str
) -> None:
    """Worker 1 (bid 0.5) is priced out from the trace's start to second 600 (10 s at 60x); worker 0
    (bid 1.0) never is. The sweep completes; worker 1 really left (its process is gone) and came
    back as a new process at a new address; the account bills what really ran.

    The price rises at the start, not later, because the sweep lasts under a second here: a later
    rise raced the sweep's end (the notice never came)."""
    from mlflow.tracking import MlflowClient

    from mopflow.base.tracking import MlflowTracker
    from mopflow.training.compute.cluster import dask_client
    from mopflow.training.search.scaling import log_volatile
    from mopflow.training.search.sweep import run_strategy_search

    csv = tmp_path / "prices.csv"
    csv.write_text("timestamp,price\n0,0.8\n600,0.3\n100000,0.3\n")
    speed = 60.0
    cfg = SearchConfig(
        n_trials=3,
        epochs=10,
        parallel_trials=2,
        space=SPACE,
        pruner="none",
        spot_trace=str(csv),
        spot_bids=[1.0, 0.5],
        spot_speed=speed,
    )
    with dask_client("", 2) as client:
        outcome = run_strategy_search(
            cfg, small_manifest, "spot", str(tmp_path / "j.log"), str(tmp_path / "art"), client
        )
        after = len(cluster_workers(client))
    assert after == 2, "the replay leaves every worker running"
    assert [r.state for r in outcome.results] == ["COMPLETE"] * 3
    assert all(len(r.history) == 10 for r in outcome.results)
    report = outcome.spot
    assert report is not None and report.error == ""
    kinds = [e.kind for e in report.events if e.worker == "1"]
    assert kinds[:3] == ["joined", "notice", "exit"], kinds
    assert "notice" not in [e.kind for e in report.events if e.worker == "0"]
    pids, addresses = report.pids("1"), report.addresses("1")
    assert len(set(pids)) == 2 and len(set(addresses)) == 2, "restarted: a new process at a new address"
    notice, gone = (
        next(e for e in report.events if e.worker == "1" and e.kind == k) for k in ("notice", "exit")
    )
    assert 0 <= notice.trace_t < 1.0 * speed  # within a poll (and a loaded machine's delay)
    t1 = report.trace_start + (report.wall_stop - report.wall_start) * speed
    trace = PriceTrace((0.0, 600.0), (0.8, 0.3), 100_000.0)
    assert report.ideal_cost == pytest.approx(sum(bill_interval(trace, [1.0, 0.5], 0.0, t1).worker_costs))
    # billed what really ran: worker 0 throughout; worker 1 until its process was gone, and again from
    # its restart (at the first price <= its bid after it left) to the end
    starts = [e for e in report.events if e.worker == "1" and e.kind == "start" and e.trace_t <= t1]
    worker1 = [(0.0, min(gone.trace_t, t1))] + ([(starts[0].trace_t, t1)] if starts else [])
    if starts:
        assert max(600.0, gone.trace_t) <= starts[0].trace_t < max(600.0, gone.trace_t) + 1.0 * speed
    expected = sum(bill_interval(trace, [math.inf], a, b).worker_costs[0] for a, b in [(0.0, t1), *worker1])
    account = report.account
    assert account.cost == pytest.approx(expected, rel=1e-6)
    # never billed less than the bids imply (but for the moments a restart takes to be noticed)
    assert report.ideal_cost - 1.0 * speed * 0.3 / 3600 <= account.cost
    # at most worker 1's time at 0.8 from the price rise (the trace's start, not the notice a poll
    # later) until its process was gone or the run ended
    assert account.cost - report.ideal_cost <= min(gone.trace_t, t1) * 0.8 / 3600 + 1e-9
    assert account.idle_seconds == pytest.approx(0.0, abs=1e-6)  # worker 0 always ran
    assert account.wasted_worker_seconds == pytest.approx(min(gone.trace_t, t1) - notice.trace_t, rel=1e-6)
    assert 0 < account.useful_worker_seconds < account.billed_worker_seconds
    assert account.units >= 3

    tracker = MlflowTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "spot", str(tmp_path / "mlartifacts"))
    run_id = tracker.start_run("search", {})
    log_volatile(tracker, run_id, outcome)
    run = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(run_id)
    assert run.data.metrics["spot_cost"] == pytest.approx(account.cost)
    assert run.data.metrics["spot_notices"] == 1.0 and run.data.params["spot_bids"] == "1,0.5"


MOP_SPACE = fixed_cnn_space(batch_size=8)


@pytest.mark.slow
def test_mop_sweep_under_a_replayed_trace_survives_a_priced_out_worker(
    tmp_path: Path, small_manifest: str
) -> None:
    """strategy=mop: worker 1 (bid 0.5) is priced out from the trace's start to trace second 30
    (0.5 s at 60x). It leaves on the notice (a unit it holds checkpoints and goes on elsewhere);
    the worker's process really exits and a new one joins under the same name while the sweep
    runs; every trial completes all its epochs and the account is logged."""
    import dask
    from mlflow.tracking import MlflowClient

    from mopflow.base.tracking import MlflowTracker
    from mopflow.training.compute.cluster import dask_client
    from mopflow.training.search.scaling import log_volatile
    from mopflow.training.search.sweep import run_search_with_executor

    # The price window opens at the start, not seconds in: the sweep's length is the machine's
    # (1.3 s for 6 epochs under a suite's load, less as units cost less), and a window that
    # opened 1 s in outlived it. Priced out from the start and back at 0.5 s, the worker is back
    # within about 0.5 s more, while the sweep (its start on one worker) goes on.
    epochs = 3 * EPOCHS_MOP
    csv = tmp_path / "prices.csv"
    csv.write_text("timestamp,price\n0,0.8\n30,0.3\n100000,0.3\n")
    cfg = SearchConfig(
        n_trials=2,
        epochs=epochs,
        strategy="mop",
        model_slots=2,
        space=MOP_SPACE,
        pruner="none",
        spot_trace=str(csv),
        spot_bids=[1.0, 0.5],
        spot_speed=60.0,
    )
    # a restarted worker that trained takes a while to come back on a loaded 2-core machine
    with dask.config.set({"distributed.deploy.lost-worker-timeout": "120s"}), dask_client("", 2) as client:
        outcome = run_search_with_executor(
            cfg,
            small_manifest,
            "spot-mop",
            str(tmp_path / "j.log"),
            str(tmp_path / "art"),
            client,
            checkpoint_root=str(tmp_path / "ckpt"),
        )
        after = len(cluster_workers(client))
    assert after == 2, "the replay leaves every worker running"
    assert [r.state for r in outcome.results] == ["COMPLETE"] * 2, [r.error for r in outcome.results]
    assert all([h["epoch"] for h in r.history] == list(range(epochs)) for r in outcome.results)
    # every model still visited both partitions once per epoch
    assert sorted(len(recs) for recs in outcome.epoch_records.values()) == [4] * epochs
    report = outcome.spot
    assert report is not None and report.error == ""
    kinds = [e.kind for e in report.events if e.worker == "1" and e.wall <= report.wall_stop]
    timeline = [(e.worker, e.kind, round(e.wall - report.wall_start, 2)) for e in report.events]
    assert kinds[:5] == ["joined", "notice", "exit", "start", "joined"], (
        timeline,
        report.wall_stop - report.wall_start,
    )
    assert "notice" not in [e.kind for e in report.events if e.worker == "0"]
    pids, addresses = report.pids("1"), report.addresses("1")
    assert len(set(pids)) >= 2 and len(set(addresses)) >= 2, "a new process at a new address"
    assert report.account.cost > 0 and report.account.billed_worker_seconds > 0

    tracker = MlflowTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "spot", str(tmp_path / "mlartifacts"))
    run_id = tracker.start_run("search", {})
    log_volatile(tracker, run_id, outcome)
    run = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(run_id)
    assert run.data.metrics["spot_cost"] == pytest.approx(report.account.cost)
    assert run.data.metrics["spot_notices"] == 1.0 and run.data.metrics["spot_restarts"] >= 1.0


EPOCHS_MOP = 3
