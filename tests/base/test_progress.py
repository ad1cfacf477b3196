from __future__ import annotations

import io

from mopflow.base import progress
from mopflow.base.progress import ProgressView


def test_subscribers_hear_every_event_until_they_unsubscribe_and_a_failing_one_breaks_nothing() -> None:
    heard: list[dict[str, object]] = []

    def broken(event: dict[str, object]) -> None:
        raise RuntimeError("a view must never break the run")

    unsubscribe_broken = progress.subscribe(broken)
    unsubscribe = progress.subscribe(heard.append)
    try:
        progress.publish("stage", stage="shard")
    finally:
        unsubscribe()
        unsubscribe_broken()
    progress.publish("stage", stage="search")
    assert heard == [{"kind": "stage", "stage": "shard"}]


def test_the_plain_view_prints_a_line_per_notable_event_and_unsubscribes() -> None:
    out = io.StringIO()
    with ProgressView(out, live=False):
        progress.publish("stage", stage="shard")
        progress.publish("epoch", model="trial-0000", epoch=0, epochs=2)  # the bars' business
        progress.publish("stage", stage="search")
    progress.publish("stage", stage="after the view")  # nobody listens any more
    lines = out.getvalue().splitlines()
    assert [line.split("] ", 1)[1] for line in lines] == ["shard", "search"]


def test_an_event_published_while_the_view_shows_one_is_shown_too() -> None:
    """A signal handler runs on the thread it interrupts: its event can come while the view is
    writing the previous one."""
    import threading

    class Interrupted(io.StringIO):
        interrupted = False

        def write(self, text: str) -> int:
            if not self.interrupted:  # the first line is being written: the stop comes now
                self.interrupted = True
                progress.publish("stop", signal="SIGINT", timeout_s=30.0)
            return super().write(text)

    out = Interrupted()

    def run() -> None:
        with ProgressView(out, live=False):
            progress.publish("stage", stage="search")

    shower = threading.Thread(target=run, daemon=True)
    shower.start()
    shower.join(timeout=10)
    assert not shower.is_alive(), "the view waits for itself"
    assert "stopping (SIGINT)" in out.getvalue() and "] search" in out.getvalue()
