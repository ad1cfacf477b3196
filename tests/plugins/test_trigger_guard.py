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

from compression.config import CONF_FIELDS, MAX_CONF_BYTES, conf_json_schema, validate_conf

REPO = Path(__file__).resolve().parents[2]
PLUGINS = REPO / "plugins"
if str(PLUGINS) not in sys.path:
    sys.path.insert(0, str(PLUGINS))

import trigger_guard  # noqa: E402

PIPELINE = trigger_guard.GuardedDag(
    "mopflow_sweep",
    frozenset(CONF_FIELDS),
    {key: schema["default"] for key, schema in conf_json_schema().items()},
    validate_conf,
)
PROMOTE = trigger_guard.GuardedDag(
    "mopflow_promote", frozenset({"action", "name", "version"}), {"action": "promote", "name": "m"}
)
GUARDED = {d.dag_id: d for d in (PIPELINE, PROMOTE)}


async def resolve(call: trigger_guard.Call) -> trigger_guard.GuardedDag | None:
    """Like the plugin's: only a caller with a token, only the guarded DAGs."""
    if call.headers.get("authorization") != "Bearer good":
        return None
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

    guarded = trigger_guard.TriggerGuard(app, resolve=resolve, limit=limit)
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
        ("mopflow_sweep", {"bogus": 1}, {"Authorization": "Bearer bad"}),  # Airflow answers 401/403
        ("mopflow_sweep", None, {}),  # the Params' defaults
        ("mopflow_sweep", [1, 2], {}),  # not an object: Airflow answers 422
    ],
)
def test_what_the_guard_leaves_to_airflow(dag_id: str, conf: Any, headers: dict[str, str]) -> None:
    client, seen = _client()
    assert _trigger(client, dag_id, conf, headers=headers).status_code == 200
    assert len(seen) == 1 and json.loads(seen[0])["conf"] == conf


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
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(PLUGINS),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__MOPFLOW__MAX_CONF_BYTES": "65536",
    }
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found == {"errors": {}, "n": 1, "limit": 65536, "class": "TriggerGuard"}
