"""MLflow "model from code": a mopflow bundle served as a pyfunc returning class probabilities.

Logged with ``python_model=<this file>`` and ``artifacts={"bundle": <folder>, "mopflow_code":
<zip>}``; loading reads JSON + safetensors only (no pickled objects). The zip holds the mopflow
package the model was logged with, so that a process without mopflow installed serves it; this
file imports nothing of mopflow before the zip is on the path.
"""

from __future__ import annotations

import sys
from typing import Any

import mlflow
import numpy as np
import pandas as pd
from mlflow.pyfunc import PythonModel

CODE_ARTIFACT = "mopflow_code"  # the artifact holding the mopflow package, zipped


class BundleProbabilities(PythonModel):
    """Input: a table with the bundle's feature columns, a tensor of examples ``(n, *shape)``
    (images ``(n, channels, height, width)``, sequences ``(n, steps, features)``; MLflow's
    ``TensorSpec``), or one column ``x`` of encoded images (base64 PNG/JPEG) or tensors.
    Output: one ``prob_<class>`` column per class."""

    def load_context(self, context: Any) -> None:
        code = context.artifacts.get(CODE_ARTIFACT)  # older models: MLflow's code/ folder instead
        if code and "mopflow" not in sys.modules:  # the code it was logged with, ahead of any installed
            sys.path.insert(0, code)
        from mopflow.compression.ensemble import faster_form
        from mopflow.training.models.bundle import load_bundle

        self.bundle = load_bundle(context.artifacts["bundle"])
        # Members sharing an architecture can run stacked in one vmap call; whether that beats
        # the plain member loop depends on the CPU and the sizes, so it is measured once here.
        self.forward, _ = faster_form(self.bundle.module, int(np.prod(self.bundle.input_shape)))

    # MLflow reads model_input's hint at every load: it warns for Any and for no hint, and checks
    # requests against any other hint but pd.DataFrame / np.ndarray, which it passes as they come.
    # A request is a table (pd.DataFrame), a tensor (np.ndarray) or an example column (a table);
    # the signature logged with the model describes it, and model_rows checks it.
    def predict(
        self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None
    ) -> pd.DataFrame:
        from mopflow.registry.inputs import model_rows
        from mopflow.training.models.bundle import predict_proba

        x = model_rows(model_input, self.bundle.feature_columns, self.bundle.input_shape)
        probs = predict_proba(self.forward, x).numpy()
        return pd.DataFrame(probs, columns=[f"prob_{i}" for i in range(probs.shape[1])])


mlflow.models.set_model(BundleProbabilities())
