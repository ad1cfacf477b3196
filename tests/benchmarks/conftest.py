"""The benchmark scripts' own modules (``benchmarks/studies/growing.py``, ...) are importable in these tests,
as they are to the scripts themselves, which run with ``benchmarks/`` first on the path.

This is the suite's one path entry, and it is ``benchmarks/``, never the repository root: processes
that a study spawns unpickle their targets (``studies.plain_optuna._worker``) by module name, and
a spawned child gets its path from its parent's ``sys.path``."""

from __future__ import annotations

import sys

from tests.benchmarks.loader import BENCHMARKS_DIR

if str(BENCHMARKS_DIR) not in sys.path:
    sys.path.append(str(BENCHMARKS_DIR))
