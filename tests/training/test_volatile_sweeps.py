"""Sweeps on volatile workers: Dask worker processes of a real LocalCluster are preempted (SIGTERM,
a spot notice) and killed (SIGKILL, no notice) mid-sweep; the nanny restarts them. The sweep
finishes with as many COMPLETE trials as an undisturbed run with the same seed, a best accuracy
close to it, and the work redone reported in unit-seconds."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from training.config import SearchConfig
from training.search import SearchOutcome, checkpoint_folder, run_search, run_search_with_executor
from training.trial import CHECKPOINT_FILE

SPACE = {
    "families": {
        "cnn": {
            "width": {"type": "categorical", "choices": [8]},
            "depth": {"type": "categorical", "choices": [2]},
        }
    },
    "common": {
        "lr": {"type": "float", "low": 0.005, "high": 0.02, "log": True},
        "batch_size": {"type": "categorical", "choices": [16]},
    },
}
ACC_TOLERANCE = 0.1  # the hopping order (MOP) and the shuffle after a resume differ between runs


@pytest.fixture(scope="module")
def volatile_client() -> Iterator[Any]:
    """A cluster of its own: its workers get killed."""
    from training.cluster import dask_client

    with dask_client("", 2) as client:
        yield client


def _disturb(client: Any, ready: Callable[[dict[str, Any]], bool], running: Callable[[], bool]) -> list[str]:
    """Once both workers are training (``ready`` on what each processes), SIGTERM one (a spot
    notice) and SIGKILL the other a few batches later; the nanny restarts both."""
    deadline = time.monotonic() + 120
    while running() and time.monotonic() < deadline:
        processing = {str(w): [str(k) for k in keys] for w, keys in client.processing().items()}
        busy = sorted(w for w, keys in processing.items() if keys)
        if len(busy) == 2 and ready(processing):
            pids = client.run(os.getpid, workers=busy)
            time.sleep(0.15)  # a few batches into their units
            os.kill(pids[busy[0]], signal.SIGTERM)
            os.kill(pids[busy[1]], signal.SIGKILL)
            return [f"SIGTERM {busy[0]}", f"SIGKILL {busy[1]}"]
        time.sleep(0.02)
    return []


def _sweep(
    run: Callable[[], SearchOutcome], client: Any, ready: Callable[[dict[str, Any]], bool] | None = None
) -> tuple[SearchOutcome, list[str]]:
    outcome: dict[str, SearchOutcome] = {}
    runner = threading.Thread(target=lambda: outcome.update(result=run()))
    runner.start()
    events = _disturb(client, ready, runner.is_alive) if ready is not None else []
    runner.join(timeout=240)
    assert not runner.is_alive(), "the sweep should finish"
    client.wait_for_workers(2, timeout=60)
    return outcome["result"], events


def _compare(calm: SearchOutcome, rough: SearchOutcome, events: list[str]) -> None:
    assert [e.split()[0] for e in events] == ["SIGTERM", "SIGKILL"], events
    states = sorted(r.state for r in rough.results)
    assert states == sorted(r.state for r in calm.results) == ["COMPLETE"] * len(calm.results)
    assert abs((rough.complete()[0].value or 0) - (calm.complete()[0].value or 0)) <= ACC_TOLERANCE
    assert calm.redone_unit_seconds == 0.0
    assert rough.redone_unit_seconds > 0.0  # the SIGKILLed unit or trial was done again


@pytest.mark.slow
def test_mop_sweep_survives_preempted_and_killed_workers(
    small_manifest: str, tmp_path: Path, volatile_client: Any
) -> None:
    cfg = SearchConfig(
        n_trials=2, epochs=3, strategy="mop", model_slots=2, space=SPACE, pruner="none", sampler="random"
    )

    def run(name: str) -> Callable[[], SearchOutcome]:
        return lambda: run_search_with_executor(
            cfg,
            small_manifest,
            name,
            str(tmp_path / f"{name}.log"),
            str(tmp_path / name),
            volatile_client,
            checkpoint_root=str(tmp_path / name / "ckpt"),
        )

    calm, _ = _sweep(run("calm"), volatile_client)
    # disturbed in the second epoch, when the workers are warm and training
    rough, events = _sweep(
        run("rough"), volatile_client, lambda p: all("-e1-" in k for keys in p.values() for k in keys)
    )
    _compare(calm, rough, events)
    records = [r for recs in rough.epoch_records.values() for r in recs]
    # the unit stopped by the notice went on from its batch, not from the start of its sub-epoch
    assert any(r["resumed_at_batch"] > 0 for r in records), records
    # every model still visited every partition once per epoch
    assert sorted(len(recs) for recs in rough.epoch_records.values()) == [4, 4, 4]


@pytest.mark.slow
def test_task_sweep_survives_preempted_and_killed_workers(
    small_manifest: str, tmp_path: Path, volatile_client: Any
) -> None:
    cfg = SearchConfig(n_trials=2, epochs=3, n_workers=2, space=SPACE, pruner="none", sampler="random")

    def run(name: str) -> Callable[[], SearchOutcome]:
        return lambda: run_search(
            cfg, small_manifest, name, str(tmp_path / f"{name}.log"), str(tmp_path / name), volatile_client
        )

    calm, _ = _sweep(run("calm"), volatile_client)
    first = [Path(checkpoint_folder(str(tmp_path / "rough"), "rough", n)) / CHECKPOINT_FILE for n in (0, 1)]
    # disturbed once both trials have checkpointed their first epoch
    rough, events = _sweep(run("rough"), volatile_client, lambda p: all(c.exists() for c in first))
    _compare(calm, rough, events)
    assert all([h["epoch"] for h in r.history] == [0, 1, 2] for r in rough.results)
    assert any(r.resumed_after_notice_at_step is not None for r in rough.results)  # the notice's checkpoint
