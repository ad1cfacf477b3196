"""The search benchmark's baseline with no mopflow in it: plain Optuna and a plain PyTorch loop.

What a user would write instead: ``job["workers"]`` spawned processes (one torch thread each)
asking and telling trials of ONE study in a ``JournalStorage(JournalFileBackend(...))`` under
``job["work"]``, each trial trained in a plain loop over the manifest's parquet shards (read with
pandas), each epoch's validation accuracy reported (``trial.report(val_acc, epoch)``, epochs from
0 as mopflow reports them) before ``trial.should_prune()``. Arms: :data:`PLAIN_ARMS`.

As in mopflow, so that only the machinery differs (the test checks the accuracies equal those of
mopflow's trainable unit): the model (mopflow's family registry and standardisation), its seed
(``seed * 1000 + trial number``; ``+ epoch`` before each epoch), each epoch's row order (the
seeded permutation of ``training/trainable/batches.py``), AdamW, cross-entropy, one-cycle over
``epochs x ceil(rows / batch_size)`` steps stepped per batch, eval-mode validation, TPE's settings
(multivariate, grouped, ``max(2, min(10, trials // 3))`` startup trials), the last accuracy told
as the value, and a non-finite loss failing the trial. Random search proposes what mopflow's
random search proposes, trial for trial (:func:`random_proposals`, enqueued in trial order before
the processes start): the two random arms train the same trials with the same seeds, so their
seconds compare the machinery, seed by seed, rather than two draws. Differs: the TPE arms' processes
each have their own sampler (seed ``seed + 1_000_003 * index``; process 0's is mopflow's), so
proposals interleave through the storage rather than come from one coordinator; ``space=None``
reads mopflow's packaged table space; tables only (no image manifests).

Budget and stopping, as mopflow's search: a trial starts only while fewer than ``budget_epochs``
epochs were trained over all trials (a shared counter), fewer than ``trials`` were started and no
epoch reported ``val_acc >= target`` (a shared event). Trials running then train on to their last
epoch (or until pruned), as mopflow's do: at most ``budget - 1 + workers x epochs`` epochs in all.
``busy_s``: seconds in the training and validation batch loops, summed over processes. The clock
starts once every process has started, imported torch (and what its first optimizer imports,
``torch._dynamo``) and loaded its data and the study, as mopflow's searches are timed on a running
cluster, and stops when the last process has told its last trial, as a mopflow search's stops with
its sweep; ``start_s`` is that start-up and ``stop_s`` the processes' exits, apart.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from studies.search_summary import search_row

PLAIN_ARMS: dict[str, tuple[str, str]] = {
    "plain-random": ("random", "none"),
    "plain-tpe": ("tpe", "none"),
    "plain-tpe+sh": ("tpe", "successive_halving"),
}
DEFAULT_COMMON: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.0, "batch_size": 128}  # mopflow's
EVAL_BATCH = 4096


def process_seed(seed: int, index: int) -> int:
    """The sampler seed of worker process ``index`` (process 0: the search's seed itself)."""
    return seed + 1_000_003 * index


def trial_seed(seed: int, number: int) -> int:
    """The torch seed of trial ``number``, mopflow's rule (``controller._spec``)."""
    return seed * 1000 + number


def suggest_params(trial: Any, space: dict[str, Any]) -> dict[str, Any]:
    """One configuration from an Optuna trial, named as mopflow's ``sample_params`` names them
    (``family``, then ``<family>_<param>``, then the common params or their defaults)."""

    def suggest(name: str, spec: dict[str, Any]) -> Any:
        if spec["type"] == "int":
            return trial.suggest_int(name, spec["low"], spec["high"], log=spec.get("log", False))
        if spec["type"] == "float":
            return trial.suggest_float(name, spec["low"], spec["high"], log=spec.get("log", False))
        return trial.suggest_categorical(name, list(spec["choices"]))

    families = sorted(space["families"])
    family = families[0] if len(families) == 1 else trial.suggest_categorical("family", families)
    params: dict[str, Any] = {"family": family}
    for name, spec in sorted(space["families"][family].items()):
        params[name] = suggest(f"{family}_{name}", spec)
    common = space.get("common", {})
    for name, default in DEFAULT_COMMON.items():
        params[name] = suggest(name, common[name]) if name in common else default
    return params


def make_sampler(kind: str, seed: int, n_trials: int) -> Any:
    """The arm's sampler, with mopflow's settings (``training/search/algorithms.py``)."""
    import optuna

    if kind == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    startup = max(2, min(10, n_trials // 3))  # a third of the trials are random, 2 to 10
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup, multivariate=True, group=True)


def random_proposals(space: dict[str, Any], seed: int, n_trials: int) -> list[dict[str, Any]]:
    """The Optuna parameters of the first ``n_trials`` trials a seeded random search proposes, in
    trial order: one ``RandomSampler(seed)`` asked trial after trial, as mopflow's coordinator asks
    its sampler (``training/search/algorithms.py``)."""
    import optuna

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    proposals = []
    for _ in range(n_trials):
        trial = study.ask()
        suggest_params(trial, space)
        proposals.append(dict(trial.params))
    return proposals


def make_pruner(kind: str, min_resource: int) -> Any:
    """No pruning, or Optuna's successive halving (reduction factor 3)."""
    import optuna

    if kind == "none":
        return optuna.pruners.NopPruner()
    return optuna.pruners.SuccessiveHalvingPruner(min_resource=min_resource, reduction_factor=3)


def load_split(manifest: dict[str, Any], root: Path, split: str) -> tuple[Any, Any]:
    """Features (float32) and labels (int64) of a split, its shards in name order."""
    import numpy as np
    import pandas as pd
    import torch

    names = sorted(str(e["name"]) for e in manifest["splits"][split])
    frame = pd.concat([pd.read_parquet(root / name) for name in names], ignore_index=True)
    # writable and C-ordered: torch takes it without a copy or a warning
    x = np.require(frame[manifest["feature_columns"]].to_numpy(dtype=np.float32), requirements=["C", "W"])
    y = np.require(frame[manifest["label_column"]].to_numpy(dtype=np.int64), requirements=["C", "W"])
    return torch.from_numpy(x), torch.from_numpy(y)


def build_network(params: dict[str, Any], manifest: dict[str, Any]) -> Any:
    """The family's ``nn.Module`` from mopflow's registry, standardised by the manifest's stats."""
    from mopflow.training.models.builtin import ArchSpec, build_model
    from mopflow.training.models.families import DataSpec

    arch = ArchSpec.from_params(params, DataSpec.from_manifest(manifest))
    return build_model(arch, manifest["normalization"]["mean"], manifest["normalization"]["std"])


@dataclass
class Shared:
    """What the processes share: epochs trained, trials started, the target reached."""

    lock: Any
    epochs: Any
    started: Any
    goal: Any
    ready: Any = None  # a semaphore each process releases once its imports, data and study are loaded
    go: Any = None  # set when every process is ready: the search's clock starts


def claim_trial(shared: Shared, job: dict[str, Any]) -> bool:
    """Whether a new trial may start (counted as started when it may)."""
    with shared.lock:
        spent = shared.epochs.value >= job["budget_epochs"] or shared.started.value >= job["trials"]
        if spent or shared.goal.is_set():
            return False
        shared.started.value += 1
        return True


class Trainer:
    """One process's data and clock: trains and validates trials, recording each epoch report."""

    def __init__(self, job: dict[str, Any], shared: Shared) -> None:
        manifest_path = Path(str(job["manifest"]).removeprefix("file://"))
        self.manifest = json.loads(manifest_path.read_text())
        if self.manifest.get("example") is not None:
            raise ValueError("plain_optuna reads tables only (the manifest has an example column)")
        self.train = load_split(self.manifest, manifest_path.parent, "train")
        self.val = load_split(self.manifest, manifest_path.parent, "validation")
        self.job, self.shared = job, shared
        self.reports: list[tuple[float, float]] = []  # (time.monotonic(), val_acc)
        self.busy_s = 0.0

    def run_trial(self, trial: Any, params: dict[str, Any]) -> tuple[str, float | None]:
        """Train ``trial`` to its last epoch or until pruned: (state, last val_acc)."""
        import torch
        import torch.nn.functional as F

        seed, epochs = trial_seed(self.job["seed"], trial.number), int(self.job["epochs"])
        batch_size, (x, y) = int(params["batch_size"]), self.train
        torch.manual_seed(seed)  # as mopflow seeds a model before building it
        model = build_network(params, self.manifest)
        opt = torch.optim.AdamW(model.parameters(), lr=params["lr"], weight_decay=params["weight_decay"])
        steps = epochs * math.ceil(len(y) / batch_size)
        schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=params["lr"], total_steps=max(steps, 1))
        val_acc = None
        for epoch in range(epochs):
            began = time.perf_counter()
            torch.manual_seed(seed + epoch)  # mopflow's per-pass seed (the shift augmentation)
            order = torch.randperm(
                len(y), generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch * 1009)
            )
            model.train()
            for start in range(0, len(order), batch_size):
                index = order[start : start + batch_size]
                loss = F.cross_entropy(model(x[index]), y[index])
                if not math.isfinite(loss.item()):
                    self.busy_s += time.perf_counter() - began
                    return "FAIL", val_acc
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                schedule.step()
            val_acc = self.accuracy(model)
            self.busy_s += time.perf_counter() - began
            self.record(val_acc)
            trial.report(val_acc, epoch)
            if trial.should_prune():
                return "PRUNED", val_acc
        return "COMPLETE", val_acc

    def accuracy(self, model: Any) -> float:
        """Top-1 accuracy on the validation split, in batches, in eval mode."""
        import torch

        x, y = self.val
        model.eval()
        with torch.no_grad():
            correct = sum(
                int((model(x[i : i + EVAL_BATCH]).argmax(dim=1) == y[i : i + EVAL_BATCH]).sum())
                for i in range(0, len(y), EVAL_BATCH)
            )
        return correct / len(y) if len(y) else math.nan

    def record(self, val_acc: float) -> None:
        """Count the epoch over all processes; reaching the target stops new trials."""
        with self.shared.lock:
            self.shared.epochs.value += 1
            self.reports.append((time.monotonic(), val_acc))
            if val_acc >= self.job["target"]:
                self.shared.goal.set()


def _worker(index: int, job: dict[str, Any], study_name: str, journal: str, shared: Shared, out: str) -> None:
    """One process: ask, train and tell trials while the budget allows; write its reports."""
    import optuna
    import torch

    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler_kind, pruner_kind = PLAIN_ARMS[job["arm"]]
    study = optuna.load_study(
        study_name=study_name,
        storage=optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(journal)),
        sampler=make_sampler(sampler_kind, process_seed(job["seed"], index), job["trials"]),
        pruner=make_pruner(pruner_kind, job["min_resource"]),
    )
    trainer = Trainer(job, shared)
    # torch's first optimizer imports torch._dynamo (1-1.4 s): before the clock, as
    # mopflow's workers import it with Lightning before a search's clock starts
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    shared.ready.release()
    shared.go.wait()
    while claim_trial(shared, job):
        trial = study.ask()
        try:
            state, value = trainer.run_trial(trial, suggest_params(trial, job["space"]))
        except Exception as exc:  # a trial that cannot train fails, as in mopflow; the search goes on
            print(f"plain search: trial {trial.number} failed: {exc!r}", file=sys.stderr)
            state, value = "FAIL", None
        if state == "COMPLETE":
            study.tell(trial, value)
        else:
            study.tell(trial, state=getattr(optuna.trial.TrialState, state))
    done = {"reports": trainer.reports, "busy_s": trainer.busy_s, "finished": time.monotonic()}
    Path(out).write_text(json.dumps(done))


def packaged_space() -> dict[str, Any]:
    """mopflow's packaged table space (the file), for ``space=None``."""
    from importlib import resources

    return dict(json.loads(resources.files("mopflow.training").joinpath("spaces/default.json").read_text()))


def run_plain_search(job: dict[str, Any]) -> dict[str, Any]:
    """One plain-Optuna search of ``job["arm"]`` (:data:`PLAIN_ARMS`) on ``run_one``'s job dict;
    returns ``run_one``'s row (strategy ``"plain"``) plus ``busy_s`` and ``utilisation``."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no line per study in the table
    job = {**job, "space": job.get("space") or packaged_space()}
    name = f"bench-{job['arm'].replace('+', '-')}-{job['seed']}"
    folder = Path(job["work"]) / "plain" / name
    folder.mkdir(parents=True, exist_ok=True)
    journal = folder / "journal.log"
    journal.unlink(missing_ok=True)  # a fresh study each run
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
    study = optuna.create_study(study_name=name, storage=storage, direction="maximize")
    if PLAIN_ARMS[job["arm"]][0] == "random":  # trial k: mopflow's trial k (the processes ask in turn)
        for params in random_proposals(job["space"], job["seed"], job["trials"]):
            study.enqueue_trial(params)
    ctx = multiprocessing.get_context("spawn")
    shared = Shared(
        ctx.Lock(),
        ctx.Value("i", 0, lock=False),
        ctx.Value("i", 0, lock=False),
        ctx.Event(),
        ctx.Semaphore(0),
        ctx.Event(),
    )
    outs = [folder / f"worker-{i}.json" for i in range(job["workers"])]  # rewritten by each worker
    spawned = time.monotonic()
    procs = [
        ctx.Process(target=_worker, args=(i, job, name, str(journal), shared, str(out)))
        for i, out in enumerate(outs)
    ]
    for proc in procs:
        proc.start()
    _wait_ready(shared, procs)
    started = time.monotonic()  # as mopflow's searches are timed: workers up, imports done
    shared.go.set()
    for proc in procs:
        proc.join()
    joined = time.monotonic()
    failed = [i for i, proc in enumerate(procs) if proc.exitcode != 0]
    if failed:
        raise RuntimeError(f"plain search {name}: worker process(es) {failed} failed")
    results = [json.loads(out.read_text()) for out in outs]
    # the clock stops when the last process has told its last trial, as a mopflow search's stops
    # with its sweep (its cluster stays up); the processes' exits are ``stop_s``, apart
    total = max(float(r["finished"]) for r in results) - started
    reports = sorted((t - started, acc) for r in results for t, acc in r["reports"])
    trials = optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
    busy = sum(r["busy_s"] for r in results)
    row = search_row(job, "plain", reports, total, busy, [t.state.name for t in trials])
    return row | {"start_s": round(started - spawned, 2), "stop_s": round(joined - started - total, 2)}


def _wait_ready(shared: Shared, procs: Sequence[Any]) -> None:
    """Until every process is ready; a process that died before is an error."""
    for _ in procs:
        while not shared.ready.acquire(timeout=1.0):
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                shared.go.set()
                raise RuntimeError(f"a plain search worker process failed while starting (exit {dead})")
