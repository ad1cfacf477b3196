"""MOP's units served by a resident trainer on each worker: a direct call per unit, not a Dask task.

Why: a MOP unit is one model's pass over one partition, on the worker that holds the partition.
As a Dask task, its trip took about 10.7 ms and 3-6.7 ms of the coordinator process's CPU (Dask's
client and scheduler) with nothing in it; as a direct call to the worker, the way Dask's actors
make theirs, 0.7-1.1 ms and 0.35-0.76 ms (``benchmarks/roundtrip.py``, states of 1 B to 1 MiB,
two workers, a 2-CPU machine). With a GPU's short passes that difference is the workers' idle
time (``benchmarks/small_units.py``).

How: :class:`UnitService`, a worker plugin, gives every worker (those that join later too: Dask
applies a registered plugin to them) the handler :data:`HANDLER`. A call runs
:func:`~mopflow.training.executors.units.train_pass_and_validate` in the worker process's one
unit thread, in order of arrival (the unit queued ahead of a worker waits behind its running
one), and answers with the unit's result or its exception. The worker keeps what it kept for
units run as tasks: its partitions' rows and built models (``training/executors/resident.py``).
:class:`UnitCalls` makes the calls from the coordinator; each is a
:class:`concurrent.futures.Future`. A unit sent with a token (one started ahead of its round,
``training/executors/mop_lookahead.py``) can be dropped: the handler :data:`DROP_HANDLER` makes it
end at its next batch, or before it starts, with ``ChainStopped``.

Faults, owned here and in the driver (``training/executors/mop.py``), since no Dask task stands
behind a unit:

* a spot notice (SIGTERM): the running unit hands its state back at its next batch and a queued
  one hands its own back untouched, as in a task; the leaving worker waits for them
  (:func:`~mopflow.training.volatile.preempt.unit_outside_tasks`) before it closes;
* a killed worker: its connection closes, and the call fails at once with an ``OSError``; a worker
  cut off answers nothing, and the driver sees it missing from the scheduler's membership. Either
  way the unit is redone from the model's last finished unit, as before.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

from mopflow.training.volatile.preempt import unit_outside_tasks

HANDLER = "mopflow_mop_unit"
DROP_HANDLER = "mopflow_mop_drop"
PLUGIN_NAME = "mopflow-mop-units"

_UNIT_THREAD: list[concurrent.futures.ThreadPoolExecutor] = []  # this worker process's, made once
_UNIT_THREAD_LOCK = threading.Lock()


def _unit_thread() -> concurrent.futures.ThreadPoolExecutor:
    """The one thread this worker process runs units in (made at its first unit)."""
    with _UNIT_THREAD_LOCK:
        if not _UNIT_THREAD:
            _UNIT_THREAD.append(
                concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="mopflow-unit")
            )
        return _UNIT_THREAD[0]


_RUNNING: list[str] = []  # the unit this worker process runs now, as a label
# The tokens of units the coordinator dropped (started ahead of their round), and when: a dropped
# unit ends at its next batch, or before it starts. A drop can arrive before its unit (another
# connection); one whose unit never comes is forgotten after DROP_KEPT_S.
_DROPPED: dict[str, float] = {}
DROP_KEPT_S = 600.0


def unit_label(args: Sequence[Any]) -> str:
    """A unit's label from its arguments: ``mop-<model>-e<epoch>-<partition>``."""
    spec, epoch, meta = args[0], args[4], args[7]
    return f"mop-{spec.model_id}-e{epoch}-{meta.get('partition', '')}"


def units_running() -> list[str]:
    """The labels of the units this worker process runs now (for fault tests that must hit one)."""
    return list(_RUNNING)


def _run_unit(*args: Any, token: str = "") -> Any:
    from mopflow.training.executors.units import train_pass_and_validate

    halt = (lambda: token in _DROPPED) if token else None
    _RUNNING.append(unit_label(args))
    try:
        train: Callable[..., Any] = train_pass_and_validate  # args: all but ``halt``
        return train(*args, halt=halt)
    finally:
        _RUNNING.clear()
        _DROPPED.pop(token, None)


def pack(value: Any) -> bytes:
    """A call's arguments or its result as one pickle: a single bytes field of Dask's message,
    passed through as it is. Handed to Dask's serialization instead, a unit's arguments were
    pickled one by one, each looked up by module and tried for compression, in the coordinator's
    event loop: that thread's CPU over a small-units search of 400 units fell from 350-370 ms to
    230-290 ms packed (``benchmarks/small_units.py``)."""
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _packed_call(function: Callable[..., Any], args: bytes, keywords: dict[str, Any]) -> bytes:
    return pack(function(*pickle.loads(args), **keywords))


async def run_in_unit_thread(function: Callable[..., Any], args: bytes, **keywords: Any) -> dict[str, Any]:
    """A handler's body: ``function(*args, **keywords)`` in the unit thread, ``args`` as
    :func:`call_worker` packed them, answered as ``{"status": "OK", "result": <packed result>}``
    or ``{"status": "error", "exception": ...}``. Unpacking and packing happen in the unit thread
    too, so the worker's event loop only moves bytes."""
    from distributed.protocol import to_serialize

    with unit_outside_tasks():
        try:
            result = await asyncio.get_running_loop().run_in_executor(
                _unit_thread(), _packed_call, function, args, keywords
            )
        except Exception as exc:  # the unit's own outcome (a notice, a non-finite loss): the caller's
            return {"status": "error", "exception": to_serialize(exc)}
    return {"status": "OK", "result": result}


async def serve_unit(args: bytes = b"", token: str = "") -> dict[str, Any]:
    """The handler: run one unit (``train_pass_and_validate``'s arguments, packed) in the unit
    thread; with a ``token``, :func:`drop_units` can drop it (``ChainStopped`` comes back)."""
    return await run_in_unit_thread(_run_unit, args, token=token)


async def drop_units(args: bytes = b"", tokens: Sequence[str] = ()) -> dict[str, Any]:
    """The handler that drops units sent with these tokens: each ends at its next batch, or
    before it starts (one that has ended already is left alone)."""
    now = time.monotonic()
    for old in [t for t, when in _DROPPED.items() if now - when > DROP_KEPT_S]:
        _DROPPED.pop(old, None)
    _DROPPED.update(dict.fromkeys(tokens, now))
    return {"status": "OK", "result": pack(None)}


def call_worker(
    client: Any, worker: str, handler: str, args: Sequence[Any], **extra: Any
) -> concurrent.futures.Future[Any]:
    """Call ``handler`` on ``worker`` with ``args`` from ``client``'s event loop: a future of its
    result, or of its exception (an ``OSError`` when the worker is gone). Direct, or through the
    scheduler for a client told not to reach workers itself (``direct_to_workers=False``), as Dask's
    actors do. ``args`` travel packed (:func:`pack`), and so does the result; ``extra``: more
    keyword arguments of the handler (msgpack-able)."""
    packed = pack(tuple(args))

    async def ask() -> Any:
        if client.direct_to_workers is False:
            from distributed.actor import ProxyRPC

            rpc: Any = ProxyRPC(client.scheduler, worker)
        else:
            rpc = client.rpc(worker)
        reply = await getattr(rpc, handler)(args=packed, **extra)
        if reply["status"] == "OK":
            return pickle.loads(reply["result"])
        raise reply["exception"]

    return asyncio.run_coroutine_threadsafe(ask(), client.loop.asyncio_loop)


class UnitService(WorkerPlugin):
    """Installs :func:`serve_unit` on a worker. Registering it again (a second sweep on the same
    cluster) changes nothing on a worker: the handler and the unit thread are the process's."""

    name = PLUGIN_NAME

    def setup(self, worker: Any) -> None:
        worker.handlers[HANDLER] = serve_unit
        worker.handlers[DROP_HANDLER] = drop_units


class UnitCalls:
    """The coordinator's side: units sent to workers' services, answered as futures."""

    def __init__(self, client: Any) -> None:
        self.client = client
        client.register_plugin(UnitService(), name=PLUGIN_NAME)

    def call(self, worker: str, args: Sequence[Any], token: str = "") -> concurrent.futures.Future[Any]:
        """Send one unit (``train_pass_and_validate``'s arguments) to ``worker``; with a ``token``,
        :meth:`drop` can drop it."""
        return call_worker(self.client, worker, HANDLER, args, token=token)

    def drop(self, worker: str, tokens: Sequence[str]) -> None:
        """Drop the units sent to ``worker`` with ``tokens`` (not waited for: a worker gone has
        dropped them already)."""
        call_worker(self.client, worker, DROP_HANDLER, (), tokens=list(tokens))
