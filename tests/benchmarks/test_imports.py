"""Every benchmark script still imports against the code it measures (they are not run here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.loader import BENCHMARKS_DIR, load_benchmark

BENCHMARKS = sorted(BENCHMARKS_DIR.glob("*.py"))


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_the_benchmark_imports(script: Path) -> None:
    module = load_benchmark(script)
    assert callable(getattr(module, "main", None)), f"{script.name} has no main()"


def test_there_are_benchmarks_to_check() -> None:
    assert len(BENCHMARKS) >= 8
