"""The volatile-worker wing: training on workers that come and go, and what they cost.

- :mod:`~training.volatile.workers`: worker schedules ``n_j`` and step-size scaling (pure);
- :mod:`~training.volatile.scaling`: a sweep's rounds on ``n_j`` workers, and spot replay in a sweep;
- :mod:`~training.volatile.preempt`: spot notices (SIGTERM) on a worker: checkpoint and leave;
- :mod:`~training.volatile.growing`: the growing-workers experiment (Zhang et al. 2020);
- :mod:`~training.volatile.cost`: price models, worker-hours and a run's cost account;
- :mod:`~training.volatile.spot_plan`: planning bids on spot workers;
- :mod:`~training.volatile.spot_replay`: replaying a spot price trace against bids.

Nothing here imports the operator's tools (``infra.cli``, ``infra.stack``) or Airflow.
"""
