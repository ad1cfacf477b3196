"""The student search's logic: its space, the Pareto front, the choice, and the ask-and-tell loop
on a real Optuna study with stand-in training and timing."""

from __future__ import annotations

from collections.abc import Sequence

import optuna
import pytest

from mopflow.compression.config import DistillConfig
from mopflow.compression.distill.distill import StudentBudgetError
from mopflow.compression.distill.student_search import (
    Candidate,
    SearchIO,
    StudentSearchSetup,
    candidate_space,
    choose,
    pareto_front,
    run_student_search,
    search_student_plan,
)
from mopflow.registry.latency import Latency
from mopflow.training.models.builtin import ArchSpec, count_params
from mopflow.training.models.families import DataSpec

DATA = DataSpec(40, 10)


def _candidate(number: int, val_acc: float | None, p95: float) -> Candidate:
    arch = ArchSpec.of("mlp", {"width": number + 1, "depth": 1}, DATA)
    return Candidate(number, arch, count_params(arch), p95, val_acc)


def test_the_space_holds_every_student_family_for_the_data_within_the_parameter_budget() -> None:
    space = candidate_space(DATA, 5_000)
    assert {"cnn", "mlp", "rescnn"} <= {r.family for r in space}
    assert "cnn2d" not in {r.family for r in space}  # images only
    for found in space:
        for depth, (low, high) in found.widths.items():
            params = (
                {"width": high, "depth": depth}
                if found.family != "rescnn"
                else {"width": high, "depth": depth, "shift": 0}
            )
            assert count_params(ArchSpec.of(found.family, params, DATA)) <= 5_000
            assert low <= high


def test_the_front_keeps_what_nothing_beats_on_both_and_the_choice_fits_the_budget() -> None:
    candidates = [
        _candidate(0, 0.80, 1.0),
        _candidate(1, 0.85, 2.0),
        _candidate(2, 0.84, 3.0),  # beaten by 1: more accurate and faster
        _candidate(3, 0.90, 5.0),
        _candidate(4, None, 0.5),  # pruned: never distilled
    ]
    front = pareto_front(candidates)
    assert [c.number for c in front] == [0, 1, 3]
    assert choose(front, 4.0).number == 1  # the most accurate within 4 ms
    assert choose(front, None).number == 3
    assert choose(front, 0.5) is None


class _Io:
    """Stand-ins: the latency grows with the width, the accuracy too (and with depth)."""

    def __init__(self) -> None:
        self.trained: list[int] = []
        self.recorded: list[tuple[int, str]] = []

    def latency(self, arch: ArchSpec) -> Latency:
        ms = 0.05 * arch.params["width"] * arch.params.get("depth", 1)
        return Latency(ms / 2, ms, 256, 40)

    def train(self, candidates: Sequence[Candidate]) -> list[tuple[str, float]]:
        self.trained += [c.number for c in candidates]
        return [(f"mem://c{c.number}", min(0.99, 0.5 + c.num_params / 20_000)) for c in candidates]

    def record(self, candidate: Candidate, state: str) -> None:
        self.recorded.append((candidate.number, state))

    def search_io(self) -> SearchIO:
        return SearchIO(self.latency, self.train, self.record)


def _study() -> optuna.Study:
    sampler = optuna.samplers.TPESampler(seed=0)
    return optuna.create_study(directions=["maximize", "minimize"], sampler=sampler)


def test_candidates_over_the_budget_are_pruned_untrained_and_a_rerun_goes_on() -> None:
    study, io = _study(), _Io()
    space = candidate_space(DATA, 5_000)
    found = run_student_search(study, space, DATA, 6, 2, 2.0, io.search_io())
    assert [c.number for c in found] == list(range(6)) and len(study.trials) == 6
    pruned = [c.number for c in found if c.latency_p95_ms > 2.0]
    assert pruned and io.trained, "the seed gives both kinds"
    assert sorted(set(io.trained) | set(pruned)) == list(range(6)) and not set(io.trained) & set(pruned)
    assert {n for n, s in io.recorded if s == "PRUNED"} == set(pruned)
    states = {t.number: t.state.name for t in study.trials}
    assert all(states[n] == "PRUNED" for n in pruned)
    # the same study again, asked for 8: the 6 told are kept, 2 more asked
    again = run_student_search(study, space, DATA, 8, 2, 2.0, _Io().search_io())
    assert [c.number for c in again] == list(range(8))
    assert [c.val_acc for c in again[:6]] == [c.val_acc for c in found]


def test_the_chosen_plan_is_on_the_front_within_the_budget_or_the_search_fails_naming_it() -> None:
    io = _Io()
    setup = StudentSearchSetup(_study(), io.record)
    cfg = DistillConfig(trials=6, budget_ms=2.0)
    plan, result = search_student_plan(cfg, DATA, 5_000, setup, 2, io.latency, io.train)
    assert result.chosen in result.front and result.chosen.latency_p95_ms <= 2.0
    assert plan.arch == result.chosen.arch and plan.budget_ms == 2.0
    tight = DistillConfig(trials=3, budget_ms=1e-4)
    with pytest.raises(
        StudentBudgetError,
        match=r"student_budget_ms=0.0001: no student serves a request of 256 rows .* the fastest, .* takes p95",
    ):
        search_student_plan(
            tight, DATA, 5_000, StudentSearchSetup(_study(), io.record), 2, io.latency, io.train
        )


def test_the_configured_student_is_the_first_candidate_of_a_new_study() -> None:
    """The search starts from the student the config alone gives, so it ends with one at least as
    accurate on validation; a rerun (the study has trials) does not enqueue it again."""
    io = _Io()
    study = _study()
    start = ArchSpec.of("cnn", {"width": 9, "depth": 2}, DATA)
    setup = StudentSearchSetup(study, io.record)
    cfg = DistillConfig(trials=2, budget_ms=2.0)
    _, result = search_student_plan(cfg, DATA, 5_000, setup, 1, io.latency, io.train, start)
    assert result.candidates[0].arch == start
    search_student_plan(
        cfg.model_copy(update={"trials": 3}), DATA, 5_000, setup, 1, io.latency, io.train, start
    )
    assert sum(t.params == study.trials[0].params for t in study.trials) == 1


def test_under_a_latency_budget_the_space_holds_only_students_that_serve_within_it() -> None:
    """Each depth's widths end at the largest that serves within the budget, found by bisection;
    a depth whose smallest width is over it ends the family's depths; a search in that space
    trains every candidate."""
    io = _Io()  # p95 = 0.05 ms x width x depth

    def serves(arch: ArchSpec) -> bool:
        return io.latency(arch).p95_ms <= 2.0

    space = candidate_space(DATA, 5_000, serves)
    unbounded = {r.family: r.widths for r in candidate_space(DATA, 5_000)}
    for family in space:
        for depth, (_, high) in family.widths.items():
            assert 0.05 * high * depth <= 2.0
            assert high == unbounded[family.family][depth][1] or 0.05 * (high + 1) * depth > 2.0
    # rescnn's widths start at 4: at 0.5 ms, depth 2 serves (0.4 ms) and depth 3 does not
    tight = candidate_space(DATA, 5_000, lambda arch: io.latency(arch).p95_ms <= 0.5)
    assert next(r for r in tight if r.family == "rescnn").depths == (1, 2)
    found = run_student_search(_study(), space, DATA, 6, 2, 2.0, io.search_io())
    assert all(c.val_acc is not None for c in found) and sorted(io.trained) == list(range(6))
