"""The Sweeps page's pictures of a search (the page's templates show them and keep a running
sweep current).

No Airflow here (the plugin in ``mopflow_plugin.py`` serves them). The figures are drawn on
request from the Optuna storage with the functions the search stage logs to MLflow
(``training/search/figures.py``), so a running sweep's pictures show its trials so far; a finished
sweep's come the same way. Nothing from a request is imported, evaluated or unpickled: a study
name must look like the names the pipeline gives studies and exist in the storage, and a figure
kind must be one of three.
"""

from __future__ import annotations

import functools
import re
import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from typing import Any

from mopflow.training.search.figures import FIGURE_KINDS, draw, png, unavailable_reason

STUDY_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,127}$")  # a model name, '-', a run key
REFRESH_S = 15  # how often the page fetches a running sweep's section again (templates/refresh.js)
CACHE_SIZE = 64  # PNGs kept, keyed by the study's state: an unchanged study is not drawn again


def check_study(name: str) -> str:
    """``name`` when it can be a pipeline study's name, else ValueError."""
    if not STUDY_RE.match(name):
        raise ValueError(f"study {name!r} is not a study name ({STUDY_RE.pattern})")
    return name


def check_kind(kind: str) -> str:
    """``kind`` when it is a figure the page shows, else ValueError."""
    if kind not in FIGURE_KINDS:
        raise ValueError(f"figure {kind!r} is not one of {', '.join(FIGURE_KINDS)}")
    return kind


@functools.lru_cache(maxsize=4)
def storage(storage_url: str) -> Any:
    """One Optuna storage (one database engine) per URL for the life of the web server process."""
    from mopflow.base.optuna_storage import make_storage

    return make_storage(storage_url)


def _load(optuna_storage: Any, study_name: str) -> Any:
    """The study, or KeyError when the storage has none of that name (never created here)."""
    import optuna

    return optuna.load_study(
        study_name=check_study(study_name),
        storage=optuna_storage,
        sampler=optuna.samplers.RandomSampler(),  # only read: no need to build the default sampler
    )


def figure_status(optuna_storage: Any, study_name: str) -> dict[str, str | None]:
    """Each figure kind: None when the study can give it now, else the reason it cannot."""
    trials = _load(optuna_storage, study_name).get_trials(deepcopy=False)
    return {kind: unavailable_reason(trials, kind) for kind in FIGURE_KINDS}


def statuses(optuna_storage: Any, studies: Iterable[str]) -> dict[str, dict[str, str | None]]:
    """:func:`figure_status` of each study the storage holds (others are left out: a study of
    another storage, or deleted)."""
    found = {}
    for name in set(studies):
        try:
            found[name] = figure_status(optuna_storage, name)
        except (KeyError, ValueError):
            continue
    return found


_drawn: OrderedDict[Hashable, bytes] = OrderedDict()
_drawn_lock = threading.Lock()


def figure_png(optuna_storage: Any, study_name: str, kind: str) -> bytes:
    """One figure of a study as PNG: ValueError for a bad name or kind, KeyError for a study the
    storage does not hold, ``FigureUnavailable`` (with its reason) when the study cannot give it."""
    check_kind(kind)
    study = _load(optuna_storage, study_name)
    trials = study.get_trials(deepcopy=False)
    state = tuple(
        (t.number, t.state.value, t.value, len(t.intermediate_values), t.datetime_complete) for t in trials
    )
    key = (id(optuna_storage), study_name, kind, state)
    with _drawn_lock:
        if key in _drawn:
            _drawn.move_to_end(key)
            return _drawn[key]
    image = png(draw(study, kind))
    with _drawn_lock:
        _drawn[key] = image
        while len(_drawn) > CACHE_SIZE:
            _drawn.popitem(last=False)
    return image
