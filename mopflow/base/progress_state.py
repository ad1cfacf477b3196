"""What a run's progress events add up to (pure): a bar per stage, and a notice for each event
worth one (a finished trial, a stage that starts, a stop).

A bar counts what its total counts: the search's finished trials (a promotion continues its
model's trial, so it adds no trial; the extra trials the ensemble needs raise the total before
they start), the student's epochs. A resumed stage's earlier units count towards its total but
not towards the estimate of the time left, which only this run's pace gives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Event = dict[str, Any]
Segment = tuple[str, str]  # (text, style): a style is a rich style name, "" for none
STATE_STYLES = {"COMPLETE": "green", "PRUNED": "yellow", "FAIL": "red"}
_RUNNING_SHOWN = 3  # running trials named on the search bar; the rest are counted


@dataclass(frozen=True)
class Notice:
    """One event as a line. ``stays``: a terminal prints it above the bars, where it stays (not a
    stage start nor a student epoch: the bars show those)."""

    segments: tuple[Segment, ...]
    stays: bool
    stage: str

    @property
    def text(self) -> str:
        return "".join(text for text, _ in self.segments)


@dataclass
class StageBar:
    """One stage's bar: what it counts (``unit``; "" when it has no count) and how far it got."""

    name: str
    started_s: float
    unit: str = ""
    completed: int = 0
    total: int | None = None
    state: str = "running"  # running, done, stopping, or ended (the view closed while it ran)
    attempt: int = 1  # a retried stage starts its bar again
    rate_from: tuple[float, int] = (0.0, 0)  # (time, completed) the pace is measured from
    last_done_s: float | None = None  # when the last unit of this run finished
    ended_s: float | None = None

    @property
    def shown_total(self) -> int | None:
        """The total shown: never below the count (a study resumed with a smaller budget)."""
        return None if self.total is None else max(self.total, self.completed)

    def count(self, completed: int, total: int | None, now: float) -> None:
        """Set the count; a count that went back (the stage restarted its units) restarts the pace."""
        if completed < self.completed:
            self.rate_from, self.last_done_s = (now, completed), None
        elif completed > self.completed:
            self.last_done_s = now
        self.completed, self.total = completed, total

    def elapsed_s(self, now: float) -> float:
        return (self.ended_s if self.ended_s is not None else now) - self.started_s

    def remaining_s(self, now: float) -> float | None:
        """The time left at this run's pace, counting down between units; None when unknown."""
        if self.state != "running" or self.shown_total is None:
            return None
        return remaining_s(now, self.rate_from, self.last_done_s, self.completed, self.shown_total)


def remaining_s(
    now: float, rate_from: tuple[float, int], last_done_s: float | None, completed: int, total: int
) -> float | None:
    """Seconds left: the mean time per unit finished since ``rate_from`` times the units left,
    less the time since the last one finished, but never below the units after the next one;
    None when unknown (no unit finished yet, or the last one is overdue)."""
    since_s, since_count = rate_from
    done = completed - since_count
    left = total - completed
    if left <= 0:
        return 0.0
    if done <= 0 or last_done_s is None:
        return None
    per_unit = (last_done_s - since_s) / done
    estimate = max(per_unit * left - (now - last_done_s), per_unit * (left - 1))
    return estimate if estimate >= 1.0 else None


@dataclass
class RunProgress:
    """The bars of a run's stages, in the order they started, and what the search found so far."""

    bars: dict[str, StageBar] = field(default_factory=dict)
    current: str | None = None
    best: tuple[float, int] | None = None  # (val_acc, trial number) of the best finished trial
    running: dict[str, tuple[int, int]] = field(default_factory=dict)  # model -> (epoch, epochs)

    def apply(self, event: Event, now: float) -> Notice | None:
        """Take one event (at ``now``, a monotonic clock's seconds); its notice, if it has one."""
        handler = _HANDLERS.get(str(event.get("kind")))
        return handler(self, event, now) if handler else None

    def bar(self, name: str) -> StageBar | None:
        return self.bars.get(name)

    def note(self, name: str) -> str:
        """What a bar says besides its count: the search's best trial and its running trials."""
        if name != "search":
            return ""
        parts = [f"best {_best(self.best)}"] if self.best else []
        if self.running and self.current == "search":
            shown = sorted(self.running.items())[:_RUNNING_SHOWN]
            named = ", ".join(f"{model} {epoch}/{epochs}" for model, (epoch, epochs) in shown)
            more = len(self.running) - len(shown)
            parts.append(f"running {named}" + (f" (+{more})" if more else ""))
        return " · ".join(parts)

    def close(self, now: float) -> None:
        """The view closes: a stage still running ends here (whether it succeeded, the run says)."""
        self._end_current("ended", now)

    def _stage(self, event: Event, now: float) -> Notice:
        name = str(event["stage"])
        self._end_current("done", now)
        bar = self.bars.get(name)
        if bar is None:
            self.bars[name] = StageBar(name, now, rate_from=(now, 0))
        else:  # the stage's retry: its bar starts again
            self.bars[name] = StageBar(name, now, bar.unit, attempt=bar.attempt + 1, rate_from=(now, 0))
        self.current = name
        self.running.clear()
        again = f" (attempt {self.bars[name].attempt})" if self.bars[name].attempt > 1 else ""
        return Notice(((name + again, "bold"),), stays=False, stage=name)

    def _search(self, event: Event, now: float) -> Notice:
        bar = self._counted("search", "trials", now)
        finished = int(event.get("finished", 0))
        bar.count(finished, int(event["total"]), now)
        if event.get("extra"):
            text = (
                f"search · {event['extra']} more trial(s) without pruning: {event['complete']} COMPLETE, "
                f"{event['needed']} needed for the ensemble · {_count(bar)} trials"
            )
            return Notice(((text, "bold yellow"),), stays=True, stage="search")
        bar.rate_from, bar.last_done_s = (now, finished), None  # earlier attempts' trials: not this pace
        return Notice((("search", "bold"), (f" · {_count(bar)} trials", "")), stays=False, stage="search")

    def _epoch(self, event: Event, now: float) -> None:
        self.running[str(event["model"])] = (int(event["epoch"]) + 1, int(event["epochs"]))

    def _trial(self, event: Event, now: float) -> Notice:
        self.running.pop(str(event.get("model")), None)
        bar = self._counted("search", "trials", now)
        bar.count(int(event["finished"]), int(event.get("total") or bar.total or 0), now)
        value = event.get("value")
        number = int(event["number"])
        if value is not None and (self.best is None or float(value) > self.best[0]):
            self.best = (float(value), number)
        return Notice(trial_segments(event, self.best, bar), stays=True, stage="search")

    def _distill_epoch(self, event: Event, now: float) -> Notice | None:
        bar = self._counted("distill", "epochs", now)
        epoch, epochs = int(event["epoch"]), int(event["epochs"])
        bar.count(epoch, epochs, now)
        if epoch % max(epochs // 10, 1) and epoch != epochs:  # a plain line per tenth of the epochs
            return None
        return Notice((("distill", "bold"), (f" · student epoch {epoch}/{epochs}", "")), False, "distill")

    def _warm_start(self, event: Event, now: float) -> Notice:
        studies, trials = list(event.get("studies") or []), int(event.get("trials") or 0)
        text = (
            f"search · warm start from stud{'y' if len(studies) == 1 else 'ies'} {', '.join(studies)} "
            f"({trials} trial{'' if trials == 1 else 's'})"
            if trials
            else "search · warm start: no earlier study of this data, space and epochs; starting cold"
        )
        return Notice(((text, "dim"),), stays=True, stage="search")

    def _stop(self, event: Event, now: float) -> Notice:
        stage = self.current or ""
        self._end_current("stopping", now)
        text = (
            f"stopping ({event['signal']}): the run ends within {float(event['timeout_s']):.0f} s; "
            f"{event['signal']} again stops at once"
        )
        return Notice(((text, "bold red"),), stays=True, stage=stage)

    def _counted(self, name: str, unit: str, now: float) -> StageBar:
        """The bar of stage ``name`` (made when its count comes before its start), counting ``unit``."""
        if name not in self.bars:
            self._end_current("done", now)
            self.bars[name] = StageBar(name, now, rate_from=(now, 0))
            self.current = name
        bar = self.bars[name]
        bar.unit = unit
        return bar

    def _end_current(self, state: str, now: float) -> None:
        bar = self.bars.get(self.current or "")
        if bar is not None and bar.state == "running":
            bar.state, bar.ended_s = state, now


_HANDLERS: dict[str, Callable[[RunProgress, Event, float], Notice | None]] = {
    "stage": RunProgress._stage,
    "search": RunProgress._search,
    "epoch": RunProgress._epoch,
    "trial": RunProgress._trial,
    "distill_epoch": RunProgress._distill_epoch,
    "stop": RunProgress._stop,
    "warm_start": RunProgress._warm_start,
}


def trial_segments(event: Event, best: tuple[float, int] | None, bar: StageBar) -> tuple[Segment, ...]:
    """A finished trial: number, family, state, epochs trained, last value, the best so far, the count."""
    state = str(event.get("state", "?"))
    value = event.get("value")
    epoch, epochs = event.get("epoch"), event.get("epochs")
    trained = f"epoch {epoch}/{epochs}" if epoch is not None and epochs else "epoch ?"
    segments: list[Segment] = [
        (f"trial {int(event['number']):>3}", "bold"),
        (f"  {str(event.get('family') or '?'):<6}", "cyan"),
        (f"  {state:<8}", STATE_STYLES.get(state, "")),
        (f"  {trained:<11}", ""),
        (f"  val_acc {float(value):.4f}" if value is not None else "  val_acc -     ", ""),
        (
            f"  best {_best(best)}" if best else "  best -",
            "bold" if best and best[1] == event["number"] else "",
        ),
        (f"  · {_count(bar)} trials", "dim"),
    ]
    if event.get("continues") is not None:
        segments.append((f" · continues trial {int(event['continues'])}", "dim"))
    return tuple(segments)


def _best(best: tuple[float, int] | None) -> str:
    return "-" if best is None else f"{best[0]:.4f} (trial {best[1]})"


def _count(bar: StageBar) -> str:
    return f"{bar.completed}/{bar.shown_total}" if bar.shown_total is not None else str(bar.completed)


def clock(seconds: float) -> str:
    """``mm:ss``, or ``h:mm:ss`` from an hour on."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def plain_line(notice: Notice, state: RunProgress, elapsed_s: float, now: float) -> str:
    """A notice as one plain line: the run's elapsed time, the text, and the stage's time left."""
    bar = state.bar(notice.stage)
    left = bar.remaining_s(now) if bar is not None else None
    suffix = f" · ~{clock(left)} left" if left is not None and left > 0 else ""
    return printable(f"[{clock(elapsed_s)}] {notice.text}{suffix}")


def printable(text: str) -> str:
    """``text`` without control characters (a log file or a pipe gets no escape sequence)."""
    return "".join(ch for ch in text if ch.isprintable())
