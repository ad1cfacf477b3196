"""The trainable unit: one model trained a pass at a time, the same way by every strategy.

A unit is built from a model spec (params, seed, device), the data's shape (its manifest) and
the length of its schedule in global steps. It trains one pass over the tensors it is given (an
epoch over every shard for ``task``, a sub-epoch over one partition for ``mop``, an epoch of
the transfer set for the distilled student), resuming mid-pass from a batch; evaluates in
batches; and exports and imports its whole state (weights, AdamW moments, global step, the
position inside a pass and the RNG there) as safetensors plus JSON, so it can hop between
workers or be checkpointed, and loading it never unpickles.

Each pass's row order is a function of (seed, epoch, pass index) alone (``training/trainable/batches.py``)
and the learning rate a function of the global step alone (``training/trainable/schedule.py``): a configuration follows the same
curve on the same batches wherever it trains and however often it was stopped.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mopflow.training.compute.devices import CPU, DeviceSpec
from mopflow.training.models.families import DataSpec
from mopflow.training.trainable.augment import AugmentedBatches
from mopflow.training.trainable.batches import Batches, pass_order, rank_share
from mopflow.training.trainable.loop import StepCount, TrainerSteps, plain_pass, trainer_pass
from mopflow.training.trainable.state import load_moments, moments_of, pack, state_metadata

EVAL_BATCH = 4096  # rows per evaluation batch: a split need not fit on the device at once


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
class PassRecord:
    """What one pass did: rows seen, optimizer steps, mean loss, learning rate at its end."""

    rows: int
    steps: int
    train_loss: float
    lr_end: float
    resumed_at_batch: int
    # inside the batch loop (not Trainer set-up or state packing); a timing, not what the pass did
    loop_s: float = field(default=0.0, compare=False)


class PassInterrupted(Exception):  # noqa: N818 - a stop asked for, not an error
    """A pass stopped at a batch boundary because ``stop()`` said so; ``state`` continues it."""

    def __init__(self, state: bytes, batches: int, n_batches: int) -> None:
        super().__init__(f"stopped at batch {batches}/{n_batches}")
        self.state, self.batches, self.n_batches = state, batches, n_batches


@dataclass(frozen=True)
class _PassPlan:
    """Where one pass starts: its position, its length in batches and, resumed, the batches and
    the loss (sum, count) done before it stopped."""

    epoch: int
    pass_index: int
    part: str
    n_batches: int
    skip: int  # batches done before a stop (0: from the start)
    loss_so_far: list[Any] | None  # None: a fresh pass


class TrainableUnit:
    """One model with its optimizer moments, schedule position and pass position.

    ``lr``, ``weight_decay`` and ``batch_size`` come from the spec's params; ``temperature`` and
    ``alpha`` weigh a soft-target term when a pass's tensors carry soft targets (distillation).
    """

    def __init__(
        self,
        spec: ModelSpec,
        model: Any,
        total_steps: int,
        temperature: float = 1.0,
        alpha: float = 0.0,
        arch: Any = None,
    ) -> None:
        self.spec, self.model, self.total_steps = spec, model, int(total_steps)
        self.arch = arch  # the model's ArchSpec (bundles record it)
        self.temperature, self.alpha = temperature, alpha
        self.global_step = 0
        self.meta: dict[str, Any] = {}  # the caller's facts carried in the state (epoch, visits)
        self._moments: dict[int, dict[str, Any]] = {}
        self._partial: dict[str, Any] | None = None  # where a stopped pass goes on
        self._rng: Any = None
        self.augment: Any = None  # an Augmenter of the training batches (training.trainable.augment)

    @classmethod
    def build(
        cls, spec: ModelSpec, manifest: Mapping[str, Any], total_steps: int, **loss: float
    ) -> TrainableUnit:
        """A fresh unit: the spec's architecture on the manifest's features, seeded by the spec."""
        from mopflow.training.models.builtin import ArchSpec, build_model

        arch = ArchSpec.from_params(spec.params, DataSpec.from_manifest(manifest))
        norm = manifest["normalization"]
        spec.device.seed(spec.seed)
        return cls(spec, build_model(arch, norm["mean"], norm["std"]), total_steps, arch=arch, **loss)

    # ------------------------------------------------------------------------------ training

    def train_pass(
        self,
        tensors: Sequence[Any],
        epoch: int,
        pass_index: int = 0,
        part: str = "",
        stop: Callable[[], bool] | None = None,
        callbacks: Sequence[Any] = (),
        shard: tuple[int, int] = (0, 1),
        trainer_kwargs: Mapping[str, Any] | None = None,
    ) -> PassRecord:
        """Train one pass over ``tensors`` (``(x, y)`` or ``(x, y, soft_targets)``).

        ``part`` names what the pass covers (e.g. its shards): a state stopped mid-pass goes on
        only in the same (epoch, pass, part), from the batch it stopped at, with its RNG state.
        ``stop`` is asked after every batch; when it says so (before the last batch) the pass
        raises :class:`PassInterrupted` with the state at that batch boundary. ``callbacks`` are
        extra Lightning callbacks for this pass (e.g. a clock). ``shard = (rank, world)`` trains
        rank ``rank``'s share of the pass's order (every ``world``-th row, the order padded from
        its start to a multiple of ``world``, as DDP's sampler does) and ``trainer_kwargs`` adds to
        the Trainer's settings (a DDP strategy and its node count).
        """
        from mopflow.training.data.streaming import StreamedRows

        batch_size = int(self.spec.params["batch_size"])
        streamed = tensors if isinstance(tensors, StreamedRows) else None
        if streamed is not None:  # read pass by pass from the shards (a partition over the budget)
            n_rows = streamed.n_rows // shard[1] if shard[1] > 1 else streamed.n_rows
        else:
            order = rank_share(pass_order(self.spec.seed, epoch, pass_index, len(tensors[0])), *shard)
            n_rows = len(order)
        plan = self._start_pass(epoch, pass_index, part, n_rows, batch_size)
        holder: dict[str, Any] = {}  # the pass's optimizer, once made
        module = self._module(plan, holder)
        plain = self.trains_without_trainer(callbacks, trainer_kwargs)
        steps_done = StepCount() if plain else None
        if stop is not None:
            module.after_batch = self._stop_watch(
                stop, plan, holder, (steps_done or TrainerSteps(module)).count
            )
        batches: Any
        if streamed is not None:
            device = str(self.spec.device.torch_device())
            batches = streamed.batches(
                self.spec.seed, epoch, pass_index, batch_size, plan.skip, shard, device
            )
        else:
            batches = Batches(
                [self._on_device(t) for t in tensors], order[plan.skip * batch_size :], batch_size
            )
        if self.augment:  # on the worker, each batch seeded by its place in the pass
            batches = AugmentedBatches(batches, self.augment, self.spec.seed, epoch, pass_index, plan.skip)
        if steps_done is not None:
            plain_pass(module, batches, steps_done, self.spec.device.torch_device())
            steps = steps_done.completed
        else:
            in_runs = streamed is None and shard[1] == 1
            steps = trainer_pass(module, batches, self.spec.device, callbacks, trainer_kwargs, in_runs)
        self.capture(holder["optimizer"], self.global_step + steps)
        self._on_host()
        return PassRecord(
            rows=n_rows,
            steps=steps,
            train_loss=float(module.last_train_loss),
            lr_end=float(holder["optimizer"].param_groups[0]["lr"]),
            resumed_at_batch=plan.skip,
            loop_s=float(holder.get("loop_s", 0.0)),
        )

    def trains_without_trainer(
        self, callbacks: Sequence[Any] = (), trainer_kwargs: Mapping[str, Any] | None = None
    ) -> bool:
        """Whether a pass trains in the plain loop (:func:`~mopflow.training.trainable.lit.plain_pass`):
        on one device in 32-bit precision, with no Lightning callback and no Trainer setting of
        the caller's (DDP's strategy). Everything else fits a Lightning Trainer."""
        return not callbacks and not trainer_kwargs and self.spec.device.precision == "32"

    def _start_pass(self, epoch: int, pass_index: int, part: str, n_rows: int, batch_size: int) -> _PassPlan:
        """Where the pass starts: at the batch a state stopped in this same (epoch, pass, part)
        left off, with its RNG state and loss so far, else at the start with the epoch's seed.
        Consumes the stopped pass's position."""
        import torch

        partial, self._partial = self._partial, None
        same_pass = partial is not None and (partial["epoch"], partial["pass_index"], partial["part"]) == (
            epoch,
            pass_index,
            part,
        )
        resumed = partial if same_pass else None
        self.spec.device.seed(self.spec.seed + epoch)
        if resumed is not None:
            torch.set_rng_state(self._rng)
        return _PassPlan(
            epoch,
            pass_index,
            part,
            n_batches=-(-n_rows // batch_size),
            skip=int(resumed["batches"]) if resumed is not None else 0,
            loss_so_far=list(resumed.get("loss_so_far", [0.0, 0])) if resumed is not None else None,
        )

    def _module(self, plan: _PassPlan, holder: dict[str, Any]) -> Any:
        """The Lightning module of one pass: the unit's model, its optimizer restored with the
        unit's moments (and kept in ``holder``), its schedule going on from the global step."""
        import torch

        from mopflow.training.trainable.lit import Classifier

        unit = self
        loss_so_far = plan.loss_so_far

        class UnitModule(Classifier):
            def restore_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
                holder["optimizer"] = optimizer
                unit.restore_moments(optimizer)

            def on_train_epoch_start(self) -> None:
                super().on_train_epoch_start()
                # a resumed pass's mean loss covers the batches done before the stop too
                self._epoch_loss = [float(loss_so_far[0]), int(loss_so_far[1])] if loss_so_far else [0.0, 0]
                holder["loop_started"] = time.perf_counter()

            def on_train_epoch_end(self) -> None:
                holder["loop_s"] = time.perf_counter() - holder["loop_started"]
                super().on_train_epoch_end()  # the epoch's mean loss

        module = UnitModule(
            self.model,
            lr=float(self.spec.params["lr"]),
            weight_decay=float(self.spec.params["weight_decay"]),
            temperature=self.temperature,
            alpha=self.alpha,
            total_steps=self.total_steps,
            start_step=self.global_step,
        )
        holder["module"] = module
        module.epoch_label = plan.epoch
        module.log_train_loss = False  # the pass record carries it (DDP ranks reduce it themselves)
        return module

    def _stop_watch(
        self, stop: Callable[[], bool], plan: _PassPlan, holder: dict[str, Any], steps: Callable[[], int]
    ) -> Callable[[int], None]:
        """What the pass's module calls after every batch: it asks ``stop`` and, when that says so
        before the last batch, keeps the unit's position there (``steps()``: the pass's optimizer
        steps so far) and raises :class:`PassInterrupted`."""
        import torch

        unit = self

        def after_batch(done: int) -> None:
            if not stop():
                return
            batches = plan.skip + done
            if batches >= plan.n_batches:  # the pass is done anyway
                return
            unit.capture(holder["optimizer"], unit.global_step + steps())
            unit._partial = {
                "epoch": plan.epoch,
                "pass_index": plan.pass_index,
                "part": plan.part,
                "batches": batches,
                "loss_so_far": list(holder["module"]._epoch_loss),
            }
            unit._rng = torch.get_rng_state()
            raise PassInterrupted(unit.export_state(), batches, plan.n_batches)

        return after_batch

    def capture(self, optimizer: Any, global_step: int) -> None:
        """Take the optimizer's moments and the global step reached (what an export saves)."""
        self.global_step = int(global_step)
        self._moments = moments_of(optimizer)

    def restore_moments(self, optimizer: Any) -> None:
        """Put the unit's optimizer moments into a new optimizer of its model's parameters."""
        load_moments(optimizer, self._moments)

    def _on_host(self) -> None:
        """Between passes the weights live on the host (packing, evaluation); a CPU unit's are
        there already (moving them still walks every module)."""
        if self.spec.device.is_gpu:
            self.model.cpu()

    def _on_device(self, tensor: Any) -> Any:
        device = self.spec.device.torch_device()
        return tensor if tensor.device == device else tensor.to(device)

    def evaluate(self, x: Any, y: Any) -> float:
        """Top-1 accuracy on ``(x, y)``, in batches, on the unit's device."""
        return self.correct_rows(x, y) / len(y) if len(y) else math.nan

    def correct_rows(self, x: Any, y: Any) -> int:
        """Rows of ``(x, y)`` whose top-1 prediction is the label, in batches, on the unit's device
        (split shards add up to the split's accuracy)."""
        import torch

        from mopflow.training.models.metrics import top1_correct

        device = self.spec.device.torch_device()
        if self.spec.device.is_gpu:
            self.model.to(device)
        self.model.eval()
        x, correct = torch.as_tensor(x), 0
        with torch.no_grad():
            for start in range(0, len(x), EVAL_BATCH):
                scores = self.model(x[start : start + EVAL_BATCH].to(device))
                correct += top1_correct(scores, y[start : start + EVAL_BATCH])
        self._on_host()
        self.model.train()
        return correct

    # ------------------------------------------------------------------------ state in and out

    def export_state(self, meta: Mapping[str, Any] | None = None) -> bytes:
        """The whole state as safetensors bytes: weights, AdamW moments, the RNG of a stopped
        pass, and JSON metadata (global step, the stopped pass's position, ``meta``)."""
        # no copies: packing writes every tensor into the bytes before anything trains again
        tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in self.model.state_dict().items()}
        steps: dict[str, float] = {}
        for index, moments in self._moments.items():
            for name in ("exp_avg", "exp_avg_sq"):
                tensors[f"opt.{index}.{name}"] = moments[name].detach().cpu().contiguous()
            steps[str(index)] = float(moments["step"])
        if self._partial is not None and self._rng is not None:
            tensors["extra.rng"] = self._rng
        info = {
            **self.meta,
            **dict(meta or {}),
            "model_id": self.spec.model_id,
            "global_step": self.global_step,
        }
        if self._partial is not None:
            info["partial"] = dict(self._partial)
        return pack(tensors, {"meta": json.dumps(info), "steps": json.dumps(steps)})

    def import_state(self, data: bytes) -> dict[str, Any]:
        """Load a state exported by any unit of the same spec; return its metadata."""
        from safetensors.torch import load

        metadata = state_metadata(data)
        tensors = load(data)
        self.model.load_state_dict(
            {k[6:]: v for k, v in tensors.items() if k.startswith("model.")}, strict=True
        )
        steps = json.loads(metadata.get("steps", "{}"))
        self._moments = {
            int(index): {
                "step": float(step),
                "exp_avg": tensors[f"opt.{index}.exp_avg"],
                "exp_avg_sq": tensors[f"opt.{index}.exp_avg_sq"],
            }
            for index, step in steps.items()
        }
        meta: dict[str, Any] = json.loads(metadata.get("meta", "{}"))
        self.global_step = int(meta.pop("global_step", max((int(s) for s in steps.values()), default=0)))
        partial = meta.pop("partial", None)
        self._partial = dict(partial) if partial and "extra.rng" in tensors else None
        self._rng = tensors.get("extra.rng")
        meta.pop("model_id", None)
        self.meta = meta
        return {**meta, "global_step": self.global_step, **({"partial": partial} if partial else {})}
