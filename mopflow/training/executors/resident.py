"""What a worker keeps between units: built models, by architecture, for the next state to load into.

A unit of training arrives as a state (weights, moments, position) and leaves as one. Building
its model from the architecture each time (every layer made and initialised, to be overwritten by
the state at once) is about 0.3 ms of a small model's unit: on a GPU's 15-ms passes, a fifth of
what a unit may cost beyond them (``benchmarks/small_units.py``). So a worker process keeps the
models its units used, by (data, architecture), and a unit that loads a state takes one of them
instead of building one. Loading the state overwrites every parameter and buffer the model has
(``load_state_dict(strict=True)``), so the unit trains exactly as on a freshly built model
(``tests/training/executors/test_resident.py``). A unit with no state yet still builds its model:
its initial weights come from the seeded build.

A model is held by one unit at a time (taken, then given back), so several units on one worker
never share one. The pool holds at most ``MOPFLOW_MODEL_POOL_MB`` of parameters and buffers
(default 256), dropping the models unused longest first.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from typing import Any

DEFAULT_POOL_MB = 256.0


def pool_bytes_here() -> int:
    """The pool's size on this worker: ``MOPFLOW_MODEL_POOL_MB`` (0 keeps no model), else 256 MB."""
    raw = os.environ.get("MOPFLOW_MODEL_POOL_MB", "")
    try:
        megabytes = float(raw) if raw else DEFAULT_POOL_MB
    except ValueError:
        raise ValueError(
            f"MOPFLOW_MODEL_POOL_MB={raw!r}: expected a number of megabytes (e.g. 256)"
        ) from None
    if megabytes < 0:
        raise ValueError(f"MOPFLOW_MODEL_POOL_MB={raw!r}: expected a number of megabytes >= 0")
    return int(megabytes * 2**20)


def model_bytes(model: Any) -> int:
    """Bytes of a model's parameters and buffers."""
    return int(sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())))


class ModelPool:
    """Built models not in use, by key, the least recently given back dropped first beyond
    ``max_bytes``. Safe to use from several threads (a worker may run units side by side)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._free: OrderedDict[Hashable, list[tuple[Any, int]]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def take(self, key: Hashable) -> Any | None:
        """A model kept under ``key``, now the caller's alone; None when there is none."""
        with self._lock:
            models = self._free.get(key)
            if not models:
                return None
            model, size = models.pop()
            self._bytes -= size
            if not models:
                del self._free[key]
            return model

    def give_back(self, key: Hashable, model: Any) -> None:
        """Keep ``model`` for the next unit of ``key`` (the caller no longer uses it)."""
        size = model_bytes(model)
        if size > self.max_bytes:
            return
        model.zero_grad(set_to_none=True)  # a pass's gradients are not kept alive between units
        with self._lock:
            self._free.setdefault(key, []).append((model, size))
            self._free.move_to_end(key)
            self._bytes += size
            while self._bytes > self.max_bytes:
                oldest = next(iter(self._free))
                _, dropped = self._free[oldest].pop(0)
                self._bytes -= dropped
                if not self._free[oldest]:
                    del self._free[oldest]

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._bytes = 0


_POOLS: dict[int, ModelPool] = {}


def models_here() -> ModelPool:
    """This process's pool (its size read from the environment once)."""
    max_bytes = pool_bytes_here()
    if max_bytes not in _POOLS:
        _POOLS[max_bytes] = ModelPool(max_bytes)
    return _POOLS[max_bytes]


@contextmanager
def pooled(key: Hashable | None, build: Any) -> Iterator[Any]:
    """A model for one unit: one kept under ``key`` or, when there is none (or ``key`` is None:
    the model must be built fresh), ``build()``; given back under ``key`` when the unit is done
    with it, whether or not the unit succeeded (the next one loads its own state)."""
    pool = models_here() if key is not None else None
    model = pool.take(key) if pool is not None else None
    model = build() if model is None else model
    try:
        yield model
    finally:
        if pool is not None and pool.max_bytes:
            pool.give_back(key, model)
