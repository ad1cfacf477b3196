"""The stack's ports and knobs: flags, then the environment, then defaults or free ports; bad
values refused by name."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from mopflow.infra.stack.config import PORT_ENV, StackConfig, StackError, choose_ports, config_from_env
from tests.infra.stack.helpers import counter


def test_ports_take_flags_then_env_then_defaults() -> None:
    env = {"MOPFLOW_MLFLOW_PORT": "6000", "MOPFLOW_AIRFLOW_PORT": "9090"}
    ports = choose_ports({"airflow": 9191}, env, free=False, pick_free=counter())
    assert ports.airflow == 9191  # the flag beats the environment
    assert ports.mlflow == 6000
    assert ports.optuna == 8081 and ports.dask_scheduler == 8786 and ports.dask_dashboard == 8787


def test_free_ports_are_picked_distinct_for_unset_ones_only() -> None:
    repeats = iter([30000, 30000, 30001, 30001, 30002, 30003, 30004, 30005, 30006, 30007])
    ports = choose_ports({"optuna": 9999}, {}, free=True, pick_free=lambda: next(repeats))
    values = list(ports.model_dump().values())
    assert ports.optuna == 9999
    assert len(set(values)) == len(values) == len(PORT_ENV)
    assert all(v >= 30000 for k, v in ports.model_dump().items() if k != "optuna")


def test_free_ports_env_switch() -> None:
    config = config_from_env({"MOPFLOW_STACK_FREE_PORTS": "1"}, {}, None, 2, counter(41000))
    assert config.ports.airflow >= 41000
    config = config_from_env({}, {}, None, 2, counter(41000))
    assert config.ports.airflow == 8080


@pytest.mark.parametrize(
    ("requested", "env", "needle"),
    [
        ({}, {"MOPFLOW_MLFLOW_PORT": "abc"}, "MOPFLOW_MLFLOW_PORT='abc'"),
        ({"mlflow": 8080}, {}, "mlflow=8080 is also the port of airflow"),
        ({"optuna": 80}, {}, "optuna=80"),
        ({"dask_scheduler": 70000}, {}, "dask_scheduler=70000"),
    ],
)
def test_bad_ports_are_refused_by_name(requested: dict[str, int], env: dict[str, str], needle: str) -> None:
    with pytest.raises(StackError, match=needle):
        choose_ports(requested, env, free=False, pick_free=counter())


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"MOPFLOW_TRAINING_POOL_SLOTS": "0"}, "pool_slots=0"),
        ({"MOPFLOW_TRAINING_POOL_SLOTS": "many"}, "MOPFLOW_TRAINING_POOL_SLOTS='many'"),
        ({"MOPFLOW_STACK_TIMEOUT_S": "-1"}, "timeout_s=-1"),
    ],
)
def test_bad_stack_settings_are_refused_by_name(env: dict[str, str], needle: str) -> None:
    with pytest.raises(StackError, match=needle):
        config_from_env(env, {}, True, 2, counter())


def test_pool_slots_come_from_the_environment() -> None:
    assert config_from_env({"MOPFLOW_TRAINING_POOL_SLOTS": "3"}, {}, True, 2, counter()).pool_slots == 3
    assert config_from_env({}, {}, True, 2, counter()).pool_slots == 1


def test_the_stacks_address_takes_the_flag_then_the_environment_then_loopback() -> None:
    default = config_from_env({}, {}, True, 2, counter())
    assert default.host == "127.0.0.1" and default.loopback
    env = {"MOPFLOW_STACK_HOST": "10.0.0.5"}
    assert config_from_env(env, {}, True, 2, counter()).host == "10.0.0.5"
    flagged = config_from_env(env, {}, True, 2, counter(), host="Node-1.Example")
    assert flagged.host == "node-1.example" and not flagged.loopback  # a name, compared without case
    assert config_from_env({"MOPFLOW_STACK_HOST": "fd00::2"}, {}, True, 2, counter()).host == "fd00::2"
    assert config_from_env({}, {}, True, 2, counter(), host="localhost").loopback


@pytest.mark.parametrize(
    ("host", "needle"),
    [
        (
            "0.0.0.0",
            r"MOPFLOW_STACK_HOST \(--host\) '0.0.0.0' binds every interface but cannot be advertised"
            r".*give this host's own address",
        ),
        ("::", r"MOPFLOW_STACK_HOST \(--host\) '::' binds every interface"),
        ("no host!", r"MOPFLOW_STACK_HOST \(--host\) 'no host!' is neither an IP address nor a host name"),
    ],
)
def test_an_address_that_cannot_be_advertised_is_refused_naming_the_setting(host: str, needle: str) -> None:
    with pytest.raises(StackError, match=needle):
        config_from_env({"MOPFLOW_STACK_HOST": host}, {}, True, 2, counter())
    with pytest.raises(StackError, match=needle):  # the flag's value is refused alike
        config_from_env({}, {}, True, 2, counter(), host=host)
    with pytest.raises(ValidationError, match="MOPFLOW_STACK_HOST"):  # a config built directly, too
        StackConfig(ports=config_from_env({}, {}, True, 2, counter()).ports, dask_workers=1, host=host)
