"""The pipeline configuration the stage tests run: data, search and distillation small enough
for a whole pipeline on a CPU in minutes (each test adds its own ``model_name``)."""

from __future__ import annotations

from typing import Any

SMALL_CONF: dict[str, Any] = {
    "num_samples": 600,
    "n_shards": 2,
    "n_trials": 2,
    "epochs": 2,
    "pruner": "none",
    "top_k": 2,
    "distill_epochs": 1,
}
