"""Airflow's Celery configuration, with Celery workers whose task processes start with mopflow's
training stack imported, as the warm LocalExecutor's do (:mod:`mopflow.plugins.warm_executor`).

``AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS=mopflow.plugins.warm_celery.CELERY_CONFIG`` (``mopflow up``
sets it with the CeleryExecutor, and ``mopflow worker-env`` passes it on to other hosts) is
Airflow's own Celery configuration, unchanged; a Celery worker that reads it imports the stack
in its main process when it starts (Celery's ``worker_init``), before it forks its pool, so the
pool's processes and the task processes they fork have it. The scheduler reads the same
configuration and imports nothing more.
"""

from __future__ import annotations

from typing import Any

from airflow.providers.celery.executors.default_celery import DEFAULT_CELERY_CONFIG
from celery.signals import worker_init

from mopflow.plugins.warm_executor import import_task_stack, settle_heap_before_forks


def _import_before_the_pool_forks(**_: Any) -> None:
    import_task_stack()
    settle_heap_before_forks()


worker_init.connect(_import_before_the_pool_forks, weak=False, dispatch_uid="mopflow-warm-pool")

CELERY_CONFIG: dict[str, Any] = dict(DEFAULT_CELERY_CONFIG)
