"""Several DDP trials at once on one cluster: gangs of workers taken whole, stops that end at the
epoch decided on, spot notices that stop every rank at the same batch, and the bf16 hook seen
where it hands tensors to the collective."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from mopflow.training.executors import DataRef, ModelSpec
from mopflow.training.executors.base import EpochReport, ModelOutcome
from mopflow.training.executors.ddp import DDPExecutor
from mopflow.training.executors.ddp_workers import choose_gang, concurrent_trials, placement_problem
from mopflow.training.trainable.state import read_meta

CNN = {"family": "cnn", "width": 8, "depth": 2, "lr": 0.02, "weight_decay": 0.0, "batch_size": 16}


def test_a_gang_takes_one_worker_per_device_and_refuses_shared_gpus_by_name() -> None:
    cpus = {f"w{i}": f"cpu:w{i}" for i in range(5)}
    assert choose_gang(cpus, 2) == ["w0", "w1"] and concurrent_trials(cpus, 2) == 2
    # trials_per_gpu=2 on 2 GPUs: 4 workers, but a gang needs 2 different GPUs
    shared = {"a0": "cuda:0", "a1": "cuda:0", "b0": "cuda:1", "b1": "cuda:1"}
    assert choose_gang(shared, 2) == ["a0", "b0"] and concurrent_trials(shared, 2) == 2
    one_gpu = {"a0": "cuda:0", "a1": "cuda:0"}
    assert choose_gang(one_gpu, 2) is None
    problem = placement_problem(one_gpu, 2, {"GPU": 1})
    assert problem is not None and "2 different devices" in problem and "trials_per_gpu" in problem


@pytest.fixture(scope="module")
def four_workers() -> Iterator[Any]:
    """A cluster of 4 single-thread workers (one is preempted and restarted by a test)."""
    import dask

    from mopflow.training.compute.cluster import dask_client
    from mopflow.training.volatile.preempt import register_preemption

    with dask.config.set({"distributed.deploy.lost-worker-timeout": "120s"}), dask_client("", 4) as client:
        # Every rank stops at one batch before the noticed worker leaves; on a slow, loaded 2-core
        # host that took longer than the default 30 s grace, and the rank was recorded as lost.
        register_preemption(client, {"MOPFLOW_PREEMPT_GRACE_S": "120"})
        yield client


class StopAt:
    """Stops each model after its epoch in ``last``; notes when each report arrived."""

    def __init__(self, last: dict[str, int], on_report: Any = None) -> None:
        self.last, self.on_report = last, on_report
        self.heard: list[EpochReport] = []

    def on_epoch_end(self, report: EpochReport) -> bool:
        self.heard.append(report)
        if self.on_report is not None:
            self.on_report(report)
        return report.epoch < self.last.get(report.model_id, 10**6)

    def on_model_done(self, outcome: ModelOutcome) -> None:
        return None

    def new_models(self, free_slots: int) -> list[ModelSpec]:
        return []


@pytest.mark.slow
def test_two_trials_train_at_once_and_stop_at_the_epoch_decided_on(
    small_manifest: str, four_workers: Any, tmp_path: Path
) -> None:
    executor = DDPExecutor(
        four_workers, DataRef.open(small_manifest), world_size=2, checkpoint_root=str(tmp_path)
    )
    controller = StopAt({"a": 0, "b": 2})
    outcomes = executor.run([ModelSpec("a", CNN, seed=0), ModelSpec("b", CNN, seed=1)], 4, controller)
    for model, last in (("a", 0), ("b", 2)):
        outcome = outcomes[model]
        assert outcome.error is None and outcome.stopped_early, outcome.error
        assert [r.epoch for r in outcome.history] == list(range(last + 1))
        # the state and the checkpoint end at the epoch of the decision, not one past it
        assert outcome.state is not None and read_meta(outcome.state)["epoch"] == last
        checkpoint = (tmp_path / model / "last.safetensors").read_bytes()
        assert read_meta(checkpoint)["epoch"] == last
    # both trials trained at once, each on its own gang of 2 of the 4 workers
    (a,) = [r for r in executor.records if r["model"] == "a"]
    (b,) = [r for r in executor.records if r["model"] == "b"]
    assert a["start"] < b["end"] and b["start"] < a["end"]
    assert set(a["worker"].split(",")).isdisjoint(b["worker"].split(","))
    assert len(set(executor.rank_pids["a"]) | set(executor.rank_pids["b"])) == 4


@pytest.mark.slow
def test_a_trials_seed_decides_its_weights_under_ddp(small_manifest: str, four_workers: Any) -> None:
    """Two trials of one seed end with bit-identical weights, on whichever gang they trained;
    a third of another seed ends with other weights."""
    from safetensors.torch import load

    executor = DDPExecutor(four_workers, DataRef.open(small_manifest), world_size=2)
    specs = [ModelSpec("a", CNN, seed=3), ModelSpec("b", CNN, seed=3), ModelSpec("c", CNN, seed=4)]
    outcomes = executor.run(specs, 1)
    states = {m: load(outcomes[m].state or b"") for m in "abc"}
    weights = [k for k in states["a"] if not k.startswith("opt.")]
    assert weights and all(torch.equal(states["a"][k], states["b"][k]) for k in weights)
    assert not all(torch.equal(states["a"][k], states["c"][k]) for k in weights)


@pytest.mark.slow
def test_a_spot_notice_on_one_rank_stops_all_at_one_batch_and_resumes_there(
    small_manifest: str, four_workers: Any, tmp_path: Path
) -> None:
    """Fault: one rank's worker gets SIGTERM (a spot notice) while its trial trains.
    Expected: every rank stops at the same batch of that epoch, the state there is the
    checkpoint, the trial goes on from that batch on other workers, and ends with the weights of
    an undisturbed run."""
    from safetensors.torch import load

    data = DataRef.open(small_manifest)
    spec = ModelSpec("d", CNN, seed=0)
    calm = DDPExecutor(four_workers, data, world_size=2).run([spec], 2)["d"]
    assert calm.error is None and calm.state is not None

    executor = DDPExecutor(four_workers, data, world_size=2, checkpoint_root=str(tmp_path))
    victim: list[int] = []

    def notice_on_one_rank(report: EpochReport) -> None:
        if report.epoch == 0:  # the ranks wait for this decision: the notice lands in epoch 1
            training = [pid for pid in four_workers.run(_pid_if_training_a_rank).values() if pid]
            assert len(training) == 2, training
            victim.append(max(training))
            os.kill(victim[0], signal.SIGTERM)

    outcome = executor.run([spec], 2, StopAt({}, notice_on_one_rank))["d"]
    assert victim, "the notice was never given"
    assert outcome.error is None, outcome.error
    assert [r.epoch for r in outcome.history] == [0, 1]  # every epoch once
    (notice,) = executor.interruptions
    assert notice["kind"] == "notice" and "of epoch 2" in notice["what"]
    assert victim[0] not in executor.rank_pids["d"]  # it went on without the leaving worker
    assert [r.val_acc for r in outcome.history] == [r.val_acc for r in calm.history]
    assert outcome.state is not None
    ours, theirs = load(outcome.state), load(calm.state)
    assert all(bool((ours[k] == theirs[k]).all()) for k in theirs if k.startswith("model."))
    four_workers.wait_for_workers(4, timeout=60)


def _pid_if_training_a_rank(dask_worker: Any) -> int:
    """The worker's pid while it runs a DDP rank, else 0."""
    running = [str(task.key) for task in dask_worker.state.executing]
    return os.getpid() if any(key.startswith("ddp-") for key in running) else 0


@pytest.fixture(scope="module")
def blobs_manifest(tmp_path_factory: pytest.TempPathFactory, four_workers: Any) -> str:
    """Two separable classes in 16 features, 3,000 rows: a validation split of ~900 rows, where
    0.5 points is ~4 rows."""
    import numpy as np
    import pandas as pd

    from mopflow.training.data import shard_dataset
    from mopflow.training.data.config import DataConfig

    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, size=3000)
    x = rng.normal(size=(3000, 16)) + np.where(y[:, None] == 1, 1.0, -1.0)
    frame = pd.DataFrame(x, columns=[f"f{i}" for i in range(16)]).assign(label=y)
    root = tmp_path_factory.mktemp("blobs")
    frame.to_parquet(root / "blobs.parquet")
    cfg = DataConfig(dataset=str(root / "blobs.parquet"), n_shards=2, val_fraction=0.3, test_fraction=0.1)
    return shard_dataset(cfg, str(root / "shards"), four_workers).manifest_uri


def _record_all_reduce() -> None:
    """In a worker: note the dtype and size of every tensor handed to ``all_reduce``."""
    import torch.distributed as dist

    if not hasattr(dist, "_seen_by_test"):
        inner = dist.all_reduce

        def all_reduce(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            dist._seen_by_test.append((str(tensor.dtype), int(tensor.numel())))  # type: ignore[attr-defined]
            return inner(tensor, *args, **kwargs)

        dist.all_reduce = all_reduce
    dist._seen_by_test = []  # type: ignore[attr-defined]


def _seen_all_reduce() -> list[tuple[str, int]]:
    import torch.distributed as dist

    return list(getattr(dist, "_seen_by_test", []))


@pytest.mark.slow
def test_the_bf16_hook_hands_bf16_gradients_to_the_collective_and_still_converges(
    blobs_manifest: str, four_workers: Any
) -> None:
    mlp = {"family": "mlp", "width": 16, "depth": 1, "lr": 0.01, "weight_decay": 0.0, "batch_size": 64}
    spec = ModelSpec("m", mlp, seed=0)
    n_params = 16 * 16 + 16 + 16 * 2 + 2
    runs = {}
    for compress in (False, True):
        four_workers.run(_record_all_reduce)
        executor = DDPExecutor(
            four_workers, DataRef.open(blobs_manifest), world_size=2, bf16_compress=compress
        )
        outcome = executor.run([spec], epochs=3)["m"]
        assert outcome.error is None, outcome.error
        seen = [s for per_worker in four_workers.run(_seen_all_reduce).values() for s in per_worker]
        gradients = {dtype for dtype, numel in seen if numel >= n_params // 2}  # the buckets
        runs[compress] = (outcome.history[-1].val_acc, gradients)
    (plain_acc, plain_sent), (bf16_acc, bf16_sent) = runs[False], runs[True]
    assert plain_sent == {"torch.float32"} and bf16_sent == {"torch.bfloat16"}, runs
    assert plain_acc >= 0.95 and abs(bf16_acc - plain_acc) <= 0.005, runs


@pytest.mark.slow
def test_a_ddp_sweep_on_four_workers_trains_two_trials_at_once(
    small_manifest: str, four_workers: Any, tmp_path: Path
) -> None:
    """Through the search: with 4 workers and world size 2, the second trial is asked and
    trains while the first still trains (one at a time, it would start once the first is told)."""
    import optuna

    from mopflow.training.search.config import SearchConfig
    from mopflow.training.search.study import make_storage
    from mopflow.training.search.sweep import run_search_with_executor
    from tests.spaces import fixed_cnn_space

    storage = str(tmp_path / "journal.log")
    cfg = SearchConfig(
        n_trials=3,
        epochs=2,
        strategy="ddp",
        ddp_world_size=2,
        space=fixed_cnn_space(batch_size=16),
        pruner="none",
    )
    outcome = run_search_with_executor(
        cfg,
        small_manifest,
        "gangs",
        storage,
        str(tmp_path / "art"),
        four_workers,
        checkpoint_root=str(tmp_path / "c"),
    )
    assert [r.state for r in outcome.results] == ["COMPLETE"] * 3
    trials = optuna.load_study(study_name="gangs", storage=make_storage(storage)).trials
    first, second = sorted(trials, key=lambda t: t.number)[:2]
    assert first.datetime_complete is not None and second.datetime_start is not None
    assert second.datetime_start < first.datetime_complete  # the two trained at once
