"""The screen readers of the pseudo-terminal runs (tests/infra/cli/test_local_runs.py runs them)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.infra.cli.terminal import before_first_progress, foreign_lines, run_in_terminal, screen_lines


def test_a_command_in_a_terminal_sees_a_terminal(tmp_path: Path) -> None:
    code, output = run_in_terminal(
        [sys.executable, "-c", "import sys; print(sys.stdout.isatty(), sys.stderr.isatty()); sys.exit(3)"],
        {"PATH": "/usr/bin:/bin"},
        tmp_path,
        timeout=60,
    )
    assert code == 3 and screen_lines(output) == ["True True"]


def test_the_screen_is_read_as_the_lines_a_person_saw() -> None:
    drawn = (
        "config : demo\r\nrun key abc\r\n\x1b[2K\x1b[1A⠋ shard     ━━━━  00:00\r✓ shard     ━━━━  00:01\r\n"
    )
    lines = screen_lines(drawn)
    assert lines == ["config : demo", "run key abc", "⠋ shard     ━━━━  00:00", "✓ shard     ━━━━  00:01"]
    assert before_first_progress(lines) == ["config : demo", "run key abc"]
    with pytest.raises(AssertionError, match="no progress row"):
        before_first_progress(lines[:2])


def test_library_logs_and_warnings_are_told_from_mopflows_lines() -> None:
    lines = [
        "mopflow run: run key 1c754283c71f; full log: /h/logs/1c.log (--verbose streams it)",
        "2026-11-29 13:02:11,001 - distributed.scheduler - INFO - State start",
        "[2026-11-29T13:02:12.000+0000] {migration.py:211} INFO - Context impl SQLiteImpl.",
        "/x/starlette/formparsers.py:12: PendingDeprecationWarning: Please use `import python_multipart`",
        "trial   0  rescnn  COMPLETE  epoch 1/1    val_acc 0.2658  best 0.2658 (trial 0)",
    ]
    assert foreign_lines(lines) == lines[1:4]
