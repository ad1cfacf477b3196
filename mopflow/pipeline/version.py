"""The code version recorded as lineage on every run."""

from __future__ import annotations

import subprocess
from functools import lru_cache
from importlib import metadata
from pathlib import Path


@lru_cache(maxsize=1)
def code_version() -> str:
    """``<package version>+g<commit>`` when run from a git checkout, else the package version."""
    try:
        version = metadata.version("mopflow")
    except metadata.PackageNotFoundError:
        version = "0+unknown"
    repo = Path(__file__).resolve().parents[2]  # mopflow/pipeline/version.py -> the checkout
    if not (repo / ".git").exists():  # an installed wheel: never the commit of a repository around it
        return version
    try:
        commit = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return version
    return f"{version}+g{commit}" if commit else version
