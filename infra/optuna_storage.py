"""Optuna storage from a URL: a journal file on one host, an RDB (PostgreSQL) across hosts."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import optuna
from optuna.storages import BaseStorage, JournalStorage, RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.storages.journal import JournalFileBackend


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


def make_storage(url: str, n_workers: int = 1) -> BaseStorage:
    """Open an Optuna storage. SQLite is refused for parallel workers (it locks under concurrent writes)."""
    kind = storage_kind(url)
    if kind == "sqlite" and n_workers > 1:
        raise StorageConfigError(
            f"Optuna storage {url!r} is SQLite, which cannot take {n_workers} concurrent workers; "
            "use a journal file (a path) or PostgreSQL"
        )
    if kind == "journal":
        path = Path(journal_path(url)).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        return JournalStorage(JournalFileBackend(os.fspath(path)))
    heartbeat = heartbeat_seconds()
    with warnings.catch_warnings():  # heartbeats are "experimental" in Optuna since 2.9, stable in use
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return _rdb(url, heartbeat)


def _rdb(url: str, heartbeat: int | None) -> RDBStorage:
    return RDBStorage(
        url,
        engine_kwargs={"pool_pre_ping": True},
        heartbeat_interval=heartbeat,
        grace_period=heartbeat * 3 if heartbeat else None,
        # A trial whose worker stopped beating is failed and enqueued again with the same params;
        # mopflow resumes it from the failed trial's last checkpoint (see training.search).
        heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=2) if heartbeat else None,
    )


HEARTBEAT_ENV = "MOPFLOW_OPTUNA_HEARTBEAT_S"


def heartbeat_seconds() -> int | None:
    """Heartbeat interval of RDB-stored trials (``MOPFLOW_OPTUNA_HEARTBEAT_S``, default 30; 0 = off).

    Only RDB storages keep heartbeats; with a journal file the single coordinator recovers trials
    left RUNNING when it restarts.
    """
    raw = os.environ.get(HEARTBEAT_ENV, "30").strip()
    try:
        value = int(raw)
    except ValueError:
        raise StorageConfigError(f"{HEARTBEAT_ENV}={raw!r} is not a whole number of seconds") from None
    if value < 0:
        raise StorageConfigError(f"{HEARTBEAT_ENV}={value} must be >= 0")
    return value or None


def quiet_optuna() -> None:
    """Keep Optuna's per-trial INFO lines out of task logs (mopflow logs its own progress)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
