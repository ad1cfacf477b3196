"""The students trained on the Dask workers: bundles, histories, epochs relayed, reruns reused."""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from mopflow.base import progress
from mopflow.compression.config import DistillConfig
from mopflow.compression.distill.distill import plan_student
from mopflow.compression.distill.student_job import StudentJob, train_student_job, train_students_on_workers
from mopflow.compression.distill.transfer_shards import build_transfer_set
from mopflow.training.data import load_manifest, load_split
from mopflow.training.models.bundle import load_bundle
from mopflow.training.models.families import DataSpec
from mopflow.training.models.metrics import top1_accuracy

CFG = DistillConfig(epochs=3, munge_multiplier=1, temperature=2.0).resolved("table")


def _job(manifest_uri: str, teacher_uri: str) -> StudentJob:
    data = DataSpec.from_manifest(load_manifest(manifest_uri))
    plan = plan_student(CFG, load_bundle(teacher_uri).num_params(), data)
    return StudentJob(plan, CFG, manifest_uri, seed=0, bundle_extra={"teacher": teacher_uri})


def test_both_students_train_on_the_workers_and_report_every_epoch(
    tmp_path: Path,
    dask_client: Any,
    small_manifest: str,
    teacher_uri: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    transfer = build_transfer_set(
        dask_client, small_manifest, teacher_uri, False, CFG, 0, str(tmp_path / "t")
    )
    job = _job(small_manifest, teacher_uri)
    outputs = (str(tmp_path / "student"), str(tmp_path / "hard"))
    seen: list[dict[str, Any]] = []
    unsubscribe = progress.subscribe(seen.append)
    try:
        with caplog.at_level(logging.INFO, logger="mopflow.compression.distill.distill"):
            soft, hard = train_students_on_workers(dask_client, job, transfer, 5, outputs)
    finally:
        unsubscribe()
    assert (soft.bundle_uri, hard.bundle_uri) == outputs
    assert len(soft.history) == 3 and len(hard.history) == 5
    # the soft-target student's epochs reach this process's progress view; both are logged here
    assert [e["epoch"] for e in seen if e["kind"] == "distill_epoch"] == [1, 2, 3]
    assert "soft-target student epoch 3/3" in caplog.text and "hard-label student epoch 5/5" in caplog.text
    bundle = load_bundle(soft.bundle_uri)
    assert bundle.spec["extra"]["teacher"] == teacher_uri and bundle.spec["extra"]["soft_targets"] is True
    x_val, y_val = load_split(small_manifest, "validation")
    with torch.no_grad():
        scores = soft.module()(torch.from_numpy(x_val))
    assert top1_accuracy(scores, y_val) == pytest.approx(soft.history[-1]["val_acc"])
    assert soft.history[-1]["val_acc"] > 0.15  # chance is 0.1


def test_a_rerun_reuses_a_trained_student(tmp_path: Path, small_manifest: str, teacher_uri: str) -> None:
    job = _job(small_manifest, teacher_uri)
    out = str(tmp_path / "hard")
    first = train_student_job(job, None, 1, out)
    written = os.stat(tmp_path / "hard" / "spec.json").st_mtime_ns
    again = train_student_job(job, None, 1, out)
    assert again == first
    assert os.stat(tmp_path / "hard" / "spec.json").st_mtime_ns == written


def test_a_damaged_transfer_block_fails_the_student_naming_it(
    tmp_path: Path, dask_client: Any, small_manifest: str, teacher_uri: str
) -> None:
    from mopflow.training.data import ShardIntegrityError

    transfer = build_transfer_set(
        dask_client, small_manifest, teacher_uri, False, CFG, 0, str(tmp_path / "t")
    )
    damaged = transfer.blocks[-1].shard
    Path(damaged).write_bytes(b"torn")
    with pytest.raises(ShardIntegrityError, match=damaged):
        train_students_on_workers(
            dask_client,
            _job(small_manifest, teacher_uri),
            transfer,
            1,
            (str(tmp_path / "s"), str(tmp_path / "h")),
        )
    assert not (tmp_path / "s").exists()  # nothing half-written


@pytest.mark.slow
def test_a_student_whose_worker_is_killed_is_trained_again_on_the_restarted_worker(
    tmp_path: Path, small_manifest: str, teacher_uri: str
) -> None:
    """Fault: the worker training the students is SIGKILLed after the first epoch. Expected: the
    nanny restarts it, Dask runs the lost task again there from the first epoch, and both students
    end with their full histories."""
    import signal
    import threading

    import dask

    from mopflow.training.compute.cluster import dask_client

    epochs, events, outcome = 12, [], {}
    first_epoch = threading.Event()

    def on_event(event: dict[str, Any]) -> None:
        if event["kind"] == "distill_epoch":
            events.append(event["epoch"])
            first_epoch.set()

    lost_worker_wait = {"distributed.deploy.lost-worker-timeout": "120s"}
    with dask.config.set(lost_worker_wait), dask_client("", 1) as client:
        transfer = build_transfer_set(client, small_manifest, teacher_uri, False, CFG, 0, str(tmp_path / "t"))
        job = replace(_job(small_manifest, teacher_uri), cfg=CFG.model_copy(update={"epochs": epochs}))
        outputs = (str(tmp_path / "student"), str(tmp_path / "hard"))

        def train() -> None:
            outcome["students"] = train_students_on_workers(client, job, transfer, 2, outputs)

        unsubscribe = progress.subscribe(on_event)
        runner = threading.Thread(target=train)
        try:
            runner.start()
            assert first_epoch.wait(timeout=180), "the student should have finished an epoch"
            (pid,) = client.run(os.getpid).values()
            os.kill(pid, signal.SIGKILL)  # the nanny restarts the worker; the scheduler reschedules
            runner.join(timeout=300)
        finally:
            unsubscribe()
        assert not runner.is_alive()
    soft, hard = outcome["students"]
    assert len(soft.history) == epochs and len(hard.history) == 2
    assert events.count(1) >= 2 and events[-1] == epochs  # started over, then ran to the end
