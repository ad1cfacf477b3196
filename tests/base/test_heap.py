"""The collector settings of mopflow's own processes (mopflow.base.heap)."""

from __future__ import annotations

import gc
import subprocess
import sys
from collections.abc import Iterator

import pytest

from mopflow.base.heap import THRESHOLDS, collect_less_often, freeze_long_lived


@pytest.fixture
def collector() -> Iterator[None]:
    thresholds = gc.get_threshold()
    yield
    gc.set_threshold(*thresholds)
    gc.unfreeze()


def test_collections_come_less_often_and_never_more_often(collector: None) -> None:
    gc.set_threshold(700, 10, 10)
    collect_less_often()
    assert gc.get_threshold() == THRESHOLDS
    gc.set_threshold(50_000, 10, 1_000)  # set higher by someone else: kept where higher
    collect_less_often()
    assert gc.get_threshold() == (50_000, THRESHOLDS[1], 1_000)


def test_frozen_objects_are_out_of_the_collectors_walks(collector: None) -> None:
    gc.unfreeze()
    kept = [[] for _ in range(1000)]
    freeze_long_lived()
    assert gc.get_freeze_count() >= len(kept)  # the permanent generation, which no collection walks


@pytest.mark.parametrize(("call", "frozen"), [("main()", True), ("main(['settings'])", False)])
def test_the_command_freezes_its_heap_before_exit_only_as_its_own_process(call: str, frozen: bool) -> None:
    """The console script calls ``main()`` and exits next: its heap is frozen, so that the
    interpreter's last collection does not walk it. ``main(argv)`` called by another program
    leaves that program's collector alone."""
    code = (
        "import gc, sys\n"
        "from mopflow.infra.cli.parser import main\n"
        "sys.argv = ['mopflow', 'settings']\n"
        f"assert {call} == 0\n"
        "print(gc.get_freeze_count())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (int(proc.stdout.strip().splitlines()[-1]) > 0) is frozen
