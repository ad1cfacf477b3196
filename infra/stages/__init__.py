"""The pipeline's stages, one function per Airflow task: start, shard, search, ensemble, distill,
register, finalize.

This is the layer that joins ``training`` and ``compression`` into the pipeline; the DAG files
and ``mopflow run`` call it, and nothing below it imports it. Every stage runs inside one
:func:`~mopflow.infra.stages.context.stage` context (the config parsed once, the stage's MLflow run owned
through the ``Tracker``, lineage tags, peak memory, the root cause recorded on failure), takes
the small dicts its upstream stages returned, and returns one for XCom. Every stage is
idempotent: outputs are keyed by content hash or by the pipeline run key.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

# Where each public name of the stage layer lives. Imported on first use: the DAG files import
# this package while Airflow parses them, and the stages' own imports (torch, MLflow) are heavy.
_HOMES = {
    "start_pipeline": "run",
    "finalize_pipeline": "run",
    "shard_stage": "shard",
    "search_stage": "search",
    "champion_warm_start": "search",
    "BEST_PARAMS_TAG": "search",
    "ensemble_stage": "ensemble",
    "distill_stage": "distill",
    "register_stage": "register",
    "PipelineFailed": "context",
    "RunContext": "context",
    "make_run_key": "context",
    "permanent_errors": "context",
    "read_failure": "context",
    "study_name_for": "context",
    "tracker_for": "context",
}

# The tasks of a pipeline DAG, in order, by the name the DAG files call them.
STAGE_NAMES = (
    "start_pipeline",
    "shard_stage",
    "search_stage",
    "ensemble_stage",
    "distill_stage",
    "register_stage",
    "finalize_pipeline",
)


def stage_function(name: str) -> Callable[..., dict[str, Any]]:
    """The function of the pipeline task ``name`` (one of :data:`STAGE_NAMES`)."""
    if name not in STAGE_NAMES:
        raise KeyError(f"no pipeline stage {name!r}; expected one of {list(STAGE_NAMES)}")
    function: Callable[..., dict[str, Any]] = __getattr__(name)
    return function


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)


__all__ = ["STAGE_NAMES", "stage_function", *_HOMES]
