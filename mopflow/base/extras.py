"""mopflow's optional parts and the extras that install them (``pip install 'mopflow[EXTRA]'``).

The core install runs the embedded defaults: ``mopflow run`` and the DAGs in a user's own Airflow.
The stack, S3, PostgreSQL and the CeleryExecutor come with extras; a set-up that needs one that is
missing is refused before anything starts, naming the extra."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping

from mopflow.base.optuna_storage import redact_url

# extra -> the modules it brings (pyproject.toml's [project.optional-dependencies])
EXTRA_MODULES: Mapping[str, tuple[str, ...]] = {
    "stack": ("optuna_dashboard",),
    "s3": ("s3fs", "boto3"),
    "postgres": ("psycopg2", "asyncpg"),
    "celery": ("celery", "redis", "airflow.providers.celery"),
}


def _starts(prefix: str) -> Callable[[str], bool]:
    return lambda value: value.startswith(prefix)


# settings whose value says which extra a set-up needs: (variables, test of a value, extra)
NEEDS: tuple[tuple[tuple[str, ...], Callable[[str], bool], str], ...] = (
    (
        ("MOPFLOW_OPTUNA_STORAGE", "MOPFLOW_MLFLOW_BACKEND_STORE", "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"),
        _starts("postgresql"),
        "postgres",
    ),
    (
        ("MOPFLOW_DATA_ROOT", "MOPFLOW_ARTIFACT_ROOT", "MOPFLOW_MLFLOW_ARTIFACTS_DESTINATION"),
        _starts("s3://"),
        "s3",
    ),
    # a name, a class path or a list of executors (Airflow's multiple executors)
    (("AIRFLOW__CORE__EXECUTOR",), lambda value: "CeleryExecutor" in value, "celery"),
)

Finder = Callable[[str], bool]


class MissingExtraError(RuntimeError):
    """A set-up needs an extra that is not installed."""


def importable(name: str) -> bool:
    """Whether this Python can import module ``name`` (without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package is missing
        return False


def missing_modules(extra: str, find: Finder = importable) -> list[str]:
    """The modules of ``extra`` that ``find`` does not find."""
    return [name for name in EXTRA_MODULES[extra] if not find(name)]


def require_extra(extra: str, needed_for: str, find: Finder = importable) -> None:
    """Raise :class:`MissingExtraError` naming ``extra`` when any of its modules is missing."""
    missing = missing_modules(extra, find)
    if missing:
        raise MissingExtraError(
            f"{needed_for} needs the {extra} extra, which is not installed (no module "
            f"{', '.join(missing)}): pip install 'mopflow[{extra}]'"
        )


def extras_needed(environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """The extras the settings in ``environ`` need, each with the setting that needs it."""
    needed: list[tuple[str, str]] = []
    for names, needs, extra in NEEDS:
        name = next((n for n in names if needs(environ.get(n, ""))), None)
        if name is not None:
            needed.append((extra, name))
    return needed


def require_extras_of(environ: Mapping[str, str], find: Finder = importable) -> None:
    """Refuse a set-up (:class:`MissingExtraError`) whose settings need an extra not installed."""
    for extra, name in extras_needed(environ):
        require_extra(extra, f"{name}={redact_url(environ[name])!r}", find)  # no password shown
