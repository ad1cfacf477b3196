"""The volatile-worker wing: training on workers that come and go, and what they cost.

- :mod:`~mopflow.training.volatile.schedules`: worker schedules ``n_j`` (pure);
- :mod:`~mopflow.training.volatile.preempt`: spot notices (SIGTERM) on a worker: checkpoint and leave;
- :mod:`~mopflow.training.volatile.prices`: spot price distributions and the price errors;
- :mod:`~mopflow.training.volatile.price_trace`: price traces (CSV, sampled, repeated) and their distribution;
- :mod:`~mopflow.training.volatile.cost`: accounting a run's work against a price trace and bids;
- :mod:`~mopflow.training.volatile.run_account`: a run's cost account and its tracking;
- :mod:`~mopflow.training.volatile.spot_plan_model`: the error bound and a spot plan's expected cost and time;
- :mod:`~mopflow.training.volatile.spot_plan`: planning bids on spot workers (on-demand, one bid, two bids);
- :mod:`~mopflow.training.volatile.spot_plan_report`: the plan-spot table and JSON;
- :mod:`~mopflow.training.volatile.spot_replay`: replaying a spot price trace against a LocalCluster's workers;
- :mod:`~mopflow.training.volatile.spot_report`: a replay's events and account, and their tracking.

Nothing here imports the operator's tools (``mopflow.infra.cli``, ``mopflow.infra.stack``) or Airflow.
"""
