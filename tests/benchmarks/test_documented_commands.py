"""Every benchmark command the documentation gives runs at HEAD: its options are the script's
own, with values it accepts (checked by the script's argument parsing, nothing run). A command
of an earlier commit says so: ``git switch --detach SHA && .venv/bin/python benchmarks/...``."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path
from typing import Any, NoReturn

import pytest

from tests.benchmarks.loader import BENCHMARKS_DIR, load_benchmark

DOCS = BENCHMARKS_DIR.parent / "docs"
COMMAND = re.compile(r"(git switch --detach \w+ && )?\.venv/bin/python benchmarks/(\w+)\.py([^`\n]*)")


def documented_commands(docs: Path = DOCS) -> list[tuple[str, str, list[str]]]:
    """(page, script, arguments) of every ``.venv/bin/python benchmarks/X.py ...`` in the docs,
    in code blocks (continued over ``\\`` line ends) and in inline code, without comments."""
    found = []
    for page in sorted(docs.rglob("*.md")):
        text = re.sub(r"\\\n\s*", " ", page.read_text())  # a command continued on the next line
        for match in COMMAND.finditer(text):
            if match.group(1):  # a command of an earlier commit, run there
                continue
            args = match.group(3).split("#", 1)[0]
            found.append((str(page.relative_to(docs)), match.group(2), shlex.split(args)))
    return found


class Parsed(Exception):
    """The script's arguments parsed; nothing more of it runs."""


def parses(script: str, args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Parse ``args`` as ``script`` does: through its ``parse_args`` (with the checks it makes after
    argparse) where it has one, else its ``main`` up to its argument parser, and no further."""
    module = load_benchmark(script)
    original = argparse.ArgumentParser.parse_args

    def error(self: argparse.ArgumentParser, message: str) -> NoReturn:
        raise AssertionError(f"{script}.py {shlex.join(args)}: {message}")

    monkeypatch.setattr(argparse.ArgumentParser, "error", error)
    if hasattr(module, "parse_args"):
        module.parse_args(args)
        return

    def parse_and_stop(self: argparse.ArgumentParser, *a: Any, **k: Any) -> NoReturn:
        raise Parsed(original(self, *a, **k))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    with pytest.raises(Parsed):
        module.main(args)


def test_the_docs_give_benchmark_commands() -> None:
    commands = documented_commands()
    assert len(commands) >= 20 and {script for _, script, _ in commands} >= {"search", "distill", "scale"}


@pytest.mark.parametrize(
    ("page", "script", "args"),
    documented_commands(),
    ids=[f"{page}:{script} {' '.join(args)}"[:90] for page, script, args in documented_commands()],
)
def test_a_documented_benchmark_command_runs_at_head(
    page: str, script: str, args: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    parses(script, args, monkeypatch)


def test_an_option_the_script_does_not_know_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(AssertionError, match="unrecognized arguments: --bogus"):
        parses("mop_bound", ["--bogus"], monkeypatch)
    with pytest.raises(AssertionError, match=r"unknown arm\(s\)/strateg\(ies\) \[.mop-rolling.\]"):
        parses("search", ["--strategies", "mop,mop-rolling"], monkeypatch)
