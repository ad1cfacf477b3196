"""mopflow's Airflow DAGs: ``mopflow_retrain``, ``mopflow_sweep`` and ``mopflow_promote``.

This folder is the DAGs folder of ``mopflow run`` and ``mopflow up``; ``mopflow dags install``
gives another Airflow a loader file that imports the DAGs from here.
"""
