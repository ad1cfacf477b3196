"""What ``mopflow run`` will run, worked out before Airflow starts: the config file or the demo's,
the ``--set`` keys converted by their types, the retraining DAG's defaults merged in, validated
whole, its data within the data roots, and the warm-start decision in words."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mopflow.infra.cli.errors import CliError

DEMO_CONFIG = Path(__file__).parents[1] / "configs" / "demo.yaml"


@dataclass(frozen=True)
class RunPlan:
    """The conf a run is triggered with, where it came from, and the config it resolves to."""

    conf: dict[str, Any]  # the run's conf (the DAG's Params fill in the rest)
    source: str  # which config is in force, in words
    config: Any  # the PipelineConfig of the DAG's defaults merged with ``conf``
    retrain_keys: frozenset[str]  # keys whose value comes from the DAG's defaults
    data_roots: tuple[str, ...] = ()  # `--data-root` folders, absolute: this run may read there too

    def describe(self) -> list[str]:
        """The first lines of a run: the config in force and the warm-start decision."""
        return [f"config    : {self.source}", f"warm start: {self.warm_start()}"]

    def warm_start(self) -> str:
        """Whether and from what the search warm-starts, and where that came from."""
        search = self.config.search
        parts = []
        if search.warm_start:
            parts.append("the champion's best parameters first")
        if search.warm_start_studies:
            studies = search.warm_start_studies
            newest = "the newest earlier study" if studies == 1 else f"the {studies} newest earlier studies"
            parts.append(f"the trials of {newest} of the same data, space and epochs")
        if not parts:
            return "off (a cold start)"
        origin = (
            " (mopflow_retrain's default; --set warm_start=false --set warm_start_studies=0 starts cold)"
            if {"warm_start", "warm_start_studies"} & self.retrain_keys
            else ""
        )
        return "on: " + " and ".join(parts) + origin


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a flat YAML/JSON config (the DAG's Params)."""
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise CliError(f"cannot read config file {file}: {exc}") from exc
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise CliError(f"config file {file} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise CliError(f"config file {file} must hold a mapping of settings, got {type(data).__name__}")
    return data


def parse_sets(items: Sequence[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` items, each converted by its key's type; every bad item reported at once."""
    from mopflow.pipeline.conf_input import parse_text_value
    from mopflow.pipeline.config import CONF_FIELDS, ConfigError

    values: dict[str, Any] = {}
    problems = []
    for item in items:
        key, sep, text = item.partition("=")
        if not sep:
            problems.append(f"--set expects KEY=VALUE, got {item!r}")
            continue
        if key.strip() not in CONF_FIELDS:  # reported with the other keys' errors by the validation
            values[key.strip()] = text
            continue
        try:
            values[key.strip()] = parse_text_value(key.strip(), text)
        except ConfigError as exc:
            problems.append(str(exc))
    if problems:
        raise CliError("invalid --set: " + "; ".join(problems))
    return values


def plan_run(
    config_path: str | None, sets: Sequence[str], data_roots: Sequence[str], environ: Mapping[str, str]
) -> RunPlan:
    """The run ``mopflow run`` would start, validated as the DAG will see it, or :class:`CliError`.

    Without ``--config`` the demo's config applies to the demo's dataset only: on another dataset
    the per-modality defaults do (``student_family=auto`` and the like)."""
    from mopflow.base.settings import Settings
    from mopflow.pipeline.conf_input import check_data_roots, retrain_defaults
    from mopflow.pipeline.config import ConfigError, PipelineConfig

    overrides = parse_sets(sets)
    if config_path:
        base, source = load_config_file(config_path), f"{config_path}"
    else:
        demo = load_config_file(DEMO_CONFIG)
        demo_dataset = demo.get("dataset", PipelineConfig().data.dataset)
        dataset = overrides.get("dataset", demo_dataset)
        if dataset == demo_dataset:
            base, source = demo, f"the demo's ({DEMO_CONFIG})"
        else:
            base = {}
            source = (
                f"the defaults for {dataset} (the demo's tuning in {DEMO_CONFIG.name} is for "
                f"{demo_dataset} only; pass --config FILE for your own)"
            )
    if overrides:
        source += " with --set " + " ".join(sorted(item.strip() for item in sets))
    conf = {**base, **overrides}
    try:
        defaults = retrain_defaults(environ)
        config = PipelineConfig.from_conf({**defaults, **conf})
        extra_roots = tuple(_absolute(root) for root in data_roots)
        check_data_roots(config, [*Settings.from_env(environ).allowed_data_roots, *extra_roots])
    except ConfigError as exc:
        raise CliError(f"invalid config: {exc}") from exc
    return RunPlan(
        typed_conf(conf, config.to_conf()), source, config, frozenset(defaults) - frozenset(conf), extra_roots
    )


def typed_conf(conf: Mapping[str, Any], validated: Mapping[str, Any]) -> dict[str, Any]:
    """``conf`` with each key's value as validation made it (``--set epochs=3`` gives the text
    ``"3"``, ``image_size=32,32`` a list of texts): the DAG's Params check the types of the conf
    a run is triggered with."""
    return {key: validated.get(key, value) for key, value in conf.items()}


def _absolute(root: str) -> str:
    """A ``--data-root`` folder as an absolute path (URLs unchanged)."""
    return root if "://" in root else str(Path(root).expanduser().resolve())
