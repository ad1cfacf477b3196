"""The MLflow tags mopflow writes on its runs and model versions, and searches by: one name each."""

from __future__ import annotations

# a pipeline run's identity, on every run of it (RunContext.tags)
RUN_KEY = "mopflow.run_key"
DAG_ID = "mopflow.dag_id"
AIRFLOW_RUN_ID = "mopflow.airflow_run_id"
STAGE = "mopflow.stage"  # pipeline, shard, search, trial, ensemble, distill, register
# lineage: the data and the study a run's results come from
MANIFEST_HASH = "mopflow.manifest_hash"
STUDY = "mopflow.study"
# a trial's nested run
TRIAL = "mopflow.trial"
TRIAL_STATE = "mopflow.trial_state"
WORKER = "mopflow.worker"
# the register stage's decision, on its run and on the model version
PROMOTED = "mopflow.promoted"
PROMOTION_REASON = "mopflow.promotion_reason"
# on a registered student: its best trial's parameters, what a warm-started sweep tries first
BEST_PARAMS = "mopflow.best_trial_params"
# a student version's serving latency (p95 ms a request, one CPU thread) and the budget it met
LATENCY_P95 = "mopflow.latency_p95_ms"
STUDENT_BUDGET_MS = "mopflow.student_budget_ms"
