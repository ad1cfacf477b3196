#!/usr/bin/env bash
# One-shot set-up before the Airflow components start (compose service `airflow-init`, Kubernetes
# Job `airflow-init`): migrate the metadata DB and create the training pool. Idempotent: both
# commands may run again on every deploy.
set -euo pipefail

slots="${MOPFLOW_TRAINING_POOL_SLOTS:-1}"
if ! [[ "$slots" =~ ^[1-9][0-9]*$ ]]; then
  echo "airflow-init: MOPFLOW_TRAINING_POOL_SLOTS=$slots is not a positive integer" >&2
  exit 2
fi

airflow db migrate
# Training tasks (search, distill) of all DAG runs queue on this pool instead of oversubscribing
# the Dask workers (README: DAGs). Same name as infra/stack/airflow_home.py's TRAINING_POOL.
airflow pools set mopflow_training "$slots" "mopflow training tasks (search, distill)"
