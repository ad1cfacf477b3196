"""The local stack behind ``mopflow up`` / ``down`` / ``status``.

Five services on 127.0.0.1 (or the address ``MOPFLOW_STACK_HOST`` / ``up --host`` names), wired
to one another and to the same MOPFLOW_HOME:

- ``mlflow``: an MLflow tracking server on the settings' backend store, serving artifacts;
- ``dask-scheduler`` (with its HTTP dashboard) and ``dask-workers`` (one nanny process);
- ``optuna-dashboard`` on the study storage;
- ``airflow``: ``airflow standalone`` (scheduler, dag-processor, api-server, triggerer) on this
  project's ``dags/`` and ``plugins/``, whose task processes get the stack's MLflow and Dask
  addresses through ``MOPFLOW_TRACKING_URI`` and ``MOPFLOW_DASK_ADDRESS``. With the
  CeleryExecutor (``AIRFLOW__CORE__EXECUTOR``; standalone would force the LocalExecutor) the
  components run as services of their own instead: ``airflow`` is then the api-server, beside
  ``airflow-scheduler``, ``airflow-dag-processor``, ``airflow-triggerer`` and
  ``airflow-celery-worker`` (the broker, e.g. Redis, is not started by the stack).

The backends follow the settings (e.g. ``MOPFLOW_PROFILE=scale-out``): Airflow's metadata on
``AIRFLOW__DATABASE__SQL_ALCHEMY_CONN``, MLflow's on ``MOPFLOW_MLFLOW_BACKEND_STORE`` with its
artifacts at ``MOPFLOW_MLFLOW_ARTIFACTS_DESTINATION``, Optuna's on ``MOPFLOW_OPTUNA_STORAGE``. A
tracking URI or Dask address on loopback or on the stack's address names the server the stack
itself serves; one on another host is refused (the stack would not be the one the tasks use). On
an address other hosts reach, every Airflow component gets the secrets Airflow hosts must share,
and ``<home>/stack/worker.env`` holds what a Celery worker on another host needs.

Every service runs in its own process group with its log under ``<home>/stack/logs``; pids,
ports, URLs and health checks are recorded in ``<home>/stack/state.json`` so that ``status``
and ``down`` work from any shell. The pure parts are separate from the edges so that they can be
tested without starting anything:

- :mod:`~mopflow.infra.stack.config`: ports and knobs from flags and the environment (``StackConfig``);
- :mod:`~mopflow.infra.stack.services`: what a service is (spec, health check, record);
- :mod:`~mopflow.infra.stack.environment`: the services' environments, Airflow's shared with ``mopflow run``;
- :mod:`~mopflow.infra.stack.specs` and :mod:`~mopflow.infra.stack.airflow_services`: the command lines;
- :mod:`~mopflow.infra.stack.auth`: MLflow's basic-auth files, Airflow's password file and shared secrets;
- :mod:`~mopflow.infra.stack.worker_env`: the settings of a worker host (``worker.env``);
- :mod:`~mopflow.infra.stack.state`: the state file, its lock and how a state is printed;
- the edges: :mod:`~mopflow.infra.stack.probes` (ports, health checks), :mod:`~mopflow.infra.stack.processes`
  (spawn, stop, wait) and :mod:`~mopflow.infra.stack.lifecycle` (``up``, ``down``, ``status``).
"""

from mopflow.infra.stack.config import (
    DEFAULT_HOST,
    PORT_ENV,
    STACK_ENV,
    StackConfig,
    StackError,
    StackPorts,
    config_from_env,
)
from mopflow.infra.stack.lifecycle import down, status, up, up_choosing_ports
from mopflow.infra.stack.probes import free_port, port_answers
from mopflow.infra.stack.services import (
    CELERY_SERVICES,
    SERVICE_ORDER,
    HealthCheck,
    ServiceRecord,
    ServiceSpec,
)
from mopflow.infra.stack.specs import build_specs
from mopflow.infra.stack.state import StackState, read_state, state_path

__all__ = [
    "CELERY_SERVICES",
    "DEFAULT_HOST",
    "PORT_ENV",
    "SERVICE_ORDER",
    "STACK_ENV",
    "HealthCheck",
    "ServiceRecord",
    "ServiceSpec",
    "StackConfig",
    "StackError",
    "StackPorts",
    "StackState",
    "build_specs",
    "config_from_env",
    "down",
    "free_port",
    "port_answers",
    "read_state",
    "state_path",
    "status",
    "up",
    "up_choosing_ports",
]
