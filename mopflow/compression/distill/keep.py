"""Which student is registered: the distilled one or its hard-label twin, by validation accuracy.

Both students are trained side by side with the same architecture and as many optimizer steps;
distillation can still lose (few epochs, few transfer points), and then the twin is the better
model to register. The choice reads validation accuracy only, so the test split stays an unbiased
estimate of the model that is kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

StudentKind = Literal["distilled", "hard_label"]

# The students' rows in the evaluation report.
REPORT_NAMES: dict[StudentKind, str] = {"distilled": "student", "hard_label": "hard-label student"}


@dataclass(frozen=True)
class KeptStudent:
    """The student kept for registration, why, and both validation accuracies compared."""

    student: StudentKind
    reason: str
    distilled_val_acc: float
    hard_label_val_acc: float

    @property
    def val_acc(self) -> float:
        """The kept student's validation accuracy."""
        return self.hard_label_val_acc if self.student == "hard_label" else self.distilled_val_acc

    @property
    def report_name(self) -> str:
        """The kept student's row in the evaluation report."""
        return REPORT_NAMES[self.student]

    def to_dict(self) -> dict[str, Any]:
        """JSON form (a missing accuracy becomes null)."""
        return {
            "student": self.student,
            "model": self.report_name,
            "reason": self.reason,
            "val_acc": {
                "distilled": _finite_or_none(self.distilled_val_acc),
                "hard_label": _finite_or_none(self.hard_label_val_acc),
            },
        }


def keep_student(distilled_val_acc: float, hard_label_val_acc: float) -> KeptStudent:
    """The hard-label student when its validation accuracy is higher, else the distilled one (a
    tie, or an accuracy that is missing or NaN, keeps the distilled student)."""
    d, h = float(distilled_val_acc), float(hard_label_val_acc)
    if not (math.isfinite(d) and math.isfinite(h)):
        reason = f"no validation accuracies to compare (distilled {d}, hard-label {h}); the distilled student is kept"
        return KeptStudent("distilled", reason, d, h)
    ds, hs = _distinct_digits(d, h)
    if h > d:
        return KeptStudent("hard_label", f"hard-label val_acc {hs} > distilled {ds}", d, h)
    if d > h:
        return KeptStudent("distilled", f"distilled val_acc {ds} > hard-label {hs}", d, h)
    return KeptStudent(
        "distilled", f"distilled val_acc {ds} = hard-label {hs} (a tie keeps the distilled student)", d, h
    )


def mark_kept(report: list[dict[str, Any]], kept: KeptStudent) -> list[dict[str, Any]]:
    """The evaluation report with each student's validation accuracy and whether it was kept (the
    other rows as they were)."""
    val_acc = {
        REPORT_NAMES["distilled"]: kept.distilled_val_acc,
        REPORT_NAMES["hard_label"]: kept.hard_label_val_acc,
    }
    return [
        row | {"val_acc": _finite_or_none(val_acc[row["model"]]), "kept": row["model"] == kept.report_name}
        if row["model"] in val_acc
        else dict(row)
        for row in report
    ]


def kept_line(kept: KeptStudent) -> str:
    """One line for the report's reader: the student kept and why."""
    return f"kept: the {kept.student.replace('_', '-')} student, {kept.reason}"


def _distinct_digits(a: float, b: float) -> tuple[str, str]:
    """``a`` and ``b`` with 4 decimals, or as many more as it takes to tell them apart."""
    for digits in range(4, 10):
        sa, sb = f"{a:.{digits}f}", f"{b:.{digits}f}"
        if sa != sb:
            return sa, sb
    return f"{a:.4f}", f"{b:.4f}"


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None
