"""The wheel, installed the way a user installs it: built from the checkout, installed into a fresh
virtual environment with a model-family package beside it (``examples/custom_family``, found by
its entry point), and run from a folder outside the checkout: one pipeline run takes the installed
family through every stage, and the installed MLflow serves its student.

The fresh environment sees the project's venv's libraries (the lock's versions) through a path
file, all but the checkout's editable mopflow, so only the wheel's ``mopflow`` is there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import PORT_RANGE_ENV
from tests.dags.serving import invoke, served

REPO = Path(__file__).resolve().parents[1]
# What the wheel is built from: the package's real files. The repository's top-level links
# (training/ -> mopflow/training, ...) stay behind, as on a file system without symbolic links.
PACKAGE_SOURCES = ("pyproject.toml", "README.md", "mopflow")
# The Sweeps page's templates: package data the wheel must hold, or the page cannot be rendered.
PAGE_TEMPLATES = sorted(p.name for p in (REPO / "mopflow" / "plugins" / "templates").iterdir())
# The smallest run that still goes through every stage (two one-epoch trials, both ensembled),
# searching the installed family only. At 16 channels or more, any two members leave a budget (0.1 x
# the ensemble's parameters) of at least 523 parameters: room for the smallest depth-3 TCN student
# (334), whichever trials the search completes.
TCN_SPACE = {
    "families": {
        "tcn": {
            "channels": {"type": "int", "low": 16, "high": 24},
            "levels": {"type": "int", "low": 2, "high": 3},
            "kernel": {"type": "categorical", "choices": [3, 5]},
            "dropout": {"type": "float", "low": 0.0, "high": 0.1},
        }
    }
}
TINY_RUN = {
    "num_samples": 600,
    "n_shards": 2,
    "n_trials": 2,
    "epochs": 1,
    "min_resource": 1,
    "top_k": 2,
    "distill_epochs": 1,
    "model_name": "wheel",
    "max_gap_to_ensemble": 100,
    "search_space": TCN_SPACE,
    "student_family": "tcn",
    "student_depth": 3,
}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The wheel built from the checkout, installed in a fresh venv; a work folder outside both."""
    root = tmp_path_factory.mktemp("wheel")
    # A copy of what the wheel is built from: no leftovers of an earlier build (build/) get in.
    source = root / "source"
    source.mkdir()
    for name in PACKAGE_SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(
                REPO / name, source / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            shutil.copy2(REPO / name, source / name)
    assert not [p for p in source.rglob("*") if p.is_symlink()], "the package holds a symbolic link"
    dist = root / "dist"
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(dist),
            ".",
        ],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-3000:]
    (wheel,) = dist.glob("mopflow-*.whl")
    env_dir = root / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    # The lock's libraries, after the venv's own site-packages (a plain path: no .pth runs from it),
    # without the checkout's editable mopflow (its dist-info would register a second plugin).
    libraries = root / "libraries"
    libraries.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(("mopflow", "__editable__")):
            (libraries / entry.name).symlink_to(entry)
    (site / "project_libraries.pth").write_text(f"{libraries}\n")
    # The one library script the run needs (MLflow's scoring server starts `uvicorn`), as pip
    # would have written it into the venv: the venv sees the lock's libraries, not their scripts.
    uvicorn = env_dir / "bin" / "uvicorn"
    uvicorn.write_text(f"#!{python}\nimport sys\nfrom uvicorn.main import main\nsys.exit(main())\n")
    uvicorn.chmod(0o755)
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-3000:]
    # A model-family package beside it, installed as a user installs one (a copy: building writes
    # into the source folder).
    family = root / "custom_family"
    shutil.copytree(REPO / "examples" / "custom_family", family)
    install = subprocess.run(
        [
            *[sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q"],
            *["--no-build-isolation", "--no-index", str(family)],
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TMPDIR": str(root)},
    )
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-3000:]
    work = root / "work"
    work.mkdir()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MOPFLOW_", "AIRFLOW", "MLFLOW_", "PYTHON")) or k == PORT_RANGE_ENV
    }
    env |= {
        "MOPFLOW_HOME": str(root / "home"),
        "MOPFLOW_RETRY_DELAY_S": "1",
        "PATH": f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        "AIRFLOW_HOME": str(root / "airflow-of-the-user"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
    }
    return {"wheel": wheel, "python": python, "bin": env_dir / "bin", "work": work, "env": env, "root": root}


def _run(
    installed: dict[str, Any], *argv: str, timeout: int = 600, **env: str
) -> subprocess.CompletedProcess[str]:
    """``argv`` in the work folder with the installed venv's environment (plus ``env``)."""
    return subprocess.run(
        list(argv),
        cwd=installed["work"],
        env=installed["env"] | env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _python(installed: dict[str, Any], code: str) -> subprocess.CompletedProcess[str]:
    return _run(installed, str(installed["python"]), "-c", code)


def test_the_wheel_holds_one_namespace_with_the_dags_and_the_plugin(installed: dict[str, Any]) -> None:
    names = zipfile.ZipFile(installed["wheel"]).namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {"mopflow", installed["wheel"].name.split("-py")[0] + ".dist-info"}, tops
    for packaged in (
        "mopflow/dags/retrain.py",
        "mopflow/dags/sweep.py",
        "mopflow/dags/promote.py",
        "mopflow/dags/.airflowignore",
        "mopflow/plugins/mopflow_plugin.py",
        *(f"mopflow/plugins/templates/{name}" for name in PAGE_TEMPLATES),
        "mopflow/training/spaces/default.json",
        "mopflow/infra/configs/demo.yaml",
        "mopflow/py.typed",
    ):
        assert packaged in names, packaged
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(installed["wheel"]).read(entry_points).decode()
    assert "[airflow.plugins]" in text and "[apache_airflow_provider]" in text


def test_only_mopflow_is_importable_from_the_install(installed: dict[str, Any]) -> None:
    code = """
import importlib, json, mopflow
from mopflow import DataSpec, ModelFamily
found = {}
for name in ("training", "infra", "compression", "dags", "plugins"):
    try:
        importlib.import_module(name)
        found[name] = True
    except ImportError:
        found[name] = False
from mopflow.plugins.sweeps_html import render_page
from mopflow.plugins.sweeps_page import Links, PageData
page = render_page(PageData([], Links(), "m"))  # the templates, read from the installed package
print(json.dumps({"file": mopflow.__file__, "version": mopflow.__version__, "generic": found,
                  "page": "<h1>Sweeps</h1>" in page and "prefers-color-scheme: dark" in page}))
"""
    proc = _python(installed, code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["file"].startswith(str(installed["root"] / "venv")), seen[
        "file"
    ]  # the wheel's, not the checkout's
    assert seen["version"] == installed["wheel"].name.split("-")[1]
    assert seen["generic"] == dict.fromkeys(("training", "infra", "compression", "dags", "plugins"), False)
    assert seen["page"] is True


def test_airflow_finds_the_plugin_the_provider_and_the_packaged_dags(installed: dict[str, Any]) -> None:
    folder = installed["root"] / "user-dags"
    folder.mkdir()
    wrote = _run(installed, str(installed["bin"] / "mopflow"), "dags", "install", str(folder))
    assert wrote.returncode == 0, wrote.stderr[-3000:]
    code = f"""
import json
from airflow import plugins_manager
from airflow.providers_manager import ProvidersManager
from airflow.dag_processing.dagbag import DagBag
plugins, errors = plugins_manager._get_plugins()
bag = DagBag(dag_folder={str(folder)!r})
print(json.dumps({{
    "plugins": [[p.name, str(p.source)] for p in plugins], "plugin_errors": errors,
    "provider": "mopflow" in ProvidersManager().providers,
    "dags": sorted(bag.dag_ids), "dag_errors": bag.import_errors,
    "fileloc": sorted({{d.fileloc for d in bag.dags.values()}}),
}}))
"""
    proc = _python(installed, code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["plugin_errors"] == {}
    assert [name for name, _ in seen["plugins"]] == ["mopflow"]
    assert "mopflow" in seen["plugins"][0][1]  # its source is the entry point, not a plugins folder
    assert seen["provider"] is True
    assert seen["dags"] == ["mopflow_promote", "mopflow_retrain", "mopflow_sweep"]
    assert seen["dag_errors"] == {}
    assert seen["fileloc"] == [
        str(folder / "mopflow_dags.py")
    ]  # the tasks find their DAG in the user's folder


@pytest.mark.slow
def test_mopflow_run_from_outside_the_checkout_trains_the_installed_family_and_serves_it(
    installed: dict[str, Any],
) -> None:
    config = installed["work"] / "tiny.json"
    config.write_text(json.dumps(TINY_RUN))
    summary = installed["work"] / "summary.json"
    proc = _run(
        installed,
        str(installed["bin"] / "mopflow"),
        "run",
        "--config",
        str(config),
        "--summary-json",
        str(summary),
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads(summary.read_text())
    registered = result["registered"]
    assert registered["name"] == "wheel-student" and int(registered["version"]) >= 1
    assert str(REPO) not in result.get("log_file", "")
    # the installed family went through every stage: searched, ensembled, distilled into
    assert result["best_trial"]["params"]["family"] == "tcn"
    assert {"channels", "levels", "kernel", "dropout"} <= set(result["best_trial"]["params"])
    assert result["student"]["arch"]["family"] == "tcn"
    assert result["student"]["num_params"] <= 0.1 * result["ensemble"]["num_params"]
    assert registered["aliases"]
    # the installed MLflow serves it: the model server finds the family in its environment
    home = Path(installed["env"]["MOPFLOW_HOME"])
    with served(home, "models:/wheel-student@champion", installed["env"], python=installed["python"]) as url:
        columns = [f"x{i:03d}" for i in range(40)]
        rows = [[0.05 * i for i in range(40)]] * 2
        answer = invoke(url, {"dataframe_split": {"columns": columns, "data": rows}})
    predictions = answer["predictions"]
    assert len(predictions) == 2 and abs(sum(predictions[0].values()) - 1.0) < 1e-4


def test_a_missing_dags_folder_is_one_line_and_exit_2(installed: dict[str, Any]) -> None:
    missing = installed["root"] / "no-such-dags"
    proc = _run(installed, str(installed["bin"] / "mopflow"), "run", MOPFLOW_DAGS_FOLDER=str(missing))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"mopflow: DAGs folder '{missing}' (MOPFLOW_DAGS_FOLDER) does not exist or is not a folder"
    )


def test_an_airflow_that_cannot_load_the_plugin_is_one_line_and_exit_2(installed: dict[str, Any]) -> None:
    broken = installed["root"] / "broken-airflow"
    (broken / "airflow").mkdir(parents=True)
    (broken / "airflow" / "__init__.py").write_text('raise ImportError("this Airflow is broken")\n')
    folder = installed["root"] / "dags-of-a-broken-airflow"
    folder.mkdir()
    proc = _run(
        installed, str(installed["bin"] / "mopflow"), "dags", "install", str(folder), PYTHONPATH=str(broken)
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "mopflow: Airflow cannot load mopflow's plugin mopflow.plugins.mopflow_plugin:MopflowPlugin: "
        "ImportError: this Airflow is broken"
    )
    assert not (folder / "mopflow_dags.py").exists()  # nothing written for an Airflow that cannot use it
