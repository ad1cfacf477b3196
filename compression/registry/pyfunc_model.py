"""MLflow "model from code": a mopflow bundle served as a pyfunc returning class probabilities.

Logged with ``python_model=<this file>`` and ``artifacts={"bundle": <folder>}``; loading reads
JSON + safetensors only (no pickled objects).
"""

from __future__ import annotations

from typing import Any

import mlflow
import numpy as np
import pandas as pd
from mlflow.pyfunc import PythonModel


class BundleProbabilities(PythonModel):
    """Input: a table with the bundle's feature columns, or a tensor of examples ``(n, *shape)``
    (images ``(n, channels, height, width)``, sequences ``(n, steps, features)``; MLflow's
    ``TensorSpec``). Output: one ``prob_<class>`` column per class."""

    def load_context(self, context: Any) -> None:
        from mopflow.compression.ensemble import faster_form
        from mopflow.training.models.bundle import load_bundle

        self.bundle = load_bundle(context.artifacts["bundle"])
        # Members sharing an architecture can run stacked in one vmap call; whether that beats
        # the plain member loop depends on the CPU and the sizes, so it is measured once here.
        self.forward, _ = faster_form(self.bundle.module, len(self.bundle.feature_columns))

    def predict(self, context: Any, model_input: Any, params: dict[str, Any] | None = None) -> pd.DataFrame:
        from mopflow.training.models.bundle import predict_proba

        columns = self.bundle.feature_columns
        if isinstance(model_input, pd.DataFrame):
            missing = [c for c in columns if c not in model_input.columns]
            if missing:
                raise ValueError(f"input is missing feature column(s) {missing[:5]}")
            x = model_input[columns].to_numpy(dtype=np.float32)
        else:
            x = np.asarray(model_input, dtype=np.float32)
            shape = tuple(self.bundle.input_shape)
            if x.ndim == len(shape) + 1:
                if tuple(x.shape[1:]) != shape:
                    raise ValueError(f"expected examples of shape {list(shape)}, got {list(x.shape[1:])}")
                x = x.reshape(len(x), -1)
        if x.ndim != 2 or x.shape[1] != len(columns):
            raise ValueError(f"expected {len(columns)} features per row, got shape {x.shape}")
        probs = predict_proba(self.forward, x).numpy()
        return pd.DataFrame(probs, columns=[f"prob_{i}" for i in range(probs.shape[1])])


mlflow.models.set_model(BundleProbabilities())
