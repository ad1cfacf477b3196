"""Data parallelism inside one model: Lightning DDP over W processes per configuration.

Each configuration is one ``torchrun`` job in its own process group (never ``strategy="ddp"``
inside an Airflow task or a Dask worker: it would re-run the wrong program). The caller sees
each epoch's report as rank 0 writes it and can stop the job between epochs.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from training.executors.base import Controller, EpochReport, Executor, ModelOutcome, TrainAll
from training.executors.units import DataRef, ModelSpec

log = logging.getLogger(__name__)


class DDPExecutor(Executor):
    """Models one after another, each trained by W DDP processes (gloo on CPU, nccl on GPU)."""

    name = "ddp"

    def __init__(
        self,
        data: DataRef,
        world_size: int = 2,
        checkpoint_root: str = "",
        bf16_compress: bool = False,
        epoch_timeout_s: float = 600.0,
    ) -> None:
        super().__init__(data, checkpoint_root)
        self.world_size = world_size
        self.bf16_compress = bf16_compress
        self.epoch_timeout_s = epoch_timeout_s

    def run(
        self, models: Sequence[ModelSpec], epochs: int, controller: Controller | None = None
    ) -> dict[str, ModelOutcome]:
        ctl = controller or TrainAll()
        return self._one_model_at_a_time(models, ctl, lambda spec: self._train_one(spec, epochs, ctl))

    def _train_one(self, spec: ModelSpec, epochs: int, controller: Controller) -> ModelOutcome:
        outcome = ModelOutcome(spec)
        with tempfile.TemporaryDirectory(prefix=f"ddp-{spec.model_id}-") as tmp:
            out = Path(tmp)
            batch = int(spec.params["batch_size"])
            job: dict[str, Any] = {
                "spec": asdict(spec),
                "data": asdict(self.data),
                "epochs": epochs,
                "out_dir": str(out),
                # The configuration's batch size is the global batch: each rank takes its share.
                "batch_per_rank": max(1, batch // self.world_size),
                "bf16_compress": self.bf16_compress,
            }
            found = self.load_checkpoint(spec.model_id)
            if found is not None:  # resume from the latest epoch checkpoint (weights; a fresh optimizer)
                state, meta = found
                (out / "resume.safetensors").write_bytes(state)
                job["resume_state"] = str(out / "resume.safetensors")
                job["start_epoch"] = int(meta.get("epoch", -1)) + 1
                log.info(
                    "ddp: %s resumes at epoch %d from its checkpoint", spec.model_id, job["start_epoch"] + 1
                )
                if job["start_epoch"] >= epochs:
                    outcome.state = state
                    return outcome
            (out / "job.json").write_text(json.dumps(job))
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={self.world_size}",
                "-m",
                "training.executors.ddp_main",
                "--job",
                str(out / "job.json"),
            ]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
            log.info("ddp: %s starts on %d processes", spec.model_id, self.world_size)
            started = time.time()
            proc = subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
            )
            seen, last_progress = 0, time.monotonic()
            try:
                while True:
                    seen, new = self._read_reports(out, seen)
                    for report in new:
                        last_progress = time.monotonic()
                        if outcome.stopped_early:  # trained before the job saw STOP: not reported
                            continue
                        outcome.history.append(report)
                        keep = controller.on_epoch_end(report)
                        log.info(
                            "ddp: %s epoch %d/%d val_acc=%.4f",
                            spec.model_id,
                            report.epoch + 1,
                            epochs,
                            report.val_acc,
                        )
                        if not keep:
                            (out / "STOP").touch()
                            outcome.stopped_early = True
                    if proc.poll() is not None:
                        break
                    if time.monotonic() - last_progress > self.epoch_timeout_s:
                        raise TimeoutError(f"no epoch finished within {self.epoch_timeout_s:.0f}s")
                    time.sleep(0.2)
                seen, new = self._read_reports(out, seen)
                for report in new:
                    if outcome.stopped_early:
                        break
                    outcome.history.append(report)
                    if not controller.on_epoch_end(report):
                        outcome.stopped_early = True
                if proc.returncode != 0:
                    tail = proc.stdout.read().decode(errors="replace")[-3000:] if proc.stdout else ""
                    outcome.error = f"torchrun exited with {proc.returncode}: {tail}"
                    log.warning("ddp: %s failed: exit code %d", spec.model_id, proc.returncode)
            except TimeoutError as exc:
                outcome.error = f"TimeoutError: {exc}"
                log.warning("ddp: %s timed out; stopping its process group", spec.model_id)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
                    try:
                        proc.wait(timeout=20)
                    except subprocess.TimeoutExpired:
                        os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait()
            checkpoint = out / "last.safetensors"
            if checkpoint.exists():
                outcome.state = checkpoint.read_bytes()
                outcome.checkpoint_uri = self.save_checkpoint(spec.model_id, outcome.state)
            self.records.append(
                {
                    "model": spec.model_id,
                    "worker": f"ddp x{self.world_size}",
                    "start": started,
                    "end": time.time(),
                    "epochs": len(outcome.history),
                }
            )
        return outcome

    @staticmethod
    def _read_reports(out: Path, seen: int) -> tuple[int, list[EpochReport]]:
        path = out / "epochs.jsonl"
        if not path.exists():
            return seen, []
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        new = [json.loads(line) for line in lines[seen:]]
        reports = [
            EpochReport(
                str(r.get("model_id", "")),
                int(r["epoch"]),
                float(r["val_acc"]),
                float(r["train_loss"]),
                float(r["lr"]) if r.get("lr") is not None else None,
            )
            for r in new
        ]
        return len(lines), reports
