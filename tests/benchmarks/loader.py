"""Load a benchmark script as a module (they live outside the packages, run as scripts), and
check that a quick run left the recorded results alone."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
RESULTS_DIR = BENCHMARKS_DIR / "results"


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


def recorded_results(results: Path = RESULTS_DIR) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in results.iterdir()}


def assert_not_written_over(recorded: dict[str, int], out: Path, results: Path = RESULTS_DIR) -> None:
    """No file the quick run wrote to ``out`` was also written into the recorded results. A result
    changed meanwhile with other content is a full benchmark running beside the suite, not this
    run, and does not fail it."""
    for path in out.iterdir():
        recorded_copy = results / path.name
        if (
            path.is_file()
            and recorded_copy.exists()
            and recorded_results(results).get(path.name) != recorded.get(path.name)
        ):
            assert recorded_copy.read_bytes() != path.read_bytes(), f"the quick run wrote {recorded_copy}"
