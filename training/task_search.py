"""The ``task`` coordinator: asks for trials, trains each on one Dask worker, tells results.

Ask-and-tell keeps sampling and bookkeeping in one process; workers only report per-epoch
values (for pruning) to the shared storage. At most ``n_workers`` trials run at once, and a
worker runs one trial at a time (one thread per worker process).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import optuna

from infra import storage
from training.config import SearchConfig
from training.devices import CPU, DeviceSpec
from training.preempt import lost_spans, redone_seconds, task_story
from training.scaling import round_scaling, with_spot_replay
from training.search import (
    STALE_CHECK_S,
    SearchOutcome,
    WarmStart,
    checkpoint_folder,
    fail_orphans,
    fail_stale_heartbeats,
    open_study,
    register_preemption,
    result_detail,
    retried_trial,
    tell_result,
)
from training.space import sample_params
from training.trial import TrialResult, TrialSpec, train_trial

log = logging.getLogger(__name__)


@with_spot_replay
def run_search(
    cfg: SearchConfig,
    manifest_uri: str,
    study_name: str,
    storage_url: str,
    artifact_root: str,
    client: Any,
    storage_options: Mapping[str, Any] | None = None,
    on_trial_done: Callable[[TrialResult], None] | None = None,
    min_complete: int = 1,
    warm_start: WarmStart | None = None,
    device: DeviceSpec = CPU,
) -> SearchOutcome:
    """Run (or resume) the study until ``cfg.n_trials`` trials have finished or time runs out.
    Each trial trains on ``device`` (a GPU trial only on a worker with the ``GPU`` resource).

    If pruning left fewer than ``min_complete`` COMPLETE trials (the ensemble needs its
    members), extra trials are run with pruning off until there are enough (at most
    ``2 * min_complete`` extra attempts).
    """
    study, space, already, results = open_study(
        cfg, manifest_uri, study_name, storage_url, storage_options, warm_start
    )
    if already:
        log.info(
            "search: study %s already has %d finished trials; %d to go",
            study_name,
            len(already),
            max(cfg.n_trials - len(already), 0),
        )
    deadline = time.monotonic() + cfg.timeout_minutes * 60 if cfg.timeout_minutes else None
    started = time.monotonic()
    register_preemption(client)
    scaling = round_scaling(cfg, client)  # worker_schedule: n_j workers per round of trials
    try:  # show the workers' per-epoch progress in this (task) log
        client.forward_logging("training", level=logging.INFO)
    except Exception:  # an older scheduler without log forwarding still trains
        log.debug("worker log forwarding unavailable")

    def resume_folder(trial: optuna.trial.Trial) -> str:
        retried = retried_trial(trial)
        return "" if retried is None else checkpoint_folder(artifact_root, study_name, retried)

    def run_batch(count: int, pruner: str, respect_deadline: bool) -> None:
        """Ask for ``count`` trials, keeping at most ``n_workers`` in flight, and tell their results."""
        from distributed import wait

        in_flight: dict[Any, optuna.trial.Trial] = {}
        asked = 0
        while asked < count or in_flight:
            while asked < count and scaling.may_start(len(in_flight)):
                if respect_deadline and deadline is not None and time.monotonic() > deadline:
                    log.info(
                        "search: time budget of %.1f min reached; not starting more trials",
                        cfg.timeout_minutes,
                    )
                    count = asked
                    break
                trial = study.ask()
                params = sample_params(space, trial)
                spec = TrialSpec(
                    number=trial.number,
                    trial_id=trial._trial_id,
                    params=params,
                    epochs=cfg.epochs,
                    seed=cfg.seed * 1000 + trial.number,
                    manifest_uri=manifest_uri,
                    bundle_uri=storage.join(
                        artifact_root, "studies", study_name, f"trial-{trial.number:04d}"
                    ),
                    study_name=study_name,
                    optuna_storage=storage_url,
                    storage_options=dict(storage_options or {}),
                    pruner=pruner,
                    min_resource=cfg.min_resource,
                    checkpoint_uri=checkpoint_folder(artifact_root, study_name, trial.number),
                    resume_from=resume_folder(trial),
                    device=device,
                )
                future = client.submit(
                    train_trial,
                    spec,
                    pure=False,
                    key=f"trial-{study_name}-{trial.number}",
                    resources=device.resources() or None,
                )
                in_flight[future] = trial
                asked += 1
                scaling.started()
                log.info("search: started trial %d %s", trial.number, params)
            if not in_flight:
                break
            try:
                done, _ = wait(list(in_flight), timeout=STALE_CHECK_S, return_when="FIRST_COMPLETED")
            except TimeoutError:
                done = set()
            stale = fail_stale_heartbeats(study)
            for future, trial in list(in_flight.items()):
                if trial.number in stale and future not in done:
                    # its retry (same params, resumed from its checkpoint) is asked for next
                    future.cancel()
                    del in_flight[future]
                    asked -= 1
            for future in done:
                if future not in in_flight:
                    continue
                trial = in_flight.pop(future)
                try:
                    result: TrialResult = future.result()
                except Exception as exc:  # the worker died or the task could not run
                    result = TrialResult(
                        number=trial.number,
                        trial_id=trial._trial_id,
                        params=sample_params(space, trial),
                        state="FAIL",
                        value=None,
                        history=[],
                        bundle_uri=None,
                        error=f"{type(exc).__name__}: {exc}",
                    )
                # attempts lost with their worker (spot notice or kill), less what checkpoints saved
                result.redone_s = redone_seconds(
                    lost_spans(task_story(client, str(future.key))), result.saved_at
                )
                future.release()  # the result is here now: the worker need not keep it
                if result.redone_s > 0:
                    log.warning(
                        "search: trial %d redid %.2fs of work lost to preempted or killed workers",
                        result.number,
                        result.redone_s,
                    )
                if not tell_result(study, trial, result):
                    asked -= 1  # it was failed for a stale heartbeat: its queued retry runs instead
                    continue
                results.append(result)
                log.info(
                    "search: trial %d %s %s in %.1fs — %d/%d finished, %d running, %.0fs elapsed",
                    result.number,
                    result.state,
                    result_detail(result),
                    result.duration_s,
                    len(results),
                    cfg.n_trials,
                    len(in_flight),
                    time.monotonic() - started,
                )
                if on_trial_done is not None:
                    on_trial_done(result)

    run_batch(max(cfg.n_trials - len(already), 0), cfg.pruner, respect_deadline=True)
    fail_orphans(study)
    extra_attempts = 0
    while True:
        complete = sum(1 for r in results if r.state == "COMPLETE")
        missing = min_complete - complete
        if missing <= 0 or extra_attempts >= 2 * min_complete:
            break
        log.warning(
            "search: only %d COMPLETE trial(s), %d needed; running %d more without pruning",
            complete,
            min_complete,
            missing,
        )
        run_batch(missing, "none", respect_deadline=False)
        extra_attempts += missing
    fail_orphans(study)
    return SearchOutcome(
        study_name=study_name,
        storage_url=storage_url,
        results=sorted(results, key=lambda r: r.number),
        worker_rounds=tuple(scaling.history),
    )
