"""The code version recorded on every run names the checkout's commit."""

from __future__ import annotations

import subprocess
from pathlib import Path

from mopflow.pipeline.version import code_version

REPO = Path(__file__).resolve().parents[2]


def test_a_checkouts_code_version_names_its_commit() -> None:
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert code_version().endswith(f"+g{head}")
