"""The example family package (examples/custom_family): without it, its family is refused by name.

Installed as a package is (its entry point, not an edit to mopflow), it is taken through shard ->
search -> ensemble -> distill -> register -> serve by the installed wheel's run
(``tests/test_packaging.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.dags.test_end_to_end import REPO, _env
from tests.test_packaging import TCN_SPACE as SPACE


def test_without_the_package_the_family_is_refused_naming_the_registered_ones(tmp_path: Path) -> None:
    home = tmp_path / "home"
    proc = subprocess.run(
        [sys.executable, "-m", "mopflow.infra.cli", "run", "--set", f"search_space={json.dumps(SPACE)}"],
        cwd=REPO,
        env=_env(home),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "unknown model family 'tcn'" in proc.stderr and "registered: ['cnn'" in proc.stderr
    assert not (home / "data").exists()
