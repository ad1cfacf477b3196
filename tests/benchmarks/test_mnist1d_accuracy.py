"""The demo benchmark's log reading (its run is the demo itself: too long for the suite)."""

from __future__ import annotations

from pathlib import Path

from tests.benchmarks.loader import load_benchmark

bench = load_benchmark("mnist1d_accuracy")

FULL_LOG = """\
2026-11-25T08:09:42.100000Z [info     ] [DAG TEST] starting task_id=shard map_index=-1 [airflow]
2026-11-25T08:09:45.600000Z [info     ] [DAG TEST] end task task_id=shard map_index=-1 [airflow]
2026-11-25T08:09:45.700000Z [info     ] [DAG TEST] starting task_id=search map_index=-1 [airflow]
2026-11-25T08:10:45.700000Z [info     ] [DAG TEST] end task task_id=search map_index=-1 [airflow]
"""


def test_stage_seconds_come_from_the_full_log_the_console_names(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    log.write_text(FULL_LOG)
    console = f"mopflow run: run key abc; full log: {log} (--verbose streams it)\n[00:06] shard\n"
    assert bench.stage_seconds(bench.full_log(console)) == {"shard": 3.5, "search": 60.0}
    assert bench.full_log("[00:06] shard\n") == "[00:06] shard\n"  # no file named: the console
