"""A PostgreSQL server of one test's own: a throwaway cluster (initdb) in a temporary folder, on a
port of the xdist worker's range, that the test may restart or stop without touching the shared
server every other test uses."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from mopflow.base import ports


def postgres_bin() -> Path | None:
    """The folder of the newest installed PostgreSQL's server programs (initdb, pg_ctl)."""
    if found := shutil.which("initdb"):
        return Path(found).parent
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]))
    return versions[-1].parent if versions else None


@dataclass(frozen=True)
class PrivatePostgres:
    """A running throwaway server: its URL (user postgres, trust on 127.0.0.1) and controls."""

    bin: Path
    data: Path
    port: int
    as_user: tuple[str, ...]

    @property
    def url(self) -> str:
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/postgres"

    def ctl(self, *args: str) -> None:
        """pg_ctl on this cluster; the server's output goes to its log file, never to our pipes."""
        options = f"-p {self.port} -k {self.data} -c listen_addresses=127.0.0.1"
        log = str(self.data.parent / "server.log")
        self._run("pg_ctl", "-D", str(self.data), "-l", log, "-o", options, "-w", "-t", "60", *args)

    def restart(self) -> None:
        """Stop (fast: open connections are cut) and start again on the same port."""
        self.ctl("-m", "fast", "restart")

    def _run(self, program: str, *args: str) -> None:
        proc = subprocess.run(
            [*self.as_user, str(self.bin / program), *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=120,
            env={**os.environ, "LC_ALL": "C"},
        )
        if proc.returncode:
            raise RuntimeError(f"{program} {' '.join(args)} failed: {proc.stderr.decode(errors='replace')}")


@contextmanager
def private_postgres() -> Iterator[PrivatePostgres]:
    """initdb a cluster in a temporary folder, start it, yield it, stop it and remove the folder.
    As root, the server runs as the ``postgres`` user (PostgreSQL refuses to run as root), in a
    folder of its own under the system's temporary folder (pytest's are the owner's alone)."""
    bin_dir = postgres_bin()
    if bin_dir is None:
        raise FileNotFoundError("no PostgreSQL server programs (initdb) on this machine")
    as_user: Sequence[str] = ()
    root = Path(tempfile.mkdtemp(prefix="mopflow-test-pg-"))
    data = root / "pgdata"
    data.mkdir()
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        for path in (root, data):
            os.chown(path, user.pw_uid, user.pw_gid)
        as_user = ("runuser", "-u", "postgres", "--")
    server = PrivatePostgres(bin_dir, data, ports.free_port(), tuple(as_user))
    try:
        server._run("initdb", "-D", str(data), "-U", "postgres", "--auth=trust", "--no-sync")
        server.ctl("start")
        try:
            yield server
        finally:
            server.ctl("-m", "immediate", "stop")
    finally:
        shutil.rmtree(root, ignore_errors=True)
