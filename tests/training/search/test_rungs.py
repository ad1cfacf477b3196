"""ASHA's rungs: which models go on at once, which wait, and when a waiting one is promoted."""

from __future__ import annotations

from mopflow.training.search.rungs import Rungs


def test_rungs_sit_at_min_resource_times_powers_of_the_reduction_factor_below_the_budget() -> None:
    rungs = Rungs(min_resource=3, reduction_factor=3, max_epochs=30)
    assert [e for e in range(1, 31) if rungs.rung_at(e) is not None] == [3, 9, 27]
    assert (rungs.rung_at(3), rungs.rung_at(9), rungs.rung_at(27)) == (0, 1, 2)
    assert Rungs(15, 3, 15).rung_at(15) is None  # the last epoch: nothing left to decide
    assert rungs.epochs() == [3, 9, 27] and Rungs(15, 3, 15).epochs() == []


def test_early_models_wait_and_the_best_is_promoted_once_the_rung_fills() -> None:
    rungs = Rungs(min_resource=3, reduction_factor=3, max_epochs=30)
    assert not rungs.reach(0, "a", 0.9)  # alone at the rung: the top third is empty, it waits
    assert not rungs.reach(0, "b", 0.5)
    assert rungs.promotable(["a", "b"]) == []
    assert not rungs.reach(0, "c", 0.4)  # three results: the top third is "a", which waits elsewhere
    assert rungs.promotable(["a", "b", "c"]) == ["a"]
    rungs.promote("a")
    assert rungs.promotable(["b", "c"]) == []  # promoted once only
    assert [rungs.reach(0, m, v) for m, v in [("d", 0.3), ("e", 0.2)]] == [False, False]
    assert rungs.reach(0, "f", 0.6)  # six results, top two: "a" and "f", in it on arrival: goes on
    assert rungs.promotable(["b", "c", "d", "e"]) == []
    assert [rungs.reach(0, m, v) for m, v in [("g", 0.1), ("h", 0.05)]] == [False, False]
    assert rungs.promotable(["b", "c", "d", "e", "g", "h"]) == []
    assert not rungs.reach(0, "i", 0.01)  # nine results, top three: "b" (0.5) waited its way in
    assert rungs.promotable(["b", "c", "d", "e", "g", "h", "i"]) == ["b"]


def test_promotions_come_from_the_highest_rung_first() -> None:
    rungs = Rungs(min_resource=1, reduction_factor=2, max_epochs=8)
    for model, value in [("a", 0.9), ("b", 0.8), ("c", 0.1), ("d", 0.2)]:
        rungs.reach(0, model, value)
    rungs.reach(1, "a", 0.95)  # "a" went on to rung 1 and waits there, alone
    rungs.reach(1, "b", 0.5)
    assert rungs.highest_rung("a") == 1
    assert rungs.promotable(["a", "b", "c"]) == ["a"]  # rung 1's top half before rung 0's
