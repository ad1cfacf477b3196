"""The benchmarks' one harness (``benchmarks/studies/harness.py``): the command line every script
shares, where a run's JSON goes, the schema of every result file, and the printed table."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from studies import harness

from tests.benchmarks.loader import BENCHMARKS_DIR, RESULTS_DIR
from tests.benchmarks.test_documented_commands import parses

HEAD = subprocess.run(
    ["git", "rev-parse", "HEAD"], cwd=BENCHMARKS_DIR, capture_output=True, text=True, check=True
).stdout.strip()
SCRIPTS = sorted(p.stem for p in BENCHMARKS_DIR.glob("*.py"))


def test_the_command_line_has_quick_out_and_seeds_where_asked() -> None:
    parser = harness.parser("A benchmark.\n\nMore.", "a smoke run", seeds=3)
    args = parser.parse_args(["--quick", "--out", "x.json"])
    assert (args.quick, args.out, args.seeds) == (True, Path("x.json"), 3)
    assert parser.description == "A benchmark."
    assert "--seeds" not in harness.parser(None, "a smoke run").format_help()


def test_a_full_run_writes_to_the_results_and_a_quick_one_never(tmp_path: Path) -> None:
    recorded = RESULTS_DIR / "x.json"
    assert harness.results_file(None, False, recorded) == recorded
    assert harness.results_file(tmp_path, True, recorded) == tmp_path / "x.json"
    assert harness.results_file(tmp_path / "y.json", False, recorded) == tmp_path / "y.json"
    for out in (None, RESULTS_DIR, RESULTS_DIR / "x.json"):  # a quick run's figures are not recorded
        quick = harness.results_file(out, True, recorded)
        assert quick.name == "x.json" and quick.parent != RESULTS_DIR and quick.parent.is_dir()


def test_a_report_records_commit_machine_date_config_and_seeds(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    harness.write_report(
        out, {"benchmark": "x", "commit": "stale", "rows": [1]}, config={"p": Path("a")}, seeds=[0, 1]
    )
    report = json.loads(out.read_text())
    assert list(report) == ["commit", "benchmark", "date", "machine", "config", "seeds", "rows"]
    assert report["commit"].removesuffix("+dirty") == HEAD  # the commit it was measured at
    assert {"cpu_count", "platform", "python", "torch"} <= set(report["machine"])
    assert (report["config"], report["seeds"], report["rows"]) == ({"p": "a"}, [0, 1], [1])


def test_outside_a_checkout_the_commit_is_unknown(tmp_path: Path) -> None:
    assert harness.commit(tmp_path) == "unknown"


def test_a_table_prints_every_row_and_returns_its_lines(capsys: pytest.CaptureFixture[str]) -> None:
    lines = harness.print_table(
        ["model", "test_acc"], [["ensemble", "0.9612"], ["student", None]], title="accuracy"
    )
    assert capsys.readouterr().out.splitlines() == lines
    assert lines[0].strip() == "accuracy" and lines[1].split() == ["model", "test_acc"]
    assert [line.split() for line in lines[-2:]] == [["ensemble", "0.9612"], ["student", "-"]]
    assert lines[-1].endswith("-") and lines[-2].endswith("0.9612")  # the figures right-aligned


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_benchmark_takes_the_shared_options(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each script's command line is the harness's: ``--quick`` and ``--out`` parse (nothing run)."""
    parses(script, ["--quick", "--out", "quick.json"], monkeypatch)


def test_every_recorded_result_names_the_commit_it_was_measured_at() -> None:
    for path in sorted(RESULTS_DIR.glob("*.json")):
        report = json.loads(path.read_text())
        commit = report.get("commit", report.get("recorded_in_commit", ""))
        assert len(commit.removesuffix("+dirty")) >= 7, f"{path.name} records no commit"
