"""Training passes that run on workers: one pass of one model over some shards, state in and out.

A model's state (weights and optimizer moments) travels as safetensors bytes, so it can hop
between workers (MOP) or be checkpointed after every pass, and loading it never unpickles.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from training.preempt import NOTICE, UnitPreempted, notice_received

log = logging.getLogger(__name__)

# Worker-process cache of loaded partitions: each worker loads its shards once and keeps them.
_PARTITIONS: dict[tuple[str, tuple[str, ...]], tuple[Any, Any]] = {}
# The same for the evaluation splits (validated after every epoch: read and verified once).
_EVAL_SPLITS: dict[tuple[str, str], tuple[Any, Any]] = {}


@dataclass(frozen=True)
class ModelSpec:
    """A configuration to train (the search's trial params) and its seed."""

    model_id: str
    params: dict[str, Any]
    seed: int = 0


@dataclass(frozen=True)
class DataRef:
    """Where the shards are (passed to workers; small)."""

    manifest_uri: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    cache_dir: str = ""


def epoch_lr(base_lr: float, epoch: int, total_epochs: int) -> float:
    """Cosine decay by epoch (one value per epoch, so a sub-epoch on any worker uses the same)."""
    warmup = 1 if total_epochs > 3 else 0
    if epoch < warmup:
        return base_lr * 0.3
    progress = (epoch - warmup) / max(1, total_epochs - warmup)
    return base_lr * (0.02 + 0.98 * 0.5 * (1 + math.cos(math.pi * progress)))


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
                optimizer.state[param] = {
                    "step": torch.tensor(steps[str(index)]),
                    "exp_avg": tensors[f"opt.{index}.exp_avg"],
                    "exp_avg_sq": tensors[f"opt.{index}.exp_avg_sq"],
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
) -> tuple[bytes, dict[str, Any]]:
    """One pass of ``spec`` over ``shard_names`` at ``epoch`` (a MOP sub-epoch, or a whole epoch).

    Returns the new state and the pass's record (worker, timings, rows, loss).
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
    lr = epoch_lr(float(spec.params["lr"]), epoch, total_epochs)
    optimizer_holder: dict[str, Any] = {}

    class PassModule(Classifier):
        """Constant LR within the pass; optimizer moments carried over from the previous pass."""

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.AdamW(
                self.parameters(), lr=lr, weight_decay=float(spec.params["weight_decay"])
            )
            if state is not None:
                unpack_state(state, self.model, optimizer)
            optimizer_holder["opt"] = optimizer
            return optimizer

    # Weights and moments are loaded once, in configure_optimizers (Lightning calls it before the first step).
    module = PassModule(model, lr=lr, weight_decay=float(spec.params["weight_decay"]))
    x, y = load_partition(data, shard_names)
    loaded = time.time()
    # Same shuffling for the same (model, epoch, pass) wherever it runs: the permutation that
    # DataLoader(shuffle=True, generator=...) draws, less the batches a preempted attempt did.
    generator = torch.Generator().manual_seed(spec.seed * 1_000_003 + epoch * 1009 + pass_index)
    batch_size = int(spec.params["batch_size"])
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
            packed = pack_state(model, optimizer_holder.get("opt"), {**done_meta, "partial": partial}, rng)
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
        max_epochs=1, limit_val_batches=0, callbacks=[NoticeWatch()], **quiet_trainer_kwargs()
    )
    try:
        trainer.fit(module, loader)
    except NonFiniteLossError:
        raise
    new_state = pack_state(model, optimizer_holder.get("opt"), done_meta)
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
    }


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
    model.eval()
    with torch.no_grad():
        pred = model(x).argmax(dim=1).numpy()
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
) -> tuple[bytes, dict[str, Any], float | None]:
    """A pass, then (when it ends the model's epoch) validation on the same worker.

    Validating where the state already is saves a task and a round trip per model-epoch, and
    the wait for a separate validation phase at the end of a MOP round.
    """
    new_state, record = train_pass(spec, state, data, shard_names, epoch, total_epochs, pass_index, meta)
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
