"""The deployment files in infra/deploy (docker-compose, Kubernetes manifests, Dockerfile).

They cannot run here (no Docker daemon, no cluster), so they are checked as data: structure and
cross-references (services, labels, ports, ConfigMaps, Secrets), the settings they pass to the
mopflow containers against mopflow/base/settings.py and the MOPFLOW_ variables the code reads, the
Airflow config keys against Airflow's own config template, and every CLI flag against the
installed `mlflow`, `dask`, `optuna-dashboard` and `airflow` commands. The resolved environment
of each mopflow container is fed to ``Settings.from_env`` and must point at the services defined.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from packaging.specifiers import SpecifierSet

from mopflow.base.hosts import WorkerHost, across_hosts_problems, endpoints, is_loopback
from mopflow.base.settings import LOCAL_ENV, RUNTIME_ENV, SETTING_ENV, TRAINING_POOL, Settings
from mopflow.infra import stack

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
DEPLOY = REPO / "infra" / "deploy"
COMPOSE_FILE = DEPLOY / "docker-compose.yaml"
ENV_EXAMPLE = DEPLOY / "env.example"
K8S = DEPLOY / "k8s"
SECRETS_EXAMPLE = K8S / "secrets.env.example"
DOCKERFILE = DEPLOY / "Dockerfile"
IMAGE_ROOT = "/opt/mopflow"  # the Dockerfile's WORKDIR: the repository inside the image

# Workloads running mopflow code: Airflow's components (the scheduler runs the tasks, the
# dag-processor parses the DAG files, the api-server serves the Sweeps page) and the Dask workers.
AIRFLOW_WORKLOADS = (
    "airflow-init",
    "airflow-apiserver",
    "airflow-scheduler",
    "airflow-dag-processor",
    "airflow-triggerer",
)
MOPFLOW_WORKLOADS = (*AIRFLOW_WORKLOADS, "dask-worker")
SERVICES = {"postgres", "mlflow", "optuna-dashboard", "dask-scheduler", *MOPFLOW_WORKLOADS}
# Secrets the user creates (docs/operations/deployment.md, k8s/secrets.env.example).
USER_PROVIDED_SECRETS = {"mopflow-secrets"}
# The DAG-level variables docs/user-guide/configuration.md documents: they must stay in the registry.
DAG_LEVEL_ENV = {
    "MOPFLOW_RETRAIN_SCHEDULE",
    "MOPFLOW_TASK_RETRIES",
    "MOPFLOW_RETRY_DELAY_S",
    "MOPFLOW_TRAINING_POOL_SLOTS",
}
CODE_DIRS = ("training", "compression", "infra", "dags", "plugins", "mopflow/base")
SECRET_NAME = re.compile(r"(PASSWORD|SECRET|SECRET_KEY|FERNET_KEY|ACCESS_KEY|ACCESS_KEY_ID)$")


def required_env() -> set[str]:
    """Every variable the deployment must pass to the mopflow containers."""
    return {var for var, _ in SETTING_ENV.values()} | set(RUNTIME_ENV)


# ---------------------------------------------------------------------------- the code's variables


def env_vars_in_code() -> dict[str, list[str]]:
    """MOPFLOW_ variables named in the product code, with the files naming them."""
    found: dict[str, list[str]] = {}
    pattern = re.compile(r"\bMOPFLOW_[A-Z0-9_]*[A-Z0-9]\b")
    for folder in CODE_DIRS:
        for file in sorted((REPO / folder).rglob("*.py")):
            for var in set(pattern.findall(file.read_text())):
                found.setdefault(var, []).append(str(file.relative_to(REPO)))
    return found


def test_every_variable_the_code_reads_is_registered() -> None:
    """A MOPFLOW_ variable read anywhere in the code is a setting, a runtime variable (both passed
    through by the deployment files) or a local-tooling one; a new one must be registered."""
    local = (
        set(LOCAL_ENV)
        | {var for var, _ in stack.PORT_ENV.values()}
        | {var for var, _ in stack.STACK_ENV.values()}
    )
    registered = required_env() | local
    unregistered = {var: files for var, files in env_vars_in_code().items() if var not in registered}
    assert not unregistered, (
        f"MOPFLOW_ variables read by the code but in no registry: {unregistered}; add each to "
        "base/settings.py RUNTIME_ENV (and pass it through in infra/deploy) or to LOCAL_ENV"
    )
    assert set(RUNTIME_ENV) >= DAG_LEVEL_ENV
    # The scan itself finds the variables it must (it would pass vacuously on an empty result).
    assert {"MOPFLOW_TRACKING_URI", "MOPFLOW_RETRAIN_SCHEDULE", "MOPFLOW_SHARD_CACHE"} <= set(
        env_vars_in_code()
    )


def test_runtime_variables_are_documented() -> None:
    page = REPO / "docs" / "user-guide" / "configuration.md"
    text = page.read_text()
    missing = sorted(var for var in required_env() if var not in text)
    assert not missing, f"{page.relative_to(REPO)} does not mention {missing}"


# ---------------------------------------------------------------------------- compose


_COMPOSE_VAR = re.compile(
    r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|\$(?P<bare>[A-Za-z_][A-Za-z0-9_]*)"
)


class MissingVariable(KeyError):
    """A ``${VAR:?message}`` whose variable is unset or empty."""


def compose_interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Docker Compose's variable substitution (``${VAR}``, ``${VAR:-default}``, ``${VAR:?error}``,
    ``$$``) applied to every string of a loaded compose document."""
    if isinstance(value, dict):
        return {k: compose_interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [compose_interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def repl(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group("name") or match.group("bare")
        op, arg = match.group("op"), match.group("arg") or ""
        current = env.get(name)
        empty = current is None or (current == "" and op is not None and op.startswith(":"))
        if op is not None and op.endswith("?") and empty:
            raise MissingVariable(f"{name}: {arg}")
        if op is not None and op.endswith("-") and empty:
            return arg
        return current or ""

    return _COMPOSE_VAR.sub(repl, value)


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, str):
        yield value


def compose_variables(doc: Any) -> dict[str, str | None]:
    """Variables a compose document substitutes -> their operator (``:?`` required, ``:-`` default)."""
    found: dict[str, str | None] = {}
    for match in (m for text in _strings(doc) for m in _COMPOSE_VAR.finditer(text)):
        name = match.group("name") or match.group("bare")
        if name:
            op = match.group("op")
            if found.get(name) != ":?":
                found[name] = op
    return found


def env_file_keys(path: Path) -> tuple[set[str], set[str]]:
    """(keys set in an env file, keys only mentioned in commented ``# KEY=`` lines)."""
    required: set[str] = set()
    optional: set[str] = set()
    for line in path.read_text().splitlines():
        match = re.match(r"^(#\s*)?([A-Z][A-Z0-9_]*)=", line.strip())
        if match:
            (optional if match.group(1) else required).add(match.group(2))
    return required, optional


@functools.cache
def compose_raw() -> dict[str, Any]:
    doc = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(doc, dict)
    return doc


def sample_env() -> dict[str, str]:
    """The variables env.example marks required, with sample values (as a user's .env)."""
    required, _ = env_file_keys(ENV_EXAMPLE)
    values = {key: f"sample-{key.lower().replace('_', '-')}" for key in required}
    values["MOPFLOW_S3_ENDPOINT_URL"] = "https://s3.example.com"
    values["MOPFLOW_S3_BUCKET"] = "mopflow-bucket"
    return values


@functools.cache
def compose() -> dict[str, Any]:
    """The compose file as compose sees it with the sample .env."""
    doc = compose_interpolate(compose_raw(), sample_env())
    assert isinstance(doc, dict)
    return doc


def service_env(service: Mapping[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def uses_mopflow_image(service: Mapping[str, Any]) -> bool:
    return "build" in service or str(service.get("image", "")).startswith("mopflow")


def as_argv(command: Any) -> list[str]:
    return shlex.split(command) if isinstance(command, str) else [str(c) for c in command]


def test_compose_defines_the_services() -> None:
    services = compose()["services"]
    assert set(services) >= SERVICES, f"missing services: {SERVICES - set(services)}"
    for name, service in services.items():
        assert "image" in service or "build" in service, f"{name}: neither image nor build"
        if uses_mopflow_image(service):
            assert service.get("command"), f"{name}: no command"
            assert service["build"]["dockerfile"] == "infra/deploy/Dockerfile"
            assert (COMPOSE_FILE.parent / service["build"]["context"] / "infra/deploy/Dockerfile").is_file()
        if name != "airflow-init":  # one-shot; the others are servers with a health check
            assert service.get("healthcheck", {}).get("test"), f"{name}: no healthcheck"
    assert services["airflow-init"]["restart"] == "no"


# Keys of the Compose specification used to catch a misspelt key, which compose would refuse.
COMPOSE_SERVICE_KEYS = set(
    [
        "annotations",
        "attach",
        "blkio_config",
        "build",
        "cap_add",
        "cap_drop",
        "cgroup",
        "cgroup_parent",
        "command",
        "configs",
        "container_name",
        "cpu_count",
        "cpu_percent",
        "cpu_period",
        "cpu_quota",
        "cpu_rt_period",
        "cpu_rt_runtime",
        "cpu_shares",
        "cpus",
        "cpuset",
        "credential_spec",
        "depends_on",
        "deploy",
        "develop",
        "device_cgroup_rules",
        "devices",
        "dns",
        "dns_opt",
        "dns_search",
        "domainname",
        "entrypoint",
        "env_file",
        "environment",
        "expose",
        "extends",
        "external_links",
        "extra_hosts",
        "gpus",
        "group_add",
        "healthcheck",
        "hostname",
        "image",
        "init",
        "ipc",
        "isolation",
        "labels",
        "label_file",
        "links",
        "logging",
        "mac_address",
        "mem_limit",
        "mem_reservation",
        "mem_swappiness",
        "memswap_limit",
        "network_mode",
        "networks",
        "oom_kill_disable",
        "oom_score_adj",
        "pid",
        "pids_limit",
        "platform",
        "ports",
        "post_start",
        "pre_stop",
        "privileged",
        "profiles",
        "pull_policy",
        "read_only",
        "restart",
        "runtime",
        "scale",
        "secrets",
        "security_opt",
        "shm_size",
        "stdin_open",
        "stop_grace_period",
        "stop_signal",
        "storage_opt",
        "sysctls",
        "tmpfs",
        "tty",
        "ulimits",
        "user",
        "userns_mode",
        "uts",
        "volumes",
        "volumes_from",
        "working_dir",
    ]
)
COMPOSE_HEALTHCHECK_KEYS = {
    "test",
    "interval",
    "timeout",
    "retries",
    "start_period",
    "start_interval",
    "disable",
}
COMPOSE_DEVICE_KEYS = {"driver", "count", "device_ids", "capabilities", "options"}


def test_compose_uses_only_compose_keys() -> None:
    doc = compose()
    assert set(doc) <= {"name", "services", "volumes", "networks", "configs", "secrets"} | {
        k for k in doc if k.startswith("x-")
    }
    for name, service in doc["services"].items():
        assert set(service) <= COMPOSE_SERVICE_KEYS, (
            f"{name}: unknown keys {set(service) - COMPOSE_SERVICE_KEYS}"
        )
        assert set(service.get("healthcheck", {})) <= COMPOSE_HEALTHCHECK_KEYS, name
        for device in (
            service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        ):
            assert set(device) <= COMPOSE_DEVICE_KEYS, name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert source.startswith(".") or source in doc["volumes"], f"{name}: undeclared volume {source}"


def test_compose_depends_on_is_consistent() -> None:
    services = compose()["services"]
    graph: dict[str, set[str]] = {}
    for name, service in services.items():
        depends = service.get("depends_on") or {}
        targets = depends if isinstance(depends, dict) else {d: {} for d in depends}
        graph[name] = set(targets)
        for target, spec in targets.items():
            assert target in services, f"{name} depends on the undefined service {target}"
            condition = (spec or {}).get("condition", "service_started")
            assert condition in {"service_started", "service_healthy", "service_completed_successfully"}
            if condition == "service_healthy":
                assert services[target].get("healthcheck"), f"{name} waits for {target}'s missing healthcheck"
            if condition == "service_completed_successfully":
                assert services[target].get("restart") == "no", f"{target} is waited for as a one-shot"

    def visit(node: str, path: tuple[str, ...]) -> None:
        assert node not in path, f"depends_on cycle: {' -> '.join((*path, node))}"
        for nxt in graph[node]:
            visit(nxt, (*path, node))

    for name in graph:
        visit(name, ())
    # The Airflow components start after the migration; the scheduler's tasks need MLflow and Dask.
    for name in AIRFLOW_WORKLOADS[1:]:
        assert "airflow-init" in graph[name]
    assert {"mlflow", "dask-scheduler"} <= graph["airflow-scheduler"]


def test_compose_gpu_workers_reserve_an_nvidia_gpu() -> None:
    worker = compose()["services"]["dask-worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices)
    argv = as_argv(worker["command"])
    assert argv[argv.index("--nthreads") + 1] == "1", "one trial per worker needs one thread"
    assert argv[argv.index("--resources") + 1].startswith("GPU=")


def missing_pass_through(env_names: set[str], required: set[str]) -> set[str]:
    """The required variables a container's environment lacks."""
    return required - env_names


def test_pass_through_check_catches_a_new_setting() -> None:
    """The check below fails for a setting added to the registry but not to the files."""
    env = set(service_env(compose_raw()["services"]["airflow-scheduler"]))
    assert missing_pass_through(env, required_env()) == set()
    assert missing_pass_through(env, required_env() | {"MOPFLOW_NEW_SETTING"}) == {"MOPFLOW_NEW_SETTING"}


@pytest.mark.parametrize("name", MOPFLOW_WORKLOADS)
def test_compose_passes_every_setting_through(name: str) -> None:
    env = set(service_env(compose_raw()["services"][name]))
    missing = missing_pass_through(env, required_env())
    assert not missing, f"compose service {name} does not pass {sorted(missing)}"


def _url_host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname and parts.port, f"{url} names no host:port"
    return parts.hostname, parts.port


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def compose_service_port(service: Mapping[str, Any], flag: str = "--port") -> int:
    return int(_flag(as_argv(service["command"]), flag))


@pytest.mark.parametrize("name", MOPFLOW_WORKLOADS)
def test_compose_settings_resolve_to_the_services(name: str) -> None:
    """With a filled-in .env, each mopflow container's settings load and point at this file's services."""
    services = compose()["services"]
    env = service_env(services[name])
    settings = Settings.from_env(env)
    assert settings.data_root.startswith("s3://mopflow-bucket/")
    assert settings.artifact_root.startswith("s3://mopflow-bucket/")
    assert settings.storage_options == {"endpoint_url": "https://s3.example.com"}
    host, port = _url_host_port(settings.tracking_uri)
    assert host == "mlflow" and port == compose_service_port(services["mlflow"])
    assert settings.mlflow_artifact_location.startswith(f"mlflow-artifacts://{host}:{port}/")
    host, port = _url_host_port(settings.dask_address)
    assert host == "dask-scheduler" and port == compose_service_port(services["dask-scheduler"])
    assert settings.optuna_storage.startswith("postgresql")
    assert _url_host_port(settings.optuna_storage) == ("postgres", 5432)
    if name in AIRFLOW_WORKLOADS:
        assert _url_host_port(env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]) == ("postgres", 5432)
        host, port = _url_host_port(env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"])
        assert host == "airflow-apiserver" and port == int(env["AIRFLOW__API__PORT"])
        assert env["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor"
        assert env["AIRFLOW__CORE__DAGS_FOLDER"] == f"{IMAGE_ROOT}/dags"
        assert env["AIRFLOW__CORE__PLUGINS_FOLDER"] == "/opt/airflow/plugins"  # the entry point loads it


def test_compose_mlflow_server_uses_postgres_and_s3() -> None:
    mlflow = compose()["services"]["mlflow"]
    env = service_env(mlflow)
    argv = as_argv(mlflow["command"])
    assert argv[:2] == ["mlflow", "server"] and "--serve-artifacts" in argv
    assert _flag(argv, "--artifacts-destination") == "s3://mopflow-bucket/mlflow"
    assert _url_host_port(env["MLFLOW_BACKEND_STORE_URI"]) == ("postgres", 5432)
    assert env["MLFLOW_S3_ENDPOINT_URL"] == "https://s3.example.com"
    hosts = _flag(argv, "--allowed-hosts").split(",")
    assert "mlflow:*" in hosts, "the other containers reach MLflow as mlflow:5000"


def test_compose_requires_every_secret() -> None:
    """Secrets are `${VAR:?}` substitutions: compose refuses to start without them, and the file
    holds no secret value itself."""
    raw = compose_raw()
    for name, service in raw["services"].items():
        for key, value in service_env(service).items():
            if SECRET_NAME.search(key):
                assert re.fullmatch(r"\$\{[A-Z0-9_]+:\?[^}]*\}", value), f"{name}: {key}={value!r}"
            for url_password in re.findall(r"://[^:/@\s]+:([^@\s]+)@", value):
                assert url_password.startswith("${POSTGRES_PASSWORD:?"), f"{name}: {key} embeds a password"
        for arg in as_argv(service.get("command") or []):
            for url_password in re.findall(r"://[^:/@\s]+:([^@\s]+)@", arg):
                assert url_password.startswith("${POSTGRES_PASSWORD:?"), f"{name}: command embeds a password"
    env = sample_env()
    for secret in ("POSTGRES_PASSWORD", "AWS_SECRET_ACCESS_KEY", "AIRFLOW_FERNET_KEY", "AIRFLOW_JWT_SECRET"):
        with pytest.raises(MissingVariable, match=secret):
            compose_interpolate(raw, {k: v for k, v in env.items() if k != secret})


def test_env_example_lists_the_compose_variables() -> None:
    variables = compose_variables(compose_raw())
    required, optional = env_file_keys(ENV_EXAMPLE)
    must = {name for name, op in variables.items() if op == ":?"}
    assert must == required, f"required in compose {sorted(must)} vs env.example {sorted(required)}"
    unlisted = set(variables) - required - optional
    assert not unlisted, f"env.example does not mention {sorted(unlisted)}"


def test_postgres_creates_every_database_the_urls_use() -> None:
    services = compose()["services"]
    created = {services["postgres"]["environment"]["POSTGRES_DB"]}
    sql = (DEPLOY / "postgres" / "init-databases.sql").read_text()
    created |= set(re.findall(r"CREATE DATABASE (\w+);", sql))
    mount = next(v for v in services["postgres"]["volumes"] if "init-databases.sql" in v)
    assert (COMPOSE_FILE.parent / mount.split(":")[0]).is_file()
    assert ":/docker-entrypoint-initdb.d/" in mount
    urls = [v for s in services.values() for v in service_env(s).values() if v.startswith("postgresql")]
    urls += [
        a for s in services.values() for a in as_argv(s.get("command") or []) if a.startswith("postgresql")
    ]
    used = {urlsplit(url).path.lstrip("/") for url in urls}
    assert used == {"airflow", "mlflow", "optuna"}
    assert used <= created


# ---------------------------------------------------------------------------- kubernetes


@functools.cache
def kustomization() -> dict[str, Any]:
    doc = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert isinstance(doc, dict)
    return doc


@functools.cache
def k8s_objects() -> tuple[dict[str, Any], ...]:
    objects: list[dict[str, Any]] = []
    for resource in kustomization()["resources"]:
        objects += [d for d in yaml.safe_load_all((K8S / resource).read_text()) if d]
    return tuple(objects)


def by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in k8s_objects() if o["kind"] == kind}


def workloads() -> dict[str, dict[str, Any]]:
    """Deployments, StatefulSets and Jobs by name."""
    out: dict[str, dict[str, Any]] = {}
    for kind in ("Deployment", "StatefulSet", "Job"):
        out.update(by_kind(kind))
    return out


def pod_specs() -> Iterator[tuple[str, dict[str, Any]]]:
    for name, workload in workloads().items():
        yield name, workload["spec"]["template"]


def all_containers(pod: Mapping[str, Any]) -> list[dict[str, Any]]:
    spec = pod["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def configmap_data() -> dict[str, dict[str, str]]:
    return {
        name: {k: str(v) for k, v in cm.get("data", {}).items()} for name, cm in by_kind("ConfigMap").items()
    }


def secret_keys() -> set[str]:
    required, _ = env_file_keys(SECRETS_EXAMPLE)
    return required


_K8S_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def container_env(container: Mapping[str, Any]) -> dict[str, str]:
    """A container's environment as the kubelet builds it (envFrom, then env in order, ``$(VAR)``
    expanded from what is defined before), with sample values for the user-provided Secret."""
    maps = configmap_data()
    secrets = {key: f"sample-{key.lower().replace('_', '-')}" for key in secret_keys()}
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(maps[source["configMapRef"]["name"]])
        if "secretRef" in source:
            env.update(secrets)
    for item in container.get("env", []):
        if "value" in item:
            value = str(item["value"])
            undefined = [ref for ref in _K8S_REF.findall(value) if ref not in env]
            assert not undefined, f"{item['name']} refers to {undefined}, not defined before it"
            env[item["name"]] = _K8S_REF.sub(lambda m: env[m.group(1)], value)
        elif "secretKeyRef" in item["valueFrom"]:
            env[item["name"]] = secrets[item["valueFrom"]["secretKeyRef"]["key"]]
        elif "configMapKeyRef" in item["valueFrom"]:
            ref = item["valueFrom"]["configMapKeyRef"]
            env[item["name"]] = maps[ref["name"]][ref["key"]]
        else:
            env[item["name"]] = "from-downward-api"
    return env


def container_argv(container: Mapping[str, Any]) -> list[str]:
    return [str(a) for a in (*container.get("command", []), *container.get("args", []))]


def main_container(name: str) -> dict[str, Any]:
    containers = workloads()[name]["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, f"{name}: expected one container"
    return containers[0]


# Keys of the Kubernetes core/v1 PodSpec and Container used here and around, to catch misspellings.
POD_KEYS = set(
    [
        "activeDeadlineSeconds",
        "affinity",
        "automountServiceAccountToken",
        "containers",
        "dnsConfig",
        "dnsPolicy",
        "enableServiceLinks",
        "hostAliases",
        "hostIPC",
        "hostNetwork",
        "hostPID",
        "hostUsers",
        "hostname",
        "imagePullSecrets",
        "initContainers",
        "nodeName",
        "nodeSelector",
        "os",
        "overhead",
        "preemptionPolicy",
        "priority",
        "priorityClassName",
        "readinessGates",
        "resourceClaims",
        "restartPolicy",
        "runtimeClassName",
        "schedulerName",
        "securityContext",
        "serviceAccountName",
        "setHostnameAsFQDN",
        "shareProcessNamespace",
        "subdomain",
        "terminationGracePeriodSeconds",
        "tolerations",
        "topologySpreadConstraints",
        "volumes",
    ]
)
CONTAINER_KEYS = set(
    [
        "args",
        "command",
        "env",
        "envFrom",
        "image",
        "imagePullPolicy",
        "lifecycle",
        "livenessProbe",
        "name",
        "ports",
        "readinessProbe",
        "resizePolicy",
        "resources",
        "restartPolicy",
        "securityContext",
        "startupProbe",
        "stdin",
        "stdinOnce",
        "terminationMessagePath",
        "terminationMessagePolicy",
        "tty",
        "volumeDevices",
        "volumeMounts",
        "workingDir",
    ]
)


def test_kustomization_lists_every_manifest() -> None:
    listed = set(kustomization()["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk
    assert kustomization()["namespace"] == "mopflow"
    assert {image["name"] for image in kustomization()["images"]} == {"mopflow"}


def test_k8s_objects_are_well_formed() -> None:
    seen: set[tuple[str, str]] = set()
    for obj in k8s_objects():
        assert obj.get("apiVersion") and obj.get("kind"), obj
        name = obj.get("metadata", {}).get("name")
        assert name and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), f"bad name {name!r}"
        assert (obj["kind"], name) not in seen, f"duplicate {obj['kind']}/{name}"
        seen.add((obj["kind"], name))
    assert set(workloads()) >= SERVICES
    for name, workload in workloads().items():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        if workload["kind"] != "Job":
            selector = workload["spec"]["selector"]["matchLabels"]
            assert selector and selector.items() <= labels.items(), (
                f"{name}: selector does not match its pods"
            )
        pod = workload["spec"]["template"]["spec"]
        assert set(pod) <= POD_KEYS, f"{name}: unknown pod keys {set(pod) - POD_KEYS}"
        mounts = {v["name"] for v in pod.get("volumes", [])}
        for container in all_containers(workload["spec"]["template"]):
            assert set(container) <= CONTAINER_KEYS, f"{name}: unknown keys {set(container) - CONTAINER_KEYS}"
            image = container["image"]
            assert image.startswith("mopflow:") or image.startswith("postgres:"), f"{name}: image {image}"
            if image.startswith("mopflow:"):
                # args, not command: the image's entrypoint (tini, reaping the workers' children) stays PID 1.
                assert "command" not in container and container["args"], f"{name}: set args, not command"
            claims = {c["metadata"]["name"] for c in workload["spec"].get("volumeClaimTemplates", [])}
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in mounts | claims, (
                    f"{name}: mount of an undeclared volume {mount['name']}"
                )
    assert (
        'ENTRYPOINT ["/usr/bin/tini", "-g", "--"]' in DOCKERFILE.read_text()
    )  # -g: the notice reaches the worker


def test_k8s_services_select_pods_and_their_ports() -> None:
    pods = list(pod_specs())
    for name, service in by_kind("Service").items():
        selector = service["spec"]["selector"]
        selected = [pod for _, pod in pods if selector.items() <= pod["metadata"]["labels"].items()]
        assert selected, f"Service {name} selects no pod"
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            container_ports = [
                p for pod in selected for c in pod["spec"]["containers"] for p in c.get("ports", [])
            ]
            assert any(target in (p.get("name"), p["containerPort"]) for p in container_ports), (
                f"Service {name}: targetPort {target} is no container port of its pods"
            )


def test_k8s_probes_use_declared_ports() -> None:
    for name, pod in pod_specs():
        for container in pod["spec"]["containers"]:
            ports = {p.get("name") for p in container.get("ports", [])} | {
                p["containerPort"] for p in container.get("ports", [])
            }
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                spec = container.get(probe, {})
                for handler in ("httpGet", "tcpSocket"):
                    if handler in spec:
                        assert spec[handler]["port"] in ports, f"{name}: {probe} on an undeclared port"


def test_k8s_configmaps_and_secrets_exist() -> None:
    maps = configmap_data()
    keys = secret_keys()
    page = REPO / "docs" / "operations" / "deployment.md"
    text = page.read_text()
    for secret in USER_PROVIDED_SECRETS:
        assert secret in text, (
            f"the user-provided Secret {secret} is not documented in {page.relative_to(REPO)}"
        )
    for name, pod in pod_specs():
        for volume in pod["spec"].get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in maps, f"{name}: volume of a missing ConfigMap"
            if "secret" in volume:
                assert volume["secret"]["secretName"] in USER_PROVIDED_SECRETS
        for container in all_containers(pod):
            for source in container.get("envFrom", []):
                if "configMapRef" in source:
                    assert source["configMapRef"]["name"] in maps, f"{name}: envFrom a missing ConfigMap"
                if "secretRef" in source:
                    assert source["secretRef"]["name"] in USER_PROVIDED_SECRETS
            for item in container.get("env", []):
                ref = item.get("valueFrom", {})
                if "configMapKeyRef" in ref:
                    cm = ref["configMapKeyRef"]
                    assert cm["key"] in maps.get(cm["name"], {}), f"{name}: {item['name']} from a missing key"
                if "secretKeyRef" in ref:
                    sk = ref["secretKeyRef"]
                    assert sk["name"] in USER_PROVIDED_SECRETS, f"{name}: unknown Secret {sk['name']}"
                    assert sk["key"] in keys, f"{name}: key {sk['key']} is not in secrets.env.example"


def test_k8s_secret_example_lists_exactly_the_keys_used() -> None:
    used = {
        item["valueFrom"]["secretKeyRef"]["key"]
        for _, pod in pod_specs()
        for container in all_containers(pod)
        for item in container.get("env", [])
        if "secretKeyRef" in item.get("valueFrom", {})
    }
    assert used == secret_keys()


def test_k8s_holds_no_secret_values() -> None:
    for name, pod in pod_specs():
        for container in all_containers(pod):
            for item in container.get("env", []):
                if SECRET_NAME.search(item["name"]):
                    assert "secretKeyRef" in item.get("valueFrom", {}), (
                        f"{name}: {item['name']} is not a secret ref"
                    )
                for password in re.findall(r"://[^:/@\s]+:([^@\s]+)@", str(item.get("value", ""))):
                    assert password == "$(POSTGRES_PASSWORD)", f"{name}: {item['name']} embeds a password"
    for name, data in configmap_data().items():
        for key, value in data.items():
            assert not SECRET_NAME.search(key), f"ConfigMap {name} holds the secret-like key {key}"
            assert not re.search(r"://[^:/@\s]+:[^@\s]+@", value), (
                f"ConfigMap {name}: {key} embeds a password"
            )


def test_k8s_gpu_workers_request_nvidia_gpus() -> None:
    worker = main_container("dask-worker")
    for section in ("requests", "limits"):
        assert int(worker["resources"][section]["nvidia.com/gpu"]) >= 1
    argv = container_argv(worker)
    assert argv[:2] == ["dask", "worker"]
    assert _flag(argv, "--nthreads") == "1"
    assert _flag(argv, "--resources").startswith("GPU=")


@pytest.mark.parametrize("name", MOPFLOW_WORKLOADS)
def test_k8s_passes_every_setting_through(name: str) -> None:
    env = set(container_env(main_container(name)))
    missing = missing_pass_through(env, required_env())
    assert not missing, f"k8s workload {name} does not pass {sorted(missing)}"


def test_k8s_variable_references_are_defined() -> None:
    """``$(VAR)`` in env values, commands and args refers to a variable defined for the container."""
    for name, pod in pod_specs():
        for container in all_containers(pod):
            env = container_env(container)  # asserts on env values
            for arg in container_argv(container):
                undefined = [ref for ref in _K8S_REF.findall(arg) if ref not in env]
                assert not undefined, f"{name}/{container['name']}: {arg} refers to {undefined}"


def service_port(name: str, port: int) -> None:
    """Assert a Service ``name`` exposes ``port``."""
    services = by_kind("Service")
    assert name in services, f"no Service {name}"
    assert port in {p["port"] for p in services[name]["spec"]["ports"]}, f"Service {name} has no port {port}"


@pytest.mark.parametrize("name", MOPFLOW_WORKLOADS)
def test_k8s_settings_resolve_to_the_services(name: str) -> None:
    env = container_env(main_container(name))
    settings = Settings.from_env(env)
    assert settings.data_root.startswith("s3://") and settings.artifact_root.startswith("s3://")
    service_port(*_url_host_port(settings.tracking_uri))
    host, port = _url_host_port(settings.mlflow_artifact_location)
    assert settings.mlflow_artifact_location.startswith("mlflow-artifacts://")
    service_port(host, port)
    service_port(*_url_host_port(settings.dask_address))
    service_port(*_url_host_port(settings.optuna_storage))
    if name in AIRFLOW_WORKLOADS:
        service_port(*_url_host_port(env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]))
        host, port = _url_host_port(env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"])
        service_port(host, port)
        assert host == "airflow-apiserver" and port == int(env["AIRFLOW__API__PORT"])
        assert env["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor"
        assert env["AIRFLOW__CORE__DAGS_FOLDER"] == f"{IMAGE_ROOT}/dags"


def test_k8s_storage_endpoint_is_the_same_for_mopflow_and_mlflow() -> None:
    data = configmap_data()["mopflow-settings"]
    assert json.loads(data["MOPFLOW_STORAGE_OPTIONS"])["endpoint_url"] == data["MLFLOW_S3_ENDPOINT_URL"]
    env = container_env(main_container("mlflow"))
    argv = [_K8S_REF.sub(lambda m: env[m.group(1)], a) for a in container_argv(main_container("mlflow"))]
    assert urlsplit(_flag(argv, "--artifacts-destination")).scheme == "s3"
    assert _url_host_port(env["MLFLOW_BACKEND_STORE_URI"]) == ("postgres", 5432)


@pytest.mark.parametrize("deployment", ["compose", "k8s"])
def test_the_deployments_work_with_dask_workers_on_other_hosts(deployment: str) -> None:
    """Airflow's tasks and the Dask workers run in containers of their own (other host names): the
    settings pass the stages' check of a cluster across hosts even for a worker without storage
    options of its own (shared roots, an endpoint off loopback), a worker's own options are off
    loopback too, and each worker caches shards in a folder of its container."""
    if deployment == "compose":
        services = compose()["services"]
        tasks, worker = service_env(services["airflow-scheduler"]), service_env(services["dask-worker"])
    else:
        tasks, worker = (
            container_env(main_container("airflow-scheduler")),
            container_env(main_container("dask-worker")),
        )
    workers = {"tcp://dask-worker:40000": WorkerHost("dask-worker-1", own_storage_options=False)}
    assert across_hosts_problems(Settings.from_env(tasks), "airflow-scheduler", workers) == []
    assert not [e for e in endpoints(Settings.from_env(worker).storage_options) if is_loopback(e)]
    assert worker["MOPFLOW_SHARD_CACHE"] == "/var/cache/mopflow/shards"


def test_k8s_log_servers_are_reachable_by_hostname() -> None:
    """The api-server fetches task logs from <hostname>:<log port> of the scheduler and triggerer
    pods: each sets hostname + subdomain, and a headless Service of that name selects it."""
    services = by_kind("Service")
    for name, port in (("airflow-scheduler", 8793), ("airflow-triggerer", 8794)):
        pod = workloads()[name]["spec"]["template"]
        subdomain = pod["spec"]["subdomain"]
        assert pod["spec"]["hostname"] and subdomain in services
        service = services[subdomain]
        assert service["spec"].get("clusterIP") == "None"
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        service_port(subdomain, port)


def test_k8s_postgres_init_matches_compose() -> None:
    data = configmap_data()["postgres-init"]
    assert list(data.values()) == [(DEPLOY / "postgres" / "init-databases.sql").read_text()]


# ---------------------------------------------------------------------------- against the tools


def compose_commands() -> list[list[str]]:
    out: list[list[str]] = []
    for service in compose()["services"].values():
        if service.get("command"):
            out.append(as_argv(service["command"]))
        test = service.get("healthcheck", {}).get("test")
        if test and test[0] in {"CMD", "CMD-SHELL"}:
            out.append(as_argv(test[1:]) if test[0] == "CMD" else shlex.split(test[1]))
    return out


def k8s_commands() -> list[list[str]]:
    out: list[list[str]] = []
    for _, pod in pod_specs():
        for container in all_containers(pod):
            out.append(container_argv(container))
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                command = container.get(probe, {}).get("exec", {}).get("command")
                if command:
                    out.append([str(c) for c in command])
    return out


def script_commands() -> list[list[str]]:
    out: list[list[str]] = []
    for script in DEPLOY.glob("*.sh"):
        for line in script.read_text().splitlines():
            tokens = shlex.split(line, comments=True) if line.strip() else []
            if tokens[:1] == ["exec"]:
                tokens = tokens[1:]
            if tokens[:1] == ["airflow"]:
                out.append(tokens)
    return out


def every_command() -> list[list[str]]:
    return compose_commands() + k8s_commands() + script_commands()


@functools.cache
def help_text(*command: str) -> str:
    env = {"PATH": f"{BIN}:/usr/bin:/bin", "HOME": str(REPO)}
    proc = subprocess.run(
        [str(BIN / command[0]), *command[1:], "--help"], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def _flags(argv: list[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in argv if a.startswith("--")}


@pytest.mark.parametrize(
    "prefix", [("mlflow", "server"), ("dask", "scheduler"), ("dask", "worker"), ("optuna-dashboard",)]
)
def test_cli_flags_exist(prefix: tuple[str, ...]) -> None:
    commands = [argv for argv in every_command() if tuple(argv[: len(prefix)]) == prefix]
    assert commands, f"no {' '.join(prefix)} command in the deployment files"
    if prefix == ("mlflow", "server"):
        # The click command `mlflow server --help` prints (in-process: MLflow is imported anyway).
        from mlflow.cli import server

        known = {o for p in server.params for o in (*p.opts, *p.secondary_opts)}
        assert "--serve-artifacts" in known
    else:
        known = set(re.findall(r"--[a-z0-9][a-z0-9-]*", help_text(*prefix)))
    for argv in commands:
        unknown = _flags(argv) - known
        assert not unknown, f"`{' '.join(prefix)}` has no flags {sorted(unknown)}"


def test_mlflow_server_environment_variables_exist() -> None:
    """The MLFLOW_* variables given to the server are read by `mlflow server` or by MLflow."""
    import mlflow.environment_variables as mlflow_env
    from mlflow.cli import server

    known = {p.envvar for p in server.params if isinstance(p.envvar, str)} | set(dir(mlflow_env))
    names = set(service_env(compose()["services"]["mlflow"])) | set(container_env(main_container("mlflow")))
    mlflow_names = {n for n in names if n.startswith("MLFLOW_")}
    assert {"MLFLOW_BACKEND_STORE_URI", "MLFLOW_S3_ENDPOINT_URL"} <= mlflow_names
    assert not mlflow_names - known, f"unknown to MLflow: {mlflow_names - known}"


@functools.cache
def airflow_parser() -> argparse.ArgumentParser:
    from airflow.cli.cli_parser import get_parser

    return get_parser()


def airflow_cli_problem(argv: list[str]) -> str | None:
    """Why ``airflow ...`` would be refused by Airflow's CLI (unknown sub-command, flag or choice), else None."""
    parser = airflow_parser()
    tokens = argv[1:]
    while tokens and not tokens[0].startswith("-"):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            break
        if tokens[0] not in subs[0].choices:
            return f"unknown sub-command {tokens[0]!r} in {argv}"
        parser = subs[0].choices[tokens[0]]
        tokens = tokens[1:]
    if any(isinstance(a, argparse._SubParsersAction) for a in parser._actions):
        return f"{argv} stops before a sub-command"
    options = {o: a for a in parser._actions for o in a.option_strings}
    for i, token in enumerate(tokens):
        if token.startswith("-") and token != "-":
            action = options.get(token.split("=", 1)[0])
            if action is None:
                return f"unknown flag {token!r} in {argv}"
            if action.choices and i + 1 < len(tokens) and tokens[i + 1] not in action.choices:
                return f"{token} {tokens[i + 1]!r} is not one of {sorted(action.choices)}"
    return None


def test_airflow_cli_problem_detects_bad_commands() -> None:
    assert airflow_cli_problem(["airflow", "scheduler"]) is None
    assert airflow_cli_problem(["airflow", "jobs", "check", "--job-type", "SchedulerJob", "--local"]) is None
    assert airflow_cli_problem(["airflow", "schedulr"]) is not None
    assert airflow_cli_problem(["airflow", "jobs", "check", "--job-type", "Nope"]) is not None
    assert airflow_cli_problem(["airflow", "db", "check-migrations", "--wait"]) is not None


def test_airflow_commands_exist() -> None:
    commands = [argv for argv in every_command() if argv[:1] == ["airflow"]]
    started = {tuple(argv[:2]) for argv in commands}
    assert {("airflow", "scheduler"), ("airflow", "dag-processor"), ("airflow", "triggerer")} <= started
    assert ("airflow", "api-server") in started and ("airflow", "db") in started
    problems = [p for p in map(airflow_cli_problem, commands) if p]
    assert not problems, problems


def airflow_config_keys() -> set[str]:
    names: set[str] = set()
    for service in compose_raw()["services"].values():
        names |= set(service_env(service))
    for data in configmap_data().values():
        names |= set(data)
    for _, pod in pod_specs():
        for container in all_containers(pod):
            names |= {item["name"] for item in container.get("env", [])}
    for script in DEPLOY.glob("*.sh"):
        names |= set(re.findall(r"AIRFLOW__[A-Z0-9_]+", script.read_text()))
    return {n for n in names if n.startswith("AIRFLOW__")}


def test_airflow_settings_exist_in_airflow() -> None:
    import airflow

    template = Path(airflow.__file__).parent / "config_templates" / "config.yml"
    sections = yaml.safe_load(template.read_text())
    used = airflow_config_keys()
    assert {"AIRFLOW__CORE__EXECUTOR", "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"} <= used
    unknown = []
    for name in sorted(used):
        section, _, key = name.removeprefix("AIRFLOW__").partition("__")
        if key.lower() not in (sections.get(section.lower()) or {}).get("options", {}):
            unknown.append(name)
    assert not unknown, f"not Airflow {airflow.__version__} settings: {unknown}"


def test_scripts_parse_and_create_the_training_pool() -> None:
    for script in DEPLOY.glob("*.sh"):
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, f"{script.name}: {proc.stderr}"
    pools = [argv for argv in script_commands() if argv[1:3] == ["pools", "set"]]
    assert [argv[3] for argv in pools] == [TRAINING_POOL]


def test_commands_run_files_the_image_contains() -> None:
    """Paths under /opt/mopflow in the commands exist in the repo and are copied into the image."""
    dockerfile = DOCKERFILE.read_text()
    copied = set(re.findall(r"^COPY (\S+) ", dockerfile, flags=re.M))
    links = re.search(
        r'^RUN for part in ([\w ]+); do ln -s "mopflow/\$part" "\$part"; done$', dockerfile, re.M
    )
    assert links, "the Dockerfile makes the top-level links into the package"
    linked = set(links.group(1).split())
    ignored = {line.strip() for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()}
    paths = {arg for argv in every_command() for arg in argv if arg.startswith(f"{IMAGE_ROOT}/")}
    paths |= {f"{IMAGE_ROOT}/dags", f"{IMAGE_ROOT}/mopflow"}
    assert any(p.endswith(".sh") for p in paths)
    for path in paths:
        relative = path.removeprefix(f"{IMAGE_ROOT}/")
        assert (REPO / relative).exists(), f"{path}: {relative} is not in the repository"
        top, real_top = relative.split("/")[0], (REPO / relative).resolve().relative_to(REPO).parts[0]
        assert real_top in copied, f"{path}: the Dockerfile does not copy {real_top}"
        # a top-level link into the package (infra -> mopflow/infra) is made again in the image
        assert top in copied or (top in linked and (REPO / top).is_symlink()), (
            f"{path}: no {top} in the image"
        )
        assert real_top not in ignored
    assert "WORKDIR /opt/mopflow" in dockerfile


def test_dockerfile_installs_like_the_makefile() -> None:
    """torch pinned as in the Makefile (pyproject.toml accepts a range, so that a machine's own
    CPU or CUDA build is used), installed before the project, with a documented index build
    argument; then the project with constraints.txt."""
    dockerfile = DOCKERFILE.read_text()
    pinned = re.search(r'"torch==([^"]+)"', (REPO / "Makefile").read_text())
    assert pinned
    requirement = re.search(r'"torch([^"]*)"', (REPO / "pyproject.toml").read_text())
    assert requirement and SpecifierSet(requirement.group(1)).contains(pinned.group(1))
    assert f"ARG TORCH_VERSION={pinned.group(1)}" in dockerfile
    assert (
        "ARG TORCH_INDEX_URL" in dockerfile
        and "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in dockerfile
    )
    runs = re.findall(r"^RUN (.+?)(?<!\\)$", dockerfile, flags=re.M | re.S)
    torch_step = next(i for i, run in enumerate(runs) if '"torch==${TORCH_VERSION}"' in run)
    project_step = next(i for i, run in enumerate(runs) if "-c constraints.txt" in run)
    assert torch_step < project_step
    # the project with the scale-out extra (the image serves that profile), nothing beside it
    assert '-e ".[scale-out]"' in runs[project_step] and "pip check" in runs[project_step]


def test_image_holds_the_database_drivers() -> None:
    """Every PostgreSQL URL's driver is a dependency of the project the image installs, and so is
    asyncpg, which Airflow 3 derives from a postgresql sync URL for its async engine."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["scale-out"] == ["mopflow[stack,s3,postgres,celery]"]  # what the image installs
    deps = "".join(f'"{requirement}' for requirement in extras["postgres"])
    urls = [
        value
        for service in compose()["services"].values()
        for value in [*service_env(service).values(), *as_argv(service.get("command") or [])]
        if value.startswith("postgresql")
    ]
    drivers = {urlsplit(url).scheme.partition("+")[2] for url in urls}
    assert drivers == {"psycopg2"}, f"one driver for every URL, got {drivers}"
    for distribution in ("psycopg2-binary", "asyncpg"):
        assert f'"{distribution}' in deps, f"{distribution} is not a dependency in pyproject.toml"
