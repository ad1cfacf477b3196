"""The edges that start and stop the stack's processes: each service in its own process group
with its log file, recognised later by pid and start time (a reused pid is never signalled), and
polled until its health checks pass."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

from mopflow.infra.stack.config import StackError
from mopflow.infra.stack.probes import probe_all
from mopflow.infra.stack.services import ServiceRecord, ServiceSpec


def _process(rec: ServiceRecord) -> object | None:
    """The live psutil process of a record, or None (gone, or the pid now belongs to another process)."""
    import psutil

    try:
        proc = psutil.Process(rec.pid)
        if abs(proc.create_time() - rec.create_time) > 1.0 or proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except psutil.Error:
        return None


def is_running(rec: ServiceRecord) -> bool:
    """Whether the recorded process still runs (same pid and start time)."""
    return _process(rec) is not None


def spawn(spec: ServiceSpec, log_dir: Path) -> ServiceRecord:
    """Start one service in its own session (process group), output appended to its log file."""
    import psutil

    log_dir.mkdir(parents=True, exist_ok=True)
    log_file = log_dir / f"{spec.name}.log"
    with open(log_file, "ab") as log:
        log.write(f"\n=== mopflow up {datetime.now(UTC).isoformat()}: {' '.join(spec.argv)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            list(spec.argv),
            env=spec.env,
            cwd=log_dir,  # anything a service writes relative to its cwd stays in the stack's folder
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: `down` signals the whole group
        )
    return ServiceRecord(
        name=spec.name,
        pid=proc.pid,
        create_time=psutil.Process(proc.pid).create_time(),
        argv=spec.argv,
        log=str(log_file),
        url=spec.url,
        checks=spec.checks,
        ports=spec.ports,
    )


def stop_services(
    records: Sequence[ServiceRecord], grace_s: float, say: Callable[[str], None] = lambda _: None
) -> list[str]:
    """SIGTERM every recorded process group and each process's descendants, wait up to ``grace_s``,
    then SIGKILL what is left. Returns the names of the services that were running."""
    import psutil

    victims: list[tuple[str, psutil.Process]] = []
    running: list[ServiceRecord] = []
    for rec in records:
        root = _process(rec)
        if root is None:  # gone, or its pid now belongs to someone else: never signal it
            continue
        assert isinstance(root, psutil.Process)
        running.append(rec)
        # Collect descendants first: once the parent dies they are re-parented and hard to find.
        with contextlib.suppress(psutil.Error):
            victims.extend((rec.name, child) for child in root.children(recursive=True))
        victims.append((rec.name, root))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(rec.pid, signal.SIGTERM)  # pgid == pid: spawned with start_new_session
    for _, proc in victims:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs([proc for _, proc in victims], timeout=grace_s)
    if alive:
        late = sorted({f"{name} (pid {proc.pid})" for name, proc in victims if proc in alive})
        say(f"still running {grace_s:.0f} s after SIGTERM, sent SIGKILL: {', '.join(late)}")
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
    for rec in running:  # whatever joined a group during the shutdown
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(rec.pid, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=10)
    return [rec.name for rec in running]


def _log_tail(path: str, chars: int = 3000) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - chars))
            return handle.read().decode(errors="replace")
    except OSError:
        return ""


def wait_healthy(
    records: Sequence[ServiceRecord],
    timeout_s: float,
    say: Callable[[str], None],
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Poll every service's checks until all pass; fail early, with its log tail, if one dies."""
    pending = {rec.name: rec for rec in records}
    deadline = clock() + timeout_s
    last: dict[str, str] = {}
    while pending:
        for name, rec in list(pending.items()):
            if not is_running(rec):
                raise StackError(
                    f"{name} exited during start-up; last lines of {rec.log}:\n{_log_tail(rec.log)}"
                )
            ok, detail = probe_all(rec.checks)
            if ok:
                say(f"  {name:17} healthy   {rec.url}")
                del pending[name]
            else:
                last[name] = detail
        if not pending:
            return
        if clock() > deadline:
            waiting = "; ".join(f"{n}: {last.get(n, '?')}" for n in pending)
            raise StackError(
                f"not healthy after {timeout_s:.0f} s: {waiting} (logs in {Path(records[0].log).parent})"
            )
        sleep(1.0)
