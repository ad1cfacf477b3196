"""mopflow as an Airflow provider: its provider info, connection types and ``[mopflow]`` config."""

from __future__ import annotations

import importlib
import json
import uuid
import warnings
from pathlib import Path

import airflow
import jsonschema
import pytest
from airflow.sdk import BaseHook

from mopflow.plugins import connection_types
from mopflow.plugins.provider_info import CONNECTION_TYPES, get_provider_info


def test_the_provider_info_validates_against_airflow_s_schema() -> None:
    schema = json.loads((Path(airflow.__file__).parent / "provider_info.schema.json").read_text())
    jsonschema.validate(get_provider_info(), schema)


def test_each_connection_type_names_its_hook() -> None:
    declared = get_provider_info()["connection-types"]
    assert [t["connection-type"] for t in declared] == list(CONNECTION_TYPES)
    for entry in declared:
        module, _, name = entry["hook-class-name"].rpartition(".")
        hook = getattr(importlib.import_module(module), name)
        assert issubclass(hook, BaseHook)
        assert (hook.conn_type, hook.hook_name) == (entry["connection-type"], entry["hook-name"])
    assert {hook.conn_type for hook in connection_types.HOOKS} == set(CONNECTION_TYPES)


def test_airflow_lists_the_connection_types_and_the_config_default() -> None:
    from airflow.configuration import conf
    from airflow.providers_manager import ProvidersManager

    manager = ProvidersManager()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hooks = manager.hooks
    for conn_type, (class_name, hook_name) in CONNECTION_TYPES.items():
        info = hooks[conn_type]
        assert info is not None and info.hook_class_name.endswith(class_name) and info.hook_name == hook_name
    assert manager.field_behaviours["mopflow_storage"]["relabeling"]["password"] == "Secret access key"
    assert conf.get("mopflow", "max_conf_bytes") == "131072"


def test_a_hook_shows_what_its_connection_gives(monkeypatch: pytest.MonkeyPatch) -> None:
    conn_id = f"test_dask_{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv(
        f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps({"conn_type": "mopflow_dask", "host": "sched"})
    )
    assert connection_types.DaskConnectionHook(conn_id).get_conn() == {
        "MOPFLOW_DASK_ADDRESS": "tcp://sched:8786"
    }
    assert connection_types.DaskConnectionHook().conn_id == "mopflow_dask"
