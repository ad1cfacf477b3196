"""The benchmarks' one harness: their command line (``--quick``, ``--out``, ``--seeds``, each
script adding its own options), where their JSON goes, the schema every result file shares (the
commit, the machine, the date, the config and the seeds), and how a table is printed.

A full run writes into ``benchmarks/results/`` unless ``--out`` (a folder, or a ``.json`` file)
says otherwise; a ``--quick`` run writes into ``--out`` or, without it, a fresh temporary folder,
never into ``benchmarks/results/``."""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, is_dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

NO_SEEDS = -1  # ``parser(seeds=NO_SEEDS)``: the benchmark has no seeds to choose


def parser(
    doc: str | None, quick: str, *, seeds: int | None = NO_SEEDS, seeds_help: str = "seeds"
) -> argparse.ArgumentParser:
    """The benchmark's argument parser: described by the first paragraph of ``doc`` (the script's
    docstring), with ``--quick`` (a smoke run: ``quick`` says what it runs), ``--out`` and, unless
    ``seeds`` is :data:`NO_SEEDS`, ``--seeds N`` (default ``seeds``; None: the script's own default,
    which may differ under ``--quick``). The script adds its own options to it."""
    described = argparse.ArgumentParser(description=doc.split("\n\n")[0] if doc else None)
    described.add_argument("--quick", action="store_true", help=f"smoke test: {quick}")
    described.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder (or .json file) for the JSON; default benchmarks/results/, a temporary folder with --quick",
    )
    if seeds != NO_SEEDS:
        described.add_argument("--seeds", type=int, default=seeds, help=seeds_help)
    return described


def results_file(out: Path | None, quick: bool, recorded: Path) -> Path:
    """Where the JSON goes: ``--out`` (a folder, where it is named as ``recorded`` is, or a
    ``.json`` file), else ``recorded`` in ``benchmarks/results/``. A ``--quick`` run never writes
    into ``benchmarks/results/``: without another ``--out`` its file goes into a fresh temporary
    folder."""
    chosen = recorded if out is None else out if out.suffix == ".json" else out / recorded.name
    if quick and chosen.parent.resolve() == recorded.parent.resolve():
        return Path(tempfile.mkdtemp(prefix="mopflow-bench-")) / recorded.name
    return chosen


REPO = Path(__file__).resolve().parents[2]


def commit(repo: Path = REPO) -> str:
    """The commit the figures were measured at, ``+dirty`` when the code differed from it (tracked
    files other than ``benchmarks/results/``, which a benchmark running beside may be writing), or
    ``unknown`` outside a git checkout."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results"],
            cwd=repo,
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if changed else "")


def machine(load_before: Sequence[float] | None = None) -> dict[str, Any]:
    """The machine a benchmark ran on: CPUs, platform, Python and torch, and with ``load_before``
    the load average before and after the run (other processes on a shared machine inflate wall
    times)."""
    import torch

    found: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    if load_before is not None:
        found |= {"loadavg_before": list(load_before), "loadavg_after": list(os.getloadavg())}
    return found


def now() -> str:
    """The date and time in UTC, to the second, as a result file records it."""
    return datetime.now(UTC).isoformat(timespec="seconds")


def jsonable(config: Any) -> Any:
    """``config`` (a namespace, a dataclass, a mapping of them) as JSON can hold it: paths as
    strings, tuples as lists."""
    if isinstance(config, argparse.Namespace):
        config = vars(config)
    elif is_dataclass(config) and not isinstance(config, type):
        config = asdict(config)
    if isinstance(config, Mapping):
        return {str(k): jsonable(v) for k, v in config.items()}
    if isinstance(config, list | tuple | set | frozenset):
        return [jsonable(v) for v in config]
    if isinstance(config, Path):
        return str(config)
    return config


def stamped(
    report: Mapping[str, Any], config: Any = None, seeds: Sequence[int] | None = None
) -> dict[str, Any]:
    """``report`` in the schema every result file shares: the commit it was measured at (first,
    for a reader of the file), the benchmark, the date, the machine (the report's own figures of
    it kept), the config (``config``, else the report's) and the seeds (``seeds``, else the
    report's; None: a benchmark without seeds), then the report's own figures."""
    head: dict[str, Any] = {
        "commit": commit(),
        "benchmark": report.get("benchmark"),
        "date": report.get("date") or now(),
        "machine": machine() | dict(report.get("machine") or {}),
        "config": jsonable(config) if config is not None else report.get("config"),
        "seeds": list(seeds) if seeds is not None else report.get("seeds"),
    }
    return head | {k: v for k, v in report.items() if k not in head}


def dumps(report: Mapping[str, Any]) -> str:
    """The report's JSON as the result files hold it."""
    return json.dumps(report, indent=2) + "\n"


def write_report(
    out: Path | None,
    report: Mapping[str, Any],
    lead: str = "",
    *,
    config: Any = None,
    seeds: Sequence[int] | None = None,
) -> None:
    """Write the report, :func:`stamped` with ``config`` and ``seeds``, as JSON to ``out`` and say
    where; ``lead`` goes before the line (``"\\n"`` after a table). ``out`` None: not written."""
    if out is None:
        print(f"{lead}not written")
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dumps(stamped(report, config, seeds)))
    print(f"{lead}wrote {out}")


def table_lines(columns: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> list[str]:
    """``rows`` under ``columns`` as the lines of a plain-text table (rich's): the first column
    left-aligned, the others right-aligned, None shown as ``-``. Cells print as ``str`` gives them:
    format numbers before (``f"{x:.3f}"``) for a fixed precision."""
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for index, name in enumerate(columns):
        table.add_column(name, justify="left" if index == 0 else "right")
    for row in rows:
        table.add_row(*("-" if v is None else str(v) for v in row))
    console = Console(file=io.StringIO(), width=250, color_system=None, force_terminal=False)
    console.print(table)
    text = console.file.getvalue()  # type: ignore[attr-defined]
    return [line.rstrip() for line in text.splitlines() if line.strip()]


def print_table(columns: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> list[str]:
    """Print ``rows`` under ``columns`` as :func:`table_lines` gives them, and return the lines
    (a report keeps what was printed)."""
    lines = table_lines(columns, rows, title)
    print("\n".join(lines))
    return lines


def arch_params(arch: Any) -> str:
    """The architecture's own parameters, as ``width 16 depth 3``."""
    return " ".join(f"{k} {v}" for k, v in arch.params.items())


def cpu() -> dict[str, str]:
    """The CPU the figures come from: its model, and the instruction set torch's kernels use here
    (a VM moved to another host may train at another speed, with other rounding: a search's
    accuracies near its target, and so the trial that reaches it first, can change with it)."""
    import torch

    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as info:
            model = next(
                (line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), model
            )
    except OSError:
        pass
    return {"model": model, "torch_capability": str(torch.backends.cpu.get_cpu_capability())}


def add_pipeline_options(parser: argparse.ArgumentParser) -> None:
    """``--set KEY=VALUE`` (after ``--quick``'s) and ``--home DIR`` for a benchmark whose run is a
    whole ``mopflow run``."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config key (as mopflow run --set, after --quick's); not the demo any more",
    )
    parser.add_argument(
        "--home", type=Path, default=None, help="run in this MOPFLOW_HOME and keep it (with summary.json)"
    )
