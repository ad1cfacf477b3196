"""Settings from the environment: the storage options' JSON (mopflow.base.settings)."""

from __future__ import annotations

import pytest

from mopflow.base.settings import Settings, SettingsError, parse_storage_options


def test_storage_options_are_a_json_object_and_empty_means_none() -> None:
    assert parse_storage_options('{"endpoint_url": "http://s3:9000"}') == {"endpoint_url": "http://s3:9000"}
    assert parse_storage_options("") == {}
    assert Settings.from_env({"MOPFLOW_STORAGE_OPTIONS": '{"anon": true}'}).storage_options == {"anon": True}


@pytest.mark.parametrize(
    ("raw", "needle"), [("{endpoint", "not valid JSON"), ("[1]", "must be a JSON object")]
)
def test_storage_options_that_are_no_json_object_are_refused_naming_the_variable(
    raw: str, needle: str
) -> None:
    with pytest.raises(SettingsError, match=f"MOPFLOW_STORAGE_OPTIONS.*{needle}"):
        parse_storage_options(raw)
