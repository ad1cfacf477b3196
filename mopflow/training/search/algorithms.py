"""The search's algorithms as registries: samplers and pruners by name, one factory each.

The names a config may choose (``sampler=``, ``pruner=``) are the keys here; the config's types
(``SamplerName``, ``PrunerName`` in :mod:`mopflow.training.search.names`) are checked against them
when this module is imported. Everything decides in the coordinator, where every epoch is
reported. The strategies' executors are the registry ``mopflow.training.search.sweep.STRATEGIES``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, get_args

from mopflow.training.search.names import PrunerName, SamplerName

if TYPE_CHECKING:
    import optuna

    from mopflow.training.search.config import SearchConfig

REDUCTION_FACTOR = 3  # successive halving and Hyperband keep the best third at each rung


def _startup(cfg: SearchConfig) -> int:
    """Random trials before a model-based sampler takes over: a third of the budget, 2 to 10."""
    return max(2, min(10, cfg.n_trials // 3))


def _tpe(cfg: SearchConfig) -> optuna.samplers.BaseSampler:
    import optuna

    # group=True: the space is conditional (each family has its own params)
    return optuna.samplers.TPESampler(
        seed=cfg.seed, n_startup_trials=_startup(cfg), multivariate=True, group=True
    )


def _random(cfg: SearchConfig) -> optuna.samplers.BaseSampler:
    import optuna

    return optuna.samplers.RandomSampler(seed=cfg.seed)


def _gp(cfg: SearchConfig) -> optuna.samplers.BaseSampler:
    import optuna

    # categorical and family-specific params outside the shared space are sampled independently
    return optuna.samplers.GPSampler(
        seed=cfg.seed, n_startup_trials=_startup(cfg), warn_independent_sampling=False
    )


def _cmaes(cfg: SearchConfig) -> optuna.samplers.BaseSampler:
    import optuna

    # CMA-ES models the continuous params; categoricals (family, batch size) are sampled at random
    return optuna.samplers.CmaEsSampler(
        seed=cfg.seed,
        n_startup_trials=_startup(cfg),
        warn_independent_sampling=False,
        independent_sampler=optuna.samplers.RandomSampler(seed=cfg.seed),
    )


@dataclass(frozen=True)
class SamplerKind:
    """A sampler the config can name: how it is built, and whether the space's grid points are
    enqueued before it samples."""

    build: Callable[[SearchConfig], Any]
    enqueues_grid: bool = False


@dataclass(frozen=True)
class PrunerKind:
    """A pruner the config can name: how it is built from (min resource, max resource), and
    whether the search's controller keeps the rungs itself, so that a model below a rung's top
    third waits there and may be promoted later instead of being stopped for good."""

    build: Callable[[int, int | None], Any]
    waiting_rungs: bool = False
    # the epoch counts after which it may stop a trial, from (min resource, epochs); None: after any
    decides_after: Callable[[int, int], list[int] | None] = lambda min_resource, epochs: None


SAMPLERS: dict[str, SamplerKind] = {
    "tpe": SamplerKind(_tpe),
    "random": SamplerKind(_random),
    # the grid points are enqueued (study.enqueue_grid); past them, seeded random
    "grid": SamplerKind(_random, enqueues_grid=True),
    "gp": SamplerKind(_gp),
    "cmaes": SamplerKind(_cmaes),
}


def _none(min_resource: int, max_resource: int | None) -> optuna.pruners.BasePruner:
    import optuna

    return optuna.pruners.NopPruner()


def _successive_halving(min_resource: int, max_resource: int | None) -> optuna.pruners.BasePruner:
    import optuna

    # Optuna's successive halving is asynchronous (ASHA, Li et al. 2020): a trial is compared
    # with those that reached the same rung, without waiting for a full bracket
    return optuna.pruners.SuccessiveHalvingPruner(
        min_resource=min_resource, reduction_factor=REDUCTION_FACTOR
    )


def _hyperband(min_resource: int, max_resource: int | None) -> optuna.pruners.BasePruner:
    import optuna

    top = max_resource if max_resource is not None else "auto"
    if isinstance(top, int) and top <= min_resource:  # a single rung: successive halving
        return _successive_halving(min_resource, max_resource)
    return optuna.pruners.HyperbandPruner(
        min_resource=min_resource, max_resource=top, reduction_factor=REDUCTION_FACTOR
    )


def _median(min_resource: int, max_resource: int | None) -> optuna.pruners.BasePruner:
    import optuna

    return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=max(min_resource - 1, 0))


def rung_epochs(min_resource: int, epochs: int, reduction_factor: int = REDUCTION_FACTOR) -> list[int]:
    """The rungs' epoch counts: ``min_resource * reduction_factor**k`` below ``epochs`` (the
    controller's own rungs under asha, ``training/search/rungs.py``)."""
    rungs, at = [], max(min_resource, 1)
    while at < epochs:
        rungs.append(at)
        at *= reduction_factor
    return rungs


def _optuna_rung_epochs(min_resource: int, epochs: int) -> list[int]:
    """Where Optuna's successive halving (and each Hyperband bracket, a successive halving from a
    higher rung) decides: at the step ``min_resource * REDUCTION_FACTOR**k``, steps counted from 0,
    so after one epoch more than the rung."""
    return [rung + 1 for rung in rung_epochs(min_resource, epochs) if rung + 1 < epochs]


def _never(min_resource: int, epochs: int) -> list[int]:
    return []


PRUNERS: dict[str, PrunerKind] = {
    # asha: the study carries Optuna's successive halving, and the controller keeps the rungs
    # (training/search/rungs.py)
    "asha": PrunerKind(_successive_halving, waiting_rungs=True, decides_after=rung_epochs),
    "successive_halving": PrunerKind(_successive_halving, decides_after=_optuna_rung_epochs),
    "hyperband": PrunerKind(_hyperband, decides_after=_optuna_rung_epochs),
    "median": PrunerKind(_median),  # after any epoch past its warm-up
    "none": PrunerKind(_none, decides_after=_never),
}

# the config's choices are exactly the registries' names (checked once, here)
if set(get_args(SamplerName)) != set(SAMPLERS) or set(get_args(PrunerName)) != set(PRUNERS):
    raise ImportError(
        "mopflow.training.search.algorithms: the SamplerName/PrunerName choices and the registries disagree"
    )


def make_sampler(cfg: SearchConfig, space: Any = None) -> optuna.samplers.BaseSampler:
    """The seeded sampler ``cfg.sampler`` names."""
    try:
        factory = SAMPLERS[cfg.sampler]
    except KeyError:
        raise ValueError(f"unknown sampler {cfg.sampler!r}; expected one of {sorted(SAMPLERS)}") from None
    sampler: optuna.samplers.BaseSampler = factory.build(cfg)
    return sampler


def make_pruner(name: str, min_resource: int, max_resource: int | None = None) -> optuna.pruners.BasePruner:
    """The pruner ``name`` names; ``max_resource`` (the epoch budget) is Hyperband's top rung."""
    try:
        factory = PRUNERS[name]
    except KeyError:
        raise ValueError(f"unknown pruner {name!r}; expected one of {sorted(PRUNERS)}") from None
    pruner: optuna.pruners.BasePruner = factory.build(min_resource, max_resource)
    return pruner


def enqueues_grid(sampler: str) -> bool:
    """Whether the sampler ``sampler`` names starts from the space's grid points."""
    return SAMPLERS[sampler].enqueues_grid


def keeps_waiting_rungs(pruner: str) -> bool:
    """Whether under the pruner ``pruner`` names the controller keeps the rungs itself."""
    return PRUNERS[pruner].waiting_rungs


def decision_epochs(pruner: str, min_resource: int, epochs: int) -> list[int] | None:
    """The epoch counts after which the pruner ``pruner`` names may stop a trial of ``epochs``
    epochs (None: after any epoch)."""
    return PRUNERS[pruner].decides_after(min_resource, epochs)
