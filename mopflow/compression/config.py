"""The configs of the compression stages: ensemble selection, distillation and the registry.

Each is a frozen, validated model; :mod:`mopflow.pipeline.config` joins them with the data and search
configs into the pipeline config and the flat conf keys.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from mopflow.training.config import StageConfig, check_name


class EnsembleConfig(StageConfig):
    """Which trials form the ensemble."""

    top_k: int = Field(4, ge=1, le=50, description="Ensemble size: top-k members, or greedy selection steps")
    selection: Literal["top_k", "greedy"] = Field(
        "top_k", description="top_k: the k best COMPLETE trials; greedy: forward selection with replacement"
    )


class DistillConfig(StageConfig):
    """The student and its training on the ensemble's soft targets."""

    family: str = Field(
        "auto",
        min_length=1,
        max_length=32,
        description="Student model family: a registered family that can be a student (cnn, cnn2d, mlp, ...); "
        "auto = cnn for tables and sequences, cnn2d for images",
    )
    width: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="Student size (the family's size parameter, e.g. width); None = largest within the budget",
    )
    depth: int = Field(3, ge=1, le=8, description="Student depth (families with a depth parameter)")
    max_param_ratio: float = Field(0.1, gt=0, le=1.0, description="Student params <= ratio x ensemble params")
    max_params: int | None = Field(
        None,
        ge=1,
        le=1_000_000_000,
        description="Student params <= this (a size to ship); set, it replaces max_param_ratio",
    )
    budget_ms: float | None = Field(
        None,
        gt=0,
        le=60_000,
        description="Serving budget: p95 milliseconds per request of student_batch rows, served on one "
        "CPU thread; the student is the widest within it (None = no latency budget)",
    )
    trials: int = Field(
        0,
        ge=0,
        le=200,
        description="Student search: candidates (family, depth, width) distilled and weighed on accuracy "
        "and serving cost (p95 latency under student_budget_ms, else parameters); 0 = off",
    )
    request_rows: int = Field(
        256, ge=1, le=65_536, description="Rows per request when the student's serving latency is timed"
    )
    temperature: float = Field(4.0, gt=0, le=100, description="Softmax temperature of the soft targets")
    alpha: float = Field(
        0.9, ge=0, le=1, description="Weight of the soft-target loss (1 - alpha on hard labels)"
    )
    epochs: int = Field(
        48, ge=1, le=1000, description="Student training epochs over the transfer set (real + synthetic rows)"
    )
    lr: float = Field(0.01, gt=0, le=1.0, description="Student peak learning rate")
    batch_size: int = Field(64, ge=1, le=65536, description="Student batch size")
    transfer: Literal["auto", "munge", "mixup"] = Field(
        "auto",
        description="Synthetic transfer points: munge (tables), mixup of shifted examples (images, "
        "sequences; unshifted for signal tables such as MNIST-1D); auto = munge for tables of "
        "separate columns, mixup otherwise",
    )
    munge_multiplier: int = Field(
        4,
        ge=0,
        le=20,
        description="Synthetic transfer points (MUNGE or mixup) per training example (0 = off)",
    )
    munge_swap_prob: float = Field(0.5, gt=0, le=1, description="MUNGE: probability of swapping an attribute")
    munge_spread: float = Field(1.0, gt=0, le=100, description="MUNGE: perturbation width divisor s")
    mixup_alpha: float = Field(0.4, gt=0, le=10, description="mixup: Beta(alpha, alpha) mixing weights")
    mixup_shift: int = Field(
        2, ge=0, le=64, description="mixup: random shift of up to this many pixels/steps"
    )

    @field_validator("family")
    @classmethod
    def _student_family(cls, value: str) -> str:
        from mopflow.training.models.families import FamilyError, registered_families

        if value == "auto":
            return value
        families = registered_families()
        students = sorted(name for name, family in families.items() if family.can_be_student)
        if value not in families:
            raise ValueError(f"unknown model family {value!r}; student families: {students}")
        if value not in students:
            raise ValueError(f"family {value!r} cannot be a student; student families: {students}")
        if families[value].size_param is None:
            raise FamilyError(f"student family {value!r} has no size parameter to fit the budget")
        return value

    def resolved(self, modality: str, ordered: bool = False) -> DistillConfig:
        """This config with ``auto`` choices made for data of ``modality``; ``ordered``: a table
        whose features are the steps of one signal (``DataSpec.ordered``, MNIST-1D)."""
        update: dict[str, Any] = {}
        if self.family == "auto":
            update["family"] = AUTO_STUDENT[modality]
        if self.transfer == "auto":
            # MUNGE for tables of separate columns; mixup where mixing two examples gives a
            # plausible one: images, sequences and signal tables. On MNIST-1D mixup gave the
            # distilled student 0.962 against MUNGE's 0.952 (3 seeds, docs/benchmarks.md).
            update["transfer"] = "munge" if modality == "table" and not ordered else "mixup"
        return self.model_copy(update=update)

    def student_params(self, size: int | None = None) -> dict[str, Any]:
        """The student's family params: the family's defaults, ``depth`` where it has one, and
        ``size`` (else ``width``) as its size parameter (when given)."""
        from mopflow.training.models.families import get_family

        family = get_family(self.family)
        params = family.default_params()
        if "depth" in family.params:
            params["depth"] = self.depth
        chosen = size if size is not None else self.width
        if chosen is not None and family.size_param is not None:
            params[family.size_param] = chosen
        return params


AUTO_STUDENT = {"table": "cnn", "sequence": "cnn", "image": "cnn2d"}  # student_family=auto


class RegistryConfig(StageConfig):
    """Names in the Model Registry and the promotion rule."""

    model_name: str = Field("mopflow", description="Prefix of the registered model names")
    promotion: Literal["accuracy", "always", "never"] = Field(
        "accuracy", description="accuracy: champion if test accuracy >= the current champion's"
    )
    max_gap_to_ensemble: float = Field(
        2.0,
        ge=0,
        le=100,
        description="Promotion also needs the student within this many points of the ensemble",
    )

    @field_validator("model_name")
    @classmethod
    def _name(cls, value: str) -> str:
        return check_name(value, "model_name")
