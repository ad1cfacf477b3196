"""What a run's progress events add up to: the bars' counts, the time left and each event's line."""

from __future__ import annotations

import re
from typing import Any

import pytest

from mopflow.base.progress_state import RunProgress, plain_line, remaining_s


def trial(
    number: int, state: str, epoch: int, value: float | None, finished: int, **kw: Any
) -> dict[str, Any]:
    """A finished trial as the search publishes it (3 epochs per trial, 8 trials unless told)."""
    model = kw.pop("model", f"trial-{number:04d}")
    fields = {"family": "cnn", "epochs": 3, "continues": None, "total": 8} | kw
    return {"kind": "trial", "model": model, "number": number, "state": state, "epoch": epoch,
            "value": value, "finished": finished} | fields  # fmt: skip


# An ASHA search of 8 trials as a real sweep published it: two pruned models promoted (trials 4
# and 8 continue trials 2 and 3), then 3 extra trials without pruning for a 5-member ensemble.
Timed = list[tuple[float, dict[str, Any]]]
SEARCH: Timed = [
    (0.0, {"kind": "stage", "stage": "shard"}),
    (4.0, {"kind": "stage", "stage": "search"}),
    (4.0, {"kind": "search", "total": 8, "finished": 0}),
    (6.0, trial(0, "PRUNED", 1, 0.1392, 1)),
    (7.0, trial(2, "PRUNED", 1, 0.3418, 2)),
    (8.0, trial(3, "PRUNED", 1, 0.1519, 3)),
    (9.0, trial(1, "PRUNED", 1, 0.1139, 4, family="mlp")),
    (10.0, trial(5, "PRUNED", 1, 0.0886, 5)),
    (12.0, trial(4, "COMPLETE", 3, 0.3544, 5, model="trial-0002", continues=2)),
    (13.0, trial(6, "PRUNED", 1, 0.0633, 6)),
    (14.0, trial(7, "PRUNED", 1, 0.1139, 7)),
    (15.0, trial(9, "PRUNED", 1, 0.1392, 8)),
    (16.0, trial(8, "COMPLETE", 3, 0.1519, 8, model="trial-0003", continues=3)),
    (16.0, {"kind": "search", "total": 11, "finished": 8, "extra": 3, "complete": 2, "needed": 5}),
    (20.0, trial(10, "COMPLETE", 3, 0.0633, 9, total=11)),
    (21.0, trial(11, "COMPLETE", 3, 0.1772, 10, total=11)),
    (22.0, trial(12, "COMPLETE", 3, 0.1392, 11, total=11)),
    (23.0, {"kind": "stage", "stage": "ensemble"}),
]


def replay(events: Timed) -> tuple[RunProgress, list[tuple[float, Any]]]:
    state = RunProgress()
    notices = [(now, state.apply(event, now)) for now, event in events]
    return state, [(now, n) for now, n in notices if n is not None]


def test_the_search_count_never_passes_its_total_through_promotions_and_extra_trials() -> None:
    state, notices = replay(SEARCH)
    counts = [re.findall(r"\d+/\d+ trials", n.text)[0] for _, n in notices if n.text.startswith("trial")]
    assert counts == [
        *(f"{c}/8 trials" for c in (1, 2, 3, 4, 5, 5, 6, 7, 8, 8)),  # a promotion adds no trial
        "9/11 trials", "10/11 trials", "11/11 trials",
    ]  # fmt: skip
    search = state.bars["search"]
    assert (search.completed, search.shown_total, search.unit, search.state) == (11, 11, "trials", "done")
    assert state.bars["shard"].state == "done" and state.current == "ensemble"
    extra = next(n for _, n in notices if "without pruning" in n.text)
    assert extra.stays and extra.text == (
        "search · 3 more trial(s) without pruning: 2 COMPLETE, 5 needed for the ensemble · 8/11 trials"
    )


def test_a_finished_trial_names_its_number_family_state_epoch_value_and_the_best_so_far() -> None:
    _, notices = replay(SEARCH)
    lines = {n.text.split()[1]: n for _, n in notices if n.text.startswith("trial")}
    assert lines["1"].text == (
        "trial   1  mlp     PRUNED    epoch 1/3    val_acc 0.1139  best 0.3418 (trial 2)  · 4/8 trials"
    )
    assert lines["4"].text == (
        "trial   4  cnn     COMPLETE  epoch 3/3    val_acc 0.3544  best 0.3544 (trial 4)  · 5/8 trials"
        " · continues trial 2"
    )
    assert lines["4"].stays and dict(lines["4"].segments)["  COMPLETE"] == "green"
    state = RunProgress()
    failed = state.apply(trial(0, "FAIL", 2, None, 1), 1.0)
    assert failed is not None and "FAIL      epoch 2/3    val_acc -       best -" in failed.text


def test_a_study_resumed_past_a_smaller_budget_shows_its_count_as_the_total() -> None:
    state = RunProgress()
    state.apply({"kind": "stage", "stage": "search"}, 0.0)
    notice = state.apply({"kind": "search", "total": 8, "finished": 10}, 0.0)
    assert notice is not None and notice.text == "search · 10/10 trials"


def test_the_time_left_counts_down_at_this_runs_pace_and_ignores_earlier_attempts() -> None:
    state = RunProgress()
    state.apply({"kind": "stage", "stage": "search"}, 100.0)
    state.apply({"kind": "search", "total": 8, "finished": 4}, 100.0)  # 4 from an earlier attempt
    bar = state.bars["search"]
    assert bar.remaining_s(130.0) is None  # no trial of this run finished yet
    state.apply(trial(4, "COMPLETE", 3, 0.5, 5), 160.0)  # 60 s a trial, 3 to go
    assert bar.remaining_s(160.0) == 180.0
    assert bar.remaining_s(190.0) == 150.0  # counts down between trials
    assert bar.remaining_s(400.0) == 120.0  # the next one is late: the two after it still take 120 s
    assert remaining_s(400.0, (100.0, 4), 160.0, 7, 8) is None  # the last one is late: unknown
    assert remaining_s(400.0, (100.0, 4), 160.0, 8, 8) == 0.0


def test_stages_end_when_the_next_starts_a_retry_starts_again_and_a_stop_is_shown() -> None:
    state = RunProgress()
    state.apply({"kind": "stage", "stage": "shard"}, 0.0)
    state.apply({"kind": "stage", "stage": "search"}, 5.0)
    assert state.bars["shard"].elapsed_s(50.0) == 5.0  # frozen once done
    state.apply({"kind": "search", "total": 4, "finished": 0}, 5.0)
    state.apply(trial(0, "COMPLETE", 3, 0.5, 1, total=4), 9.0)
    retry = state.apply({"kind": "stage", "stage": "search"}, 20.0)
    assert retry is not None and retry.text == "search (attempt 2)"
    assert state.bars["search"].elapsed_s(21.0) == 1.0 and state.bars["search"].unit == "trials"
    stop = state.apply({"kind": "stop", "signal": "SIGINT", "timeout_s": 30.0}, 22.0)
    assert stop is not None and stop.stays
    assert stop.text == "stopping (SIGINT): the run ends within 30 s; SIGINT again stops at once"
    assert state.bars["search"].state == "stopping" and state.bars["search"].remaining_s(23.0) is None


def test_epochs_name_the_running_trials_and_the_student_has_a_line_per_tenth() -> None:
    state = RunProgress()
    state.apply({"kind": "stage", "stage": "search"}, 0.0)
    for model, epoch in [("trial-0001", 0), ("trial-0002", 4), ("trial-0003", 1), ("trial-0004", 0)]:
        assert state.apply({"kind": "epoch", "model": model, "epoch": epoch, "epochs": 9}, 1.0) is None
    assert state.note("search") == "running trial-0001 1/9, trial-0002 5/9, trial-0003 2/9 (+1)"
    state.apply(trial(2, "COMPLETE", 9, 0.91, 1), 2.0)
    assert (
        state.note("search")
        == "best 0.9100 (trial 2) · running trial-0001 1/9, trial-0003 2/9, trial-0004 1/9"
    )
    lines = [
        n.text
        for e in range(1, 21)
        if (n := state.apply({"kind": "distill_epoch", "epoch": e, "epochs": 20}, 3.0))
    ]
    assert lines == [f"distill · student epoch {e}/20" for e in range(2, 21, 2)]
    assert state.bars["distill"].completed == 20 and state.bars["search"].state == "done"


@pytest.mark.parametrize(
    "trials, text", [(0, "no earlier study"), (12, "warm start from studies a, b (12 trials)")]
)
def test_a_warm_start_is_a_line_of_the_search(trials: int, text: str) -> None:
    studies = ["a", "b"] if trials else []
    notice = RunProgress().apply({"kind": "warm_start", "studies": studies, "trials": trials}, 0.0)
    assert notice is not None and notice.stays and text in notice.text


def test_a_plain_line_has_the_elapsed_time_the_time_left_and_no_control_character() -> None:
    state, notices = replay(SEARCH[:6])
    now, last = notices[-1]
    assert plain_line(last, state, 65.0, now) == (
        "[01:05] trial   3  cnn     PRUNED    epoch 1/3    val_acc 0.1519  best 0.3418 (trial 2)  · 3/8 trials"
        " · ~00:06 left"  # 3 trials in 4 s: 5 to go
    )
    odd = state.apply(trial(9, "PRUNED", 1, 0.1, 4, family="c\x1b[2K\rnn\x07"), now)
    assert odd is not None and "  c[2Knn  PRUNED" in plain_line(odd, state, 66.0, now)
    assert plain_line(notices[0][1], state, 3725.0, 0.0) == "[1:02:05] shard"
