"""The study's lease: which attempt of the search drives the study.

Each coordinator that opens a study (a search task's try, a resumed ``mopflow run``) takes the
next generation of the lease, recorded in the study's user attributes, where every attempt on
any host reads it through the shared Optuna storage. Before each write (asking a trial, reporting
an epoch, telling a result, moving a checkpoint into place) the coordinator checks that the
study's generation is still its own; once a later attempt has taken the lease, the check raises
:class:`~mopflow.base.fencing.Superseded` and the earlier attempt stops. A newer attempt never
waits for an older one: it takes the lease at once, since the older one can only be dead or
unable to reach the storage (Airflow starts a retry after the earlier try was declared lost).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import optuna

from mopflow.base.fencing import Superseded

log = logging.getLogger(__name__)

LEASE_ATTR = "mopflow.lease"


def lease_of(study: optuna.Study) -> dict[str, Any]:
    """The study's current lease as stored (read from the storage now, not from a cache);
    ``{}`` before any attempt took one."""
    value = study.user_attrs.get(LEASE_ATTR)
    return dict(value) if isinstance(value, dict) else {}


@dataclass(frozen=True)
class StudyLease:
    """One attempt's hold on ``study``: its ``generation``, and who it is (host and process)."""

    study: optuna.Study
    generation: int
    holder: str

    @classmethod
    def take(cls, study: optuna.Study, holder: str | None = None) -> StudyLease:
        """Take the next generation of ``study``'s lease for this attempt."""
        before = lease_of(study)
        generation = int(before.get("generation", 0)) + 1
        holder = holder or f"{socket.gethostname()}:{os.getpid()}"
        study.set_user_attr(LEASE_ATTR, {"generation": generation, "holder": holder, "taken_at": time.time()})
        if before:
            log.info(
                "search: took over study %s from %s (lease generation %d -> %d)",
                study.study_name,
                before.get("holder", "?"),
                generation - 1,
                generation,
            )
        return cls(study, generation, holder)

    def check(self) -> None:
        """Raise :class:`Superseded` when a later attempt has taken the lease."""
        now = lease_of(self.study)
        if int(now.get("generation", 0)) != self.generation:
            raise Superseded(
                f"study {self.study.study_name!r} is driven by a later attempt ({now.get('holder', '?')}, "
                f"lease generation {now.get('generation')}); this attempt ({self.holder}, generation "
                f"{self.generation}) stops without writing more"
            )
