"""Stopping a training run whose units are in flight on Dask workers.

Asked to stop (``mopflow.base.stopping``), a coordinator gives every worker the spot notice once
(``training/volatile/preempt.py``): the units in flight save their state at their next batch
and come back, so the run resumes from there. The notice is withdrawn once they are back, so
the workers can train again.
"""

from __future__ import annotations

import logging
from typing import Any

from mopflow.training.volatile.preempt import clear_notice, raise_notice

log = logging.getLogger(__name__)


class StopNotice:
    """The notice a coordinator gives its workers when the run is asked to stop."""

    def __init__(self, client: Any, strategy: str, units: str) -> None:
        self.client = client
        self.strategy, self.units = strategy, units  # for the log: "mop", "unit(s)"
        self.given = False

    def give(self, in_flight: int) -> None:
        """Give every worker the notice (once): their ``in_flight`` units checkpoint and return."""
        if self.given:
            return
        self.given = True
        log.warning(
            "%s: stopping; %d %s(s) in flight checkpoint at their next batch",
            self.strategy,
            in_flight,
            self.units,
        )
        self.client.run(raise_notice)

    def withdraw(self) -> None:
        """Take the notice back (when given): the workers may train again."""
        if self.given:
            self.client.run(clear_notice)
            self.given = False
