"""Where the sharding stage's tasks run on the Dask workers: partitions handed out as workers free
up (each worker through its own contiguous run), the small tasks of a partition pinned to the
worker that holds it, and each shard sliced where its rows live and written on its writer.

The rules (:func:`feed_cap`, :func:`contiguous_runs`, :func:`next_partition`) are pure; the rest
submits to a ``distributed`` client and keeps every future it creates in the caller's ``held``
list (cancelling a task whose dependents the client no longer wants trips the scheduler)."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from mopflow.training.data.partitions import partition_stats, take_rows, write_shard

SLICE_PRIORITY = 1 << 40  # above any shard's row count


def feed_cap(unstarted: int, n_threads: int) -> int:
    """How many partition tasks a worker thread may have outstanding (running + queued) when
    ``unstarted`` are not handed out yet: three while plenty remain (the next ones are there
    when the current one ends, even if this loop is slow to hand out more on a busy machine),
    one for the last ``n_threads`` (each goes to a thread that is free, never behind a busy
    worker's task while another idles)."""
    return 3 if unstarted > n_threads else 1


def contiguous_runs(indices: Sequence[int], threads: Mapping[str, int]) -> dict[str, deque[int]]:
    """Cut ``indices`` (in order) into one contiguous run per worker, sized by its threads.

    A shard covers consecutive partitions: when neighbours live on the same worker, its writer
    finds most of its rows there and little data moves between workers.
    """
    total = sum(threads.values())
    if not threads or total <= 0:
        raise ValueError(f"need at least one worker thread, got {dict(threads)}")
    runs: dict[str, deque[int]] = {}
    start, assigned = 0, 0
    for worker, n in threads.items():
        assigned += n
        stop = round(len(indices) * assigned / total)
        runs[worker] = deque(indices[start:stop])
        start = stop
    return runs


def next_partition(runs: Mapping[str, deque[int]], worker: str) -> int | None:
    """The next partition for ``worker``: the front of its own run; once that is done, the back
    of the longest other run (the partitions its owner would reach last), so free workers keep
    busy without breaking the runs up."""
    own = runs.get(worker)
    if own:
        return own.popleft()
    longest = max(runs.values(), key=len, default=deque())
    return longest.pop() if longest else None


def partition_holders(partitions: Sequence[Any], client: Any) -> list[str | None]:
    """The worker holding each partition (waiting until they are computed)."""
    from distributed import wait

    wait(list(partitions))
    who_has = client.who_has(list(partitions))
    return [next(iter(who_has.get(p.key, ())), None) for p in partitions]


def on_holders(client: Any, fn: Any, partitions: Sequence[Any], *args: Any) -> list[Any]:
    """Submit ``fn(partition, *args)`` per partition on the worker that holds the partition.

    Left to itself the scheduler sends such a task to an idle worker while the holder is still
    generating, copying the whole partition there (worker memory then grows with the data).
    The restriction is loose, so a lost holder does not leave the task unrunnable.
    """
    return [
        client.submit(fn, p, *args, pure=False, **_pinned(holder))
        for p, holder in zip(partitions, partition_holders(partitions, client), strict=True)
    ]


def _pinned(worker: str | None) -> dict[str, Any]:
    """``client.submit`` options running a task on ``worker`` when it can (anywhere when None)."""
    return {"workers": None if worker is None else [worker], "allow_other_workers": True}


class _Feeder:
    """Hands the partition tasks out as workers free up (see :func:`per_partition_as_done`)."""

    def __init__(self, client: Any, sources: Sequence[Any], held: list[Any], queue: Any) -> None:
        self.sources, self.held, self.queue = sources, held, queue
        self.partitions: list[Any] = [None] * len(sources)
        self.index: dict[Any, int] = {}
        self.threads = {w: max(1, int(t)) for w, t in sorted(client.nthreads().items())}
        self.outstanding = dict.fromkeys(self.threads, 0)
        self.unstarted = [i for i, s in enumerate(sources) if callable(s)]
        self.runs = contiguous_runs(self.unstarted, self.threads) if self.threads else {}
        self.sent_to: dict[int, str] = {}

    def start(self, i: int, worker: str | None) -> None:
        """Start partition ``i`` (on ``worker`` when it is a function) and follow it."""
        source = self.sources[i]
        future = source(worker) if callable(source) else source
        self.partitions[i], self.index[future.key] = future, i
        if callable(source):
            self.held.append(future)
        self.queue.add(future)
        if worker is not None:
            self.outstanding[worker] += 1
            self.sent_to[i] = worker

    def feed(self) -> None:
        """Start partitions on the least busy workers, up to :func:`feed_cap` per thread."""
        left = sum(len(run) for run in self.runs.values())
        while left and self.outstanding:
            worker = min(self.outstanding, key=lambda w: self.outstanding[w] / self.threads[w])
            if self.outstanding[worker] >= feed_cap(left, sum(self.threads.values())) * self.threads[worker]:
                return
            i = next_partition(self.runs, worker)
            if i is None:
                return
            self.start(i, worker)
            left -= 1
        if not self.runs:  # no workers known: Dask places them
            for i in self.unstarted:
                self.start(i, None)
            self.unstarted.clear()

    def done(self, future: Any) -> int:
        """The index of the computed partition ``future``; its worker has a free thread again."""
        i = self.index[future.key]
        sent = self.sent_to.pop(i, None)
        if sent in self.outstanding:
            self.outstanding[sent] -= 1
        return i


def per_partition_as_done(
    client: Any,
    sources: Sequence[Any],
    held: list[Any],
    features: Sequence[str],
    whole_splits: Sequence[str],
) -> tuple[list[Any], list[Any], dict[str, list[Any]]]:
    """The partitions and, per partition, on the worker that holds it: its stats, and all its
    rows of each split in ``whole_splits`` (the pieces the shard writers take their rows from).

    ``sources`` are futures, or functions ``submit(worker)`` (see ``source_partitions``) that
    are handed out as workers free up (``feed_cap``): each worker works through its own
    contiguous run of partitions (``contiguous_runs``), then takes over the end of another's
    (``next_partition``), so the last partitions go to whichever worker is free first.

    A partition's small tasks are submitted once it is computed, pinned (loosely: a lost
    worker's tasks run elsewhere) to the worker that computed it; they outrank the partition
    tasks (priority 1), so they run between them rather than all at once after the last one.
    """
    from distributed import as_completed

    queue = as_completed()
    feeder = _Feeder(client, sources, held, queue)
    for i, source in enumerate(sources):
        if not callable(source):
            feeder.start(i, None)
    feeder.feed()
    stats: list[Any] = [None] * len(sources)
    pieces: dict[str, list[Any]] = {split: [None] * len(sources) for split in whole_splits}
    for done in queue:
        i = feeder.done(done)
        feeder.feed()  # the next partition first: its worker is free now
        # where it was computed, which need not be where it was sent (Dask may steal a queued
        # partition for an idle worker): small tasks pinned anywhere else would pull it over
        holder = next(iter(client.who_has([done]).get(done.key, ())), None)
        where = {"workers": None if holder is None else [holder], "allow_other_workers": holder is not None}
        stats[i] = client.submit(partition_stats, done, features, pure=False, priority=1, **where)
        held.append(stats[i])
        for split in whole_splits:
            pieces[split][i] = client.submit(take_rows, done, split, 0, None, pure=False, priority=1, **where)
            held.append(pieces[split][i])
    return feeder.partitions, stats, pieces


def submit_shard(
    client: Any,
    partitions: Sequence[Any],
    holders: Sequence[str | None],
    split: str,
    slices: Sequence[tuple[int, int, int]],
    url: str,
    storage_options: Mapping[str, Any] | None,
    held: list[Any],
    writer: str | None,
    priority: int,
    split_pieces: Sequence[Any] | None = None,
    layout: Mapping[str, Any] | None = None,
) -> Any:
    """Submit one shard: slice each partition where it lives, write on ``writer``.

    Only the rows the shard needs move between workers (never whole partitions). A higher
    ``priority`` (the shard's rows) runs first: a worker writes its longest shard first. The
    slicing tasks run before every write (``SLICE_PRIORITY``): a worker busy with a long write
    would otherwise keep the other waiting for the slices it holds. ``split_pieces``: each
    partition's rows of the split, already cut (one per entry of ``slices``); the writer takes
    its rows from them. ``layout``: the example column's (images and sequences).
    """
    bounds = None if split_pieces is None else [(start, stop) for _, start, stop in slices]
    pieces = (
        list(split_pieces)
        if split_pieces is not None
        else [
            client.submit(
                take_rows,
                partitions[p],
                split,
                start,
                stop,
                pure=False,
                priority=SLICE_PRIORITY + priority,
                **_pinned(holders[p]),
            )
            for p, start, stop in slices
        ]
    )
    held += pieces
    future = client.submit(
        write_shard,
        url,
        storage_options,
        pieces,
        bounds,
        layout,
        pure=False,
        priority=priority,
        **_pinned(writer),
    )
    held.append(future)
    return future
