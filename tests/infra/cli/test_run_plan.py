"""What `mopflow run` resolves before Airflow starts: typed --set values, the demo's tuning on its
own dataset only, the retraining DAG's defaults merged in, the data roots, and the CLI's
conventions (--version, --format json, exit 2 on a bad setting)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mopflow.infra.cli import main
from mopflow.infra.cli.errors import CliError
from mopflow.infra.cli.run_plan import plan_run


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {"MOPFLOW_HOME": str(tmp_path / "home"), **extra}


def test_set_values_follow_their_key_s_type(tmp_path: Path) -> None:
    plan = plan_run(
        None,
        ["label_column=yes", "epochs=8", "stratify=yes", "timeout_minutes=none", "spot_speed=1e2"],
        [],
        _env(tmp_path),
    )
    data, search = plan.config.data, plan.config.search
    assert data.label_column == "yes" and data.stratify is True  # text stays text; a bool is a bool
    assert search.epochs == 8 and search.timeout_minutes is None and search.spot_speed == 100.0
    # the run is triggered with typed values: the DAG's Params check their JSON types
    assert plan.conf["epochs"] == 8 and plan.conf["stratify"] is True and plan.conf["label_column"] == "yes"
    assert plan_run(None, ["image_size=32,32"], [], _env(tmp_path)).conf["image_size"] == [32, 32]


@pytest.mark.parametrize(
    ("sets", "needles"),
    [
        (["n_trials="], ["n_trials: an empty value", "its default (20)"]),
        (["n_trails=3", "top_k=x"], ["did you mean 'n_trials'?", "top_k", "'x'"]),
        (["epochs=16", "min_resource=20"], ["min_resource=20 is more than epochs=16", "pruner='none'"]),
        (["student_family=cnn2d"], ["student_family='cnn2d' takes ['image'] data", "the dataset is 'table'"]),
        (["n_trials"], ["--set expects KEY=VALUE, got 'n_trials'"]),
    ],
    ids=["empty", "unknown-and-bad-value", "min-resource", "student-family", "no-equals"],
)
def test_a_bad_config_is_refused_with_every_error_named(
    tmp_path: Path, sets: list[str], needles: list[str]
) -> None:
    with pytest.raises(CliError) as info:
        plan_run(None, sets, [], _env(tmp_path))
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def test_the_demo_tuning_applies_to_the_demo_dataset_only(tmp_path: Path) -> None:
    demo = plan_run(None, [], [], _env(tmp_path))
    assert demo.config.distill.family == "rescnn" and demo.config.search.n_trials == 30
    assert "the demo's" in demo.source
    table = tmp_path / "home" / "data" / "mine.csv"
    own = plan_run(None, [f"dataset={table}"], [], _env(tmp_path))
    assert own.config.distill.family == "auto" and own.config.search.n_trials == 20
    assert f"the defaults for {table}" in own.source and "mnist1d only" in own.source


def test_the_retrain_dag_s_warm_start_is_said_and_can_be_turned_off(tmp_path: Path) -> None:
    plan = plan_run(None, [], [], _env(tmp_path))
    assert plan.config.search.warm_start and plan.config.search.warm_start_studies == 1
    line = plan.describe()[1]
    assert line.startswith(
        "warm start: on: the champion's best parameters first and the trials of the newest"
    )
    assert "mopflow_retrain's default" in line
    cold = plan_run(None, ["warm_start=false", "warm_start_studies=0"], [], _env(tmp_path))
    assert cold.describe()[1] == "warm start: off (a cold start)"


def test_the_retrain_config_file_is_merged_and_validated_before_the_run(tmp_path: Path) -> None:
    retrain = tmp_path / "retrain.yaml"
    retrain.write_text("n_trials: 3\n")
    env = _env(tmp_path, MOPFLOW_RETRAIN_CONFIG=str(retrain))
    with pytest.raises(CliError, match="top_k=4 is larger than n_trials=3"):
        plan_run(None, ["top_k=4"], [], env)


def test_a_dataset_outside_the_data_roots_is_refused_unless_a_root_is_given(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere" / "table.csv"
    with pytest.raises(CliError) as info:
        plan_run(None, [f"dataset={outside}"], [], _env(tmp_path))
    assert f"dataset={str(outside)!r} outside the data roots [{str(tmp_path / 'home' / 'data')!r}]" in str(
        info.value
    )
    assert plan_run(None, [f"dataset={outside}"], [str(tmp_path / "elsewhere")], _env(tmp_path))
    env = _env(tmp_path, MOPFLOW_DATA_ROOTS=f"s3://bucket/x/,{tmp_path / 'elsewhere'}")
    assert plan_run(None, [f"dataset={outside}"], [], env)
    with pytest.raises(CliError, match="spot_trace='/etc/prices.csv' outside the data roots"):
        plan_run(None, ["spot_trace=/etc/prices.csv", "spot_bids=1.0,0.5"], [], env)


def test_version_and_json_formats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from mopflow import __version__

    monkeypatch.setenv("MOPFLOW_HOME", str(tmp_path / "home"))
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"mopflow {__version__}"
    assert main(["runs", "--format", "json"]) == 0 and json.loads(capsys.readouterr().out) == []
    assert main(["settings", "--format", "json"]) == 0
    settings = json.loads(capsys.readouterr().out)["settings"]
    assert settings["home"] == {
        "env": "MOPFLOW_HOME",
        "value": str(tmp_path / "home"),
        "help": settings["home"]["help"],
    }
    assert main(["config-keys", "--format", "json"]) == 0
    keys = json.loads(capsys.readouterr().out)
    assert (
        keys["keys"]["n_trials"]["default"] == 20 and keys["mopflow_retrain_defaults"]["warm_start"] is True
    )
    assert main(["status", "--format", "json"]) == 1  # no stack recorded: not healthy
    status = json.loads(capsys.readouterr().out)
    assert status["recorded"] is False and status["services"] == []


def test_a_bad_setting_is_one_line_and_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MOPFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MOPFLOW_DASK_WORKERS", "abc")
    assert main(["settings"]) == 2
    assert capsys.readouterr().err == "mopflow: MOPFLOW_DASK_WORKERS='abc' is not an integer\n"


def test_dry_run_prints_the_resolved_config_and_runs_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import yaml

    home = tmp_path / "home"
    monkeypatch.setenv("MOPFLOW_HOME", str(home))
    assert main(["run", "--dry-run", "--set", "epochs=5", "--set", "min_resource=2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("config    : the demo's (") and out[0].endswith(
        "with --set epochs=5 min_resource=2"
    )
    assert out[1].startswith("warm start: on: ")
    resolved = yaml.safe_load("\n".join(out[2:]))
    assert resolved["epochs"] == 5 and resolved["n_trials"] == 30 and resolved["warm_start_studies"] == 1
    assert main(["run", "--dry-run", "--set", "min_resource=20", "--set", "epochs=5"]) == 2
    assert "min_resource=20 is more than epochs=5" in capsys.readouterr().err
    assert not home.exists()  # no Airflow DB, data or run record
