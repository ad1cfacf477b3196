"""The scale benchmark's bookkeeping (its runs are too long for the suite)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from tests.benchmarks.loader import load_benchmark

bench = load_benchmark("scale")


def test_stage_peaks_are_read_from_the_stage_log_lines() -> None:
    log = (
        "2026 [info] shard: peak resident memory of the task process 593 MB (591 MB when it started)\n"
        "2026 [info] search: trial 3 COMPLETE\n"
        "2026 [info] distill: peak resident memory of the task process 1092 MB (832 MB when it started)\n"
    )
    assert bench.stage_peaks(log) == {"shard": 593, "distill": 1092}


def test_ratios_and_verdicts_compare_the_large_run_with_the_small_one() -> None:
    small = {"task_peak_mb": 800, "worker_peak_mb": 600, "wall_s": 100.0}
    large = {"task_peak_mb": 1000, "worker_peak_mb": 1200, "wall_s": 900.0}
    found = bench.ratios(small, large)
    assert found == {"task_memory": 1.25, "worker_memory": 2.0, "wall": 9.0}
    assert bench.verdict(found) == {"task_memory": "PASS", "worker_memory": "FAIL", "wall": "PASS"}


def test_the_shards_grow_with_the_data() -> None:
    args = argparse.Namespace(rows_per_shard=25_000, trials=2, epochs=1, distill_epochs=1)
    assert bench.conf_for(100_000, args)["n_shards"] == 4
    assert bench.conf_for(1_000_000, args)["n_shards"] == 40


def test_tree_memory_sees_a_child_process_grow() -> None:
    grow = "import time; b = bytearray(64 * 2**20); time.sleep(1.5)"
    child = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {grow!r}])"]
    )
    with bench.TreeMemory(child.pid, interval_s=0.05) as memory:
        child.wait()
        time.sleep(0.1)
    assert memory.worker_peak > 64 * 2**20 > memory.main_peak > 0
    assert os.getpid() not in memory.child_peaks


def test_a_big_run_joins_the_recorded_results_dated() -> None:
    recorded = {"runs": [{"rows": 100_000}], "ratios": {"wall": 6.0}, "big": None}
    joined = bench.with_big(recorded, {"rows": 10_000_000, "wall_s": 700.0})
    assert joined["runs"] == recorded["runs"] and joined["ratios"] == recorded["ratios"]
    assert joined["big"]["rows"] == 10_000_000 and "date" in joined["big"]
    assert recorded["big"] is None  # the recorded results are not changed in place
