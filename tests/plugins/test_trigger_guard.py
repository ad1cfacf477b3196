"""The trigger guard middleware in front of a small ASGI app, with the pipeline's real config
validator; and the plugin that installs it, as Airflow's plugins manager loads it. The whole path
through a real api-server is tested in tests/infra/test_stack.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mopflow.pipeline.config import CONF_FIELDS, MAX_CONF_BYTES, PipelineConfig, conf_json_schema
from mopflow.plugins import trigger_guard

PIPELINE = trigger_guard.GuardedDag(
    "mopflow_sweep",
    frozenset(CONF_FIELDS),
    {key: schema["default"] for key, schema in conf_json_schema().items()},
    PipelineConfig.from_conf,
)
PROMOTE = trigger_guard.GuardedDag(
    "mopflow_promote", frozenset({"action", "name", "version"}), {"action": "promote", "name": "m"}
)
GUARDED = {d.dag_id: d for d in (PIPELINE, PROMOTE)}


async def authenticate(headers: Any) -> Any:
    """Like the plugin's: Airflow's 401 without a token, 403 for a bad one."""
    token = headers.get("authorization", "")
    if not token:
        return trigger_guard.Refusal(401, "Not authenticated")
    return "user" if token == "Bearer good" else trigger_guard.Refusal(403, "Invalid JWT token")


async def resolve(call: trigger_guard.Call, user: Any) -> trigger_guard.GuardedDag | None:
    """Like the plugin's: only the guarded DAGs."""
    assert user == "user"  # only known callers get here
    return GUARDED.get(call.dag_id or call.endpoint.dag_id or "")


def _client(limit: int | ValueError = 4096) -> tuple[Any, list[bytes]]:
    """A TestClient on an app that records the bodies it got, behind the guard."""
    from fastapi.testclient import TestClient
    from starlette.requests import Request
    from starlette.responses import JSONResponse

    seen: list[bytes] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        body = await Request(scope, receive).body()
        seen.append(body)
        await JSONResponse({"created": True})(scope, receive, send)

    guarded = trigger_guard.TriggerGuard(
        app, authenticate=authenticate, resolve=resolve, limit=limit, default_limit=MAX_CONF_BYTES
    )
    return TestClient(guarded, headers={"Authorization": "Bearer good"}), seen


def _trigger(client: Any, dag_id: str, conf: Any, **kw: Any) -> Any:
    return client.post(f"/api/v2/dags/{dag_id}/dagRuns", json={"logical_date": None, "conf": conf}, **kw)


@pytest.mark.parametrize(
    ("method", "path", "expected"),
    [
        (
            "POST",
            "/api/v2/dags/mopflow_sweep/dagRuns",
            trigger_guard.Endpoint("conf", dag_id="mopflow_sweep"),
        ),
        ("POST", "/airflow/api/v2/dags/x/dagRuns/", trigger_guard.Endpoint("conf", dag_id="x")),
        ("POST", "/api/v2/backfills", trigger_guard.Endpoint("dag_run_conf", dag_id_field="dag_id")),
        ("POST", "/api/v2/backfills/dry_run", trigger_guard.Endpoint("dag_run_conf", dag_id_field="dag_id")),
        ("POST", "/api/v2/assets/7/materialize", trigger_guard.Endpoint("conf", asset_id=7)),
        ("GET", "/api/v2/dags/mopflow_sweep/dagRuns", None),
        ("POST", "/api/v2/dags/mopflow_sweep/dagRuns/list", None),
        ("PATCH", "/api/v2/dags/mopflow_sweep", None),
    ],
)
def test_only_run_creating_requests_are_looked_at(
    method: str, path: str, expected: trigger_guard.Endpoint | None
) -> None:
    assert trigger_guard.match_endpoint(method, path) == expected


def test_unknown_key_is_refused_naming_it_and_the_accepted_keys() -> None:
    client, seen = _client()
    answer = _trigger(client, "mopflow_sweep", {"n_trials": 4, "n_trails": 5})
    assert answer.status_code == 400
    detail = answer.json()["detail"]
    assert "unknown conf key(s) ['n_trails']" in detail and "mopflow_sweep" in detail
    assert "'n_trials'" in detail and "'student_max_param_ratio'" in detail  # the accepted keys
    assert seen == []  # Airflow never saw the request: no run


def test_oversized_conf_is_refused_naming_the_size_and_the_setting() -> None:
    client, seen = _client(limit=2048)
    answer = _trigger(client, "mopflow_sweep", {"search_space": "x" * 3000})
    assert answer.status_code == 413
    detail = answer.json()["detail"]
    assert "the limit is 2048 bytes" in detail and trigger_guard.LIMIT_ENV in detail
    assert "[mopflow] max_conf_bytes" in detail
    assert seen == []


@pytest.mark.parametrize(
    ("conf", "needle"),
    [
        ({"epochs": -3}, "epochs"),
        ({"strategy": "bogus"}, "'bogus'"),
        ({"n_trials": 2, "top_k": 4}, "top_k=4 is larger than n_trials=2"),  # a cross-key rule
        ({"search_space": '{"families": {"cnn": {"width": {"type": "int"}}}}'}, "search_space"),
    ],
)
def test_pipeline_dags_validate_the_whole_config(conf: dict[str, Any], needle: str) -> None:
    client, seen = _client()
    answer = _trigger(client, "mopflow_sweep", conf)
    assert answer.status_code == 400, answer.text
    assert needle in answer.json()["detail"]
    assert seen == []


def test_a_valid_conf_reaches_airflow_unchanged() -> None:
    client, seen = _client()
    body = {"logical_date": None, "conf": {"n_trials": 3, "top_k": 2, "strategy": "mop"}, "note": "é"}
    answer = client.post("/api/v2/dags/mopflow_sweep/dagRuns", json=body)
    assert answer.status_code == 200 and answer.json() == {"created": True}
    assert [json.loads(b) for b in seen] == [body]


def test_keys_only_for_a_dag_that_is_not_the_pipeline() -> None:
    client, seen = _client()
    assert _trigger(client, "mopflow_promote", {"action": "rollback", "name": "m"}).status_code == 200
    answer = _trigger(client, "mopflow_promote", {"action": "rollback", "model": "m"})
    assert answer.status_code == 400
    assert "['model']; the accepted keys are ['action', 'name', 'version']" in answer.json()["detail"]
    assert len(seen) == 1


def test_backfill_conf_is_checked_for_the_dag_in_the_body() -> None:
    client, seen = _client()
    body = {"dag_id": "mopflow_sweep", "from_date": "2026-01-01T00:00:00Z", "to_date": "2026-01-02T00:00:00Z"}
    answer = client.post("/api/v2/backfills", json={**body, "dag_run_conf": {"bogus": 1}})
    assert answer.status_code == 400 and "['bogus']" in answer.json()["detail"]
    assert client.post("/api/v2/backfills", json={**body, "dag_run_conf": {"n_trials": 4}}).status_code == 200
    assert len(seen) == 1


@pytest.mark.parametrize(
    ("dag_id", "conf", "headers"),
    [
        ("other_dag", {"anything": 1}, {}),  # not a mopflow DAG
        ("mopflow_sweep", None, {}),  # the Params' defaults
        ("mopflow_sweep", [1, 2], {}),  # not an object: Airflow answers 422
    ],
)
def test_what_the_guard_leaves_to_airflow(dag_id: str, conf: Any, headers: dict[str, str]) -> None:
    client, seen = _client()
    assert _trigger(client, dag_id, conf, headers=headers).status_code == 200
    assert len(seen) == 1 and json.loads(seen[0])["conf"] == conf


@pytest.mark.parametrize(
    ("headers", "status", "detail"),
    [
        ({"Authorization": ""}, 401, "Not authenticated"),
        ({"Authorization": "Bearer bad"}, 403, "Invalid JWT"),
    ],
)
def test_a_caller_without_valid_credentials_is_refused_before_the_body_is_read(
    headers: dict[str, str], status: int, detail: str
) -> None:
    client, seen = _client()
    answer = _trigger(client, "mopflow_sweep", {"bogus": 1}, headers=headers)
    assert answer.status_code == status and answer.json() == {
        "detail": detail + ("" if status == 401 else " token")
    }
    assert "bogus" not in answer.text and seen == []


def _nested(depth: int) -> bytes:
    """A trigger body whose conf nests ``depth`` objects (the body itself adds one level)."""
    return b'{"logical_date": null, "conf": ' + b'{"a": ' * depth + b"1" + b"}" * depth + b"}"


@pytest.mark.parametrize("depth", [1_000, 10_000, 1_000_000])
@pytest.mark.parametrize("token", ["Bearer good", ""])
def test_a_deeply_nested_body_is_refused_not_a_server_error(depth: int, token: str) -> None:
    client, seen = _client(limit=MAX_CONF_BYTES)
    answer = client.post(
        "/api/v2/dags/mopflow_sweep/dagRuns",
        content=_nested(depth),
        headers={"Authorization": token, "Content-Type": "application/json"},
    )
    if not token:
        assert answer.status_code == 401, answer.text
    elif len(_nested(depth)) > trigger_guard.BODY_FACTOR * MAX_CONF_BYTES:
        assert answer.status_code == 413, answer.text
        assert f"the limit is {trigger_guard.BODY_FACTOR * MAX_CONF_BYTES} bytes" in answer.json()["detail"]
    else:
        assert answer.status_code == 400, answer.text
        detail = answer.json()["detail"]
        assert f"{depth + 1} levels deep; the limit is {trigger_guard.MAX_DEPTH} levels" in detail
    assert seen == []
    # The guard still answers normally afterwards.
    assert _trigger(client, "mopflow_sweep", {"n_trials": 4}).status_code == 200


def test_a_conf_as_deep_as_the_limit_is_checked_as_usual() -> None:
    client, seen = _client()
    deep: Any = 1
    for _ in range(trigger_guard.MAX_DEPTH - 2):  # the body and the conf are two levels
        deep = {"a": deep}
    answer = _trigger(client, "mopflow_sweep", {"search_space": deep})
    assert answer.status_code == 400 and "search space: families" in answer.json()["detail"], answer.text
    assert "levels deep" not in answer.json()["detail"] and seen == []


@pytest.mark.parametrize(
    ("raw", "depth"),
    [
        (b"{}", 1),
        (b'{"a": [1, {"b": 2}], "c": {}}', 3),
        (b'{"s": "[[[{{{", "t": "\\"[["}', 1),  # brackets inside strings, escaped quotes
        (b'["unterminated [[[', 1),
        (b"[[[" + b'"\\"' * 1000, 3),
        (b"]]]][", 1),  # not JSON: still no negative depth
        (b"not json", 0),
    ],
)
def test_nesting_depth_counts_brackets_outside_strings(raw: bytes, depth: int) -> None:
    assert trigger_guard.nesting_depth(raw) == depth


def test_a_body_that_is_not_json_goes_to_airflow() -> None:
    client, seen = _client()
    answer = client.post("/api/v2/dags/mopflow_sweep/dagRuns", content=b"{not json")
    assert answer.status_code == 200 and seen == [b"{not json"]


def test_a_bad_limit_setting_refuses_every_guarded_trigger() -> None:
    with pytest.raises(ValueError, match=r"max_conf_bytes.*= 'lots' must be an integer number of bytes"):
        trigger_guard.parse_limit("lots", MAX_CONF_BYTES)
    with pytest.raises(ValueError, match=f"from 1024 to {MAX_CONF_BYTES}"):
        trigger_guard.parse_limit(str(MAX_CONF_BYTES + 1), MAX_CONF_BYTES)
    assert trigger_guard.parse_limit(None, MAX_CONF_BYTES) == MAX_CONF_BYTES
    assert trigger_guard.parse_limit(" 65536 ", MAX_CONF_BYTES) == 65536
    try:
        trigger_guard.parse_limit("0", MAX_CONF_BYTES)
    except ValueError as exc:
        bad = exc
    client, seen = _client(limit=bad)
    answer = _trigger(client, "mopflow_sweep", {"n_trials": 4})
    assert answer.status_code == 500 and "AIRFLOW__MOPFLOW__MAX_CONF_BYTES" in answer.json()["detail"]
    assert _trigger(client, "other_dag", {}).status_code == 200 and len(seen) == 1


def test_plugin_installs_the_guard_with_the_configured_limit(tmp_path: Path) -> None:
    code = """
import json
from airflow import plugins_manager as pm
plugins, errors = pm._get_plugins()
_, middlewares = pm.get_fastapi_plugins()
guard = [m for m in middlewares if m["name"] == "mopflow trigger guard"]
print(json.dumps({"errors": errors, "n": len(guard), "limit": guard[0]["kwargs"]["limit"],
                  "class": guard[0]["middleware"].__name__}))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "MOPFLOW_"))}
    env |= {
        "AIRFLOW_HOME": str(tmp_path),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(tmp_path / "plugins"),  # none: the entry point loads it
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__MOPFLOW__MAX_CONF_BYTES": "65536",
    }
    # cwd outside the checkout: its mopflow.egg-info (from `pip install -e`) would be a second
    # distribution with the same plugin entry point
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found == {"errors": {}, "n": 1, "limit": 65536, "class": "TriggerGuard"}
