"""Profiles: one setting (``MOPFLOW_PROFILE``) that moves every part of mopflow from its embedded
default to another backend, by filling in environment variables (``infra/profiles/NAME.env``).

A profile only supplies defaults: a variable already set in the environment wins, so a profile
can be pointed at other hosts without editing it.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from pathlib import Path

PROFILE_ENV = "MOPFLOW_PROFILE"
PROFILE_DIR = Path(__file__).resolve().parents[1] / "profiles"  # infra/profiles
EMBEDDED = "embedded"


class ProfileError(ValueError):
    """An unknown profile or a malformed profile file; the message names it."""


def available_profiles() -> list[str]:
    """The profile names: ``embedded`` (no file: the defaults) and one per ``profiles/*.env``."""
    return [EMBEDDED, *sorted(p.stem for p in PROFILE_DIR.glob("*.env"))]


def parse_profile(text: str, source: str = "profile") -> dict[str, str]:
    """``KEY=VALUE`` lines; blank lines and ``#`` comments are skipped; values are taken verbatim."""
    values: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not key.replace("_", "").isalnum() or not key[0].isalpha():
            raise ProfileError(f"{source}:{number}: expected KEY=VALUE, got {raw!r}")
        if key in values:
            raise ProfileError(f"{source}:{number}: {key} is set twice")
        values[key] = value.strip()
    return values


def read_profile(name: str) -> dict[str, str]:
    """The variables of profile ``name`` (empty for ``embedded``)."""
    if name == EMBEDDED:
        return {}
    path = PROFILE_DIR / f"{name}.env"
    if name not in available_profiles() or not path.is_file():  # a name, never a path
        raise ProfileError(f"unknown profile {name!r}; expected one of {available_profiles()}")
    return parse_profile(path.read_text(), str(path))


def apply_profile(environ: MutableMapping[str, str], name: str | None = None) -> dict[str, str]:
    """Fill ``environ`` with the profile's variables that it does not set already; returns those
    applied. ``name`` defaults to ``$MOPFLOW_PROFILE`` (unset = ``embedded``)."""
    chosen = name or environ.get(PROFILE_ENV) or EMBEDDED
    applied = {k: v for k, v in read_profile(chosen).items() if k not in environ}
    environ.update(applied)
    if chosen != EMBEDDED:
        environ[PROFILE_ENV] = chosen
    return applied
