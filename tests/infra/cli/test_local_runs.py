"""`mopflow run` stops on SIGINT/SIGTERM and resumes where it stopped (real processes)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from mopflow.base import stopping
from mopflow.base.settings import Settings
from mopflow.infra.cli import CliError, local_runs
from tests.dags.test_end_to_end import REPO, _env
from tests.infra.cli.terminal import (
    PROGRESS_ROW,
    before_first_progress,
    foreign_lines,
    run_in_terminal,
    screen_lines,
)

# The product's promise: a stopped run exits within MOPFLOW_STOP_TIMEOUT_S, ending at once when a
# clean stop takes longer. The tests give it a minute (a loaded 2-CPU machine's clean stop can take
# over the default 30 s) and allow the forced exit's few seconds on top.
STOP_TIMEOUT_S = 60
STOP_BOUND_S = STOP_TIMEOUT_S + 10.0
CONF = {
    "num_samples": 4000,  # epochs of a few seconds: a stop lands inside one
    "n_shards": 2,
    "n_trials": 3,
    "parallel_trials": 2,
    "epochs": 4,
    "min_resource": 4,  # no pruning: every trial trains all its epochs
    "top_k": 2,
    "student_family": "cnn",
    "distill_epochs": 2,  # the second stop lands as the students start training
    "munge_multiplier": 1,
    "model_name": "stop",
    "max_gap_to_ensemble": 100,
}


def _start(home: Path, *args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], Path]:
    log = home.parent / f"run-{time.monotonic_ns()}.log"
    handle = log.open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mopflow.infra.cli", "run", "--verbose", *args],
        cwd=REPO,
        env=_env(home) | {"MOPFLOW_STOP_TIMEOUT_S": str(STOP_TIMEOUT_S)} | (env or {}),
        stdout=handle,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return proc, log


def _wait_for(log: Path, needle: str, proc: subprocess.Popen[str], timeout: float = 600) -> None:
    """Return once ``needle`` is in the run's output (read as it grows, checked every 20 ms);
    fail if the run ends first or nothing shows within ``timeout`` (a hang)."""
    deadline = time.monotonic() + timeout
    seen, tail = 0, ""
    with log.open("rb") as handle:
        while True:
            handle.seek(seen)
            chunk = handle.read()
            seen += len(chunk)
            tail = tail[-len(needle) :] + chunk.decode(errors="replace")
            if needle in tail:
                return
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, f"{needle!r} not seen in {timeout} s"
            time.sleep(0.02)


def _stop(proc: subprocess.Popen[str], signum: int) -> tuple[int, float, list[int]]:
    """Send ``signum``; the exit code, the seconds it took, and the children still alive after."""
    children = psutil.Process(proc.pid).children(recursive=True)
    assert children, "the run has started its Dask workers"
    started = time.monotonic()
    proc.send_signal(signum)
    code = proc.wait(timeout=STOP_BOUND_S + 30)
    took = time.monotonic() - started
    alive = [c.pid for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    return code, took, alive


def _mlflow_runs(home: Path, run_key: str) -> dict[str, tuple[str, str]]:
    from mopflow.base.tracking import MlflowTracker

    tracker = MlflowTracker(f"sqlite:///{home / 'mlflow' / 'mlflow.db'}", "mopflow")
    return {
        r.info.run_name: (r.info.run_id, r.info.status)
        for r in tracker.find_runs({"mopflow.run_key": run_key})
    }


def _record(home: Path) -> local_runs.RunRecord:
    (record,) = local_runs.load_records(str(home))
    return record


def _resume(home: Path, summary: Path, times: int = 1) -> dict:
    """Resume the run in a pseudo-terminal, as a person would, and check what the screen shows:
    a few lines of mopflow's own before the first progress row, no library's log or warning
    anywhere before the summary, and a bounded number of lines."""
    code, output = run_in_terminal(
        [sys.executable, "-m", "mopflow.infra.cli", "run", "--resume", "--summary-json", str(summary)],
        _env(home),
        REPO,
        timeout=900,
    )
    lines = screen_lines(output)
    assert code == 0, lines[-60:]
    assert any(f"resumed          : {times} time(s)" in line for line in lines), lines[-30:]
    shown = lines[: lines.index("mopflow run summary")]
    first = before_first_progress(shown)
    assert 1 <= len(first) <= 15 and any(line.startswith("mopflow run: ") for line in first), first
    assert foreign_lines(shown) == [], foreign_lines(shown)[:10]
    # redraws of the progress rows aside, the screen has a line per stage message and trial
    messages = {line for line in shown if not PROGRESS_ROW.match(line)}
    assert len(messages) <= 40, sorted(messages)
    return dict(json.loads(summary.read_text()))


@pytest.mark.slow
def test_a_run_stopped_mid_search_then_mid_distill_resumes_each_time_and_finishes(tmp_path: Path) -> None:
    """SIGINT in the search, SIGTERM in the distillation of the resumed run, then a second resume
    finishes the same run: one pipeline serves both stops (each stop costs a whole run's start)."""
    home = tmp_path / "home"
    config = tmp_path / "conf.json"
    config.write_text(json.dumps(CONF))
    proc, log = _start(home, "--config", str(config))
    # the third trial starts as the first ends: past its first epoch, it has three more to go
    # (the second trial may end before the stop lands on a loaded machine)
    _wait_for(log, "task: trial-0002 epoch 1/4 val_acc", proc)
    code, took, alive = _stop(proc, signal.SIGINT)
    output = log.read_text()
    assert code == 130, output[-3000:]
    assert took < STOP_BOUND_S, took
    assert alive == []
    record = _record(home)
    assert record.state == "stopped" and f"mopflow run --resume {record.run_key}" in output
    # the epochs in flight were told to checkpoint at their next batch (an epoch that reached its
    # end first comes back whole)
    assert re.search(r"task: stopping; [1-9]\d* epoch\(s\) in flight checkpoint at their next batch", output)
    saved = re.findall(r"task: (trial-\d+) saved at batch \d+ of epoch (\d+)", output)
    before = _mlflow_runs(home, record.run_key)
    assert all(status != "RUNNING" for _, status in before.values()), before
    assert before[f"pipeline-{record.run_key}"][1] == "KILLED" and before["search"][1] == "KILLED"

    # The resumed run goes on with the trials in flight, and is stopped as its students train.
    proc, log = _start(home, "--resume")
    _wait_for(log, "distill: training the student (", proc)
    code, _, alive = _stop(proc, signal.SIGTERM)
    output = log.read_text()
    assert code == 143, output[-3000:]
    # it stopped by itself, within the stop timeout: no hard stop
    assert "stopping at once" not in output and alive == [], output[-3000:]
    # the trials in flight at the first stop were retried from their checkpoints, not afresh
    assert "was left RUNNING by an earlier attempt; retrying its params from its last checkpoint" in output
    for model, epoch in saved:  # it goes on inside the epoch it stopped in, not at its start
        assert re.search(rf"task: {model} resumes at epoch {epoch} \(step \d+\)", output), (model, epoch)
    runs = _mlflow_runs(home, record.run_key)
    assert runs["distill"][1] == "KILLED" and runs["ensemble"][1] == "FINISHED"
    assert runs["search"][1] == "FINISHED"
    assert all(status != "RUNNING" for _, status in runs.values()), runs
    assert _record(home).state == "stopped"

    summary = _resume(home, tmp_path / "summary.json", times=2)
    after = _mlflow_runs(home, record.run_key)
    assert summary["run_key"] == record.run_key and summary["resumed"] == 2
    assert summary["trials"]["COMPLETE"] + summary["trials"]["PRUNED"] == CONF["n_trials"]
    # trials finished before the first stop keep their MLflow runs; nothing is left RUNNING
    for name, (run_id, _) in before.items():
        if name.startswith("trial-"):
            assert after[name] == (run_id, "FINISHED")
    assert all(status == "FINISHED" for _, status in after.values()), after
    assert after[f"pipeline-{record.run_key}"][0] == before[f"pipeline-{record.run_key}"][0]
    assert after["ensemble"][0] == runs["ensemble"][0]  # the finished stage is not run again
    assert summary["registered"]["version"] == "1" and summary["registered"]["aliases"]
    assert _record(home).state == "succeeded"
    import optuna

    from mopflow.base.optuna_storage import make_storage

    study = optuna.load_study(
        study_name=summary["optuna"]["study_name"], storage=make_storage(str(home / "optuna" / "journal.log"))
    )
    finished = [t for t in study.trials if t.state.name in ("COMPLETE", "PRUNED")]
    assert len(finished) == CONF["n_trials"]


def test_our_handler_stays_while_others_try_to_replace_it() -> None:
    seen: list[tuple[str, int]] = []
    stopping.reset()
    before = signal.getsignal(signal.SIGTERM)

    def first(signum: int) -> None:
        stopping.request_stop(signum)
        seen.append(("first", signum))

    with local_runs.owned_signals(first, lambda signum: seen.append(("second", signum))):
        signal.signal(signal.SIGTERM, lambda *_: seen.append(("intruder", 0)))  # as a task runner does
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
    assert seen == [("first", signal.SIGTERM), ("second", signal.SIGTERM)]
    assert signal.getsignal(signal.SIGTERM) is before
    assert stopping.ended_status() == "KILLED" and stopping.stop_signal() == signal.SIGTERM
    with pytest.raises(stopping.PipelineStopped, match="stopped by SIGTERM"):
        stopping.raise_if_stopped()
    stopping.reset()
    assert stopping.ended_status() == "FAILED"


def test_run_records_and_what_can_be_resumed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = str(tmp_path)
    with pytest.raises(CliError, match="no unfinished run to resume"):
        local_runs.find_resumable(home, None)
    done = local_runs.RunRecord(
        "aaa", "d", "r1", "2026-01-01T00:00:00+00:00", {}, "succeeded", "2026-01-01T00:00:00Z"
    )
    stopped = local_runs.RunRecord(
        "bbb", "d", "r2", "2026-01-02T00:00:00+00:00", {"epochs": 3}, "stopped", "2026-01-02T00:00:00Z"
    )
    for record in (done, stopped):
        local_runs.save_record(home, record)
    assert local_runs.find_resumable(home, None).run_key == "bbb"
    with pytest.raises(CliError, match="run aaa already succeeded"):
        local_runs.find_resumable(home, "aaa")
    with pytest.raises(CliError, match=r"no run with key 'zzz'.*recent: \['bbb', 'aaa'\]"):
        local_runs.find_resumable(home, "zzz")
    table = local_runs.format_runs(local_runs.load_records(home))
    assert table.index("bbb") < table.index("aaa") and "stopped" in table
    assert local_runs.exit_code(signal.SIGINT) == 130 and local_runs.exit_code(signal.SIGTERM) == 143
    monkeypatch.setenv(local_runs.STOP_TIMEOUT_ENV, "0")
    with pytest.raises(
        CliError, match="MOPFLOW_STOP_TIMEOUT_S='0' must be a number of seconds between 1 and 3600"
    ):
        local_runs.stop_timeout_s()


def test_resume_refuses_a_new_config(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mopflow.infra.cli", "run", "--resume", "--set", "epochs=3"],
        cwd=REPO,
        env=_env(tmp_path / "home"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "--resume continues a run with its own config" in proc.stderr


@pytest.mark.slow
def test_a_failed_run_names_its_root_cause_and_exits_2_for_bad_input(tmp_path: Path) -> None:
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(0)
    table = pd.DataFrame(rng.normal(size=(300, 4)), columns=[f"px{i}" for i in range(4)])
    table["label"] = rng.integers(0, 3, 300)
    table.loc[7, "px2"] = np.nan
    table.to_csv(tmp_path / "nan.csv", index=False)
    home = tmp_path / "home"
    proc = subprocess.run(
        [
            *[sys.executable, "-m", "mopflow.infra.cli", "run"],
            *["--set", f"dataset={tmp_path / 'nan.csv'}", "--data-root", str(tmp_path)],
        ],
        cwd=REPO,
        env=_env(home) | {"MOPFLOW_RETRY_DELAY_S": "30"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-3:]
    assert last[0].startswith("mopflow: run ")
    assert "the shard stage failed: DataValidationError: 1 row(s) have NaN/inf" in last[0]
    assert "{'px2': 1}" in last[0] and "mopflow run --resume" in last[1]
    record = _record(home)
    log_file = home / "logs" / f"{record.run_key}.log"
    assert last[2] == f"full log: {log_file}"
    # the terminal shows the progress view; the logs went to the run's log file
    assert "[00:" in proc.stdout and "shard" in proc.stdout and "DAG TEST" not in proc.stdout + proc.stderr
    # from the first step to the last: the cluster's start and shutdown and Airflow's migration
    # are in the log, not on the terminal
    terminal = proc.stdout + proc.stderr
    assert "distributed." not in terminal and "Airflow database tables" not in terminal, terminal[-3000:]
    assert not list((home / "logs").glob("starting-*.log"))  # named after the run once it had a key
    output = log_file.read_text()
    assert "starting Dask LocalCluster" in output and "Airflow database tables created" in output
    # neither the shard nor finalize is retried: a retry cannot fix bad data
    assert output.count("starting task_id=shard ") == 1 and output.count("starting task_id=finalize ") == 1
    assert record.state == "failed" and record.message == "shard: DataValidationError"


@pytest.mark.slow
def test_sigint_under_mop_checkpoints_the_units_in_flight_and_resumes(tmp_path: Path) -> None:
    home = tmp_path / "home"
    config = tmp_path / "conf.json"
    conf = CONF | {
        "num_samples": 2000,
        "strategy": "mop",
        "n_trials": 2,
        "epochs": 2,
        "min_resource": 2,
    }
    config.write_text(json.dumps(conf))
    proc, log = _start(home, "--config", str(config))
    _wait_for(log, "finished p", proc)  # a first unit is done: the sweep is under way
    code, took, alive = _stop(proc, signal.SIGINT)
    output = log.read_text()
    assert code == 130 and took < STOP_BOUND_S and alive == [], output[-3000:]
    assert re.search(r"mop: stopping; \d+ unit\(s\) in flight checkpoint at their next batch", output)
    summary = _resume(home, tmp_path / "summary.json")
    assert summary["trials"]["COMPLETE"] + summary["trials"]["PRUNED"] == conf["n_trials"]


@pytest.mark.slow
def test_a_second_signal_stops_at_once_and_leaves_no_run_running(tmp_path: Path) -> None:
    home = tmp_path / "home"
    config = tmp_path / "conf.json"
    config.write_text(json.dumps(CONF | {"num_samples": 3000, "n_trials": 2, "epochs": 6, "min_resource": 6}))
    # A stop that overruns its timeout ends at once too: with an hour, only the second signal can.
    proc, log = _start(home, "--config", str(config), env={local_runs.STOP_TIMEOUT_ENV: "3600"})
    _wait_for(log, "epoch 1/6 val_acc", proc)  # training is under way
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGINT)
    # the clean stop is under way (it takes seconds: checkpoints, closing the cluster)
    _wait_for(log, "send it again to stop at once", proc)
    proc.send_signal(signal.SIGINT)
    code = proc.wait(timeout=STOP_BOUND_S + 30)  # only a hang takes this long
    output = log.read_text()
    assert code == 130 and "stopping at once (SIGINT)" in output, output[-3000:]
    assert [c.pid for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE] == []
    record = _record(home)
    assert record.state == "stopped" and f"mopflow run --resume {record.run_key}" in output
    assert record.message == "stopped at once by SIGINT"
    runs = _mlflow_runs(home, record.run_key)
    assert all(status != "RUNNING" for _, status in runs.values()), runs  # a resume reopens them
    assert runs[f"pipeline-{record.run_key}"][1] == "KILLED"


def test_a_runs_own_data_roots_are_kept_for_its_resume_and_given_to_its_stages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mopflow.infra.cli import pipeline

    home = str(tmp_path)
    record = local_runs.RunRecord(
        "ccc", "d", "r3", "2026-01-03T00:00:00+00:00", {}, "stopped", "t", data_roots=["/data/a"]
    )
    local_runs.save_record(home, record)
    assert local_runs.find_resumable(home, "ccc").data_roots == ["/data/a"]
    old = {
        k: v for k, v in json.loads((tmp_path / "runs" / "ccc.json").read_text()).items() if k != "data_roots"
    }
    (tmp_path / "runs" / "ccc.json").write_text(json.dumps(old))  # a record written before the field
    assert local_runs.find_resumable(home, "ccc").data_roots == []
    monkeypatch.setenv("MOPFLOW_DATA_ROOTS", "s3://bucket/x/")
    known = Settings.from_env().data_roots
    pipeline._allow_data_roots(known, ["/data/a", "s3://bucket/x/"])
    assert os.environ["MOPFLOW_DATA_ROOTS"] == "s3://bucket/x/,/data/a"  # the stages' settings read it
