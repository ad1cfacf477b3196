"""Spot notices on real Dask workers: SIGTERM makes the running trial checkpoint mid-epoch and
hand itself back; it resumes from that batch on the restarted worker, not from the epoch start."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from training.config import SearchConfig
from training.data import load_manifest
from training.search import checkpoint_folder, register_preemption, run_search
from training.trial import CHECKPOINT_FILE

SPACE = {
    "families": {
        "cnn": {
            "width": {"type": "categorical", "choices": [8]},
            "depth": {"type": "categorical", "choices": [2]},
        }
    },
    "common": {
        "lr": {"type": "categorical", "choices": [0.01]},
        "batch_size": {"type": "categorical", "choices": [32]},
    },
}


def test_grace_period_setting_is_validated() -> None:
    class Client:
        def register_plugin(self, plugin: object) -> None:
            self.plugin = plugin

    client = Client()
    assert register_preemption(client, {"MOPFLOW_PREEMPT_GRACE_S": "12"}) == 12.0
    assert client.plugin.grace_s == 12.0  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="MOPFLOW_PREEMPT_GRACE_S='soon'"):
        register_preemption(client, {"MOPFLOW_PREEMPT_GRACE_S": "soon"})
    with pytest.raises(ValueError, match="must be in"):
        register_preemption(client, {"MOPFLOW_PREEMPT_GRACE_S": "0"})


@pytest.mark.slow
def test_sigterm_checkpoints_mid_epoch_and_the_trial_resumes_there(
    small_manifest: str, tmp_path: Path
) -> None:
    """Fault: the worker training a trial gets SIGTERM (a spot notice) mid-epoch.
    Expected: the trial checkpoints at the next batch, the worker leaves, and the trial resumes
    on the restarted worker from the checkpoint written on the notice, with the full history."""
    from training.cluster import dask_client

    storage_url, art, epochs = str(tmp_path / "journal.log"), str(tmp_path / "art"), 20
    cfg = SearchConfig(n_trials=1, epochs=epochs, n_workers=1, space=SPACE, pruner="none")
    ckpt = Path(checkpoint_folder(art, "pre", 0)) / CHECKPOINT_FILE
    with dask_client("", 1) as client:
        outcome: dict[str, object] = {}
        runner = threading.Thread(
            target=lambda: outcome.update(
                result=run_search(cfg, small_manifest, "pre", storage_url, art, client)
            )
        )
        runner.start()
        deadline = time.monotonic() + 180
        while not ckpt.exists() and time.monotonic() < deadline and runner.is_alive():
            time.sleep(0.05)
        assert ckpt.exists(), "the trial should have finished an epoch"
        time.sleep(0.15)  # somewhere inside a later epoch
        (pid,) = client.run(os.getpid).values()
        os.kill(pid, signal.SIGTERM)
        runner.join(timeout=300)
        assert not runner.is_alive()
        (new_pid,) = client.run(os.getpid).values()
    assert new_pid != pid  # the preempted worker left; a fresh one finished the trial
    (result,) = outcome["result"].results  # type: ignore[attr-defined]
    assert result.state == "COMPLETE" and result.number == 0
    train_rows = sum(e["rows"] for e in load_manifest(small_manifest)["splits"]["train"])
    steps_per_epoch = -(-train_rows // 32)  # ceil(train rows / batch size)
    # it resumed from the checkpoint written on the notice, at the step where it was stopped
    assert result.resumed_from_step is not None and result.resumed_from_step >= steps_per_epoch
    assert result.resumed_after_notice_at_step == result.resumed_from_step
    assert [h["epoch"] for h in result.history] == list(range(epochs))
