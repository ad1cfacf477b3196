"""The evaluation report: accuracy, size and CPU latency of every model the pipeline produced."""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from mopflow.training.models.metrics import top1_correct

# Rows per forward pass when measuring accuracy: an ensemble's activations for 4096 rows took
# about 190 MB more than for 1024 (2 residual CNN members), for 16% less time.
EVAL_ROWS = 1024
# Timing a forward pass stops after this many seconds of timed passes, once this many are timed.
LATENCY_BUDGET_S = 0.25
LATENCY_MIN_REPEATS = 5


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
    forward: Callable[[torch.Tensor], torch.Tensor],
    n_features: int,
    batch: int,
    repeats: int = 30,
    budget_s: float | None = LATENCY_BUDGET_S,
) -> float:
    """Median wall time of one forward pass at ``batch`` rows, in milliseconds (one CPU thread).

    Three warm-up passes, then ``repeats`` timed ones; with ``budget_s``, timing stops once that
    many seconds are spent and at least :data:`LATENCY_MIN_REPEATS` passes are timed, so that a
    large ensemble's slow passes do not hold up the report (a median of a few 100-ms passes is as
    steady as one of thirty). ``None`` times exactly ``repeats`` passes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(batch, n_features)
        for _ in range(3):
            forward(x)
        times: list[float] = []
        spent = 0.0
        while len(times) < repeats:
            if budget_s is not None and spent >= budget_s and len(times) >= LATENCY_MIN_REPEATS:
                break
            start = time.perf_counter()
            forward(x)
            times.append(time.perf_counter() - start)
            spent += times[-1]
        return float(np.median(times) * 1e3)
    finally:
        torch.set_num_threads(threads)


@torch.no_grad()
def correct_of(
    forward: Callable[[torch.Tensor], torch.Tensor], x: np.ndarray, y: np.ndarray, batch_rows: int = EVAL_ROWS
) -> int:
    """Rows a forward function (scores per class) predicts right, ``batch_rows`` rows at a time
    (a whole split at once would hold every layer's activations for every row)."""
    xt = torch.as_tensor(x, dtype=torch.float32)
    return sum(
        (
            top1_correct(forward(xt[start : start + batch_rows]), y[start : start + batch_rows])
            for start in range(0, len(xt), batch_rows)
        ),
        0,
    )


def accuracy_of(
    forward: Callable[[torch.Tensor], torch.Tensor], x: np.ndarray, y: np.ndarray, batch_rows: int = EVAL_ROWS
) -> float:
    """Top-1 accuracy of a forward function returning scores per class (0.0 without rows)."""
    return correct_of(forward, x, y, batch_rows) / len(y) if len(y) else 0.0


def evaluate(
    models: Mapping[str, tuple[Callable[[torch.Tensor], torch.Tensor], int, int]],
    test_shards: Iterable[tuple[np.ndarray, np.ndarray]],
    repeats: int = 30,
) -> list[dict[str, Any]]:
    """One row per model: test accuracy, parameters, size on disk, latency at batch 1 and 256.

    ``models`` maps a name to (forward, parameter count, size in bytes). ``test_shards`` are the
    test split's ``(features, labels)`` shards, each read once and measured by every model.
    """
    correct, rows, n_features = dict.fromkeys(models, 0), 0, 0
    for x, y in test_shards:
        for name, (forward, _, _) in models.items():
            correct[name] += correct_of(forward, x, y)
        rows, n_features = rows + len(y), x.shape[1]
    if not rows:
        raise ValueError("the test split has no rows to evaluate the models on")
    return [
        {
            "model": name,
            "test_acc": correct[name] / rows,
            "params": int(params),
            "size_kb": round(size / 1024, 1),
            "latency_ms_b1": latency_ms(forward, n_features, 1, repeats),
            "latency_ms_b256": latency_ms(forward, n_features, 256, repeats),
        }
        for name, (forward, params, size) in models.items()
    ]


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The report as a fixed-width text table (also valid Markdown). When rows carry a validation
    accuracy (the students) it gets a column, and a row marked ``kept`` says so after its name."""
    with_val = any("val_acc" in r for r in rows)
    val_head, val_rule = ("val_acc | ", "---:|") if with_val else ("", "")
    header = f"| model | test_acc | {val_head}params | size_kb | latency_ms_b1 | latency_ms_b256 |"
    lines = [header, f"|---|---:|{val_rule}---:|---:|---:|---:|"]
    for r in rows:
        name = f"{r['model']} (kept)" if r.get("kept") else r["model"]
        val = f"{_cell(r.get('val_acc'))} | " if with_val else ""
        lines.append(
            f"| {name} | {r['test_acc']:.4f} | {val}{r['params']} | {r['size_kb']} | "
            f"{r['latency_ms_b1']:.3f} | {r['latency_ms_b256']:.3f} |"
        )
    return "\n".join(lines)


def _cell(value: float | None) -> str:
    return "" if value is None else f"{value:.4f}"


class _StaticInt8(nn.Module):
    """A classifier prepared for eager-mode static INT8: float standardisation, then quantized
    convolutions/linears (ReLU fused) between a QuantStub and a DeQuantStub."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        from torch.ao.quantization import DeQuantStub, QuantStub

        standardize, backbone = model[0], model[1]  # type: ignore[index]
        if not all(hasattr(backbone, name) for name in ("reshape", "features", "head")):
            raise TypeError(
                f"static quantization needs a backbone with reshape/features/head (the quantizable "
                f"families' layout), not {type(backbone).__name__}"
            )
        self.standardize = standardize
        self.reshape = backbone.reshape
        self.quant = QuantStub()
        self.dequant = DeQuantStub()
        self.body: nn.Module = backbone.features
        self.head: nn.Module = backbone.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.quant(self.reshape(self.standardize(x)))
        h = self.body(h)
        return self.dequant(self.head(h.flatten(1)))


def static_int8_engine() -> str:
    """The quantized engine used to pack static INT8 weights: fbgemm on x86 when present, else
    x86 (oneDNN/fbgemm dispatch), else qnnpack (ARM).

    Measured on the demo's CNN student (2-core x86 VM, 1 thread): fbgemm-packed convolutions ran
    batch 1 in ~0.12 ms vs ~0.18 ms with the x86 engine's packing, and batch 256 ~20-30% faster
    (``benchmarks/distill.py``).
    """
    engines = torch.backends.quantized.supported_engines
    for engine in ("fbgemm", "x86", "qnnpack"):
        if engine in engines:
            return engine
    raise RuntimeError(f"no INT8 engine among the supported ones: {engines}")


def quantize_static_int8(model: nn.Module, calibration_x: np.ndarray, engine: str | None = None) -> nn.Module:
    """INT8 static quantization of every Conv1d and Linear (ReLU fused), calibrated on ``calibration_x``.

    Dynamic quantization converts only Linear layers; a CNN spends its time in convolutions,
    so this is the variant that makes a CNN student faster on CPU. The whole backbone is
    quantized, first convolution included (keeping it in float was slower: one more quantize
    step and a float conv); weights per output channel, activations per tensor (histogram
    observers). ``engine`` packs the weights (default :func:`static_int8_engine`); the packed
    weights carry their kernels, so the global engine is restored afterwards.
    """
    import copy
    import warnings

    from torch.ao.quantization import convert, fuse_modules, get_default_qconfig, prepare

    engine = engine or static_int8_engine()
    if engine not in torch.backends.quantized.supported_engines:
        raise ValueError(
            f"quantized engine {engine!r} is not supported here; expected one of "
            f"{torch.backends.quantized.supported_engines}"
        )
    if len(calibration_x) == 0:
        raise ValueError("static INT8 quantization needs calibration rows; got none")
    previous = torch.backends.quantized.engine
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao eager quantization is deprecated in favour of torchao
            torch.backends.quantized.engine = engine
            wrapped = _StaticInt8(copy.deepcopy(model).eval()).eval()
            pairs = [[str(i), str(i + 1)] for i in range(0, len(wrapped.body) - 1, 2)]  # type: ignore[arg-type]
            if pairs:
                wrapped.body = fuse_modules(wrapped.body, pairs)
            wrapped.qconfig = get_default_qconfig(engine)
            wrapped.standardize.qconfig = None  # stays in float
            prepared = prepare(wrapped)
            with torch.no_grad():
                xt = torch.as_tensor(calibration_x, dtype=torch.float32)
                for start in range(0, len(xt), 512):
                    prepared(xt[start : start + 512])
            return convert(prepared)
    finally:
        torch.backends.quantized.engine = previous
