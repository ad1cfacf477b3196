"""What every benchmark script shares about its output: where its JSON goes, and how a model's
architecture is printed."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def results_file(out: Path | None, quick: bool, recorded: Path) -> Path | None:
    """Where the JSON goes: ``--out`` (a folder, where it is named as ``recorded`` is, or a
    ``.json`` file), else ``recorded`` in ``benchmarks/results/``; a ``--quick`` run writes it
    only to ``--out``."""
    if out is None:
        return None if quick else recorded
    return out if out.suffix == ".json" else out / recorded.name


def arch_params(arch: Any) -> str:
    """The architecture's own parameters, as ``width 16 depth 3``."""
    return " ".join(f"{k} {v}" for k, v in arch.params.items())
