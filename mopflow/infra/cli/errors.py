"""The error every ``mopflow`` command raises for what the operator can fix."""

from __future__ import annotations


class CliError(RuntimeError):
    """A user-facing error: printed without a traceback, exit code 2."""
