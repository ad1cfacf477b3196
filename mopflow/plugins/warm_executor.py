"""Airflow's LocalExecutor, its task processes started with mopflow's training stack imported.

The LocalExecutor forks its worker processes from the scheduler when it starts, and each worker
forks a process per task. A task of mopflow's DAGs then imports torch, Lightning, MLflow, Dask
and Optuna on its own: about 7 s of CPU and a few hundred MB per task, before its first line of
work, eight times in a sweep. :class:`WarmLocalExecutor` imports them once in the scheduler,
before its workers fork, so that every worker and task process starts with them (the pages are
shared copy-on-write). Nothing else changes: it is the LocalExecutor.

``mopflow up`` runs it in place of the LocalExecutor (``AIRFLOW__CORE__EXECUTOR`` unset or
``LocalExecutor``); in an Airflow of one's own,
``AIRFLOW__CORE__EXECUTOR=mopflow.plugins.warm_executor.WarmLocalExecutor``. Celery workers get the
same from :mod:`mopflow.plugins.warm_celery`.
"""

from __future__ import annotations

import importlib
import logging
import time

from airflow.executors.local_executor import LocalExecutor

from mopflow.base.heap import collect_less_often, freeze_long_lived

REGISTRY = "mopflow.registry.model_registry"
# What mopflow's tasks import, the heaviest first: Lightning alone is 3 s of CPU (it pulls in
# torch, torchmetrics, scipy.signal, matplotlib and torch._dynamo).
TASK_IMPORTS = (
    "pytorch_lightning",
    "mlflow",
    "distributed",
    "optuna",
    "mopflow.training.search.sweep",
    "mopflow.training.executors.units",
    "mopflow.training.data",
    "mopflow.compression.distill.distill",
    "mopflow.compression.ensemble",
    REGISTRY,
)

log = logging.getLogger(__name__)


def import_task_stack(modules: tuple[str, ...] = TASK_IMPORTS) -> list[str]:
    """Import ``modules`` in this process, and with the registry among them have MLflow index the
    installed packages (what it reads to log a model); the modules that failed (logged: a task
    importing one fails on its own, naming it). A speed-up, never a reason for the scheduler to
    stop."""
    failed = []
    started = time.process_time()
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any import error is the task's to report
            log.warning("mopflow: could not import %s before forking task processes: %s", name, exc)
            failed.append(name)
    if REGISTRY in modules and REGISTRY not in failed:
        from mopflow.registry.model_registry import index_installed_packages

        index_installed_packages()  # what MLflow reads to log a model (ensemble, distill)
    log.info(
        "mopflow: task processes start with the training stack imported (%.1f s of CPU once)",
        time.process_time() - started,
    )
    return failed


def settle_heap_before_forks() -> None:
    """What the forks inherit (the imported stack) out of the garbage collector's walks, its pages
    left shared copy-on-write; every task process collects less often (:mod:`mopflow.base.heap`)."""
    collect_less_often()
    freeze_long_lived()


class WarmLocalExecutor(LocalExecutor):
    """The LocalExecutor, whose worker processes fork after the training stack was imported."""

    def start(self) -> None:
        import_task_stack()
        settle_heap_before_forks()
        super().start()
