"""MOP's scheduling replayed in the pure scheduler (benchmarks/studies/mop_replay.py)."""

from __future__ import annotations

import pytest
from studies.mop_replay import replay, replay_without_rounds


@pytest.mark.parametrize("ahead", [False, True])
def test_models_of_one_size_take_their_work_over_the_workers(ahead: bool) -> None:
    # 4 models x 2 partitions x 0.1 s a round, over 2 workers: 0.4 s a round, nobody waits
    replayed = replay({f"m{i}": 0.1 for i in range(4)}, workers=2, rounds=3, ahead=ahead)
    assert replayed.wall_s == pytest.approx(1.2)
    assert replayed.utilisation == pytest.approx(1.0)


@pytest.mark.parametrize("round_epochs", [1, 3])
def test_every_unit_runs_once_an_epoch_and_a_slow_model_sets_the_pace(round_epochs: int) -> None:
    unit_s = {"slow": 0.3, "a": 0.03, "b": 0.04}
    replayed = replay(unit_s, workers=2, rounds=2, round_epochs=round_epochs)
    epochs = 2 * round_epochs
    assert replayed.busy_s == pytest.approx(epochs * 2 * sum(unit_s.values()))
    # the slow model's two units of an epoch run one after the other
    assert replayed.wall_s >= epochs * 2 * 0.3 - 1e-9


def test_without_rounds_small_models_fill_the_worker_a_slow_one_is_not_on_only_in_any_order() -> None:
    one_slow = {"slow": 0.3, "a": 0.03, "b": 0.04, "c": 0.035}
    in_cycle = replay_without_rounds(one_slow, workers=2).utilisation
    any_order = replay_without_rounds(one_slow, workers=2, any_order=True).utilisation
    # in its cycle a small model takes the free worker once, then must hop to the slow one's;
    # in any order it may take the free worker again at its epoch's turn
    assert in_cycle < 0.7 < 0.8 < any_order < 1.0
    assert replay_without_rounds({f"m{i}": 0.1 for i in range(4)}, 2).utilisation == pytest.approx(1.0)
