"""mopflow: Airflow-orchestrated model selection, ensembling and distillation with Dask, Optuna,
Lightning and MLflow.

The package's parts, from the top: ``mopflow.dags`` (the Airflow DAG files) and
``mopflow.plugins`` (the Airflow plugin), ``mopflow.infra`` (the ``mopflow`` command, the local
stack, deployment), ``mopflow.pipeline`` (the stages), ``mopflow.compression`` (ensembles,
distillation, registry), ``mopflow.training`` (the training core) and ``mopflow.base`` (the
ground floor: settings, storage, tracking).

A model-family plugin needs only what this module exports::

    from mopflow import DataSpec, ModelFamily
"""

from __future__ import annotations

from mopflow.training.models.families import DataSpec, ModelFamily

__version__ = "0.2.0"

__all__ = ["DataSpec", "ModelFamily", "__version__"]
