"""The evaluation report: accuracy, size and CPU latency of every model the pipeline produced."""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn


def quantize_int8(model: nn.Module) -> nn.Module:
    """INT8 dynamic quantization of the Linear layers, for CPU inference."""
    import warnings

    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():
        # torch.ao's eager quantization is deprecated in favour of torchao, which is not installed.
        warnings.simplefilter("ignore")
        return quantize_dynamic(model.eval(), {nn.Linear}, dtype=torch.qint8)


def serialized_bytes(module: nn.Module) -> int:
    """Size of the module's state dict when serialised (measures quantized packed weights too)."""
    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    return len(buffer.getvalue())


@torch.no_grad()
def latency_ms(
    forward: Callable[[torch.Tensor], torch.Tensor], n_features: int, batch: int, repeats: int = 30
) -> float:
    """Median wall time of one forward pass at ``batch`` rows, in milliseconds (one CPU thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(batch, n_features)
        for _ in range(3):
            forward(x)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            forward(x)
            times.append(time.perf_counter() - start)
        return float(np.median(times) * 1e3)
    finally:
        torch.set_num_threads(threads)


@torch.no_grad()
def accuracy_of(forward: Callable[[torch.Tensor], torch.Tensor], x: np.ndarray, y: np.ndarray) -> float:
    """Top-1 accuracy of a forward function returning scores per class."""
    scores = forward(torch.as_tensor(x, dtype=torch.float32))
    return float((scores.argmax(dim=1).numpy() == y).mean())


def evaluate(
    models: Mapping[str, tuple[Callable[[torch.Tensor], torch.Tensor], int, int]],
    x_test: np.ndarray,
    y_test: np.ndarray,
    repeats: int = 30,
) -> list[dict[str, Any]]:
    """One row per model: test accuracy, parameters, size on disk, latency at batch 1 and 256.

    ``models`` maps a name to (forward, parameter count, size in bytes).
    """
    rows = []
    for name, (forward, params, size) in models.items():
        rows.append(
            {
                "model": name,
                "test_acc": accuracy_of(forward, x_test, y_test),
                "params": int(params),
                "size_kb": round(size / 1024, 1),
                "latency_ms_b1": latency_ms(forward, x_test.shape[1], 1, repeats),
                "latency_ms_b256": latency_ms(forward, x_test.shape[1], 256, repeats),
            }
        )
    return rows


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The report as a fixed-width text table (also valid Markdown)."""
    header = "| model | test_acc | params | size_kb | latency_ms_b1 | latency_ms_b256 |"
    lines = [header, "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['test_acc']:.4f} | {r['params']} | {r['size_kb']} | "
            f"{r['latency_ms_b1']:.3f} | {r['latency_ms_b256']:.3f} |"
        )
    return "\n".join(lines)
