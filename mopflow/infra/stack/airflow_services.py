"""Airflow in the stack: which executor runs, the services that make it up (``airflow standalone``,
or with the CeleryExecutor each component on its own) and the training pool it is given."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from pathlib import Path

from mopflow.base.settings import TRAINING_POOL
from mopflow.infra.stack.config import DEFAULT_HOST, StackError, StackPorts, url_host
from mopflow.infra.stack.services import HealthCheck, ServiceSpec

# The LocalExecutor whose task processes fork with the training stack imported (mopflow/plugins/
# warm_executor.py): what the stack runs when the LocalExecutor is asked for by name or by default.
WARM_LOCAL_EXECUTOR = "mopflow.plugins.warm_executor.WarmLocalExecutor"
# The same for a Celery worker's pool: Airflow's Celery configuration, the stack imported first.
WARM_CELERY_CONFIG = "mopflow.plugins.warm_celery.CELERY_CONFIG"


def airflow_executor(environ: Mapping[str, str]) -> str:
    """The default executor's class name (the first of ``AIRFLOW__CORE__EXECUTOR``; default
    LocalExecutor); only the LocalExecutor and the CeleryExecutor are run by the stack."""
    raw = environ.get("AIRFLOW__CORE__EXECUTOR", "").strip()
    first = raw.split(",")[0].strip()
    name = first.rpartition(":")[2].rpartition(".")[2] or "LocalExecutor"
    if first.rpartition(":")[2] == WARM_LOCAL_EXECUTOR:
        name = "LocalExecutor"
    if name not in ("LocalExecutor", "CeleryExecutor"):
        raise StackError(
            f"AIRFLOW__CORE__EXECUTOR={raw!r}: `mopflow up` runs the LocalExecutor or the CeleryExecutor"
        )
    if name == "CeleryExecutor":
        conn = environ.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "")
        if not conn or conn.startswith("sqlite"):
            raise StackError(
                "the CeleryExecutor needs Airflow's metadata on a database server, e.g. "
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=postgresql+psycopg2://postgres@127.0.0.1:5432/mopflow_airflow "
                f"(got {conn or 'the SQLite default'!r})"
            )
        if not environ.get("AIRFLOW__CELERY__BROKER_URL", "").strip():
            raise StackError(
                "the CeleryExecutor needs a broker: set AIRFLOW__CELERY__BROKER_URL "
                "(e.g. redis://127.0.0.1:6379/0; the scale-out profile does)"
            )
    return name


def airflow_specs(
    executor: str, env: dict[str, str], p: StackPorts, bin_dir: str, host: str = DEFAULT_HOST
) -> list[ServiceSpec]:
    """Airflow: ``airflow standalone`` for the LocalExecutor; for the CeleryExecutor (which
    standalone replaces by the LocalExecutor) the api-server as ``airflow`` and each other
    component, the Celery worker included, as a service of its own; checked on ``host``."""
    airflow = str(Path(bin_dir) / "airflow")
    where = url_host(host)
    url = f"http://{where}:{p.airflow}"
    health = HealthCheck(kind="airflow", url=f"{url}/api/v2/monitor/health")  # metadata DB + scheduler
    if executor != "CeleryExecutor":
        if env.get("AIRFLOW__CORE__EXECUTOR", "").strip() in ("", "LocalExecutor"):
            env = env | {"AIRFLOW__CORE__EXECUTOR": WARM_LOCAL_EXECUTOR}
        return [
            ServiceSpec(
                name="airflow",
                argv=(airflow, "standalone"),
                env=env,
                url=url,
                checks=(health,),
                ports=(p.airflow, p.airflow_worker_logs, p.airflow_trigger_logs),
            )
        ]
    if not env.get("AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS", "").strip():
        env = env | {"AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS": WARM_CELERY_CONFIG}
    worker_logs = f"tcp://{where}:{p.airflow_worker_logs}"
    trigger_logs = f"tcp://{where}:{p.airflow_trigger_logs}"
    return [
        ServiceSpec(
            name="airflow",
            argv=(airflow, "api-server"),
            env=env,
            url=url,
            checks=(health,),
            ports=(p.airflow,),
        ),
        ServiceSpec(name="airflow-scheduler", argv=(airflow, "scheduler"), env=env, url=url, checks=()),
        ServiceSpec(
            name="airflow-dag-processor", argv=(airflow, "dag-processor"), env=env, url=url, checks=()
        ),
        ServiceSpec(
            name="airflow-triggerer",
            argv=(airflow, "triggerer"),
            env=env,
            url=trigger_logs,
            checks=(HealthCheck(kind="tcp", url=trigger_logs),),  # its log server is up
            ports=(p.airflow_trigger_logs,),
        ),
        ServiceSpec(
            name="airflow-celery-worker",
            # A node name of this stack's own: two stacks on one broker and host never clash.
            argv=(airflow, "celery", "worker", "--celery-hostname", f"mopflow-{p.airflow}@%h"),
            env=env,
            url=env.get("AIRFLOW__CELERY__BROKER_URL", ""),
            checks=(HealthCheck(kind="tcp", url=worker_logs),),  # its log server is up
            ports=(p.airflow_worker_logs,),
        ),
    ]


def set_training_pool(env: Mapping[str, str], bin_dir: str, slots: int) -> None:
    """Create or resize the Airflow pool that caps concurrent training tasks (idempotent)."""
    cmd = [
        str(Path(bin_dir) / "airflow"),
        "pools",
        "set",
        TRAINING_POOL,
        str(slots),
        "mopflow training tasks",
    ]
    proc = subprocess.run(cmd, env=dict(env), capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise StackError(f"`{' '.join(cmd[1:])}` failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
