"""Every benchmark script still imports against the code it measures (they are not run here)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).resolve().parents[2] / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_the_benchmark_imports(script: Path) -> None:
    spec = importlib.util.spec_from_file_location(f"bench_{script.stem}", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)  # the top level only: main() runs under `if __name__ == "__main__"`
    assert callable(getattr(module, "main", None)), f"{script.name} has no main()"


def test_there_are_benchmarks_to_check() -> None:
    assert len(BENCHMARKS) >= 8
