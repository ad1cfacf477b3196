"""mopflow inside an Airflow: where its DAG files are, the loader file that gives another Airflow's
DAGs folder those DAGs (``mopflow dags install``), and the checks that the DAGs folder and the
plugin can be loaded, each failing with one line that names what is wrong."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path

from mopflow.base.airflow_home import dags_folder
from mopflow.infra.cli.errors import CliError

LOADER_NAME = "mopflow_dags.py"
# The packaged DAGs: (module, the name of its DAG object, the DAG's id); the loader imports these.
PACKAGED_DAGS = (
    ("mopflow.dags.retrain", "retrain_dag", "mopflow_retrain"),
    ("mopflow.dags.sweep", "sweep_dag", "mopflow_sweep"),
    ("mopflow.dags.promote", "promote_dag", "mopflow_promote"),
)
PLUGIN_ENTRY_POINT = ("airflow.plugins", "mopflow")
LOADER_HEADER = '"""mopflow\'s Airflow DAGs, imported from the installed mopflow package.'


def loader_source() -> str:
    """The text of the loader file: a DAG file whose module globals are mopflow's DAGs."""
    imports = "".join(f"from {module} import {name}\n" for module, name, _ in PACKAGED_DAGS)
    names = ", ".join(f'"{name}"' for _, name, _ in PACKAGED_DAGS)
    return (
        f"{LOADER_HEADER}\n\n"
        "Written by `mopflow dags install`. The DAGs follow the installed package: upgrading mopflow\n"
        "upgrades them, with no need to write this file again.\n"
        '"""\n\n'
        f"{imports}\n__all__ = [{names}]\n"
    )


def install_loader(folder: Path, force: bool = False) -> Path:
    """Write the loader file into the DAGs folder ``folder``; returns its path.

    Refuses a folder that does not exist or cannot be written, and a file of the same name that
    ``mopflow dags install`` did not write (unless ``force``)."""
    if not folder.is_dir():
        raise CliError(f"DAGs folder {str(folder)!r} does not exist or is not a folder")
    if not os.access(folder, os.W_OK):
        raise CliError(f"DAGs folder {str(folder)!r} is not writable")
    target = folder / LOADER_NAME
    if target.exists() and not force and not target.read_text(errors="replace").startswith(LOADER_HEADER):
        raise CliError(f"{str(target)!r} exists and was not written by mopflow: pass --force to replace it")
    partial = target.with_name(f".{LOADER_NAME}.partial")
    partial.write_text(loader_source())
    partial.replace(target)  # atomic: the dag-processor never parses half a file
    return target


def checked_dags_folder(environ: Mapping[str, str]) -> Path:
    """The DAGs folder mopflow's Airflow uses, refused when it or its retraining DAG is missing
    or unreadable (a ``MOPFLOW_DAGS_FOLDER`` that points nowhere, a damaged install)."""
    folder = dags_folder(environ)
    source = "MOPFLOW_DAGS_FOLDER" if environ.get("MOPFLOW_DAGS_FOLDER") else "the packaged DAGs folder"
    if not folder.is_dir():
        raise CliError(f"DAGs folder {str(folder)!r} ({source}) does not exist or is not a folder")
    retrain = folder / "retrain.py"
    if not retrain.is_file() or not os.access(retrain, os.R_OK) or not os.access(folder, os.R_OK | os.X_OK):
        raise CliError(f"DAGs folder {str(folder)!r} ({source}) has no readable retrain.py")
    return folder


def load_plugin() -> None:
    """Load mopflow's Airflow plugin through its entry point, as Airflow's plugins manager does;
    refused with the reason when it cannot be (mopflow not installed, an incompatible Airflow)."""
    group, name = PLUGIN_ENTRY_POINT
    found = [ep for ep in metadata.entry_points(group=group) if ep.name == name]
    if not found:
        raise CliError(
            f"no {group!r} entry point named {name!r}: is mopflow installed (pip install mopflow)?"
        )
    try:
        found[0].load()
    except Exception as exc:  # whatever the import raised, reported in one line
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise CliError(
            f"Airflow cannot load mopflow's plugin {found[0].value}: {type(exc).__name__}: {first}"
        ) from exc


def check_plugin_loads(environ: Mapping[str, str]) -> None:
    """:func:`load_plugin` in a child process with ``environ``: importing Airflow reads (and may
    write) the configuration of its ``AIRFLOW_HOME``, which must not be this process's."""
    code = "from mopflow.infra.cli.airflow_integration import main_load_plugin; main_load_plugin()"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=dict(environ), capture_output=True, text=True, timeout=300
    )
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        raise CliError(lines[-1] if lines else f"loading mopflow's plugin exited with {proc.returncode}")


def main_load_plugin() -> None:
    """The child process of :func:`check_plugin_loads`: exit 2 with one line when it fails."""
    try:
        load_plugin()
    except CliError as exc:
        print(exc, file=sys.stderr)
        raise SystemExit(2) from None


def cmd_dags_install(args: argparse.Namespace) -> int:
    """``mopflow dags install DAGS_FOLDER``: write the loader file there, once this environment's
    Airflow has shown it can load the plugin."""
    check_plugin_loads(os.environ)
    target = install_loader(Path(args.folder).expanduser(), force=args.force)
    print(
        f"wrote {target}: Airflow will list {', '.join(dag_id for _, _, dag_id in PACKAGED_DAGS)} (the plugin loads by entry point)"
    )
    return 0


def cmd_dags_path(args: argparse.Namespace) -> int:
    """``mopflow dags path``: print the DAGs folder ``mopflow run`` and ``mopflow up`` use."""
    print(checked_dags_folder(os.environ))
    return 0
