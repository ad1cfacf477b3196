"""What every benchmark script shares about its output: where its JSON goes, the machine it ran
on, how a model's architecture is printed, and the options of a benchmark that is a pipeline run."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def results_file(out: Path | None, quick: bool, recorded: Path) -> Path | None:
    """Where the JSON goes: ``--out`` (a folder, where it is named as ``recorded`` is, or a
    ``.json`` file), else ``recorded`` in ``benchmarks/results/``; a ``--quick`` run writes it
    only to ``--out``."""
    if out is None:
        return None if quick else recorded
    return out if out.suffix == ".json" else out / recorded.name


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


def stamped(report: dict[str, Any]) -> dict[str, Any]:
    """``report`` with the commit it was measured at (first, for a reader of the file)."""
    return {"commit": commit()} | {k: v for k, v in report.items() if k != "commit"}


def write_report(out: Path | None, report: dict[str, Any], lead: str = "") -> None:
    """Write the report's JSON to ``out`` and say where, or say it was not written (a ``--quick``
    run without ``--out``); ``lead`` goes before the line (``"\\n"`` after a table)."""
    if out is None:
        print(f"{lead}not written (--quick writes its JSON only to --out)")
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(stamped(report), indent=2) + "\n")
    print(f"{lead}wrote {out}")


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


def machine(load_before: Sequence[float]) -> dict[str, Any]:
    """The machine a benchmark ran on, with the load average before and after it (other
    processes on a shared machine inflate wall times)."""
    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "loadavg_before": list(load_before),
        "loadavg_after": list(os.getloadavg()),
    }


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
