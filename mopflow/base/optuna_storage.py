"""Optuna storage from a URL: a journal file on one host, an RDB (PostgreSQL) across hosts."""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import BaseStorage, JournalStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend

log = logging.getLogger(__name__)


class StorageConfigError(ValueError):
    """The Optuna storage URL cannot be used for this search."""


def storage_kind(url: str) -> str:
    """'journal' for file paths and journal:// URLs, 'sqlite' or 'rdb' for database URLs."""
    if url.startswith("journal://"):
        return "journal"
    if url.startswith("sqlite:"):
        return "sqlite"
    if "://" in url:
        return "rdb"
    return "journal"


def journal_path(url: str) -> str:
    """The file behind a journal URL or path."""
    return url[len("journal://") :] if url.startswith("journal://") else url


def make_storage(url: str, writers: int = 1) -> BaseStorage:
    """Open an Optuna storage. SQLite is refused for parallel workers (it locks under concurrent writes)."""
    kind = storage_kind(url)
    if kind == "sqlite" and writers > 1:
        raise StorageConfigError(
            f"Optuna storage {url!r} is SQLite, which cannot take {writers} concurrent writers; "
            "use a journal file (a path) or PostgreSQL"
        )
    if kind == "journal":
        path = Path(journal_path(url)).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        return JournalStorage(JournalFileBackend(os.fspath(path)))
    # No heartbeats: trials report from the one coordinator, which recovers the trials a dead
    # coordinator left RUNNING when it restarts (training.search.retry_stale_trials).
    return _retrying("connect", lambda: ResilientRDBStorage(url, engine_kwargs={"pool_pre_ping": True}))


def redact_url(url: str) -> str:
    """The storage URL with any password replaced by ``***`` (for logs, XCom, summaries, UIs)."""
    if storage_kind(url) != "rdb":
        return url
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a database URL after all: show only its scheme
        return url.split("://", 1)[0] + "://***"


def quiet_optuna() -> None:
    """Keep Optuna's per-trial INFO lines out of task logs (mopflow logs its own progress)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)


# RDB calls retried when the database is briefly unreachable (a restart, a fail-over, a dropped
# connection). pool_pre_ping replaces dead pooled connections; these retries bridge the seconds
# in which no new connection can be made.
DB_RETRIES = 7
_RETRIED_METHODS = (  # the entry points Optuna's cache layer calls on its RDB backend
    "create_new_study",
    "get_all_studies",
    "get_study_id_from_name",
    "get_study_name_from_id",
    "get_study_directions",
    "get_study_user_attrs",
    "get_study_system_attrs",
    "set_study_user_attr",
    "set_study_system_attr",
    "_create_new_trial",
    "_set_trial_param",
    "set_trial_state_values",
    "set_trial_intermediate_value",
    "set_trial_user_attr",
    "set_trial_system_attr",
    "get_trial",
    "_get_trials",
    "_get_best_trial_id",
    "get_trial_id_from_study_id_trial_number",
)


def _transient(exc: BaseException) -> bool:
    """A lost or refused connection (retry), not a bad statement or bad data (raise)."""
    import sqlalchemy.exc

    permanent = (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.DataError, sqlalchemy.exc.ProgrammingError)
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, permanent):
            return False
        if isinstance(seen, sqlalchemy.exc.DBAPIError) and seen.connection_invalidated:
            return True
        if isinstance(
            seen,
            sqlalchemy.exc.OperationalError
            | sqlalchemy.exc.InterfaceError
            | sqlalchemy.exc.DisconnectionError
            | sqlalchemy.exc.PendingRollbackError
            | sqlalchemy.exc.InvalidatePoolError,
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _retrying(what: str, call: Any) -> Any:
    """Run ``call()``; retry with backoff (about 30 s in all) while the database is unreachable."""
    delay = 0.5
    for attempt in range(DB_RETRIES):
        try:
            return call()
        except Exception as exc:
            if not _transient(exc) or attempt == DB_RETRIES - 1:
                raise
            log.warning(
                "optuna storage: %s failed (%s); retrying in %.1fs (%d/%d)",
                what,
                type(exc.__cause__ or exc).__name__,
                delay,
                attempt + 1,
                DB_RETRIES - 1,
            )
            time.sleep(delay)
            delay = min(delay * 2, 8.0)
    raise AssertionError("unreachable")


def _with_retries(name: str) -> Any:
    base = getattr(RDBStorage, name)

    @functools.wraps(base)
    def method(self: RDBStorage, *args: Any, **kwargs: Any) -> Any:
        return _retrying(name, lambda: base(self, *args, **kwargs))

    return method


class ResilientRDBStorage(RDBStorage):
    """Optuna's RDB storage whose calls survive a database restart of up to about half a minute."""


for _name in _RETRIED_METHODS:
    setattr(ResilientRDBStorage, _name, _with_retries(_name))
