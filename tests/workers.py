"""How `make test` shares the suite between its pytest-xdist workers."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import pytest
from xdist.scheduler import LoadFileScheduling

SERVICES_UNIT = "local services"


def work_unit(nodeid: str, services_files: Collection[str]) -> str:
    """The unit of work a test belongs to: its file, or ``SERVICES_UNIT`` for the tests of the
    local servers (one worker runs them one after another)."""
    path = nodeid.split("::", 1)[0]
    return SERVICES_UNIT if path in services_files else path


class FileAndServicesScheduling(LoadFileScheduling):
    """Whole test files go to the next free worker, as with ``--dist loadfile``, and the files in
    ``services_files`` form one unit."""

    def __init__(self, config: pytest.Config, log: Any, services_files: Collection[str]) -> None:
        super().__init__(config, log)
        self.services_files = frozenset(services_files)

    def _split_scope(self, nodeid: str) -> str:
        return work_unit(nodeid, self.services_files)
