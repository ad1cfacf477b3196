#!/usr/bin/env bash
# Airflow's api-server with the admin password taken from AIRFLOW_ADMIN_PASSWORD (a secret) instead
# of a random one printed to the log: the SimpleAuthManager reads its users' passwords from
# AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE and only generates those missing there.
set -euo pipefail

file="${AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE:?airflow-api-server: set AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE}"
: "${AIRFLOW_ADMIN_PASSWORD:?airflow-api-server: set AIRFLOW_ADMIN_PASSWORD (the password of the admin user)}"
mkdir -p "$(dirname "$file")"
umask 077
# json.dumps escapes whatever the password holds.
python -c 'import json, os, sys; open(sys.argv[1], "w").write(json.dumps({"admin": os.environ["AIRFLOW_ADMIN_PASSWORD"]}) + "\n")' "$file"

exec airflow api-server "$@"
