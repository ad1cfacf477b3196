"""The peak memory a stage held is measured while it runs and logged when it ends."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from mopflow.pipeline.memory import MB, PeakMemory, measured_stage


def _hold(megabytes: int) -> int:
    block = np.ones(megabytes * MB, dtype=np.uint8)  # touched: resident, not just reserved
    time.sleep(0.3)  # held longer than the sampling interval, as a stage's data is
    return int(block[::4096].sum())


def test_the_peak_inside_a_block_is_seen_after_it_is_freed() -> None:
    with PeakMemory(interval_s=0.01) as peak:
        _hold(200)
    assert peak.peak_bytes - peak.start_bytes >= 150 * MB
    with PeakMemory(interval_s=0.01) as calm:
        pass
    assert calm.peak_bytes - calm.start_bytes < 50 * MB


def test_a_stage_logs_its_peak_even_when_it_fails(caplog: pytest.LogCaptureFixture) -> None:
    @measured_stage("probe")
    def stage(megabytes: int) -> int:
        if megabytes < 0:
            raise ValueError("bad")
        return _hold(megabytes)

    with caplog.at_level(logging.INFO, logger="mopflow.pipeline.memory"):
        assert stage(100) == 100 * MB // 4096
        with pytest.raises(ValueError):
            stage(-1)
    lines = [r.getMessage() for r in caplog.records if r.name == "mopflow.pipeline.memory"]
    assert len(lines) == 2 and all(line.startswith("probe: peak resident memory") for line in lines)
    peak_mb = float(lines[0].split("process ")[1].split(" MB")[0])
    start_mb = float(lines[0].split("(")[1].split(" MB")[0])
    assert peak_mb - start_mb >= 80
