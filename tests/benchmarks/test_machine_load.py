"""The benchmarks' record of other load on the machine (``benchmarks/studies/machine_load.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from studies.machine_load import CLEAN_SHARE, LoadWatch


def _burn(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_work_in_the_watched_tree_is_its_own_and_work_outside_it_is_not() -> None:
    # a tree of one sleeping process: this test's own CPU time is outside it
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with LoadWatch(root_pid=sleeper.pid, interval_s=0.1) as outside:
            _burn(1.0)
    finally:
        sleeper.kill()
        sleeper.wait()
    found = outside.record()
    assert found["outside_cpu_s"] >= 0.8 and found["own_cpu_s"] < 0.3
    assert found["outside_share"] > CLEAN_SHARE and found["clean"] is False

    with LoadWatch(root_pid=os.getpid(), interval_s=0.1) as own:  # this process is the tree
        _burn(1.0)
    assert own.record()["own_cpu_s"] >= 0.8
