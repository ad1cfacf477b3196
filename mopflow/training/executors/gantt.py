"""MOP observability: a Gantt chart (worker x time, one colour per model), the idle fraction and
the invariants an epoch's units keep."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def idle_fraction(records: Sequence[Mapping[str, Any]]) -> float:
    """Share of worker-time spent idle between the epoch's first start and last end."""
    if not records:
        return 0.0
    workers = {str(r["worker"]) for r in records}
    start = min(float(r["start"]) for r in records)
    end = max(float(r["end"]) for r in records)
    span = (end - start) * len(workers)
    busy = sum(float(r["end"]) - float(r["start"]) for r in records)
    return max(0.0, 1.0 - busy / span) if span > 0 else 0.0


def gantt_png(records: Sequence[Mapping[str, Any]], path: str, title: str = "") -> str:
    """Draw the units of an epoch: one row per worker, one colour per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workers = sorted({str(r["worker"]) for r in records})
    models = sorted({str(r["model"]) for r in records})
    colours = plt.get_cmap("tab20")
    t0 = min(float(r["start"]) for r in records) if records else 0.0
    fig, ax = plt.subplots(figsize=(10, 1 + 0.6 * len(workers)))
    for r in records:
        row = workers.index(str(r["worker"]))
        colour = colours(models.index(str(r["model"])) % 20)
        ax.barh(
            row,
            float(r["end"]) - float(r["start"]),
            left=float(r["start"]) - t0,
            color=colour,
            edgecolor="black",
        )
        ax.text(float(r["start"]) - t0, row, f" {r['model']}", va="center", fontsize=7)
    ax.set_yticks(range(len(workers)), labels=workers)
    ax.set_xlabel("seconds")
    ax.set_title(
        title
        or f"MOP epoch: {len(models)} models on {len(workers)} workers (idle {idle_fraction(records):.0%})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def check_invariants(
    records: Iterable[Mapping[str, object]], models: Iterable[str], partitions: Iterable[str]
) -> None:
    """Raise AssertionError unless an epoch's unit records (model, partition, worker, start, end)
    visit each (model, partition) exactly once, never overlap for one model, never overlap on one worker."""
    recs = list(records)
    seen = sorted((str(r["model"]), str(r["partition"])) for r in recs)
    expected = sorted((m, p) for m in models for p in partitions)
    assert seen == expected, f"units run {seen} differ from every (model, partition) once {expected}"
    for key in ("model", "worker"):
        groups: dict[str, list[tuple[float, float]]] = {}
        for r in recs:
            groups.setdefault(str(r[key]), []).append((float(r["start"]), float(r["end"])))  # type: ignore[arg-type]
        for name, spans in groups.items():
            spans.sort()
            for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
                assert start >= end, f"{key} {name} ran two units at once"
