"""The search brain is live under the executor strategies: Optuna hears of every trial the moment it
finishes, so the sampler learns from it and the pruner compares with it while the sweep goes on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest

from mopflow.training.compute.workers import cluster_workers
from mopflow.training.search.config import SearchConfig
from mopflow.training.search.space import optuna_params_for
from mopflow.training.search.sweep import run_search_with_executor
from tests.spaces import cnn_8x2_space

GOOD_LR, BAD_LR = 0.02, 1e-7  # the bad rate leaves a model at chance (0.1) for every epoch
SPACE = cnn_8x2_space(
    {
        "lr": {"type": "categorical", "choices": [GOOD_LR, BAD_LR]},
        "batch_size": {"type": "categorical", "choices": [16]},
    }
)


class SpySampler(optuna.samplers.BaseSampler):
    """The study's real sampler, noting how many COMPLETE trials it was given at each new trial."""

    def __init__(self, inner: optuna.samplers.BaseSampler) -> None:
        self.inner = inner
        self.complete_seen: list[int] = []

    def before_trial(self, study: optuna.Study, trial: Any) -> None:
        states = (optuna.trial.TrialState.COMPLETE,)
        self.complete_seen.append(len(study.get_trials(deepcopy=False, states=states)))
        self.inner.before_trial(study, trial)

    def infer_relative_search_space(self, study: optuna.Study, trial: Any) -> dict[str, Any]:
        return self.inner.infer_relative_search_space(study, trial)

    def sample_relative(
        self, study: optuna.Study, trial: Any, search_space: dict[str, Any]
    ) -> dict[str, Any]:
        return self.inner.sample_relative(study, trial, search_space)

    def sample_independent(self, study: optuna.Study, trial: Any, name: str, distribution: Any) -> Any:
        return self.inner.sample_independent(study, trial, name, distribution)

    def after_trial(self, study: optuna.Study, trial: Any, state: Any, values: Any) -> None:
        self.inner.after_trial(study, trial, state, values)


def _sweep(cfg: SearchConfig, manifest: str, tmp_path: Path, client: Any, **kw: Any) -> Any:
    return run_search_with_executor(
        cfg,
        manifest,
        "live",
        str(tmp_path / "journal.log"),
        str(tmp_path / "artifacts"),
        client,
        checkpoint_root=str(tmp_path / "ckpt"),
        **kw,
    )


@pytest.mark.parametrize("ask_ahead", [False, True])
def test_a_mop_sweep_tells_optuna_each_trial_when_it_finishes(
    small_manifest: str, dask_client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ask_ahead: bool
) -> None:
    """Expected: each trial is told as its model finishes, its bundle written; without asking
    ahead the sampler proposes the second cohort from the first's results, with it (the default)
    the second cohort is asked as the first's last epoch starts, before any trial is told."""
    import mopflow.training.search.study as search

    spies: list[SpySampler] = []

    def spying(cfg: SearchConfig, space: Any = None) -> SpySampler:
        spies.append(SpySampler(real_make_sampler(cfg, space)))
        return spies[-1]

    real_make_sampler = search.make_sampler
    monkeypatch.setattr(search, "make_sampler", spying)
    cfg = SearchConfig(
        n_trials=4,
        epochs=2,
        strategy="mop",
        model_slots=2,
        space=SPACE,
        sampler="tpe",
        pruner="none",
        mop_ask_ahead=ask_ahead,
    )
    logged: list[tuple[int, int]] = []  # (trial, trials asked by then)
    storage = str(tmp_path / "journal.log")

    def on_trial_done(result: Any) -> None:
        asked = len(optuna.load_study(study_name="live", storage=search.make_storage(storage)).trials)
        logged.append((result.number, asked))

    outcome = _sweep(cfg, small_manifest, tmp_path, dask_client, on_trial_done=on_trial_done)
    assert [r.state for r in outcome.results] == ["COMPLETE"] * 4
    # Without asking ahead TPE was given the first two trials, COMPLETE, before it sampled the
    # last two, and the first two trials' runs were written before the last two were asked.
    seen, asked = ([0, 0, 0, 0], 4) if ask_ahead else ([0, 0, 2, 2], 2)
    assert spies[0].complete_seen == seen
    assert sorted(logged)[:2] == [(0, asked), (1, asked)] and len(logged) == 4
    for result in outcome.results:  # each bundle was written when its trial was told
        assert result.bundle_uri and Path(result.bundle_uri).exists()
    # the workers' seconds inside the batch loops, apart from what each unit costs around them
    units = [r for records in outcome.epoch_records.values() for r in records]
    assert all(0 < r["loop_s"] < r["end"] - r["start"] for r in units)
    assert sum("val_s" in r for r in units) == 4 * 2  # each model's epoch ends with its validation
    assert outcome.busy_s == pytest.approx(sum(r["loop_s"] + r.get("val_s", 0.0) for r in units))
    assert outcome.workers == 2 and 0 < outcome.utilisation < 1  # type: ignore[operator]


def _enqueue(storage: str, cfg: SearchConfig, lrs: list[float]) -> None:
    from mopflow.training.search.study import make_storage

    study = optuna.create_study(study_name="live", storage=make_storage(storage), direction="maximize")
    base = {"family": "cnn", "width": 8, "depth": 2, "batch_size": 16}
    for lr in lrs:
        study.enqueue_trial(optuna_params_for(cfg.search_space(), {**base, "lr": lr}))


def _median_sweep(strategy: str, manifest: str, tmp_path: Path, client: Any, epochs: int = 4) -> Any:
    """Two good trials, then two that cannot learn: the median pruner stops those, comparing them
    with the good ones, which were told COMPLETE while the sweep went on. Under ``task`` one trial
    runs at a time: with two, a bad trial could start beside a good one still training, and be
    judged at its third epoch before that good one was COMPLETE (the pruner then waits an epoch)."""
    cfg = SearchConfig(
        n_trials=4,
        epochs=epochs,
        strategy=strategy,
        parallel_trials=1 if strategy == "task" else 2,
        model_slots=2,
        ddp_world_size=2,
        space=SPACE,
        sampler="random",
        pruner="median",
        min_resource=3,  # judged from the third epoch on: the good ones have learned by then
    )
    _enqueue(str(tmp_path / "journal.log"), cfg, [GOOD_LR, GOOD_LR, BAD_LR, BAD_LR])
    outcome = _sweep(cfg, manifest, tmp_path, client)
    states = {r.number: (r.state, r.pruned_epoch, len(r.history)) for r in outcome.results}
    assert states[0][0] == states[1][0] == "COMPLETE", states
    for bad in (2, 3):
        state, pruned_epoch, epochs = states[bad]
        assert state == "PRUNED" and pruned_epoch == 2, states  # the first epoch it could be judged
        assert epochs == pruned_epoch + 1, states  # it trained no epoch past the decision
    return outcome


def test_the_median_pruner_prunes_under_mop(small_manifest: str, dask_client: Any, tmp_path: Path) -> None:
    _median_sweep("mop", small_manifest, tmp_path, dask_client)


def test_the_median_pruner_prunes_under_task_one_chain_a_trial(
    small_manifest: str, dask_client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a pruner that may stop a model after any epoch, ``task`` trains each trial's epochs
    in one chain and the pruner decides as each is heard: a pruned trial's chain is told to stop
    at its next batch, and its history and checkpoint end at the epoch it was pruned after."""
    from mopflow.training.executors import task_run
    from mopflow.training.trainable.state import read_meta

    chains: list[str] = []
    ends: list[str] = []
    submit, collect = task_run.TaskRun._submit_now, task_run.TaskRun.collect

    def submitting(run: Any, mid: str) -> None:
        chains.append(mid)
        submit(run, mid)

    def collecting(run: Any, future: Any) -> None:
        error = future.exception() if future.status == "error" else None
        ends.append(type(error).__name__ if error is not None else "finished")
        collect(run, future)

    monkeypatch.setattr(task_run.TaskRun, "_submit_now", submitting)
    monkeypatch.setattr(task_run.TaskRun, "collect", collecting)
    # pruned after epoch 3 of 6: three more epochs would have to run before the chain ended alone
    outcome = _median_sweep("task", small_manifest, tmp_path, dask_client, epochs=6)
    assert sorted(chains) == sorted(set(chains)) and len(chains) == 4, chains  # one Dask task a trial
    assert ends.count("ChainStopped") == 2 and ends.count("finished") == 2, ends
    for bad in (2, 3):
        checkpoint = tmp_path / "ckpt" / f"trial-{bad:04d}" / "last.safetensors"
        assert read_meta(checkpoint.read_bytes())["epoch"] == 2
        assert not list(checkpoint.parent.glob("staged-*"))  # what it staged past the stop is gone
    assert [len(r.history) for r in outcome.results] == [6, 6, 3, 3]


@pytest.mark.slow
def test_the_median_pruner_prunes_under_ddp(small_manifest: str, dask_client: Any, tmp_path: Path) -> None:
    _median_sweep("ddp", small_manifest, tmp_path, dask_client)


def test_pruning_that_leaves_too_few_members_adds_unpruned_trials_under_mop(
    small_manifest: str, dask_client: Any, tmp_path: Path
) -> None:
    cfg = SearchConfig(
        n_trials=3,
        epochs=4,
        strategy="mop",
        model_slots=2,
        space=SPACE,
        sampler="random",
        pruner="median",
        min_resource=3,
    )
    # Two good trials finish; the third cannot learn and is pruned; the ensemble wants 3 members.
    _enqueue(str(tmp_path / "journal.log"), cfg, [GOOD_LR, GOOD_LR, BAD_LR, GOOD_LR])
    outcome = _sweep(cfg, small_manifest, tmp_path, dask_client, min_complete=3)
    states = [r.state for r in outcome.results]
    assert states == ["COMPLETE", "COMPLETE", "PRUNED", "COMPLETE"], states
    assert len(outcome.results[3].history) == 4  # the extra trial ran unpruned to the end


class CoordinatorKilled(RuntimeError):
    """Stands for the search task's process dying mid-sweep."""


def test_a_restarted_mop_coordinator_loses_at_most_the_sub_epochs_in_flight(
    small_manifest: str, dask_client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mopflow.training.search.controller import SearchController

    cfg = SearchConfig(
        n_trials=2, epochs=4, strategy="mop", model_slots=2, space=SPACE, sampler="random", pruner="none"
    )
    _enqueue(str(tmp_path / "journal.log"), cfg, [GOOD_LR, GOOD_LR])
    real = SearchController.on_epoch_end
    heard: list[Any] = []

    def dies_at_the_fourth_report(self: Any, report: Any) -> bool:
        heard.append(report)
        keep = real(self, report)
        if len(heard) == 4:  # both models finished their second epoch
            raise CoordinatorKilled("the search task's process died")
        return keep

    monkeypatch.setattr(SearchController, "on_epoch_end", dies_at_the_fourth_report)
    with pytest.raises(CoordinatorKilled):
        _sweep(cfg, small_manifest, tmp_path, dask_client)
    monkeypatch.setattr(SearchController, "on_epoch_end", real)
    outcome = _sweep(cfg, small_manifest, tmp_path, dask_client)  # the restarted search task
    # The trials left RUNNING are retried as trials 2 and 3, each resuming its model at epoch 3.
    assert [(r.number, r.state) for r in outcome.results] == [(2, "COMPLETE"), (3, "COMPLETE")]
    assert all([h["epoch"] for h in r.history] == [0, 1, 2, 3] for r in outcome.results)
    units = sum(len(records) for records in outcome.epoch_records.values())
    # 2 models x the 2 epochs left x 2 partitions at most (fewer when a model had gone on into its
    # third epoch): nothing checkpointed before the death is trained again
    assert units <= 2 * 2 * 2


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["mop", "ddp"])
@pytest.mark.parametrize("pruner", ["asha", "successive_halving", "hyperband"])
def test_rung_pruners_prune_live_and_nothing_trains_past_a_decision(
    pruner: str, strategy: str, small_manifest: str, dask_client: Any, tmp_path: Path
) -> None:
    """Two good trials, then three that cannot learn, judged at the first epoch: each pruner
    prunes in a real sweep, a pruned trial's history, state and checkpoint end at the epoch it
    was judged on, and an ASHA promotion goes on from that checkpoint at the next epoch."""
    from mopflow.training.search.rungs import PROMOTED_ATTR
    from mopflow.training.search.study import make_storage
    from mopflow.training.trainable.state import read_meta

    cfg = SearchConfig(
        n_trials=5,
        epochs=3,
        strategy=strategy,
        model_slots=2,
        ddp_world_size=2,
        space=SPACE,
        sampler="random",
        pruner=pruner,
        min_resource=1,
    )
    _enqueue(str(tmp_path / "journal.log"), cfg, [GOOD_LR, GOOD_LR, BAD_LR, BAD_LR, BAD_LR])
    outcome = _sweep(cfg, small_manifest, tmp_path, dask_client)
    by_number = {r.number: r for r in outcome.results}
    pruned = [r for r in outcome.results if r.state == "PRUNED"]
    assert pruned, [(r.number, r.state, r.pruned_epoch) for r in outcome.results]
    for result in pruned:
        assert result.pruned_epoch is not None and len(result.history) == result.pruned_epoch + 1
    study = optuna.load_study(study_name="live", storage=make_storage(str(tmp_path / "journal.log")))
    promotions = {
        t.number: t.user_attrs[PROMOTED_ATTR] for t in study.trials if PROMOTED_ATTR in t.user_attrs
    }
    for result in pruned:  # the kept checkpoint ends where the record ends (unless promoted on)
        model = tmp_path / "ckpt" / f"trial-{result.number:04d}" / "last.safetensors"
        if result.number not in promotions.values():
            assert read_meta(model.read_bytes())["epoch"] == result.pruned_epoch, result.number
    if pruner == "asha":
        assert promotions, "ASHA promoted no waiting model"
    for number, earlier in promotions.items():
        judged_at = max(study.trials[earlier].intermediate_values)  # the rung it waited at
        assert study.trials[earlier].state == optuna.trial.TrialState.PRUNED
        promoted = by_number[number]
        assert promoted.resumed_from_epoch == judged_at, (promoted, study.trials[earlier])
        assert [h["epoch"] for h in promoted.history] == list(range(len(promoted.history)))


def test_a_task_asha_sweep_never_leaves_a_worker_without_an_epoch_while_trials_remain(
    small_manifest: str, dask_client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Li et al.'s rule under ``task``: when a slot frees, a model waiting at a rung is promoted if
    it may be, otherwise a new trial starts. Every time the executor has admitted what it could, an
    epoch per worker is in flight for as long as new trials remain to be started (after the last
    one, the sweep's tail: only models that finish or wait for a promotion)."""
    from mopflow.training.executors import task_run

    admits: list[tuple[int, bool]] = []  # after each admit: epochs in flight, new trials remain
    admit = task_run.TaskRun.admit

    def admitting(run: Any) -> None:
        admit(run)
        admits.append((len(run.in_flight), run.controller.started < run.controller.budget))

    monkeypatch.setattr(task_run.TaskRun, "admit", admitting)
    cfg = SearchConfig(
        n_trials=8, epochs=4, strategy="task", space=SPACE, sampler="random", pruner="asha", min_resource=1
    )
    lrs = [GOOD_LR, BAD_LR, BAD_LR, GOOD_LR, BAD_LR, BAD_LR, GOOD_LR, BAD_LR]
    _enqueue(str(tmp_path / "journal.log"), cfg, lrs)
    outcome = _sweep(cfg, small_manifest, tmp_path, dask_client)
    assert {r.state for r in outcome.results} >= {"COMPLETE", "PRUNED"}  # models stopped at rungs
    workers = len(cluster_workers(dask_client))  # type: ignore[attr-defined]
    assert admits[0] == (workers, True) and admits[-1][1] is False
    assert not [(n, remain) for n, remain in admits if n < workers and remain], admits
