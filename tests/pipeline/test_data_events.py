"""The config a data-triggered retrain runs with: the event's data keys over the retrain's own Params."""

from __future__ import annotations

import base64
import pickle
import re
from pathlib import Path

import pytest

from mopflow.pipeline.config import ConfigError
from mopflow.pipeline.data_events import carried_keys, conf_with_data_events, event_conf, read_conf_file

SWEEP = {"dataset": "mnist1d", "num_samples": 1200, "n_shards": 3, "n_trials": 7, "model_name": "sweep"}


def test_an_event_carries_the_data_keys_and_the_model_name_only() -> None:
    carried = event_conf(SWEEP | {"epochs": 5, "sampler": "random"})
    assert carried == {k: v for k, v in SWEEP.items() if k != "n_trials"}
    assert {"dataset", "num_samples", "n_shards", "model_name"} <= carried_keys()
    assert not {"n_trials", "epochs", "sampler", "promotion"} & carried_keys()


def test_the_retrain_takes_the_newest_events_data_and_keeps_its_own_search() -> None:
    retrain = {"n_trials": 4, "epochs": 2, "num_samples": 900, "model_name": "mopflow"}
    older = {"conf": {"num_samples": 800, "model_name": "old"}}
    newer = {"conf": event_conf(SWEEP)}
    merged = conf_with_data_events(retrain, [older, newer, {"manifest_hash": "x"}])
    assert merged["num_samples"] == 1200 and merged["n_shards"] == 3 and merged["model_name"] == "sweep"
    assert merged["n_trials"] == 4 and merged["epochs"] == 2  # the retrain's own Params


def test_without_a_carrying_event_the_params_stand() -> None:
    params = {"n_trials": 4}
    assert conf_with_data_events(params, []) == params
    assert conf_with_data_events(params, [{"manifest_uri": "file:///m.json"}]) == params


@pytest.mark.parametrize(
    ("carried", "needle"),
    [
        ({"n_trials": 100}, "n_trials"),  # not a data key: an event cannot change the search
        ({"num_samples": -5}, "num_samples"),
        ("dataset=x", "must be a mapping"),
    ],
)
def test_a_bad_event_is_refused_naming_the_key(carried: object, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        conf_with_data_events({"n_trials": 4}, [{"conf": carried}])


def test_a_retrain_config_file_is_read_and_validated(tmp_path: Path) -> None:
    good = tmp_path / "retrain.yaml"
    good.write_text("n_trials: 4\nepochs: 2\nmodel_name: nightly\n")
    assert read_conf_file(good) == {"n_trials": 4, "epochs": 2, "model_name": "nightly"}
    bad = tmp_path / "bad.yaml"
    bad.write_text("n_trials: 0\n")
    with pytest.raises(ConfigError, match=r"bad.yaml.*n_trials"):
        read_conf_file(bad)
    with pytest.raises(ConfigError, match="must hold a mapping"):
        (tmp_path / "list.yaml").write_text("- 1\n")
        read_conf_file(tmp_path / "list.yaml")
    with pytest.raises(ConfigError, match="cannot read"):
        read_conf_file(tmp_path / "missing.yaml")


class _TouchOnUnpickle:
    """Unpickling this creates ``path``: a trace left by any code that unpickles it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[Path]]:
        return (Path.touch, (self.path,))


def test_a_pickle_in_an_event_or_a_conf_file_is_never_unpickled(tmp_path: Path) -> None:
    """A pickle payload as a carried value, as the whole carried conf (raw or base64) or in a YAML
    conf file (a python tag, or !!binary bytes): refused naming the key, never unpickled."""
    marker = tmp_path / "unpickled"
    payload = pickle.dumps(_TouchOnUnpickle(marker))
    encoded = base64.b64encode(payload).decode()
    for carried, needle in [
        ({"dataset": payload}, "dataset"),
        ({"model_name": payload}, "model_name"),
        ({"dataset": encoded}, f"unknown dataset {re.escape(repr(encoded))}"),  # a plain string
        (payload, "must be a mapping"),
        (encoded, "must be a mapping"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            conf_with_data_events({"n_trials": 4}, [{"conf": carried}])
    tagged = tmp_path / "tagged.yaml"
    tagged.write_text(f"n_trials: 4\nmodel_name: !!python/object/apply:pathlib.Path.touch [{marker}]\n")
    with pytest.raises(ConfigError, match="tagged.yaml is not valid YAML"):
        read_conf_file(tagged)
    binary = tmp_path / "binary.yaml"
    binary.write_text(f"n_trials: 4\nmodel_name: !!binary {encoded}\n")
    with pytest.raises(ConfigError, match=r"binary.yaml: model_name"):
        read_conf_file(binary)
    assert not marker.exists()
    pickle.loads(payload)  # the payload is live: unpickled, it leaves its trace
    assert marker.exists()
