"""The base of the stages' frozen, validated configs, and the rule for names."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict


class StageConfig(BaseModel):
    """Base: immutable, unknown keys refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)


_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$")


def check_name(value: str, what: str) -> str:
    """Names used for studies and registered models: letters, digits, '_', '.', '-'."""
    if not _NAME_RE.match(value):
        raise ValueError(f"{what} {value!r} must match {_NAME_RE.pattern}")
    return value
