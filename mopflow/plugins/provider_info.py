"""mopflow as an Airflow provider: what ``airflow providers list`` shows for it.

Registered through the ``apache_airflow_provider`` entry point. The plugin is registered through
the ``airflow.plugins`` entry point alone, not listed here too: Airflow would load it twice.
"""

from __future__ import annotations

from typing import Any

from mopflow import __version__


def get_provider_info() -> dict[str, Any]:
    """The provider's description, in the shape of Airflow's ``provider_info.schema.json``."""
    return {
        "package-name": "mopflow",
        "name": "mopflow",
        "description": "Model selection at scale: Optuna searches training Lightning models on Dask, "
        "ensembles, distillation and the MLflow Model Registry, as Airflow DAGs.",
        "versions": [__version__],
    }
