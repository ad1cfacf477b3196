"""Fencing: an attempt that a later attempt has taken over writes nothing more.

Airflow retries a task whose worker host went silent (killed, or cut off) on another worker.
A host that was only cut off may come back while the retry runs, and its task would go on
telling the study and writing checkpoints beside the retry's. Each attempt therefore takes a
numbered lease when it starts (a fencing token: the study's, ``training/search/lease.py``) and
checks it before each write; an attempt whose lease was taken by a later one raises
:class:`Superseded` and stops.
"""

from __future__ import annotations

from collections.abc import Callable


class Superseded(RuntimeError):
    """A later attempt holds the lease: this one must stop without writing anything more. A
    permanent error: retrying the superseded attempt would only fence the newer one."""


Fence = Callable[[], None]  # raises Superseded when the attempt no longer holds its lease


def unfenced() -> None:
    """The fence of a run that shares its outputs with no other attempt: never raises."""
