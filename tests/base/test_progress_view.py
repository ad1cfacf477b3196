"""The view `mopflow run` shows: rich bars with trial lines above them on a terminal, plain lines
elsewhere, drawn from a list of progress events on a clock the test moves."""

from __future__ import annotations

import io
import re
from typing import Any

from rich.console import Console

from mopflow.base import progress
from mopflow.base.progress import ProgressView
from tests.base.test_progress_state import SEARCH, Timed

CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # anything but a newline or a tab


class Clock:
    """Monotonic seconds that the test sets."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def play(view: ProgressView, clock: Clock, events: Timed) -> None:
    for now, event in events:
        clock.now = now
        kind = event["kind"]
        progress.publish(kind, **{k: v for k, v in event.items() if k != "kind"})


def plain_text(renderable: Any, width: int = 160) -> str:
    out = io.StringIO()
    Console(file=out, width=width, force_terminal=False).print(renderable)
    return out.getvalue()


def test_without_a_terminal_each_event_is_one_plain_line() -> None:
    out, clock = io.StringIO(), Clock()
    with ProgressView(out, live=False, clock=clock) as view:
        play(view, clock, SEARCH)
    progress.publish("stage", stage="after the view")  # nobody listens any more
    text = out.getvalue()
    lines = text.splitlines()
    assert not CONTROL.search(text)
    assert all(re.match(r"\[\d\d:\d\d\] ", line) for line in lines)
    assert [line.split("] ", 1)[1].split(" · ")[0] for line in lines[:3]] == ["shard", "search", "search"]
    assert sum(line.split("] ", 1)[1].startswith("trial") for line in lines) == 13
    assert lines[-2].startswith("[00:22] trial  12  cnn     COMPLETE  epoch 3/3")
    assert lines[-2].endswith("best 0.3544 (trial 4)  · 11/11 trials") and lines[-1] == "[00:23] ensemble"
    counts = re.findall(r"(\d+)/(\d+) trials", text)
    assert len(counts) == 15 and all(int(m) <= int(n) for m, n in counts)


def test_on_a_terminal_each_finished_trial_stays_above_a_bar_per_stage() -> None:
    out, clock = io.StringIO(), Clock()
    console = Console(file=out, width=160, force_terminal=True, color_system="standard")
    view = ProgressView(out, live=True, console=console, clock=clock)
    with view:
        play(view, clock, SEARCH[:-1])
        clock.now = 22.0
        bars = plain_text(view._view.progress.get_renderable())
    printed = out.getvalue()
    assert "\x1b[" in printed  # drawn in place with control sequences
    lines = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", printed).splitlines()
    kept = [line for line in lines if line.startswith("trial")]
    assert kept[0].startswith("trial   0  cnn     PRUNED    epoch 1/3    val_acc 0.1392")
    assert len(kept) == len({line.split()[1] for line in kept}) == 13  # every trial, once
    assert sum(line.startswith("search · 3 more trial(s) without pruning") for line in lines) == 1
    after_last = lines[lines.index(kept[-1]) + 1 :]  # the bars drawn with the line are up to date
    redrawn = next(line for line in after_last if line[2:].startswith("search "))
    assert re.search(r"━ 11/11 trials ", redrawn), redrawn
    shard, search = bars.splitlines()
    assert shard.startswith("✓ shard") and "00:04" in shard
    assert re.search(r"━+ +11/11 trials 00:18 +best 0\.3544 \(trial 4\)", search), search
    ended = plain_text(view._view.progress.get_renderable()).splitlines()[1]  # the view closed first
    assert ended.startswith("· search") and "11/11 trials 00:18 " in ended


def test_a_running_search_shows_its_count_time_left_and_running_trials() -> None:
    out, clock = io.StringIO(), Clock()
    console = Console(file=out, width=160, force_terminal=True)
    view = ProgressView(out, live=True, console=console, clock=clock)
    with view:
        play(view, clock, SEARCH[1:6])  # 3 trials in 4 s
        play(view, clock, [(8.5, {"kind": "epoch", "model": "trial-0001", "epoch": 1, "epochs": 3})])
        clock.now = 9.0
        (search,) = plain_text(view._view.progress.get_renderable()).splitlines()
    assert "3/8 trials 00:05 ~00:05 left best 0.3418 (trial 2) · running trial-0001 2/3" in search
    assert search[0] not in "✓■"  # still running: a spinner


def test_a_stop_is_printed_above_the_bars_and_marks_the_stage_that_stops() -> None:
    out, clock = io.StringIO(), Clock()
    view = ProgressView(
        out, live=True, console=Console(file=out, width=120, force_terminal=True), clock=clock
    )
    with view:
        play(view, clock, [(0.0, {"kind": "stage", "stage": "shard"})])
        play(view, clock, [(3.0, {"kind": "stop", "signal": "SIGTERM", "timeout_s": 30.0})])
        clock.now = 9.0
        (shard,) = plain_text(view._view.progress.get_renderable()).splitlines()
    assert "stopping (SIGTERM): the run ends within 30 s; SIGTERM again stops at once" in out.getvalue()
    assert shard.startswith("■ shard") and "00:03" in shard and "━" not in shard  # not shown as done
