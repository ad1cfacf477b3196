"""`mopflow run` on this machine: one DAG run through ``dag.test()`` that stops when asked and
can be resumed.

Every run has a record, ``$MOPFLOW_HOME/runs/<run key>.json`` (its key, Airflow run id, logical
date, conf and state). While the DAG runs, this process owns SIGINT and SIGTERM: the first one
asks the run to stop (``mopflow.base.stopping``): the stage in progress is interrupted, its Dask cluster
closed, its MLflow runs end ``KILLED``, no task is retried, ``finalize`` closes the rest and
the process exits with 130 (SIGINT) or 143 (SIGTERM) within ``MOPFLOW_STOP_TIMEOUT_S``
(default 30 s). A second signal stops at once. ``--resume`` runs the same DAG run again (same
logical date, so the same run id and run key): shards are reused, the study continues (trials
in flight resume from their checkpoints), MLflow runs are reopened, finished stages are quick.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from mopflow.base import stopping
from mopflow.base.tag_names import RUN_KEY
from mopflow.infra.cli.errors import CliError

log = logging.getLogger("mopflow")
FailDagRun = Callable[[str, str], None]  # (dag_id, run_id): mark that DAG run failed

STOP_TIMEOUT_ENV = "MOPFLOW_STOP_TIMEOUT_S"
DEFAULT_STOP_TIMEOUT_S = 30.0
_TERMINAL: list[TextIO] = []  # the terminal while the run's output goes to its log file


@dataclass
class RunRecord:
    """What `mopflow run` needs to resume a run, and what `mopflow runs` lists."""

    run_key: str
    dag_id: str
    airflow_run_id: str
    logical_date: str
    conf: dict[str, Any]
    state: str
    started_at: str
    ended_at: str = ""
    resumed: int = 0
    message: str = ""
    # folders (or URL prefixes) this run may read beside MOPFLOW_DATA_ROOTS (`--data-root`); a
    # resume keeps them
    data_roots: list[str] = field(default_factory=list)


def records_dir(home: str) -> Path:
    return Path(home) / "runs"


def save_record(home: str, record: RunRecord) -> None:
    """Write the record atomically (a stop can come at any time)."""
    folder = records_dir(home)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{record.run_key}.json.tmp"
    tmp.write_text(json.dumps(asdict(record), indent=2, sort_keys=True, default=str))
    tmp.replace(folder / f"{record.run_key}.json")


def load_records(home: str) -> list[RunRecord]:
    """Every run record, newest first."""
    records = []
    for file in records_dir(home).glob("*.json"):
        try:
            records.append(RunRecord(**json.loads(file.read_text())))
        except (OSError, ValueError, TypeError):
            log.warning("runs: skipping unreadable run record %s", file)
    return sorted(records, key=lambda r: r.started_at, reverse=True)


def find_resumable(home: str, run_key: str | None) -> RunRecord:
    """The run to resume: ``run_key``'s, or the latest that did not succeed."""
    records = load_records(home)
    if run_key:
        match = [r for r in records if r.run_key == run_key]
        if not match:
            known = [r.run_key for r in records[:10]]
            raise CliError(f"no run with key {run_key!r} in {records_dir(home)}; recent: {known}")
        if match[0].state == "succeeded":
            raise CliError(f"run {run_key} already succeeded; there is nothing to resume")
        return match[0]
    unfinished = [r for r in records if r.state != "succeeded"]
    if not unfinished:
        raise CliError(f"no unfinished run to resume in {records_dir(home)} (see `mopflow runs`)")
    return unfinished[0]


def stop_timeout_s() -> float:
    """Seconds a stop may take before the process ends at once (``MOPFLOW_STOP_TIMEOUT_S``)."""
    raw = os.environ.get(STOP_TIMEOUT_ENV, str(DEFAULT_STOP_TIMEOUT_S))
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 1.0 <= value <= 3600.0:
        raise CliError(f"{STOP_TIMEOUT_ENV}={raw!r} must be a number of seconds between 1 and 3600")
    return value


def exit_code(signum: int | None) -> int:
    """The shell's convention: 128 + the signal's number (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + int(signum or signal.SIGINT)


def resume_hint(record: RunRecord) -> str:
    return f"resume it with: mopflow run --resume {record.run_key}"


@contextlib.contextmanager
def owned_signals(on_first: Callable[[int], None], on_second: Callable[[int], None]) -> Iterator[None]:
    """Handle SIGINT and SIGTERM here while the block runs, whatever else tries to install its
    own handlers meanwhile (Airflow's task runner sets one for SIGTERM in every task it runs)."""
    real_signal = signal.signal
    owned = (signal.SIGINT, signal.SIGTERM)

    def handler(signum: int, frame: Any) -> None:
        if stopping.stop_requested():
            on_second(signum)
        else:
            on_first(signum)

    def guarded(signum: Any, action: Any) -> Any:
        if signum in owned and threading.current_thread() is threading.main_thread():
            return handler  # ours stays installed
        return real_signal(signum, action)

    previous = {s: real_signal(s, handler) for s in owned}
    signal.signal = guarded  # type: ignore[assignment]
    try:
        yield
    finally:
        signal.signal = real_signal
        for s, action in previous.items():
            real_signal(s, action)


def end_child_processes(grace_s: float = 5.0) -> None:
    """Terminate this process's children (Dask nannies and workers, servers), then kill what is left."""
    import psutil

    children = psutil.Process().children(recursive=True)
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=grace_s)
    for child in alive:
        with contextlib.suppress(psutil.Error):
            child.kill()


def kill_leftover_runs(tracking_uri: str, experiment: str, run_key: str) -> int:
    """End this pipeline run's MLflow runs still RUNNING as KILLED; how many there were."""
    from mopflow.base.tracking import MlflowTracker

    tracker = MlflowTracker(tracking_uri, experiment)
    leftovers = [r for r in tracker.find_runs({RUN_KEY: run_key}) if r.info.status == "RUNNING"]
    for run in leftovers:
        tracker.end_run(run.info.run_id, "KILLED")
    return len(leftovers)


@dataclass
class RunOutput:
    """Where a run's output goes: ``terminal`` (the progress view, the run key) and, unless the run
    is verbose, a log file that this process's stdout and stderr point to."""

    terminal: TextIO
    log_path: Path | None = None

    def settle(self, log_file: Path) -> None:
        """The run's key is known: its log becomes ``log_file`` (an earlier attempt's log first,
        then what this attempt wrote so far). The file keeps its inode, so the Dask workers
        started meanwhile, which write to the same descriptors, keep writing to it."""
        if self.log_path is None or self.log_path == log_file:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        if log_file.exists():  # a resumed run: its earlier attempts' log comes first
            so_far = self.log_path.read_bytes()
            with self.log_path.open("r+b") as sink:
                sink.write(log_file.read_bytes())
                sink.write(so_far)
        os.replace(self.log_path, log_file)
        self.log_path = log_file


@contextlib.contextmanager
def run_output(home: str, verbose: bool) -> Iterator[RunOutput]:
    """A run's output from its first step (the Dask cluster's start, Airflow's migration) to its
    last (the cluster's shutdown). Unless ``verbose``, this process's stdout and stderr (file
    descriptors 1 and 2, so Airflow's, Dask's and the workers' output too) go to a log file in
    ``$MOPFLOW_HOME/logs`` (``starting-<pid>.log`` until :meth:`RunOutput.settle` names it after
    the run), and the terminal keeps only what mopflow writes there."""
    if verbose:
        yield RunOutput(sys.stdout)
        return
    logs = Path(home) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    starting = logs / f"starting-{os.getpid()}.log"
    sys.stdout.flush()
    sys.stderr.flush()
    saved = (os.dup(1), os.dup(2))
    terminal = os.fdopen(os.dup(saved[0]), "w", buffering=1)
    _TERMINAL[:] = [terminal]
    with starting.open("ab") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
    output = RunOutput(terminal, starting)
    try:
        yield output
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        _TERMINAL.clear()
        terminal.close()
        if output.log_path == starting:  # it stopped before the run had a key
            print(f"mopflow run: its start's log: {starting}", file=sys.stderr)


def log_file_of(home: str, run_key: str) -> Path:
    """Where a run's full log goes: ``$MOPFLOW_HOME/logs/<run key>.log``."""
    return Path(home) / "logs" / f"{run_key}.log"


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def format_runs(records: list[RunRecord]) -> str:
    """The `mopflow runs` table."""
    if not records:
        return "no runs yet (start one with `mopflow run`)"
    lines = [f"{'run key':<14} {'state':<10} {'started':<21} {'ended':<21} resumed  note"]
    for r in records:
        note = r.message if len(r.message) <= 60 else r.message[:57] + "..."
        lines.append(
            f"{r.run_key:<14} {r.state:<10} {r.started_at:<21} {r.ended_at or '-':<21} {r.resumed:>7}  {note}"
        )
    return "\n".join(lines)


class RunEnded(Exception):
    """A run that ended without its summary; ``code`` is the exit code, the message says why."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class RunStopped(RunEnded):
    """The run stopped on a signal (exit 130/143); the message says how to resume."""


class RunFailed(RunEnded):
    """The run failed: exit 2 when its input was bad (a retry cannot help), else 1."""


def failure_message(run_key: str, failure: Mapping[str, Any] | None, state: str) -> str:
    """The root cause of a failed run (the failed stage's error), and how to resume it."""
    cause = (
        f"the {failure['stage']} stage failed: {failure['error']}: {failure['message']}"
        if failure
        else f"the DAG run ended in state {state} (see the task logs above)"
    )
    return f"run {run_key} failed: {cause}\n(after fixing the cause: mopflow run --resume {run_key})"


def stop_now(
    record: RunRecord, home: str, tracking: tuple[str, str], fail_dag_run: FailDagRun, signum: int
) -> None:
    """The hard stop (second signal, or the stop took too long): end the children, mark the MLflow
    runs KILLED, the DAG run failed (``fail_dag_run``) and the record stopped, print how to resume
    and leave at once."""
    out = _TERMINAL[0] if _TERMINAL else sys.stderr
    if out.isatty():  # the progress bars hide the cursor, and os._exit leaves them no time to show it again
        out.write("\x1b[?25h")
    print(f"\nmopflow: stopping at once ({signal.Signals(signum).name})", file=out, flush=True)
    with contextlib.suppress(Exception):
        end_child_processes(grace_s=2.0)
    with contextlib.suppress(Exception):
        kill_leftover_runs(*tracking, record.run_key)
    with contextlib.suppress(Exception):
        fail_dag_run(record.dag_id, record.airflow_run_id)
    record.state, record.ended_at = "stopped", now_iso()
    record.message = f"stopped at once by {signal.Signals(signum).name}"
    with contextlib.suppress(Exception):
        save_record(home, record)
    print(f"mopflow: run {record.run_key} stopped; {resume_hint(record)}", file=out, flush=True)
    sys.stderr.flush()
    os._exit(exit_code(stopping.stop_signal() or signum))


def stopping_handlers(
    record: RunRecord, home: str, tracking: tuple[str, str], timeout_s: float, fail_dag_run: FailDagRun
) -> tuple[Callable[[int], None], Callable[[int], None]]:
    """The first-signal and second-signal handlers of a run (``fail_dag_run`` marks a DAG run
    failed in Airflow's DB: the operator's face, which may import Airflow, passes it)."""

    def first(signum: int) -> None:
        from mopflow.base import progress

        stopping.request_stop(signum)
        progress.publish("stop", signal=signal.Signals(signum).name, timeout_s=timeout_s)
        log.warning(
            "mopflow run: %s received: stopping run %s (at most %.0f s; send it again to stop at once)",
            signal.Signals(signum).name,
            record.run_key,
            timeout_s,
        )
        timer = threading.Timer(timeout_s, stop_now, (record, home, tracking, fail_dag_run, signum))
        timer.daemon = True
        timer.start()
        if not stopping.cooperative():  # else the section in progress stops on its own, cleanly
            raise stopping.PipelineStopped(f"stopped by {signal.Signals(signum).name}")

    def second(signum: int) -> None:
        stop_now(record, home, tracking, fail_dag_run, signum)

    return first, second


def started_record(dag_id: str, conf: Mapping[str, Any], run_id: str, logical: datetime) -> RunRecord:
    """A new run's record: its logical date, its Airflow run id (as dag.test makes it) and its key."""
    from mopflow.pipeline.context import make_run_key

    return RunRecord(
        run_key=make_run_key(dag_id, run_id),
        dag_id=dag_id,
        airflow_run_id=run_id,
        logical_date=logical.isoformat(),
        conf=dict(conf),
        state="running",
        started_at=now_iso(),
    )
