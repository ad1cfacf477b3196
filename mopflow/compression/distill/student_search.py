"""A multi-objective student search: the most accurate student for a serving budget.

With ``student_trials`` > 0 the distill stage does not take one student of a fixed family and
depth: an Optuna study with two objectives, validation accuracy after distillation (maximised)
and the serving cost (minimised: the p95 latency under ``student_budget_ms``, else the
parameters), searches the student's family (every registered student family that takes the
data), depth and width (up to the parameter budget). Optuna's multi-objective TPE proposes; a
candidate's cost is known before it trains (an untrained model answers as fast as a trained one),
so a candidate over a budget is pruned without training. The others are distilled on the Dask
workers, as many at once as there are workers, each on the same transfer set for the same
epochs as the registered student. The chosen student is the most accurate candidate on the
Pareto front within the budgets; it and its hard-label twin are then trained as without a search.

The study lives in the pipeline's Optuna storage under ``<study>-students``: a rerun of the stage
goes on with the candidates already told. This module holds the search's logic; its side effects
(training, timing, tracking) are injected by the stage.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mopflow.training.models.builtin import ArchSpec, count_params, largest_size_within
from mopflow.training.models.families import DataSpec, registered_families

log = logging.getLogger(__name__)

MAX_DEPTH = 6  # deeper students are slower to serve than a budget is likely to allow
OBJECTIVES = ("val_acc", "cost")


@dataclass(frozen=True)
class FamilyRange:
    """What the search may take of one student family: its depths and, for each, its widths."""

    family: str
    depths: tuple[int, ...]  # (1,) for a family without a depth parameter
    widths: Mapping[int, tuple[int, int]]  # depth -> (lowest, highest) size within the budget


@dataclass(frozen=True)
class Candidate:
    """One proposed student: its architecture, size and serving cost; ``val_acc`` once distilled
    (None: pruned over a budget, or failed)."""

    number: int
    arch: ArchSpec
    num_params: int
    latency_p95_ms: float | None
    val_acc: float | None
    bundle_uri: str = ""

    @property
    def cost(self) -> float:
        """The second objective: the p95 latency when timed, else the parameters."""
        return self.latency_p95_ms if self.latency_p95_ms is not None else float(self.num_params)

    def to_dict(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "family": self.arch.family,
            "params": dict(self.arch.params),
            "num_params": self.num_params,
            "latency_p95_ms": self.latency_p95_ms,
            "val_acc": self.val_acc,
            "bundle_uri": self.bundle_uri,
        }


def family_params(family: str, depth: int | None, width: int) -> dict[str, Any]:
    """A student family's params: its defaults, ``depth`` where it has one, ``width`` as its size."""
    spec = registered_families()[family]
    params = spec.default_params()
    if depth is not None and "depth" in spec.params:
        params["depth"] = depth
    params[str(spec.size_param)] = width
    return params


def candidate_space(
    data: DataSpec, max_params: int, serves: Callable[[ArchSpec], bool] | None = None
) -> list[FamilyRange]:
    """Every registered student family with a size parameter that takes ``data``: the depths
    that fit the data and, per depth, the widths whose model has at most ``max_params``. With
    ``serves`` (whether a model serves within the latency budget), each depth's widths end at
    the largest that serves within it (a bisection), and a depth whose smallest width does not
    ends the family's depths (a deeper model is slower): every candidate then fits the budget,
    and no trial is spent on one that cannot."""
    ranges = []
    for name, spec in sorted(registered_families().items()):
        if not (spec.can_be_student and spec.size_param and spec.fits(data)):
            continue
        size = spec.params[spec.size_param]
        depth_spec = spec.params.get("depth")
        depths = (
            range(int(depth_spec["low"]), min(int(depth_spec["high"]), MAX_DEPTH) + 1)
            if depth_spec
            else [None]
        )
        widths: dict[int, tuple[int, int]] = {}
        for depth in depths:
            try:
                high = largest_size_within(
                    name, family_params(name, depth, int(size["low"])), data, max_params
                )
            except ValueError:  # this depth does not fit the data's shape
                continue
            if high is None:
                continue
            low = int(size["low"])
            if serves is not None:
                fastest = serves_up_to(name, depth, low, high, data, serves)
                if fastest is None:
                    break
                high = fastest
            widths[depth or 1] = (low, high)
        if widths:
            ranges.append(FamilyRange(name, tuple(sorted(widths)), widths))
    return ranges


def serves_up_to(
    family: str, depth: int | None, low: int, high: int, data: DataSpec, serves: Callable[[ArchSpec], bool]
) -> int | None:
    """The largest width in ``[low, high]`` whose model ``serves`` (None: not even ``low``)."""
    has_depth = "depth" in registered_families()[family].params

    def ok(width: int) -> bool:
        return serves(ArchSpec.of(family, family_params(family, depth if has_depth else None, width), data))

    if not ok(low):
        return None
    if high == low or ok(high):  # a loose budget: two timings, no bisection
        return high
    best, lo, hi = low, low + 1, high - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if ok(mid):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def suggest_architecture(trial: Any, space: Sequence[FamilyRange], data: DataSpec) -> ArchSpec:
    """The trial's student: a family, a depth and a width (log scale) from ``space``."""
    by_name = {r.family: r for r in space}
    family = trial.suggest_categorical("family", sorted(by_name))
    found = by_name[family]
    depth = trial.suggest_int(f"{family}.depth", found.depths[0], found.depths[-1])
    if depth not in found.widths:  # a depth between two that fit but that does not: the nearest
        depth = min(found.widths, key=lambda d: abs(d - depth))
    low, high = found.widths[depth]
    width = trial.suggest_int(f"{family}.d{depth}.width", low, high, log=True)
    has_depth = "depth" in registered_families()[family].params
    return ArchSpec.of(family, family_params(family, depth if has_depth else None, width), data)


def start_params(arch: ArchSpec) -> dict[str, Any]:
    """The trial params that :func:`suggest_architecture` turns into ``arch``."""
    params = dict(arch.params)
    depth = int(params.get("depth", 1))
    size = str(registered_families()[arch.family].size_param)
    return {
        "family": arch.family,
        f"{arch.family}.depth": depth,
        f"{arch.family}.d{depth}.width": params[size],
    }


def pareto_front(candidates: Sequence[Candidate]) -> list[Candidate]:
    """The distilled candidates no other beats on both accuracy and cost, by cost."""
    done = [c for c in candidates if c.val_acc is not None and math.isfinite(c.val_acc)]

    def dominated(c: Candidate) -> bool:
        return any(
            o.val_acc >= c.val_acc and o.cost <= c.cost and (o.val_acc > c.val_acc or o.cost < c.cost)  # type: ignore[operator]
            for o in done
        )

    return sorted((c for c in done if not dominated(c)), key=lambda c: (c.cost, c.number))


def choose(front: Sequence[Candidate], budget_ms: float | None) -> Candidate | None:
    """The most accurate candidate on the front within ``budget_ms`` (the cheaper on a tie)."""
    fits = [c for c in front if budget_ms is None or (c.latency_p95_ms or 0.0) <= budget_ms]
    return max(fits, key=lambda c: (c.val_acc, -c.cost)) if fits else None


@dataclass(frozen=True)
class SearchIO:
    """The search's side effects, injected by the stage: ``latency`` times an architecture (None:
    no serving budget, parameters are the cost), ``train`` distils candidates on the workers and
    returns each one's (bundle URI, validation accuracy), ``record`` tracks a told candidate."""

    latency: Callable[[ArchSpec], Any] | None
    train: Callable[[Sequence[Candidate]], list[tuple[str, float]]]
    record: Callable[[Candidate, str], None]


def run_student_search(
    study: Any,
    space: Sequence[FamilyRange],
    data: DataSpec,
    n_trials: int,
    parallel: int,
    budget_ms: float | None,
    io: SearchIO,
) -> list[Candidate]:
    """Ask ``study`` for candidates until ``n_trials`` are told (those told before count), at most
    ``parallel`` trained at once; returns every candidate told, old and new."""
    import optuna

    for stale in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        study.tell(stale.number, state=optuna.trial.TrialState.FAIL)  # an attempt that died
    candidates = [c for c in map(_from_trial, study.get_trials(deepcopy=False)) if c is not None]
    while len(study.get_trials(deepcopy=False)) < n_trials:
        batch: list[tuple[Any, Candidate]] = []
        while len(batch) < parallel and len(study.get_trials(deepcopy=False)) < n_trials:
            trial = study.ask()
            candidate = _measured(trial, space, data, io.latency)
            over = budget_ms is not None and (candidate.latency_p95_ms or 0.0) > budget_ms
            _remember(trial, candidate)
            if over:
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                candidates.append(candidate)
                io.record(candidate, "PRUNED")
                log.info(
                    "distill: candidate %d %s %s serves in p95 %.2f ms, over the budget: not trained",
                    trial.number,
                    candidate.arch.family,
                    candidate.arch.params,
                    candidate.latency_p95_ms,
                )
                continue
            batch.append((trial, candidate))
        if not batch:
            continue
        for (trial, candidate), (bundle, acc) in zip(batch, io.train([c for _, c in batch]), strict=True):
            told = Candidate(
                candidate.number, candidate.arch, candidate.num_params, candidate.latency_p95_ms, acc, bundle
            )
            trial.set_user_attr("bundle_uri", bundle)
            study.tell(trial, [acc, told.cost])
            candidates.append(told)
            io.record(told, "COMPLETE")
            log.info(
                "distill: candidate %d %s %s: val_acc %.4f, %s",
                told.number,
                told.arch.family,
                told.arch.params,
                acc,
                f"p95 {told.latency_p95_ms:.2f} ms"
                if told.latency_p95_ms is not None
                else f"{told.num_params} params",
            )
    return sorted(candidates, key=lambda c: c.number)


def _measured(trial: Any, space: Sequence[FamilyRange], data: DataSpec, latency: Any) -> Candidate:
    arch = suggest_architecture(trial, space, data)
    p95 = float(latency(arch).p95_ms) if latency is not None else None
    return Candidate(trial.number, arch, count_params(arch), p95, None)


def _remember(trial: Any, candidate: Candidate) -> None:
    """What a rerun needs to rebuild the candidate from the study alone."""
    trial.set_user_attr("arch", candidate.arch.to_dict())
    trial.set_user_attr("num_params", candidate.num_params)
    trial.set_user_attr("latency_p95_ms", candidate.latency_p95_ms)


def _from_trial(trial: Any) -> Candidate | None:
    """A candidate told in an earlier attempt (None: it never got so far)."""
    attrs = trial.user_attrs
    if "arch" not in attrs:
        return None
    values = trial.values if trial.state.name == "COMPLETE" else None
    return Candidate(
        trial.number,
        ArchSpec.from_dict(attrs["arch"]),
        int(attrs["num_params"]),
        attrs.get("latency_p95_ms"),
        float(values[0]) if values else None,
        str(attrs.get("bundle_uri", "")),
    )


@dataclass(frozen=True)
class StudentSearchResult:
    """What a student search found: every candidate, the Pareto front, the chosen one."""

    candidates: list[Candidate]
    front: list[Candidate]
    chosen: Candidate
    budget_ms: float | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "objectives": list(OBJECTIVES),
            "cost": "latency_p95_ms" if self.budget_ms is not None else "num_params",
            "budget_ms": self.budget_ms,
            "chosen": self.chosen.number,
            "front": [c.number for c in self.front],
            "candidates": [c.to_dict() for c in self.candidates],
        }


@dataclass(frozen=True)
class StudentSearchSetup:
    """What the stage gives a student search: the study (two objectives, maximise and minimise)
    and what tracks each candidate told (``record(candidate, state)``)."""

    study: Any
    record: Callable[[Candidate, str], None]


def search_student_plan(
    dcfg: Any,
    data: DataSpec,
    max_params: int,
    setup: StudentSearchSetup,
    parallel: int,
    latency: Callable[[ArchSpec], Any] | None,
    train: Callable[[Sequence[Candidate]], list[tuple[str, float]]],
    start: ArchSpec | None = None,
) -> tuple[Any, StudentSearchResult]:
    """Run the search (``dcfg.trials`` candidates) and plan the chosen student; a budget no
    candidate meets raises :class:`~mopflow.compression.distill.distill.StudentBudgetError` naming
    it and the fastest candidate. ``start``, the student the config alone would give within the
    budgets, is the first candidate of a new study: the search then ends with a student at least
    as accurate on validation as that one."""
    from mopflow.compression.distill.distill import StudentBudgetError, StudentPlan

    budget_ms = dcfg.budget_ms
    fastest: list[tuple[float, ArchSpec]] = []  # the fastest model timed while bounding the space

    def serves(arch: ArchSpec) -> bool:
        p95 = float(latency(arch).p95_ms) if latency is not None else 0.0
        fastest[:] = [min([*fastest, (p95, arch)], key=lambda found: found[0])]
        return budget_ms is None or p95 <= budget_ms

    timed = latency is not None and budget_ms is not None
    space = candidate_space(data, max_params, serves if timed else None)
    if not space and fastest:
        p95, arch = fastest[0]
        raise StudentBudgetError(
            f"student_budget_ms={budget_ms:g}: no student serves a request of {dcfg.request_rows} rows "
            f"within it; the fastest, {arch.family} {arch.params}, takes p95 {p95:.2f} ms"
        )
    if not space:
        raise StudentBudgetError(f"no student family takes this data within {max_params} parameters")
    log.info(
        "distill: student search over %s",
        "; ".join(
            f"{r.family} depths {list(r.widths)} widths up to {max(h for _, h in r.widths.values())}"
            for r in space
        ),
    )
    if start is not None and not setup.study.get_trials(deepcopy=False):
        setup.study.enqueue_trial(start_params(start))
    io = SearchIO(latency, train, setup.record)
    candidates = run_student_search(setup.study, space, data, dcfg.trials, parallel, dcfg.budget_ms, io)
    front = pareto_front(candidates)
    chosen = choose(front, dcfg.budget_ms)
    if chosen is None:
        measured = [c for c in candidates if c.latency_p95_ms is not None]
        if dcfg.budget_ms is not None and measured:
            best = min(measured, key=lambda c: c.cost)
            raise StudentBudgetError(
                f"student_budget_ms={dcfg.budget_ms:g}: none of the {len(candidates)} candidate students "
                f"serves a request of {dcfg.request_rows} rows within it; the fastest, {best.arch.family} "
                f"{best.arch.params}, takes p95 {best.latency_p95_ms:.2f} ms"
            )
        raise StudentBudgetError(f"none of the {len(candidates)} candidate students was distilled")
    log.info(
        "distill: chose candidate %d of %d on a front of %d: %s %s, val_acc %.4f, %s",
        chosen.number,
        len(candidates),
        len(front),
        chosen.arch.family,
        chosen.arch.params,
        chosen.val_acc,
        f"p95 {chosen.latency_p95_ms:.2f} ms"
        if chosen.latency_p95_ms is not None
        else f"{chosen.num_params} params",
    )
    plan = StudentPlan(chosen.arch, chosen.num_params, max_params, dcfg.budget_ms, None)
    return plan, StudentSearchResult(candidates, front, chosen, dcfg.budget_ms)
