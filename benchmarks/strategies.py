"""Benchmark of the four execution strategies for training many models: sequential, task, ddp, mop.

What is measured
----------------
8 fixed configurations (small 1-D CNNs and MLPs, ``CONFIGS``; seeds 0..7, batch 256, AdamW with
weight decay 1e-5) are trained for 4 epochs each on MNIST-1D by every strategy in
``mopflow.training.executors``:

* ``sequential``: ``SequentialExecutor``, one model after another in one process.
* ``task``: ``TaskExecutor`` on a fresh 2-worker Dask ``LocalCluster``: one model-epoch per
  task over all training shards, at most one model per worker.
* ``mop``: ``MopExecutor`` on a fresh 2-worker ``LocalCluster``: the training shards are split
  into one partition per worker and model states hop between the workers (Cerebro's model
  hopper parallelism).
* ``ddp``: ``DDPExecutor(world_size=2)`` on a fresh 2-worker ``LocalCluster``: each model's 2
  ranks run in the 2 Dask worker processes, over gloo.

Data: ``DataConfig(num_samples=142_000, partition_rows=50_000, n_shards=4)`` (>= 100,000
training rows; the row counts are read from the manifest) is sharded once with
``mopflow.training.data.shard_dataset`` into a temporary data root and reused by every strategy.

Each strategy runs in its own subprocess (this script re-invoked with ``--run-strategy``), so
that none inherits another's partition cache, and under a wall-clock limit (``--timeout-s``):
on expiry the subprocess and all its descendants are killed by pid and the strategy is
reported as failed. For ``task`` and ``mop`` the cluster start-up and the workers' first import
of torch/Lightning happen before the clock starts; the clock covers ``executor.run`` only.

Figures per strategy
--------------------
* ``wall_s``: wall time of ``executor.run``; ``per_epoch_s`` = wall / epochs;
  ``rows_per_s`` (throughput) = configs x epochs x training rows / wall.
* ``footprint``: bytes of training data materialised across processes. ``sequential``:
  ``units.cached_bytes()`` of the benchmark subprocess (measured). ``task``/``mop``: the sum of
  ``client.run(units.cached_bytes)`` over the workers after the run (measured). ``ddp``:
  every rank loads the full training split (``ddp_rank``), so world_size x rows x
  (40 float32 + 1 int64) bytes (computed, not measured).
* ``moved``: bytes moved between processes. ``sequential``: 0 (one process). ``task``/``mop``:
  2 x the sum of ``record["state_bytes"]`` over the executor's records (each unit's state goes
  to the worker and comes back; measured payload sizes, Dask's framing not counted).
  ``ddp``: the gradient bytes every rank handed to the all-reduce, counted in the DDP comm hook
  (measured; a ring all-reduce puts about 2(W-1)/W of them on the wire).
* ``val_acc_mean``: mean over the 8 models of the final state's validation accuracy
  (``units.evaluate_state`` on the returned state, the same function for every strategy).
* ``idle`` (mop only): mean over MOP rounds of ``gantt.idle_fraction`` of that round's records.
* ``cpu`` (sequential, task, mop): CPU seconds during the timed run, from psutil: the strategy
  subprocess (the coordinator), its live descendants (Dask nannies and workers), and
  ``other_s`` = machine busy time less both (other jobs on a shared host). Not a target: it
  tells a strategy that did more work (more worker seconds for the same rows) from one that got
  less of the machine (more ``other_s``).

Targets (from the Cerebro paper; printed as PASS/FAIL)
------------------------------------------------------
MOP >= 0.9x the task-parallel throughput, <= 1/2 of its data footprint, >= 1.5x the DDP
throughput, idle fraction <= 10%, mean accuracy within 1 point of sequential.

Output: a plain-text table on stdout, the target lines, and every figure in
``benchmarks/results/strategies.json`` (with the CPU count, load averages and the date).
Timings are wall-clock on a shared machine: other processes running at the same time slow
every strategy down.

On a GPU machine ``--device cuda`` trains every strategy on the GPU (task and mop workers each
see the GPU and declare the Dask resource ``GPU``; DDP runs over nccl on up to 2 GPUs) and writes
``benchmarks/results/strategies-cuda.json``; ``--trials-per-gpu 1,2,4,8`` then also runs ``task``
with that many worker processes sharing each GPU and reports trials/s relative to 1.

Run it from the repository root::

    .venv/bin/python benchmarks/strategies.py            # full size (~10-20 minutes on 2 cores)
    .venv/bin/python benchmarks/strategies.py --quick    # smoke test: 3000 samples, 2 configs, 1 epoch
    .venv/bin/python benchmarks/strategies.py --strategies mop,task --epochs 2
    python benchmarks/strategies.py --device cuda --num-samples 1000000 --trials-per-gpu 1,2,4,8
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: make ``training`` importable
    sys.path.insert(0, str(REPO_ROOT))

RESULTS_PATH = REPO_ROOT / "benchmarks" / "results" / "strategies.json"
CUDA_RESULTS_PATH = REPO_ROOT / "benchmarks" / "results" / "strategies-cuda.json"
STRATEGY_ORDER = ("sequential", "task", "mop", "ddp")
N_WORKERS = 2
DDP_WORLD_SIZE = 2
MB = 1024 * 1024
N_FEATURES = 40
BYTES_PER_ROW = N_FEATURES * 4 + 8  # float32 features + int64 label

# The 8 configurations: (family, width, depth, lr). Seeds are 0..7 in this order.
CONFIGS: tuple[tuple[str, int, int, float], ...] = (
    ("cnn", 16, 2, 0.01),
    ("cnn", 32, 2, 0.01),
    ("cnn", 16, 3, 0.01),
    ("cnn", 32, 3, 0.005),
    ("mlp", 64, 2, 0.01),
    ("mlp", 128, 2, 0.005),
    ("mlp", 64, 3, 0.01),
    ("mlp", 128, 3, 0.005),
)

TARGET_TASK_THROUGHPUT = 0.9
TARGET_FOOTPRINT = 0.5
TARGET_DDP_THROUGHPUT = 1.5
TARGET_IDLE = 0.10
TARGET_ACC_POINTS = 1.0


@dataclass(frozen=True)
class Settings:
    """Sizes of one benchmark run."""

    num_samples: int
    n_shards: int
    configs: int
    epochs: int
    batch_size: int
    weight_decay: float
    strategies: tuple[str, ...]
    timeout_s: float
    quick: bool
    device: str = "cpu"  # cpu | cuda
    trials_per_gpu: tuple[int, ...] = ()  # cuda: the task strategy again with k workers per GPU


def model_specs(settings: Settings) -> list[dict[str, Any]]:
    """The configurations as ``ModelSpec`` fields (plain dicts: they travel as JSON)."""
    specs = []
    for seed, (family, width, depth, lr) in enumerate(CONFIGS[: settings.configs]):
        params = {
            "family": family,
            "width": width,
            "depth": depth,
            "lr": lr,
            "weight_decay": settings.weight_decay,
            "batch_size": settings.batch_size,
        }
        device = {"accelerator": "gpu" if settings.device == "cuda" else "cpu", "precision": "32"}
        specs.append(
            {"model_id": f"m{seed}-{family}{width}x{depth}", "params": params, "seed": seed, "device": device}
        )
    return specs


# ---------------------------------------------------------------------------------------------
# One strategy (runs in its own subprocess)


def _warm_imports() -> int:
    """Import torch and Lightning in a worker before the clock starts (every strategy pays it once)."""
    import pytorch_lightning  # noqa: F401
    import torch  # noqa: F401

    import mopflow.training.executors.units  # noqa: F401
    import mopflow.training.trainable.lit  # noqa: F401

    return os.getpid()


def _final_accuracy(outcomes: dict[str, Any], specs: Sequence[Any], data: Any) -> dict[str, Any]:
    """Validation accuracy of each model's returned state, and its last reported accuracy."""
    from mopflow.training.executors.units import evaluate_state

    acc: dict[str, float | None] = {}
    reported: dict[str, float | None] = {}
    errors: dict[str, str] = {}
    epochs_done: dict[str, int] = {}
    for spec in specs:
        outcome = outcomes.get(spec.model_id)
        if outcome is None:
            errors[spec.model_id] = "no outcome"
            acc[spec.model_id] = reported[spec.model_id] = None
            continue
        if outcome.error:
            errors[spec.model_id] = str(outcome.error)[-500:]
        epochs_done[spec.model_id] = outcome.epochs_done
        reported[spec.model_id] = outcome.history[-1].val_acc if outcome.history else None
        acc[spec.model_id] = evaluate_state(spec, outcome.state, data) if outcome.state else None
    return {"val_acc": acc, "reported_val_acc": reported, "errors": errors, "epochs_done": epochs_done}


def _cpu_snapshot() -> dict[str, float]:
    """CPU seconds so far: the whole machine (busy, i.e. all but idle and iowait), this process
    (the driver/coordinator) and its live descendants (Dask nannies and workers)."""
    import psutil

    machine = psutil.cpu_times()
    me = psutil.Process()
    own = me.cpu_times()
    below = 0.0
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            t = child.cpu_times()
            below += t.user + t.system
    busy = sum(machine) - machine.idle - getattr(machine, "iowait", 0.0)
    return {"machine_busy_s": busy, "coordinator_s": own.user + own.system, "descendants_s": below}


def _cpu_delta(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, float]:
    """Where the CPU went during the timed run; ``other_s``: processes outside this benchmark
    (other jobs on a shared machine) that competed with the workers."""
    d = {k: after[k] - before[k] for k in before}
    d["other_s"] = max(0.0, d["machine_busy_s"] - d["coordinator_s"] - d["descendants_s"])
    d["capacity_s"] = wall_s * (os.cpu_count() or 1)
    return d


def _state_traffic(records: Sequence[dict[str, Any]]) -> int:
    return 2 * sum(int(r.get("state_bytes", 0)) for r in records)


def _records_summary(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Busy time and partition-loading time of the training units."""
    busy = sum(float(r["end"]) - float(r["start"]) for r in records)
    loading = sum(float(r.get("load_end", r["start"])) - float(r["start"]) for r in records)
    return {"units": len(records), "busy_s": busy, "setup_and_load_s": loading}


def run_strategy(name: str, job: dict[str, Any]) -> dict[str, Any]:
    """Train the job's models with one strategy; return its figures (see the module docstring)."""
    from mopflow.training.executors.units import DataRef, ModelSpec, cached_bytes, clear_partitions

    data = DataRef.open(manifest_uri=job["manifest_uri"])
    specs = [ModelSpec.from_dict(m) for m in job["models"]]
    shards: list[str] = job["shards"]
    epochs = int(job["epochs"])
    train_rows = int(job["train_rows"])
    result: dict[str, Any] = {"strategy": name, "loadavg_before": list(os.getloadavg())}

    if name == "sequential":
        from mopflow.training.executors.task import SequentialExecutor

        _warm_imports()
        clear_partitions()
        executor: Any = SequentialExecutor(data, shards)
        cpu_before = _cpu_snapshot()
        started = time.perf_counter()
        outcomes = executor.run(specs, epochs)
        result["wall_s"] = time.perf_counter() - started
        result["cpu"] = _cpu_delta(cpu_before, _cpu_snapshot(), result["wall_s"])
        result["footprint_bytes"] = cached_bytes()
        result["footprint_method"] = "measured: units.cached_bytes() of the one training process"
        result["moved_bytes"] = 0
        result["moved_method"] = "none: every model trains in one process"
        result["moved_is_estimate"] = False
        result["records"] = _records_summary(executor.records)
    elif name in ("task", "mop"):
        from mopflow.training.compute.cluster import dask_client
        from mopflow.training.executors.gantt import idle_fraction
        from mopflow.training.executors.mop import MopExecutor
        from mopflow.training.executors.task import TaskExecutor

        cluster_started = time.perf_counter()
        on_gpu = job.get("device") == "cuda"
        per_gpu = int(job.get("trials_per_gpu", 1))
        with dask_client(
            "", N_WORKERS, accelerator="gpu" if on_gpu else "cpu", trials_per_gpu=per_gpu
        ) as client:
            workers = len(client.scheduler_info()["workers"])
            client.wait_for_workers(workers, timeout=120)
            result["workers"] = workers
            client.run(_warm_imports)
            client.run(clear_partitions)
            result["cluster_start_s"] = time.perf_counter() - cluster_started
            if name == "task":
                executor = TaskExecutor(client, data, shards)
            else:
                executor = MopExecutor(client, data, shards, seed=0)
                result["partitions"] = executor.partitions
            cpu_before = _cpu_snapshot()
            started = time.perf_counter()
            outcomes = executor.run(specs, epochs)
            result["wall_s"] = time.perf_counter() - started
            result["cpu"] = _cpu_delta(cpu_before, _cpu_snapshot(), result["wall_s"])
            per_worker = client.run(cached_bytes)
        result["footprint_bytes"] = int(sum(per_worker.values()))
        result["footprint_per_worker_bytes"] = {str(k): int(v) for k, v in per_worker.items()}
        result["footprint_method"] = (
            "measured: sum over the Dask workers of client.run(units.cached_bytes) after the run"
        )
        result["moved_bytes"] = _state_traffic(executor.records)
        result["moved_method"] = (
            "measured payload: 2 x sum of record['state_bytes'] over the executor's records "
            "(model state to the worker and back per unit; Dask framing not counted)"
        )
        result["moved_is_estimate"] = False
        result["records"] = _records_summary(executor.records)
        # Share of worker-time idle over the whole run (validation between rounds counts as idle).
        busy = result["records"]["busy_s"]
        result["run_idle_fraction"] = max(0.0, 1.0 - busy / (result["wall_s"] * workers))
        if name == "mop":
            rounds = {int(k): idle_fraction(v) for k, v in executor.epoch_records.items() if v}
            result["idle_per_round"] = rounds
            result["idle_fraction"] = sum(rounds.values()) / len(rounds) if rounds else None
            result["round_span_s"] = {
                int(k): max(float(r["end"]) for r in v) - min(float(r["start"]) for r in v)
                for k, v in executor.epoch_records.items()
                if v
            }
        else:
            result["idle_fraction_all_records"] = idle_fraction(executor.records)
    elif name == "ddp":
        from mopflow.training.executors.ddp import DDPExecutor
        from mopflow.training.models.builtin import ArchSpec, count_params
        from mopflow.training.models.families import DataSpec

        world = DDP_WORLD_SIZE
        if job.get("device") == "cuda":  # nccl: one rank per GPU
            import torch

            world = max(1, min(DDP_WORLD_SIZE, torch.cuda.device_count()))
        result["world_size"] = world
        from mopflow.training.compute.cluster import dask_client

        on_gpu = job.get("device") == "cuda"
        with dask_client("", world, accelerator="gpu" if on_gpu else "cpu") as client:
            client.wait_for_workers(world, timeout=120)
            client.run(_warm_imports)
            executor = DDPExecutor(
                client, data, world_size=world, epoch_timeout_s=float(job["ddp_epoch_timeout_s"])
            )
            started = time.perf_counter()
            outcomes = executor.run(specs, epochs)
            result["wall_s"] = time.perf_counter() - started
        result["footprint_bytes"] = DDP_WORLD_SIZE * train_rows * BYTES_PER_ROW
        result["footprint_method"] = (
            f"computed: every rank loads the full training split ({DDP_WORLD_SIZE} x {train_rows} rows "
            f"x {BYTES_PER_ROW} bytes)"
        )
        steps_total = 0
        per_model: dict[str, Any] = {}
        for spec in specs:
            arch = ArchSpec.from_params(spec.params, DataSpec(N_FEATURES, 10))
            n_params = count_params(arch)
            per_rank_batch = max(1, int(spec.params["batch_size"]) // DDP_WORLD_SIZE)
            rank_rows = math.ceil(train_rows / DDP_WORLD_SIZE)  # ranks take equal (padded) shares
            steps_per_epoch = math.ceil(rank_rows / per_rank_batch)
            outcome = outcomes.get(spec.model_id)
            done = outcome.epochs_done if outcome is not None else 0
            steps = steps_per_epoch * done
            steps_total += steps
            per_model[spec.model_id] = {
                "params": n_params,
                "steps": steps,
                "per_rank_batch": per_rank_batch,
                "allreduce_bytes": executor.allreduce_bytes.get(spec.model_id, 0),
            }
        result["moved_bytes"] = int(sum(executor.allreduce_bytes.values()))
        result["moved_method"] = (
            "measured: gradient bytes every rank handed to the all-reduce, counted in the DDP comm "
            "hook (a ring all-reduce puts about 2(W-1)/W of them on the wire); parameter broadcast "
            "and the per-epoch loss and stop collectives not counted"
        )
        result["moved_is_estimate"] = False
        result["ddp_steps_total"] = steps_total
        result["ddp_models"] = per_model
        result["launches_s"] = [float(r["end"]) - float(r["start"]) for r in executor.records]
    else:
        raise ValueError(f"unknown strategy {name!r}")

    result |= _final_accuracy(outcomes, specs, data)
    accs = [a for a in result["val_acc"].values() if a is not None]
    result["val_acc_mean"] = sum(accs) / len(accs) if len(accs) == len(specs) else None
    result["per_epoch_s"] = result["wall_s"] / epochs
    result["rows_per_s"] = len(specs) * epochs * train_rows / result["wall_s"]
    result["loadavg_after"] = list(os.getloadavg())
    return result


def _child_main(name: str, job_path: Path, result_path: Path) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    import torch

    torch.set_num_threads(1)
    job = json.loads(job_path.read_text())
    result = run_strategy(name, job)
    result_path.write_text(json.dumps(result, indent=2))
    return 0


# ---------------------------------------------------------------------------------------------
# The driver


def _kill_tree(pid: int) -> None:
    """Kill a process and every descendant (the Dask nannies and workers), by pid."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.Error:
        return
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGKILL)
    psutil.wait_procs(procs, timeout=10)


def launch(name: str, job_path: Path, work: Path, timeout_s: float) -> dict[str, Any]:
    """Run one strategy in a subprocess under a wall-clock limit; return its figures or its failure."""
    result_path = work / f"result-{name}.json"
    log_path = work / f"log-{name}.txt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--run-strategy",
        name,
        "--job",
        str(job_path),
        "--result",
        str(result_path),
    ]
    started = time.perf_counter()
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)
            proc.wait()
            rc = None
    elapsed = time.perf_counter() - started
    tail = log_path.read_text(errors="replace")[-3000:]
    if rc is None:
        return {"strategy": name, "error": f"timed out after {timeout_s:.0f}s", "log_tail": tail}
    if rc != 0 or not result_path.exists():
        return {"strategy": name, "error": f"exit code {rc}", "log_tail": tail}
    result: dict[str, Any] = json.loads(result_path.read_text())
    result["subprocess_s"] = elapsed
    return result


def shard(settings: Settings, data_root: str) -> tuple[str, dict[str, Any], float]:
    """Shard MNIST-1D once; return the manifest URI, the manifest and the time it took."""
    from mopflow.training.compute.cluster import dask_client
    from mopflow.training.data import load_manifest, shard_dataset
    from mopflow.training.data.config import DataConfig

    logging.getLogger("distributed").setLevel(logging.WARNING)  # its INFO chatter hides the table
    cfg = DataConfig(num_samples=settings.num_samples, partition_rows=50_000, n_shards=settings.n_shards)
    started = time.perf_counter()
    with dask_client("", N_WORKERS) as client:
        shard_result = shard_dataset(cfg, data_root, client)
    return shard_result.manifest_uri, load_manifest(shard_result.manifest_uri), time.perf_counter() - started


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(results: dict[str, dict[str, Any]]) -> str:
    header = (
        f"{'strategy':<11}{'wall_s':>9}{'per_epoch_s':>13}{'rows_per_s':>12}{'footprint_mb':>14}"
        f"{'moved_mb':>11}{'val_acc_mean':>14}{'idle':>7}"
    )
    lines = [header, "-" * len(header)]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"{name:<11}FAILED: {r['error']}")
            continue
        moved = r["moved_bytes"] / MB
        moved_s = f"~{moved:.1f}" if r.get("moved_is_estimate") else f"{moved:.1f}"
        lines.append(
            f"{name:<11}{r['wall_s']:>9.1f}{r['per_epoch_s']:>13.1f}{r['rows_per_s']:>12.0f}"
            f"{r['footprint_bytes'] / MB:>14.1f}{moved_s:>11}{_fmt(r['val_acc_mean'], '.4f'):>14}"
            f"{_fmt(r.get('idle_fraction'), '.1%'):>7}"
        )
    return "\n".join(lines)


def format_cpu(results: dict[str, dict[str, Any]]) -> list[str]:
    """Where the CPU went during each timed run (not a target: it tells a slower strategy that
    did more work from one that got less of the machine, e.g. other jobs on a shared host)."""
    lines = []
    for name, r in results.items():
        c = r.get("cpu")
        if "error" in r or not c:
            continue
        lines.append(
            f"CPU {name}: coordinator {c['coordinator_s']:.1f}s, workers {c['descendants_s']:.1f}s, "
            f"other processes {c['other_s']:.1f}s of {c['capacity_s']:.1f}s "
            f"({c['other_s'] / c['capacity_s']:.0%} of the machine)"
        )
    mop, task = results.get("mop", {}).get("cpu"), results.get("task", {}).get("cpu")
    if mop and task and task["descendants_s"]:
        lines.append(
            f"CPU mop/task worker seconds (same rows): {mop['descendants_s'] / task['descendants_s']:.3f}"
        )
    return lines


def evaluate_targets(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The Cerebro targets for MOP; a target whose inputs are missing is UNDEFINED."""

    def ok(name: str) -> dict[str, Any] | None:
        r = results.get(name)
        return r if r is not None and "error" not in r else None

    mop, task, ddp, seq = ok("mop"), ok("task"), ok("ddp"), ok("sequential")
    targets: list[dict[str, Any]] = []

    def add(label: str, value: float | None, passed: bool | None, unit: str, bound: str) -> None:
        status = "UNDEFINED" if passed is None else ("PASS" if passed else "FAIL")
        targets.append({"target": label, "value": value, "bound": bound, "unit": unit, "status": status})

    if mop and task:
        ratio = mop["rows_per_s"] / task["rows_per_s"]
        add(
            "MOP throughput vs task",
            ratio,
            ratio >= TARGET_TASK_THROUGHPUT,
            "x",
            f">= {TARGET_TASK_THROUGHPUT}x",
        )
        fp = mop["footprint_bytes"] / task["footprint_bytes"] if task["footprint_bytes"] else None
        add("MOP data footprint vs task", fp, None if fp is None else fp <= TARGET_FOOTPRINT, "x", "<= 0.5x")
    else:
        add("MOP throughput vs task", None, None, "x", f">= {TARGET_TASK_THROUGHPUT}x")
        add("MOP data footprint vs task", None, None, "x", "<= 0.5x")
    if mop and ddp:
        ratio = mop["rows_per_s"] / ddp["rows_per_s"]
        add(
            "MOP throughput vs DDP",
            ratio,
            ratio >= TARGET_DDP_THROUGHPUT,
            "x",
            f">= {TARGET_DDP_THROUGHPUT}x",
        )
    else:
        add("MOP throughput vs DDP", None, None, "x", f">= {TARGET_DDP_THROUGHPUT}x")
    idle = mop.get("idle_fraction") if mop else None
    add("MOP idle fraction", idle, None if idle is None else idle <= TARGET_IDLE, "", f"<= {TARGET_IDLE:.0%}")
    if mop and seq and mop["val_acc_mean"] is not None and seq["val_acc_mean"] is not None:
        diff = 100 * (mop["val_acc_mean"] - seq["val_acc_mean"])
        add("MOP accuracy vs sequential", diff, abs(diff) <= TARGET_ACC_POINTS, "points", "within 1 point")
    else:
        add("MOP accuracy vs sequential", None, None, "points", "within 1 point")
    return targets


def format_target(t: dict[str, Any]) -> str:
    value = t["value"]
    if value is None:
        shown = "n/a"
    elif t["unit"] == "x":
        shown = f"{value:.3f}x"
    elif t["unit"] == "points":
        shown = f"{value:+.2f} points"
    else:
        shown = f"{value:.1%}"
    return f"{t['status']:<9} {t['target']}: {shown} (target {t['bound']})"


def run(settings: Settings, out: Path) -> int:
    import torch

    wall_start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bench-strategies-"))
    try:
        manifest_uri, manifest, shard_s = shard(settings, str(work / "data"))
        splits = manifest["splits"]
        train_rows = sum(int(e["rows"]) for e in splits["train"])
        val_rows = sum(int(e["rows"]) for e in splits["validation"])
        shards = [str(e["name"]) for e in splits["train"]]
        print(
            f"sharded {settings.num_samples} MNIST-1D samples in {shard_s:.1f}s: {train_rows} train rows "
            f"in {len(shards)} shards, {val_rows} validation rows"
        )
        if not settings.quick and train_rows < 100_000:
            print(f"WARNING: only {train_rows} training rows (the benchmark asks for >= 100,000)")
        models = model_specs(settings)
        job = {
            "manifest_uri": manifest_uri,
            "models": models,
            "shards": shards,
            "epochs": settings.epochs,
            "train_rows": train_rows,
            "ddp_epoch_timeout_s": min(settings.timeout_s, 600.0),
            "device": settings.device,
        }
        job_path = work / "job.json"
        job_path.write_text(json.dumps(job))
        results: dict[str, dict[str, Any]] = {}
        for name in settings.strategies:
            print(f"running {name} ({len(models)} configs x {settings.epochs} epochs) ...", flush=True)
            results[name] = launch(name, job_path, work, settings.timeout_s)
            r = results[name]
            if "error" in r:
                print(f"  {name} FAILED: {r['error']}\n{r.get('log_tail', '')[-1500:]}", flush=True)
            else:
                print(
                    f"  {name}: {r['wall_s']:.1f}s, val_acc_mean {_fmt(r['val_acc_mean'], '.4f')}", flush=True
                )
                if "cpu" in r:
                    c = r["cpu"]
                    busy = r.get("records", {}).get("busy_s")
                    print(
                        f"  {name} CPU during the run: coordinator {c['coordinator_s']:.1f}s, "
                        f"workers {c['descendants_s']:.1f}s, other processes {c['other_s']:.1f}s "
                        f"of {c['capacity_s']:.1f}s; unit busy (wall) {_fmt(busy, '.1f')}s",
                        flush=True,
                    )
                if r.get("errors"):
                    print(f"  {name}: model errors: {r['errors']}", flush=True)
        per_gpu = _trials_per_gpu_sweep(settings, job, work)
        table = format_table(results)
        targets = evaluate_targets(results)
        target_lines = [format_target(t) for t in targets]
        header = (
            f"strategies: {len(models)} configs x {settings.epochs} epochs, {train_rows} train rows, "
            f"batch {settings.batch_size}, {N_WORKERS} workers / DDP world {DDP_WORLD_SIZE}, "
            f"{os.cpu_count()} CPUs"
        )
        print()
        print(header)
        print(table)
        cpu_lines = format_cpu(results)
        print()
        for line in target_lines:
            print(line)
        for line in cpu_lines:
            print(line)
        per_gpu_lines = format_trials_per_gpu(per_gpu)
        for line in per_gpu_lines:
            print(line)
        report = {
            "benchmark": "strategies",
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": {
                "cpu_count": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "torch": torch.__version__,
                "torch_threads_per_process": 1,
            },
            "settings": asdict(settings)
            | {
                "parallel_trials": N_WORKERS,
                "ddp_world_size": DDP_WORLD_SIZE,
                "models": models,
                "data_config": manifest["config"],
            },
            "data": {
                "train_rows": train_rows,
                "validation_rows": val_rows,
                "train_shards": shards,
                "manifest_hash": manifest["manifest_hash"],
                "train_bytes_in_memory": train_rows * BYTES_PER_ROW,
                "shard_s": shard_s,
            },
            "definitions": {
                "rows_per_s": "configs x epochs x train rows / wall_s (wall of executor.run only)",
                "per_epoch_s": "wall_s / epochs",
                "idle_fraction": "mop: mean over rounds of training.executors.gantt.idle_fraction(round records)",
                "val_acc_mean": "mean over models of units.evaluate_state(final state) on the validation split",
            },
            "results": results,
            "trials_per_gpu": per_gpu,
            "targets": targets,
            "total_s": time.perf_counter() - wall_start,
            "printed": [header, table, *target_lines, *cpu_lines, *per_gpu_lines],
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {out}")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _trials_per_gpu_sweep(settings: Settings, job: dict[str, Any], work: Path) -> dict[str, Any]:
    """``task`` on the GPU with k worker processes per GPU, for each k: trials/s relative to k=1."""
    out: dict[str, Any] = {}
    for k in settings.trials_per_gpu:
        path = work / f"job-tpg{k}.json"
        path.write_text(json.dumps(job | {"trials_per_gpu": k}))
        print(f"running task with {k} worker(s) per GPU ...", flush=True)
        r = launch("task", path, work, settings.timeout_s)
        if "error" in r:
            out[str(k)] = {"error": r["error"]}
            continue
        out[str(k)] = {
            "wall_s": r["wall_s"],
            "trials_per_s": settings.configs / r["wall_s"],
            "val_acc_mean": r["val_acc_mean"],
            "workers": r.get("workers"),
        }
    base = out.get("1", {}).get("trials_per_s")
    for entry in out.values():
        if base and "trials_per_s" in entry:
            entry["relative_to_1"] = entry["trials_per_s"] / base
    return out


def format_trials_per_gpu(per_gpu: dict[str, Any]) -> list[str]:
    """One line per k of the trials-per-GPU sweep."""
    lines = []
    for k, r in per_gpu.items():
        if "error" in r:
            lines.append(f"trials_per_gpu={k}: FAILED {r['error']}")
        else:
            lines.append(
                f"trials_per_gpu={k}: {r['trials_per_s']:.3f} trials/s "
                f"({_fmt(r.get('relative_to_1'), '.2f')}x of 1), val_acc_mean {_fmt(r['val_acc_mean'], '.4f')}"
            )
    return lines


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="smoke test: 3000 samples, 2 configs, 1 epoch")
    parser.add_argument(
        "--num-samples", type=int, default=None, help="MNIST-1D samples generated (default 142000)"
    )
    parser.add_argument("--n-shards", type=int, default=4, help="training shards")
    parser.add_argument("--configs", type=int, default=None, help=f"configurations (1..{len(CONFIGS)})")
    parser.add_argument("--epochs", type=int, default=None, help="epochs per model (default 4)")
    parser.add_argument("--batch-size", type=int, default=256, help="batch size of every configuration")
    parser.add_argument(
        "--strategies", default=",".join(STRATEGY_ORDER), help="comma-separated subset of the strategies"
    )
    parser.add_argument("--timeout-s", type=float, default=900.0, help="wall-clock limit per strategy")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where every strategy trains"
    )
    parser.add_argument(
        "--trials-per-gpu",
        default="",
        help="cuda: comma-separated worker counts per GPU for an extra task sweep (e.g. 1,2,4,8)",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="where the JSON is written (default: named for the device)"
    )
    parser.add_argument("--run-strategy", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--job", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.run_strategy:
        return _child_main(args.run_strategy, args.job, args.result)
    strategies = tuple(s.strip() for s in args.strategies.split(",") if s.strip())
    unknown = [s for s in strategies if s not in STRATEGY_ORDER]
    if unknown:
        raise SystemExit(f"unknown strategies {unknown}; expected some of {list(STRATEGY_ORDER)}")
    configs = args.configs if args.configs is not None else (2 if args.quick else len(CONFIGS))
    if not 1 <= configs <= len(CONFIGS):
        raise SystemExit(f"--configs must be between 1 and {len(CONFIGS)}")
    per_gpu = tuple(int(k) for k in args.trials_per_gpu.split(",") if k.strip())
    if per_gpu and args.device != "cuda":
        raise SystemExit("--trials-per-gpu needs --device cuda")
    if args.device == "cuda" and not args.run_strategy:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no CUDA device (a CPU build of torch, or no GPU)")
    settings = Settings(
        device=args.device,
        trials_per_gpu=per_gpu,
        num_samples=args.num_samples or (3000 if args.quick else 142_000),
        n_shards=args.n_shards,
        configs=configs,
        epochs=args.epochs or (1 if args.quick else 4),
        batch_size=args.batch_size,
        weight_decay=1e-5,
        strategies=strategies,
        timeout_s=args.timeout_s,
        quick=args.quick,
    )
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    out = args.out or (CUDA_RESULTS_PATH if args.device == "cuda" else RESULTS_PATH)
    return run(settings, out)


if __name__ == "__main__":
    sys.exit(main())
