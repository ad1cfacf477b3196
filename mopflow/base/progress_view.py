"""How `mopflow run` shows its progress: on a terminal, a rich bar per stage (count, elapsed time,
time left) with each finished trial printed above the bars, where it stays; elsewhere (a pipe,
a log file), one plain line per event, without control characters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TaskID, TextColumn
from rich.spinner import Spinner
from rich.table import Column
from rich.text import Text

from mopflow.base.progress_state import Notice, RunProgress, StageBar, clock, plain_line, printable

_MARKS = {"done": Text("✓", style="green"), "stopping": Text("■", style="red"), "ended": Text("·")}


class PlainView:
    """One plain line per notice, stamped with the run's elapsed time."""

    def __init__(self, out: TextIO, started_s: float) -> None:
        self.out, self.started_s = out, started_s

    def start(self) -> None:
        return None

    def show(self, notice: Notice | None, state: RunProgress, now: float) -> None:
        if notice is not None:
            print(plain_line(notice, state, now - self.started_s, now), file=self.out, flush=True)

    def close(self, state: RunProgress, now: float) -> None:
        return None


class TerminalView:
    """A bar per stage, redrawn in place; a notice that stays is printed above the bars."""

    def __init__(self, console: Console, get_time: Callable[[], float], auto_refresh: bool = True) -> None:
        self.progress = Progress(
            _MarkColumn(),
            TextColumn("{task.description}", table_column=Column(width=9, no_wrap=True)),
            BarColumn(bar_width=28),
            _CountColumn(),
            _ElapsedColumn(),
            _RemainingColumn(),
            TextColumn("{task.fields[note]}", table_column=Column(no_wrap=True, overflow="ellipsis")),
            console=console,
            get_time=get_time,
            auto_refresh=auto_refresh,
            refresh_per_second=2,
            redirect_stdout=False,  # the run's own output goes to its log file, not above the bars
            redirect_stderr=False,
        )
        self.tasks: dict[str, TaskID] = {}

    def start(self) -> None:
        self.progress.start()

    def show(self, notice: Notice | None, state: RunProgress, now: float) -> None:
        self.sync(state)
        if notice is not None and notice.stays:
            self.progress.refresh()  # a printed line redraws the bars as last refreshed: bring them up to date
            line = Text.assemble(*((printable(text), style) for text, style in notice.segments))
            self.progress.console.print(line, no_wrap=True, overflow="ellipsis")

    def close(self, state: RunProgress, now: float) -> None:
        state.close(now)
        self.sync(state)
        self.progress.stop()

    def sync(self, state: RunProgress) -> None:
        """Each stage's bar as ``state`` has it (a stage seen for the first time gets its row)."""
        for name, bar in state.bars.items():
            if name not in self.tasks:
                self.tasks[name] = self.progress.add_task(name, total=None, bar=bar, note="")
            total, completed = bar.shown_total, bar.completed
            if total is None and bar.state != "running":  # a stage without a count: full once done
                total, completed = 1, int(bar.state == "done")
            self.progress.update(
                self.tasks[name],
                total=total,
                completed=completed,
                bar=replace(bar),  # a copy: the refresh thread reads it while events go on
                note=state.note(name),
            )


def _bar(task: Task) -> StageBar:
    bar: StageBar = task.fields["bar"]
    return bar


class _MarkColumn(ProgressColumn):
    """A spinner while the stage runs, ✓ once done, ■ while it stops, · when the view ended first."""

    def __init__(self) -> None:
        self.spinner = Spinner("dots", style="cyan")
        super().__init__()

    def render(self, task: Task) -> Text:
        mark = _MARKS.get(_bar(task).state)
        if mark is not None:
            return mark
        frame = self.spinner.render(task.get_time())
        return frame if isinstance(frame, Text) else Text(str(frame))


class _CountColumn(ProgressColumn):
    """``M/N unit``, or nothing for a stage without a count."""

    def render(self, task: Task) -> Text:
        bar = _bar(task)
        if bar.shown_total is None:
            return Text("")
        return Text(f"{bar.completed}/{bar.shown_total} {bar.unit}", style="progress.download")


class _ElapsedColumn(ProgressColumn):
    """The stage's time so far (frozen once it is done)."""

    def render(self, task: Task) -> Text:
        return Text(clock(_bar(task).elapsed_s(task.get_time())), style="progress.elapsed")


class _RemainingColumn(ProgressColumn):
    """The stage's time left at this run's pace: ``~mm:ss left``, ``?`` until a unit finished."""

    def render(self, task: Task) -> Text:
        bar = _bar(task)
        if bar.state != "running" or bar.shown_total is None or bar.completed >= bar.shown_total:
            return Text("")
        left = bar.remaining_s(task.get_time())
        return Text("~? left" if left is None else f"~{clock(left)} left", style="progress.remaining")
