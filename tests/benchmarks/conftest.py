"""The benchmark scripts' own modules (``benchmarks/studies/growing.py``, ...) are importable in these tests,
as they are to the scripts themselves, which run with ``benchmarks/`` first on the path."""

from __future__ import annotations

import sys

from tests.benchmarks.loader import BENCHMARKS_DIR

if str(BENCHMARKS_DIR) not in sys.path:
    sys.path.append(str(BENCHMARKS_DIR))
