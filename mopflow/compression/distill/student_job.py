"""The students trained on the Dask workers, from the shards.

The distilled student (on the transfer blocks, :mod:`mopflow.compression.distill.transfer_shards`) and its
hard-label twin (on the real training shards) are two Dask tasks, run side by side on two
workers. Each reads its rows all at once when they fit ``MOPFLOW_DISTILL_MEMORY_MB`` or streams
them, validates after every epoch on the validation shards one at a time, and writes the trained
student as a bundle (its training history in the bundle's metadata). The task process receives
the bundle's URI and the history, and every epoch as it ends (a Dask event, shown and logged
there as if the student trained in the task process). A bundle already at the output URI (a
rerun of the stage) is reused.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mopflow.compression.config import DistillConfig
from mopflow.compression.distill.distill import StudentPlan
from mopflow.compression.distill.transfer_shards import TransferSet
from mopflow.training.compute.devices import CPU, DeviceSpec

log = logging.getLogger(__name__)

EPOCH_TOPIC = "mopflow-distill-epoch"  # Dask event topic: the students' epochs, worker -> task process


@dataclass(frozen=True)
class StudentJob:
    """What a worker needs to train one student: its plan, the settings and the data's place."""

    plan: StudentPlan
    cfg: DistillConfig
    manifest_uri: str
    seed: int
    device: DeviceSpec = CPU
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    bundle_extra: Mapping[str, Any] = field(default_factory=dict)  # kept in the students' bundles


@dataclass(frozen=True)
class TrainedStudent:
    """A student trained on a worker: where its bundle is and its per-epoch history."""

    bundle_uri: str
    history: list[dict[str, float]]

    def module(self, storage_options: Mapping[str, Any] | None = None) -> Any:
        """The student itself (a plain classifier returning logits), on the CPU."""
        from mopflow.training.models.bundle import load_bundle

        return load_bundle(self.bundle_uri, storage_options).module.members[0].eval()


def train_student_job(
    job: StudentJob, transfer: TransferSet | None, epochs: int | None, out_uri: str
) -> TrainedStudent:
    """On a worker: train ``job``'s student on ``transfer`` (soft targets) or, with ``None``, on
    the real training shards alone (hard labels) for ``epochs``; save it at ``out_uri``."""
    import torch

    from mopflow.base import storage
    from mopflow.base.hosts import storage_options_here
    from mopflow.compression.distill.distill import fit_student
    from mopflow.compression.distill.transfer_shards import student_rows, train_split_rows
    from mopflow.training.data import load_manifest, split_shards
    from mopflow.training.models.bundle import SPEC_NAME, load_bundle, save_bundle

    so = storage_options_here(job.storage_options)  # this worker's own, when it sets them
    if storage.exists(storage.join(out_uri, SPEC_NAME), so):
        saved = load_bundle(out_uri, so).spec["extra"]
        return TrainedStudent(out_uri, list(saved["history"]))
    torch.set_num_threads(1)  # a small model: more threads only contend with the other student
    manifest = load_manifest(job.manifest_uri, so)
    norm = manifest["normalization"]
    soft = transfer is not None
    rows = student_rows(transfer, so) if transfer is not None else train_split_rows(job.manifest_uri, so)
    model, history = fit_student(
        job.plan,
        job.cfg,
        rows,
        lambda: split_shards(job.manifest_uri, "validation", so),
        norm["mean"],
        norm["std"],
        job.seed,
        soft,
        epochs,
        job.device,
        on_epoch=_relay_epoch,
    )
    extra = {**job.bundle_extra, "history": history, "soft_targets": soft, "epochs": len(history)}
    save_bundle(out_uri, [model], [job.plan.arch], manifest["feature_columns"], extra, so)
    return TrainedStudent(out_uri, history)


def _relay_epoch(event: Mapping[str, Any]) -> None:
    """Send an epoch to the task process (as a Dask event); outside a worker, report it here."""
    from distributed import get_worker

    from mopflow.compression.distill.distill import report_epoch

    try:
        worker = get_worker()
    except ValueError:
        report_epoch(event)
        return
    worker.log_event(EPOCH_TOPIC, dict(event))


def train_students_on_workers(
    client: Any,
    job: StudentJob,
    transfer: TransferSet,
    baseline_epochs: int,
    out_uris: tuple[str, str],
) -> tuple[TrainedStudent, TrainedStudent]:
    """The distilled student and the hard-label baseline, trained at once as two Dask tasks (on
    workers with the resources ``job.device`` needs); returns them in that order. If one fails
    (a damaged block raises naming it), the other is cancelled. A worker lost mid-training has its
    task run again on another worker, from the first epoch."""
    from uuid import uuid4

    from mopflow.compression.distill.distill import report_epoch

    runs = [(transfer, None, "soft"), (None, baseline_epochs, "hard")]
    client.subscribe_topic(EPOCH_TOPIC, lambda event: report_epoch(event[1]))
    try:
        futures = [
            client.submit(
                train_student_job,
                job,
                rows,
                epochs,
                uri,
                pure=False,
                key=f"distill-student-{kind}-{uuid4().hex[:8]}",
                resources=job.device.resources() or None,
            )
            for (rows, epochs, kind), uri in zip(runs, out_uris, strict=True)
        ]
        try:
            soft_student, hard_student = client.gather(futures)
        except BaseException:
            client.cancel(futures)  # one failed: the other's work would be thrown away
            raise
    finally:
        client.unsubscribe_topic(EPOCH_TOPIC)
    return soft_student, hard_student


def train_candidates_on_workers(
    client: Any, job: StudentJob, transfer: TransferSet, plans: Sequence[tuple[StudentPlan, str]]
) -> list[TrainedStudent]:
    """Candidates of a student search distilled at once, one Dask task each (``plans``: each
    candidate's plan and bundle URI; a bundle already there is reused); in that order. If one
    fails, the others are cancelled."""
    from dataclasses import replace
    from uuid import uuid4

    futures = [
        client.submit(
            train_student_job,
            replace(job, plan=plan),
            transfer,
            None,
            uri,
            pure=False,
            key=f"distill-candidate-{uuid4().hex[:8]}",
            resources=job.device.resources() or None,
        )
        for plan, uri in plans
    ]
    try:
        return list(client.gather(futures))
    except BaseException:
        client.cancel(futures)
        raise
