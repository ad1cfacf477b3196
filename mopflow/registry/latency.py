"""A student's serving latency, measured on the path it is served by.

A request goes through the model as a server loads it: the bundle saved as a pyfunc model the
way the registry logs it (:class:`~mopflow.registry.pyfunc_model.BundleProbabilities`, with its
signature) and loaded with ``mlflow.pyfunc.load_model``, so MLflow's input checks against the
signature, the model's own input decoding and its forward pass are all timed, on this process's
CPU with one torch thread, the serving default. The first requests warm the model up and are not
counted; the next ones are timed one by one, and p50 and p95 are read from them.

An untrained model of an architecture answers as fast as a trained one (the same operations on
the same shapes), so a candidate's latency is known before it trains: the student is sized to a
latency budget before any training, and a budget nothing can meet fails the stage at once.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WARMUP_REQUESTS = 5
TIMED_REQUESTS = 40


@dataclass(frozen=True)
class Latency:
    """Milliseconds per request of ``rows`` rows: the median and the 95th percentile of
    ``requests`` timed requests."""

    p50_ms: float
    p95_ms: float
    rows: int
    requests: int

    def to_dict(self) -> dict[str, float | int]:
        return {"p50_ms": self.p50_ms, "p95_ms": self.p95_ms, "rows": self.rows, "requests": self.requests}


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``samples``, linearly interpolated (numpy's default)."""
    if not samples:
        raise ValueError("no samples to take a percentile of")
    ordered = sorted(samples)
    at = (len(ordered) - 1) * q / 100.0
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def time_requests(
    predict: Callable[[Any], Any],
    request: Any,
    rows: int,
    warmup: int = WARMUP_REQUESTS,
    requests: int = TIMED_REQUESTS,
    clock: Callable[[], float] = time.perf_counter,
) -> Latency:
    """Call ``predict(request)`` ``warmup`` times untimed, then ``requests`` times, each timed."""
    if requests < 1:
        raise ValueError(f"requests={requests}: at least one request is timed")
    for _ in range(warmup):
        predict(request)
    seconds = []
    for _ in range(requests):
        started = clock()
        predict(request)
        seconds.append(clock() - started)
    ms = [s * 1e3 for s in seconds]
    return Latency(percentile(ms, 50), percentile(ms, 95), rows, requests)


def pyfunc_latency(bundle_dir: str, request: Any, rows: int, requests: int = TIMED_REQUESTS) -> Latency:
    """The latency of the bundle at ``bundle_dir`` (a local folder) as the registry serves it: saved
    as a pyfunc model the way it is logged (models-from-code, with the signature of ``request``),
    loaded as a server loads it (``mlflow.pyfunc.load_model``: the input checks against the
    signature included), timed on one CPU thread."""
    import mlflow
    from mlflow.models import infer_signature
    from mlflow.pyfunc import PythonModelContext

    from mopflow.registry.model_registry import PYFUNC_FILE
    from mopflow.registry.pyfunc_model import BundleProbabilities

    model = BundleProbabilities()
    model.load_context(PythonModelContext(artifacts={"bundle": bundle_dir}, model_config={}))
    signature = infer_signature(request, model.predict(None, request))
    with tempfile.TemporaryDirectory(prefix="mopflow-served-") as folder:
        saved = str(Path(folder) / "model")
        mlflow.pyfunc.save_model(
            saved,
            python_model=str(PYFUNC_FILE),
            artifacts={"bundle": bundle_dir},
            signature=signature,
            pip_requirements=[],  # never installed: the model is loaded in this environment
        )
        return _on_one_thread(mlflow.pyfunc.load_model(saved).predict, request, rows, requests)


def _on_one_thread(predict: Callable[[Any], Any], request: Any, rows: int, requests: int) -> Latency:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return time_requests(predict, request, rows, requests=requests)
    finally:
        torch.set_num_threads(threads)


def architecture_latency(
    arch: Any, feature_columns: Sequence[str], norm: Mapping[str, Any], request: Any, rows: int
) -> Latency:
    """The serving latency of a model of ``arch`` (built untrained, written as a bundle in a
    temporary folder, served by the pyfunc class)."""
    from mopflow.training.models.builtin import build_model
    from mopflow.training.models.bundle import save_bundle

    model = build_model(arch, norm["mean"], norm["std"]).eval()
    with tempfile.TemporaryDirectory(prefix="mopflow-latency-") as folder:
        save_bundle(folder, [model], [arch], list(feature_columns))
        return pyfunc_latency(folder, request, rows)


def logged_model_latency(model_uri: str, request: Any, rows: int) -> Latency:
    """The latency of the logged (or registered) pyfunc model at ``model_uri``, loaded as a server
    loads it (``mlflow.pyfunc.load_model``), on one CPU thread."""
    import mlflow

    return _on_one_thread(mlflow.pyfunc.load_model(model_uri).predict, request, rows, TIMED_REQUESTS)
