"""mopflow's Airflow DAGs: ``mopflow_retrain``, ``mopflow_sweep`` and ``mopflow_promote``.

This folder is the DAGs folder of ``mopflow run`` and ``mopflow up``; ``mopflow dags install``
gives another Airflow a loader file that imports the DAGs from here.
"""

# The repository's top-level `dags/` is a link to this folder, for people reading the layout. Imported
# through it (the repository root on sys.path) this module would load a second time under another
# name, with its own classes and registries: refuse that.
if __name__ != "mopflow.dags":
    raise ImportError(f"import mopflow.dags, not {__name__} (the repository root is on sys.path)")
