"""Load a benchmark script as a module (they live outside the packages, run as scripts)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(script: Path | str) -> ModuleType:
    """The benchmark ``script`` (a path, or a name in ``benchmarks/``) run up to its top level only:
    ``main()`` runs under ``if __name__ == "__main__"``."""
    path = Path(script) if isinstance(script, Path) else BENCHMARKS_DIR / f"{script}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
