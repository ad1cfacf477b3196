"""``MOPFLOW_RETRAIN_CONFIG`` on every host that parses the DAG files: a local file, or an fsspec
URL on shared storage; a missing file names the setting, the path and the host."""

from __future__ import annotations

import re
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest

from mopflow.pipeline.conf_input import retrain_defaults
from mopflow.pipeline.config import RETRAIN_DEFAULTS, ConfigError


@pytest.fixture
def shared() -> Iterator[str]:
    """A folder on fsspec's in-memory store (the shared storage of these tests), removed after."""
    folder = f"memory://retrain-{uuid.uuid4().hex}"
    yield folder
    fs = fsspec.filesystem("memory")
    if fs.exists(folder):
        fs.rm(folder, recursive=True)


def _put(url: str, text: str) -> None:
    with fsspec.open(url, "w") as handle:
        handle.write(text)


def test_a_retrain_config_on_shared_storage_is_read_and_validated(shared: str) -> None:
    url = f"{shared}/retrain.yaml"
    _put(url, "n_trials: 4\nmodel_name: nightly\n")
    env = {"MOPFLOW_RETRAIN_CONFIG": url, "MOPFLOW_STORAGE_OPTIONS": "{}"}
    assert retrain_defaults(env) == {**RETRAIN_DEFAULTS, "n_trials": 4, "model_name": "nightly"}
    _put(url, "n_trials: 0\n")
    with pytest.raises(ConfigError, match=rf"config file {re.escape(url)}: .*n_trials"):
        retrain_defaults(env)
    missing = f"{shared}/missing.yaml"
    with pytest.raises(ConfigError, match=rf"cannot read config file {re.escape(missing)}"):
        retrain_defaults({"MOPFLOW_RETRAIN_CONFIG": missing})


def test_storage_options_that_are_not_json_are_named_with_the_setting(shared: str) -> None:
    env = {"MOPFLOW_RETRAIN_CONFIG": f"{shared}/retrain.yaml", "MOPFLOW_STORAGE_OPTIONS": "{endpoint"}
    with pytest.raises(
        ConfigError, match=r"MOPFLOW_RETRAIN_CONFIG='memory://.*MOPFLOW_STORAGE_OPTIONS is not valid JSON"
    ):
        retrain_defaults(env)


def test_a_missing_local_file_names_the_setting_the_path_and_the_host(tmp_path: Path) -> None:
    path = tmp_path / "retrain.yaml"
    with pytest.raises(ConfigError) as refused:
        retrain_defaults({"MOPFLOW_RETRAIN_CONFIG": str(path)})
    message = str(refused.value)
    assert f"MOPFLOW_RETRAIN_CONFIG={str(path)!r}: no such file on host {socket.gethostname()!r}" in message
    assert (
        "shared storage (an fsspec URL such as s3://bucket/retrain.yaml) or at this path on every host"
        in message
    )
    path.write_text("epochs: 2\n")
    assert retrain_defaults({"MOPFLOW_RETRAIN_CONFIG": str(path)})["epochs"] == 2
    assert retrain_defaults({}) == RETRAIN_DEFAULTS
