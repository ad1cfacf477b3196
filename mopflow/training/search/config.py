"""The search stage's frozen, validated config."""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator

from mopflow.training.config import StageConfig
from mopflow.training.executors.scheduler import MopScheduleName
from mopflow.training.search.names import PrunerName, SamplerName, StrategyName
from mopflow.training.search.space import SearchSpace, default_space, parse_space
from mopflow.training.trainable.augment import parse_spec
from mopflow.training.volatile.schedules import WorkerSchedule

_SCHEDULE_ARGS: dict[str, tuple[tuple[str, ...], int]] = {  # kind -> (positional fields, how many required)
    "static": (("n_max",), 1),
    "step": (("n_start", "increment", "n_max", "period"), 3),
    "exponential": (("eta", "n_max"), 2),
}


SCHEDULE_SPEC_HELP = (
    "'' or 'static' (a fixed cluster), 'static:<n>', 'step:<n_start>:<increment>:<n_max>[:<period>]', "
    "'exponential:<eta>:<n_max>' (rounds are epochs)"
)


DEFAULT_MIN_RESOURCE = 15  # min_resource when none is given


class SearchConfig(StageConfig):
    """The Optuna search: budget, parallelism, sampler and pruner, and the space (as data)."""

    n_trials: int = Field(20, ge=1, le=1000, description="Number of trials to finish")
    epochs: int = Field(80, ge=1, le=1000, description="Training epochs per trial")
    parallel_trials: int = Field(
        2,
        ge=1,
        le=256,
        description="Trials trained at once under task, on the Dask workers (MOPFLOW_DASK_WORKERS); more "
        "than the workers keeps them busier, but the sampler and the pruner then learn later",
    )
    trial_batches: bool = Field(
        False,
        description="strategy=task: start trials in batches of parallel_trials, the next once the whole batch "
        "has finished, and train a batch in step (each epoch decided in trial order once all its trials "
        "reported it): runs with the same seed give the same trials, but a batch waits for its slowest trial",
    )
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Sampler and training seed")
    sampler: SamplerName = Field(
        "tpe", description="Optuna sampler, seeded: tpe, random, grid, gp (Gaussian process), cmaes"
    )
    pruner: PrunerName = Field(
        "asha",
        description="Pruner at epoch boundaries: asha (waiting models promoted later), "
        "successive_halving (Optuna's, no waiting), hyperband, median, none",
    )
    augment: str = Field(
        "auto",
        max_length=200,
        description="Augmentation of the training batches, on the workers, seeded: 'auto' (images: "
        "flip,shift:2; sequences: shift:2,noise:0.02; tables: none), 'none', or names with an optional "
        "amount: crop[:min scale], flip[:probability], shift[:pixels or steps], noise[:relative std]",
    )
    grid_points: int = Field(
        3, ge=2, le=32, description="sampler=grid: values per int/float parameter (log-spaced if log)"
    )
    min_resource: int | None = Field(
        None,
        ge=1,
        le=1000,
        description=f"Epochs before the first pruning decision; at most epochs (none = {DEFAULT_MIN_RESOURCE}, "
        "which prunes nothing when epochs is smaller)",
    )
    timeout_minutes: float | None = Field(None, gt=0, le=7 * 24 * 60, description="Wall-clock budget")
    epoch_budget: int | None = Field(
        None,
        ge=1,
        le=10_000_000,
        description="Start no more trials once this many epochs were trained over all trials (trials running "
        "finish): a compute budget, so pruning buys more trials; None = n_trials alone",
    )
    goal_val_acc: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Start no more trials once a trial reports this validation accuracy (trials running "
        "finish); None = the whole budget",
    )
    space: SearchSpace | None = Field(
        None,
        description="Search space spec (JSON text or a mapping, parsed once); None = the packaged default",
    )
    strategy: StrategyName = Field(
        "task", description="task: a trial per worker; ddp: each trial on W DDP processes; mop: model hopper"
    )
    ddp_world_size: int = Field(2, ge=1, le=64, description="DDP processes per trial (strategy=ddp)")
    ddp_collective_timeout_s: float = Field(
        120.0,
        ge=5,
        le=3600,
        description="strategy=ddp: seconds a collective waits for a rank before the trial restarts from its "
        "checkpoint on another gang (a rank's host lost, or the link between ranks cut)",
    )
    bf16_compress: bool = Field(False, description="bf16 gradient compression hook under DDP")
    model_slots: int = Field(4, ge=1, le=256, description="Models training at once under strategy=mop")
    mop_schedule: MopScheduleName = Field(
        "fixed",
        description="strategy=mop: fixed (each epoch's hops are a seeded plan: runs with the same seed train "
        "the same models) or greedy (whichever worker frees first takes a unit: faster when models differ "
        "in size, but runs differ)",
    )
    mop_lookahead: bool = Field(
        True,
        description="strategy=mop: a worker the round has no more units for starts a model's next epoch "
        "before the round's decisions; kept when the model goes on (it trains the same either way), "
        "dropped when it is stopped",
    )
    mop_ask_ahead: bool = Field(
        True,
        description="strategy=mop with mop_lookahead: the trials that take the slots of models in their last "
        "epoch are asked during that epoch, so their first units train while the finished trials are told; "
        "the sampler proposes them without those models' last epoch (off: the finished trials are told, then "
        "the next ones asked, while the workers wait)",
    )
    warm_start: bool = Field(
        False, description="Enqueue the current champion's trial parameters as the first trial"
    )
    warm_start_studies: int = Field(
        0,
        ge=0,
        le=20,
        description="A new study learns from the trials of up to this many earlier studies in the Optuna "
        "storage of the same dataset, space and epochs (newest first): the sampler models them from the "
        "start, ASHA's rungs hold their values, and their best configuration is tried first; 0 = off",
    )

    worker_schedule: WorkerSchedule | None = Field(
        None,
        description="Scale the Dask cluster to n_j workers in round j (unit=epoch; task and mop); "
        "None = a fixed cluster. A string spec is accepted: " + SCHEDULE_SPEC_HELP,
    )
    scale_timeout_s: float = Field(
        120.0, gt=0, le=3600, description="Seconds a scale-up waits for workers to join before going on"
    )
    spot_trace: str = Field(
        "",
        max_length=4096,
        description="Price trace CSV (timestamp,price) replayed against the LocalCluster's workers; "
        "empty = off",
    )
    spot_bids: list[float] | None = Field(
        None, max_length=256, description="spot_trace: one bid per LocalCluster worker (per worker-hour)"
    )
    spot_speed: float = Field(
        60.0, gt=0, le=1e6, allow_inf_nan=False, description="spot_trace: trace seconds per real second"
    )

    @field_validator("worker_schedule", mode="before")
    @classmethod
    def _schedule_spec(cls, value: Any) -> Any:
        return parse_worker_schedule(value) if isinstance(value, str) else value

    @field_validator("spot_bids", mode="before")
    @classmethod
    def _bids_text(cls, value: Any) -> Any:
        return parse_bids(value) if isinstance(value, str) else value

    @field_validator("spot_trace")
    @classmethod
    def _trace_location(cls, value: str) -> str:
        if value and (not value.strip() or any(ord(c) < 32 for c in value)):
            raise ValueError(f"spot_trace {value!r} must be a path or URL without control characters")
        if value and not value.lower().endswith(".csv"):
            raise ValueError(
                f"spot_trace {value!r} must name a timestamp,price CSV file (a path or fsspec URL "
                "ending in .csv), or be empty for no replay"
            )
        return value

    @property
    def first_rung(self) -> int:
        """Epochs before the first pruning decision: ``min_resource``, or its default."""
        return DEFAULT_MIN_RESOURCE if self.min_resource is None else self.min_resource

    @model_validator(mode="after")
    def _first_rung_within_epochs(self) -> SearchConfig:
        if self.min_resource is not None and self.pruner != "none" and self.min_resource > self.epochs:
            raise ValueError(
                f"min_resource={self.min_resource} is more than epochs={self.epochs}: no trial would "
                f"ever reach a pruning decision; give min_resource <= {self.epochs}, or pruner='none'"
            )
        return self

    @model_validator(mode="after")
    def _batches_under_task(self) -> SearchConfig:
        if self.trial_batches and self.strategy != "task":
            raise ValueError(
                f"trial_batches applies to strategy='task', not {self.strategy!r} (ddp trains one trial "
                "at a time; under mop, mop_schedule='fixed' fixes the order)"
            )
        if self.trial_batches and self.worker_schedule is not None:
            raise ValueError(
                "trial_batches and worker_schedule cannot be combined: the schedule sizes each batch by "
                "the workers present, trial_batches by parallel_trials"
            )
        return self

    @model_validator(mode="after")
    def _volatile(self) -> SearchConfig:
        schedule = self.worker_schedule
        if schedule is not None:
            if self.strategy not in ("task", "mop"):
                raise ValueError(
                    f"worker_schedule scales the Dask cluster for strategy task or mop, not {self.strategy!r}"
                )
            if schedule.unit != "epoch":
                raise ValueError(
                    f"worker_schedule.unit must be 'epoch' (the cluster changes size between rounds), "
                    f"got {schedule.unit!r}"
                )
        if bool(self.spot_trace) != (self.spot_bids is not None):
            raise ValueError(
                "spot_trace and spot_bids go together: a price trace and one bid per worker "
                f"(got spot_trace={self.spot_trace!r}, spot_bids={self.spot_bids!r})"
            )
        if self.spot_bids is not None:
            if not self.spot_bids:
                raise ValueError("spot_bids must hold one bid per LocalCluster worker, got []")
            for i, bid in enumerate(self.spot_bids):
                if not 0 <= bid < float("inf"):
                    raise ValueError(f"spot_bids[{i}]={bid}: a bid must be a finite number >= 0")
            if self.strategy not in ("task", "mop"):
                raise ValueError(
                    f"spot_trace replay runs with strategy 'task' or 'mop' (a trial or unit resumes "
                    f"from its notice checkpoint on any worker), not {self.strategy!r}"
                )
            if schedule is not None:
                raise ValueError(
                    "spot_trace and worker_schedule cannot be combined (both resize the cluster)"
                )
        return self

    @field_validator("augment")
    @classmethod
    def _augment(cls, value: str) -> str:
        parse_spec(value)  # an AugmentError (a ValueError) names the bad part
        return value.strip().lower()

    @field_validator("space", mode="before")
    @classmethod
    def _parse_space(cls, value: Any) -> SearchSpace | None:
        if value is None or isinstance(value, SearchSpace):
            return value
        return parse_space(value)  # JSON text or a mapping; a SpaceError names what is wrong

    def search_space(self, modality: str = "table") -> SearchSpace:
        """The search space (``None``: the default space of the data's modality)."""
        return default_space(modality) if self.space is None else self.space


def parse_worker_schedule(spec: str) -> WorkerSchedule | None:
    """A worker schedule from its flat-config spec (rounds are epochs, ``unit="epoch"``):

    ``""``, ``"none"`` or ``"static"``: None (a fixed cluster); ``"static:<n>"``: n workers every
    round; ``"step:<n_start>:<increment>:<n_max>[:<period>]"`` (period in rounds, default 1);
    ``"exponential:<eta>:<n_max>"``: ``n_j = min(ceil(eta^(j-1)), n_max)``.
    """
    text = spec.strip().lower()
    if text in ("", "none", "static"):
        return None
    kind, *args = [part.strip() for part in text.split(":")]
    if kind not in _SCHEDULE_ARGS:
        raise ValueError(f"worker_schedule {spec!r}: unknown kind {kind!r}; expected {SCHEDULE_SPEC_HELP}")
    names, required = _SCHEDULE_ARGS[kind]
    if not required <= len(args) <= len(names):
        raise ValueError(
            f"worker_schedule {spec!r}: {kind} takes {':'.join(f'<{n}>' for n in names[:required])}"
            + (f"[:<{names[-1]}>]" if len(names) > required else "")
            + f", got {len(args)} value(s)"
        )
    fields: dict[str, Any] = {"kind": kind, "unit": "epoch"} | ({"period": 1} if kind == "step" else {})
    for name, raw in zip(names, args, strict=False):
        try:
            fields[name] = float(raw) if name == "eta" else int(raw)
        except ValueError:
            expected = "a number" if name == "eta" else "an integer"
            raise ValueError(f"worker_schedule {spec!r}: {name}={raw!r} is not {expected}") from None
    try:
        return WorkerSchedule(**fields)
    except ValidationError as exc:
        problems = "; ".join(
            (f"{e['loc'][0]}={e.get('input')!r}: " if e["loc"] else "")
            + str(e["msg"]).removeprefix("Value error, ")
            for e in exc.errors()
        )
        raise ValueError(f"worker_schedule {spec!r}: {problems}") from None


def format_worker_schedule(schedule: WorkerSchedule | None) -> str:
    """The flat-config spec of a schedule (the inverse of :func:`parse_worker_schedule`)."""
    if schedule is None:
        return ""
    if schedule.kind == "static":
        return f"static:{schedule.n_max}"
    if schedule.kind == "step":
        return f"step:{schedule.n_start}:{schedule.increment}:{schedule.n_max}:{schedule.period}"
    return f"exponential:{schedule.eta:.15g}:{schedule.n_max}"


def parse_bids(text: str) -> list[float] | None:
    """Bids written as text (the trigger form): numbers separated by commas or spaces, optionally
    in brackets; empty = None."""
    items = [t for t in re.split(r"[,\s]+", text.strip().strip("[]")) if t]
    if not items:
        return None
    bids = []
    for i, item in enumerate(items):
        try:
            bids.append(float(item))
        except ValueError:
            raise ValueError(f"spot_bids[{i}]={item!r} is not a number (bids: e.g. '1.0, 0.5')") from None
    return bids
