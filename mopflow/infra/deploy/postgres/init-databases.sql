-- Run once by the postgres image on an empty data volume (/docker-entrypoint-initdb.d), as
-- POSTGRES_USER, after it created POSTGRES_DB (airflow): the other two databases of mopflow.
-- Kept identical to the ConfigMap postgres-init in k8s/postgres.yaml (a test compares them).
CREATE DATABASE mlflow;
CREATE DATABASE optuna;
