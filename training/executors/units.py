"""Training passes that run on workers: one pass of one model over some shards, state in and out.

A model's state (weights and optimizer moments) travels as safetensors bytes, so it can hop
between workers (MOP) or be checkpointed after every pass, and loading it never unpickles.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from training.devices import CPU, DeviceSpec
from training.preempt import NOTICE, UnitPreempted, notice_received
from training.schedule import steps_per_epoch

log = logging.getLogger(__name__)

# Worker-process cache of loaded partitions: each worker loads its shards once and keeps them.
_PARTITIONS: dict[tuple[str, tuple[str, ...]], tuple[Any, Any]] = {}
# The same for the evaluation splits (validated after every epoch: read and verified once).
_EVAL_SPLITS: dict[tuple[str, str], tuple[Any, Any]] = {}
EVAL_BATCH = 4096  # rows per validation batch


@dataclass(frozen=True)
class ModelSpec:
    """A configuration to train (the search's trial params), its seed and the device it trains on."""

    model_id: str
    params: dict[str, Any]
    seed: int = 0
    device: DeviceSpec = CPU

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ModelSpec:
        """Rebuild from ``dataclasses.asdict`` (a job file): the device comes back as a DeviceSpec."""
        device = raw.get("device") or {}
        return cls(**{**raw, "device": DeviceSpec(**device) if isinstance(device, Mapping) else device})


@dataclass(frozen=True)
class DataRef:
    """Where the shards are (passed to workers; small)."""

    manifest_uri: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    cache_dir: str = ""


def load_partition(data: DataRef, shard_names: Sequence[str]) -> tuple[Any, Any]:
    """Features and labels of these training shards, loaded once per worker process and kept."""
    import torch

    from training.data import load_split

    key = (data.manifest_uri, tuple(sorted(shard_names)))
    if key not in _PARTITIONS:
        x, y = load_split(
            data.manifest_uri,
            "train",
            data.storage_options,
            shard_names=list(shard_names),
            cache_dir=data.cache_dir or None,
        )
        _PARTITIONS[key] = (torch.from_numpy(x), torch.from_numpy(y))
    return _PARTITIONS[key]


def cached_bytes() -> int:
    """Bytes of training data this worker process holds (the storage footprint)."""
    return int(
        sum(x.numel() * x.element_size() + y.numel() * y.element_size() for x, y in _PARTITIONS.values())
    )


def clear_partitions() -> None:
    """Forget the cached partitions (between benchmark runs)."""
    _PARTITIONS.clear()
    _EVAL_SPLITS.clear()


def load_eval_split(data: DataRef, split: str) -> tuple[Any, Any]:
    """Features (as a tensor) and labels of an evaluation split, loaded once per worker process."""
    import torch

    from training.data import load_split

    key = (data.manifest_uri, split)
    if key not in _EVAL_SPLITS:
        x, y = load_split(data.manifest_uri, split, data.storage_options, cache_dir=data.cache_dir or None)
        _EVAL_SPLITS[key] = (torch.from_numpy(x), y)
    return _EVAL_SPLITS[key]


def _build(spec: ModelSpec, manifest: Mapping[str, Any]) -> Any:
    from training.models import ArchSpec, build_model

    arch = ArchSpec.from_params(spec.params, len(manifest["feature_columns"]), int(manifest["num_classes"]))
    norm = manifest["normalization"]
    return arch, build_model(arch, norm["mean"], norm["std"])


def pack_state(
    model: Any, optimizer: Any | None, meta: Mapping[str, Any], extra: Mapping[str, Any] | None = None
) -> bytes:
    """Weights and AdamW moments as safetensors bytes, with JSON metadata (and ``extra`` tensors,
    e.g. the RNG state of a pass stopped mid-way)."""
    from safetensors.torch import save

    tensors = {f"model.{k}": v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    tensors |= {f"extra.{k}": v.detach().contiguous().clone() for k, v in (extra or {}).items()}
    steps: dict[str, float] = {}
    if optimizer is not None:
        for index, param in enumerate(optimizer.param_groups[0]["params"]):
            state = optimizer.state.get(param, {})
            for name in ("exp_avg", "exp_avg_sq"):
                if name in state:
                    tensors[f"opt.{index}.{name}"] = state[name].detach().contiguous().clone()
            if "step" in state:
                steps[str(index)] = float(state["step"])
    return save(tensors, metadata={"meta": json.dumps(dict(meta)), "steps": json.dumps(steps)})


class StateFormatError(ValueError):
    """Packed model state that is not a safetensors blob (truncated, or another format such as a
    pickle): refused, never deserialized as code."""


def _metadata(data: bytes) -> dict[str, str]:
    """The safetensors header's ``__metadata__`` (the header is JSON after an 8-byte length)."""
    size = int.from_bytes(data[:8], "little")
    try:
        if len(data) < 8 or not 0 < size <= len(data) - 8:
            raise ValueError(f"header length {size} does not fit in {len(data)} bytes")
        header = json.loads(data[8 : 8 + size])
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (ValueError, UnicodeDecodeError) as exc:
        raise StateFormatError(f"model state is not a safetensors blob ({exc}); refusing to load it") from exc
    return dict(header.get("__metadata__", {}))


def read_meta(data: bytes) -> dict[str, Any]:
    """The metadata packed with a state (epoch, model id, visited partitions)."""
    meta: dict[str, Any] = json.loads(_metadata(data).get("meta", "{}"))
    return meta


def unpack_state(data: bytes, model: Any, optimizer: Any | None) -> dict[str, Any]:
    """Load packed state into ``model`` (strict) and ``optimizer``; return the metadata."""
    import torch
    from safetensors.torch import load

    tensors = load(data)
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")}, strict=True)
    metadata = _metadata(data)
    steps = json.loads(metadata.get("steps", "{}"))
    if optimizer is not None and steps:
        for index, param in enumerate(optimizer.param_groups[0]["params"]):
            if str(index) in steps:
                # On the parameter's device: after a hop the model may already sit on a GPU.
                optimizer.state[param] = {
                    "step": torch.tensor(steps[str(index)]),
                    "exp_avg": tensors[f"opt.{index}.exp_avg"].to(param.device),
                    "exp_avg_sq": tensors[f"opt.{index}.exp_avg_sq"].to(param.device),
                }
    meta: dict[str, Any] = json.loads(metadata.get("meta", "{}"))
    return meta


def train_pass(
    spec: ModelSpec,
    state: bytes | None,
    data: DataRef,
    shard_names: Sequence[str],
    epoch: int,
    total_epochs: int,
    pass_index: int = 0,
    meta: Mapping[str, Any] | None = None,
    epoch_steps: int | None = None,
) -> tuple[bytes, dict[str, Any]]:
    """One pass of ``spec`` over ``shard_names`` at ``epoch`` (a MOP sub-epoch, or a whole epoch).

    The learning rate follows the one-cycle schedule of ``total_epochs x epoch_steps`` global
    steps (``training/schedule.py``) from the model's global step, which the state carries:
    the same curve whichever strategy trains it. ``epoch_steps`` is the steps of a whole epoch
    over every partition (None: this pass is the whole epoch). Returns the new state and the
    pass's record (worker, timings, rows, loss, global step and learning rate at its end).
    """
    import pytorch_lightning as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from training.data import load_manifest
    from training.lit import Classifier, NonFiniteLossError, quiet_trainer_kwargs
    from training.trial import quiet_lightning

    started = time.time()
    if notice_received():  # this worker is going away: hand the unit back untouched
        here = {"start": started, "saved_at": started, "end": started, "worker": _dask_address()}
        raise UnitPreempted(spec.model_id, state, here)
    torch.set_num_threads(1)
    quiet_lightning()
    resume = _resume_point(state, epoch, pass_index, shard_names)
    manifest = load_manifest(data.manifest_uri, data.storage_options)
    _, model = _build(spec, manifest)
    lr = float(spec.params["lr"])
    optimizer_holder: dict[str, Any] = {}
    x, y = load_partition(data, shard_names)
    loaded = time.time()
    batch_size = int(spec.params["batch_size"])
    start_step = global_step(state)

    class PassModule(Classifier):
        """Optimizer moments carried over from the previous pass; the schedule placed at the
        model's global step."""

        def restore_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
            if state is not None:
                unpack_state(state, self.model, optimizer)
            optimizer_holder["opt"] = optimizer

    # Weights and moments are loaded once, in configure_optimizers (Lightning calls it before the first step).
    steps = epoch_steps if epoch_steps is not None else steps_per_epoch([len(x)], batch_size)
    module = PassModule(
        model,
        lr=lr,
        weight_decay=float(spec.params["weight_decay"]),
        total_steps=total_epochs * steps,
        start_step=start_step,
    )
    # Same shuffling for the same (model, epoch, pass) wherever it runs: the permutation that
    # DataLoader(shuffle=True, generator=...) draws, less the batches a preempted attempt did.
    generator = torch.Generator().manual_seed(spec.seed * 1_000_003 + epoch * 1009 + pass_index)
    n_batches = -(-len(x) // batch_size)
    skip = resume.batches if resume is not None else 0
    order = torch.randperm(len(x), generator=generator)[skip * batch_size :]
    loader = DataLoader(TensorDataset(x, y), batch_size=batch_size, sampler=order.tolist())
    torch.manual_seed(spec.seed + epoch)
    if resume is not None:
        torch.set_rng_state(resume.rng)
        log.info(
            "%s: resuming epoch %d pass %d at batch %d/%d", spec.model_id, epoch, pass_index, skip, n_batches
        )
    done_meta = {"epoch": epoch, "model_id": spec.model_id, **dict(meta or {})}

    class NoticeWatch(pl.Callback):
        """A spot notice (a flag read per batch): pack the state at this batch boundary and stop."""

        def on_train_batch_end(
            self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            if not NOTICE.is_set():
                return
            batches = skip + batch_idx + 1
            if batches >= n_batches:  # the pass is done anyway
                return
            partial = {
                "epoch": epoch,
                "pass_index": pass_index,
                "shards": list(shard_names),
                "batches": batches,
            }
            rng = {"rng": torch.get_rng_state()}
            at = {**done_meta, "partial": partial, "global_step": start_step + trainer.global_step}
            packed = pack_state(model, optimizer_holder.get("opt"), at, rng)
            saved_at = time.time()
            log.warning(
                "%s: spot notice; stopped epoch %d pass %d at batch %d/%d",
                spec.model_id,
                epoch,
                pass_index,
                batches,
                n_batches,
            )
            raise UnitPreempted(
                spec.model_id,
                packed,
                {
                    "start": started,
                    "load_end": loaded,
                    "saved_at": saved_at,
                    "end": time.time(),
                    "batches": batches,
                    "worker": _dask_address(),
                },
            )

    trainer = pl.Trainer(
        max_epochs=1, limit_val_batches=0, callbacks=[NoticeWatch()], **quiet_trainer_kwargs(spec.device)
    )
    try:
        trainer.fit(module, loader)
    except NonFiniteLossError:
        raise
    end_step = start_step + trainer.global_step
    new_state = pack_state(model, optimizer_holder.get("opt"), {**done_meta, "global_step": end_step})
    ended = time.time()
    return new_state, {
        "model": spec.model_id,
        "partition": ",".join(shard_names),
        "worker": f"{os.uname().nodename}:{os.getpid()}",
        "epoch": epoch,
        "start": started,
        "load_end": loaded,
        "end": ended,
        "rows": int(len(x)),
        "resumed_at_batch": skip,
        "train_loss": float(module.last_train_loss),
        "state_bytes": len(new_state),
        "global_step_end": end_step,
        "lr_end": float(optimizer_holder["opt"].param_groups[0]["lr"]) if "opt" in optimizer_holder else lr,
    }


def global_step(state: bytes | None) -> int:
    """The optimizer steps a packed state has taken (0 for an initial state)."""
    if state is None:
        return 0
    meta = read_meta(state)
    if "global_step" in meta:
        return int(meta["global_step"])
    steps = json.loads(_metadata(state).get("steps", "{}"))  # a state packed before global_step
    return int(max(steps.values(), default=0))


def _dask_address() -> str:
    """The address of the Dask worker running this (empty outside a worker)."""
    try:
        from distributed import get_worker

        return str(get_worker().address)
    except (ImportError, ValueError):
        return ""


@dataclass(frozen=True)
class ResumePoint:
    """Where a pass stopped on a spot notice: batches done and the RNG state at that point."""

    batches: int
    rng: Any


def partial_meta(state: bytes | None) -> dict[str, Any] | None:
    """The mid-pass position packed with a state stopped on a notice (None for a finished pass)."""
    if state is None:
        return None
    partial = read_meta(state).get("partial")
    return dict(partial) if partial else None


def _resume_point(
    state: bytes | None, epoch: int, pass_index: int, shard_names: Sequence[str]
) -> ResumePoint | None:
    """The point to continue this pass from, when ``state`` was packed mid-way through it."""
    partial = partial_meta(state)
    if (
        partial is None
        or state is None
        or int(partial.get("epoch", -1)) != epoch
        or int(partial.get("pass_index", -1)) != pass_index
        or list(partial.get("shards", [])) != list(shard_names)
    ):
        return None
    from safetensors.torch import load

    return ResumePoint(int(partial["batches"]), load(state)["extra.rng"])


def init_state(spec: ModelSpec, data: DataRef) -> bytes:
    """A model's initial state (seeded), before any pass."""
    import torch

    from training.data import load_manifest

    torch.manual_seed(spec.seed)
    manifest = load_manifest(data.manifest_uri, data.storage_options)
    _, model = _build(spec, manifest)
    return pack_state(model, None, {"epoch": -1, "model_id": spec.model_id})


def evaluate_state(spec: ModelSpec, state: bytes, data: DataRef, split: str = "validation") -> float:
    """Accuracy of a packed state on a split."""
    import torch

    from training.data import load_manifest

    torch.set_num_threads(1)
    manifest = load_manifest(data.manifest_uri, data.storage_options)
    _, model = _build(spec, manifest)
    unpack_state(state, model, None)
    x, y = load_eval_split(data, split)
    device = spec.device.torch_device()
    model.to(device).eval()
    preds = []
    with torch.no_grad():  # in batches: a split need not fit on the device at once
        for start in range(0, len(x), EVAL_BATCH):
            preds.append(model(x[start : start + EVAL_BATCH].to(device)).argmax(dim=1).cpu())
    pred = torch.cat(preds).numpy() if preds else np.zeros(0, dtype=np.int64)
    return float(np.mean(pred == y))


def train_pass_and_validate(
    spec: ModelSpec,
    state: bytes | None,
    data: DataRef,
    shard_names: Sequence[str],
    epoch: int,
    total_epochs: int,
    pass_index: int = 0,
    meta: Mapping[str, Any] | None = None,
    validate: bool = False,
    epoch_steps: int | None = None,
) -> tuple[bytes, dict[str, Any], float | None]:
    """A pass, then (when it ends the model's epoch) validation on the same worker.

    Validating where the state already is saves a task and a round trip per model-epoch, and
    the wait for a separate validation phase at the end of a MOP round.
    """
    new_state, record = train_pass(
        spec, state, data, shard_names, epoch, total_epochs, pass_index, meta, epoch_steps
    )
    return new_state, record, evaluate_state(spec, new_state, data) if validate else None


def state_to_bundle(spec: ModelSpec, state: bytes, data: DataRef, url: str) -> str:
    """Write a packed state as a model bundle (the checkpoint format the ensemble stage reads)."""
    from training.bundle import save_bundle
    from training.data import load_manifest

    manifest = load_manifest(data.manifest_uri, data.storage_options)
    arch, model = _build(spec, manifest)
    unpack_state(state, model, None)
    return save_bundle(
        url,
        [model],
        [arch],
        manifest["feature_columns"],
        extra={"model_id": spec.model_id, "params": spec.params, "manifest_hash": manifest["manifest_hash"]},
        storage_options=data.storage_options,
    )
