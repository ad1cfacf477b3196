"""`mopflow` as a person sees it: run in a pseudo-terminal, its screen read back as lines."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")
# a stage's progress row: a spinner or a mark, the stage, its bar
PROGRESS_ROW = re.compile(r"^\S\s+(shard|search|ensemble|distill|register)\s+━")
# what a library's log line or a warning looks like on a terminal
FOREIGN = re.compile(
    r"distributed\.|\[info|\b(DEBUG|INFO|WARNING|ERROR)\b|Warning:|Traceback|^\[\d{4}-\d\d-\d\d"
)


def run_in_terminal(
    command: Sequence[str], env: Mapping[str, str], cwd: Path, timeout: float
) -> tuple[int, str]:
    """Run ``command`` with a pseudo-terminal as its stdin, stdout and stderr (so it draws its
    live progress as it does for a person); its exit code and everything it wrote."""
    primary, secondary = pty.openpty()
    proc = subprocess.Popen(
        list(command),
        stdin=secondary,
        stdout=secondary,
        stderr=secondary,
        env={**env, "TERM": "xterm-256color", "COLUMNS": "120", "LINES": "40"},
        cwd=cwd,
        close_fds=True,
    )
    os.close(secondary)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([primary], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(primary, 65536)
                except OSError:  # the child closed the terminal (EIO)
                    break
                if not chunk:
                    break
                chunks.append(chunk)
            elif proc.poll() is not None:
                break
        else:
            proc.kill()
            raise AssertionError(f"{command[:4]} still running after {timeout} s")
        return proc.wait(timeout=60), b"".join(chunks).decode(errors="replace")
    finally:
        os.close(primary)


def screen_lines(output: str) -> list[str]:
    """The non-blank lines a terminal showed, escape sequences removed, each redraw a line."""
    plain = ANSI.sub("", output)
    return [line.rstrip() for line in re.split(r"\r\n|\r|\n", plain) if line.strip()]


def before_first_progress(lines: Sequence[str]) -> list[str]:
    """The lines shown before the first stage's progress row."""
    for index, line in enumerate(lines):
        if PROGRESS_ROW.match(line):
            return list(lines[:index])
    raise AssertionError(f"no progress row in {len(lines)} lines: {list(lines[-20:])}")


def foreign_lines(lines: Sequence[str]) -> list[str]:
    """Lines that look like a library's log or a warning, not like mopflow's own."""
    return [line for line in lines if FOREIGN.search(line)]
