from __future__ import annotations

import io

from mopflow.infra.base import progress
from mopflow.infra.base.progress import ProgressView, RunProgress


def test_progress_follows_stages_trials_and_epochs() -> None:
    state = RunProgress()
    assert state.apply({"kind": "stage", "stage": "search"})
    assert not state.apply({"kind": "search", "total": 20, "finished": 3})
    assert not state.apply({"kind": "epoch", "model": "trial-0004", "epoch": 4, "epochs": 16})
    assert not state.apply({"kind": "epoch", "model": "trial-0005", "epoch": 0, "epochs": 16})
    assert (
        state.line(83)
        == "[01:23] search · trials 3/20 · running: trial-0004 epoch 5/16, trial-0005 epoch 1/16"
    )
    assert state.apply({"kind": "trial", "model": "trial-0004", "value": 0.91, "finished": 4, "total": 20})
    assert state.apply({"kind": "trial", "model": "trial-0005", "value": 0.42, "finished": 5, "total": 20})
    assert state.line(90) == "[01:30] search · trials 5/20, best val_acc 0.9100"
    state.apply({"kind": "stage", "stage": "distill"})
    state.apply({"kind": "distill_epoch", "epoch": 7, "epochs": 10})
    assert state.line(3600) == "[60:00] distill · trials 5/20, best val_acc 0.9100 · student epoch 7/10"


def test_the_plain_view_prints_a_line_per_notable_event_and_unsubscribes() -> None:
    out = io.StringIO()
    with ProgressView(out, live=False):
        progress.publish("stage", stage="shard")
        progress.publish("epoch", model="trial-0000", epoch=0, epochs=2)  # not a line of its own
        progress.publish("stage", stage="search")
    progress.publish("stage", stage="after the view")  # nobody listens any more
    lines = out.getvalue().splitlines()
    assert [line.split("] ", 1)[1] for line in lines] == ["shard", "search · running: trial-0000 epoch 1/2"]
