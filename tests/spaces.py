"""Search spaces shared by tests: one fixed configuration, so a sweep's outcome depends on what is tested."""

from __future__ import annotations

from typing import Any


def fixed_cnn_space(batch_size: int, lr: float = 0.01, width: int = 8, depth: int = 2) -> dict[str, Any]:
    """A space with a single point: a CNN (width 8 and depth 2 unless given) at one learning rate
    and batch size."""
    return {
        "families": {
            "cnn": {
                "width": {"type": "categorical", "choices": [width]},
                "depth": {"type": "categorical", "choices": [depth]},
            }
        },
        "common": {
            "lr": {"type": "categorical", "choices": [lr]},
            "batch_size": {"type": "categorical", "choices": [batch_size]},
        },
    }


def cnn_8x2_space(common: dict[str, Any]) -> dict[str, Any]:
    """A CNN of width 8 and depth 2 with ``common`` parameters (lr, batch size) as given."""
    return {
        "families": {
            "cnn": {
                "width": {"type": "categorical", "choices": [8]},
                "depth": {"type": "categorical", "choices": [2]},
            }
        },
        "common": common,
    }


# Two families with ranged parameters: for tests of sampling, pruning and the controller (no training).
SMALL_SEARCH_SPACE: dict[str, Any] = {
    "families": {
        "cnn": {
            "width": {"type": "int", "low": 4, "high": 64, "log": True},
            "depth": {"type": "int", "low": 2, "high": 3},
        },
        "mlp": {
            "width": {"type": "int", "low": 8, "high": 16},
            "depth": {"type": "int", "low": 1, "high": 2},
        },
    },
    "common": {
        "lr": {"type": "float", "low": 0.001, "high": 0.1, "log": True},
        "batch_size": {"type": "categorical", "choices": [32, 64]},
    },
}
