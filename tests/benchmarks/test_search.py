"""The search benchmark's statistics (its runs are too long for the suite)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from studies import search_summary as summary

from tests.benchmarks.loader import load_benchmark

bench = load_benchmark("search")


def test_epochs_to_target_counts_reports_in_arrival_order() -> None:
    reports = [(1.0, 0.5), (2.0, 0.95), (2.5, 0.97), (3.0, 0.99)]
    assert summary.epochs_to_target(reports, 0.96) == (3, 2.5)
    assert summary.epochs_to_target(reports, 0.999) == (None, None)


def test_the_bootstrap_interval_brackets_the_ratio_of_medians() -> None:
    baseline = [300, 280, 350, 310, 290, 400, 260, 330]
    arm = [100, 120, 90, 150, 110, 95, 130, 105]
    ratio, low, high = summary.bootstrap_ratio(baseline, arm)
    assert ratio == pytest.approx(305 / 107.5)
    assert low <= ratio <= high
    assert low > 2.0  # the arm is clearly better on every seed


def test_identical_arms_give_an_interval_around_one() -> None:
    same = [120, 80, 200, 150, 90, 170]
    ratio, low, high = summary.bootstrap_ratio(same, same)
    assert ratio == low == high == 1.0


def test_unpaired_samples_are_refused() -> None:
    with pytest.raises(ValueError, match="paired samples expected, got 3 and 2"):
        summary.bootstrap_ratio([1, 2, 3], [1, 2])


def test_the_retired_ratio_to_random_is_a_figure_not_a_verdict() -> None:
    table = [
        {"strategy": "task", "arm": "tpe+asha", "ratio": 2.4, "ci95": [1.7, 3.1], "clean_runs": 5},
        {"strategy": "mop", "arm": "tpe+asha", "ratio": 2.2, "ci95": [1.2, 3.5], "clean_runs": 5},
    ]
    found = summary.verdicts(table, ["task", "mop"])
    assert all(
        set(found[s]) == {"utilisation", "random_vs_plain_random", "best_vs_plain_best"} for s in found
    )
    assert found["task"]["best_vs_plain_best"] == "NOT MEASURED"  # no plain loop to judge by


def _row(strategy: str, arm: str, seed: int, seconds: float, clean: bool = True, **more: object) -> dict:
    return {
        "strategy": strategy, "arm": arm, "seed": seed, "reached": True, "epochs_to_target": 10 * seconds,
        "seconds_to_target": seconds, "total_s": seconds + 1, "load": {"clean": clean}, **more,
    }  # fmt: skip


def test_seconds_are_compared_over_the_seeds_both_arms_measured_clean() -> None:
    rows = [_row("task", "random", s, 30.0 + s) for s in range(4)]
    rows += [_row("task", "tpe+asha", s, 10.0, utilisation=0.9) for s in range(3)]
    rows += [_row("task", "tpe+asha", 3, 1.0, clean=False)]  # beside another load: left out
    table = summary.summarize(rows, ["task"], ["random", "tpe+asha"], budget_epochs=720)
    arm = next(e for e in table if e["arm"] == "tpe+asha")
    assert (arm["runs"], arm["clean_runs"], arm["paired_seeds"]) == (4, 3, 3)
    assert arm["median_s"] == 10.0 and arm["ratio"] == 3.1  # seconds: 31 / 10 over seeds 0-2
    assert arm["epochs_ratio"] == 3.1 and arm["utilisation"] == 0.9
    unclean = [_row("task", a, 0, 5.0, clean=False) for a in ("random", "tpe+asha")]
    table = summary.summarize(unclean, ["task"], ["random", "tpe+asha"], budget_epochs=720)
    assert "ratio" not in table[1]
    assert summary.verdicts(table, ["task"])["task"]["utilisation"] == dict.fromkeys(
        ("random", "tpe+asha"), "NOT MEASURED"
    )


def test_a_search_that_never_reaches_the_target_is_charged_all_its_seconds() -> None:
    assert summary.charged_seconds({"reached": True, "seconds_to_target": 12.0, "total_s": 40.0}) == 12.0
    assert summary.charged_seconds({"reached": False, "seconds_to_target": 40.0, "total_s": 41.5}) == 41.5


def test_the_plain_loop_is_the_yardstick_for_random_search_and_for_the_best_arm() -> None:
    rows = [_row("task", "random", s, 34.0, utilisation=0.5) for s in range(3)]
    rows += [_row("task", "tpe+asha", s, t, utilisation=0.9) for s, t in enumerate([10.0, 9.0, 11.0])]
    rows += [_row("plain", "plain-random", s, 30.0, utilisation=0.95) for s in range(3)]
    rows += [_row("plain", "plain-tpe+sh", s, t, utilisation=0.95) for s, t in enumerate([12.0, 13.0, 12.5])]
    arms = ["random", "tpe+asha", "plain-random", "plain-tpe+sh"]
    table = summary.summarize(rows, ["task"], arms, budget_epochs=720)
    plain = next(e for e in table if e["arm"] == "plain-tpe+sh")
    assert plain["strategy"] == "plain" and plain["ratio"] == 2.4  # against the plain loop's random
    fastest = next(e for e in table if e["arm"] == "tpe+asha")  # 10 s against the plain loop's 12.5 s
    assert (fastest["vs_plain_best_arm"], fastest["vs_plain_best_ratio"]) == ("plain-tpe+sh", 1.25)
    assert fastest["vs_plain_best_paired_seeds"] == 3 and fastest["vs_plain_best_ci95"][0] >= 1.0
    found = summary.verdicts(table, ["task"])
    assert found["task"]["random_vs_plain_random"] == "PASS"  # 34 <= 1.15 x 30
    assert found["task"]["best_vs_plain_best"] == "PASS"
    assert found["task"]["utilisation"] == {"random": "FAIL", "tpe+asha": "PASS"}  # 0.90 meets 0.90
    assert found["plain"]["utilisation"] == {"plain-random": "PASS", "plain-tpe+sh": "PASS"}
    lines = summary.table_lines({"summary": table, "verdict": found}, 0.96)
    assert any("fastest arm >= 1.25x sooner" in line and line.endswith("PASS") for line in lines)
    assert any(
        "task random: seconds to target / the plain loop's" in line and "1.13" in line for line in lines
    )
    # a fastest arm only 1.2x sooner fails the target, whatever its interval
    slower = [r | {"seconds_to_target": 10.5} if r["arm"] == "tpe+asha" else r for r in rows]
    table = summary.summarize(slower, ["task"], arms, budget_epochs=720)
    assert summary.verdicts(table, ["task"])["task"]["best_vs_plain_best"] == "FAIL"


def test_random_search_is_held_to_the_plain_loop_seed_by_seed() -> None:
    # mopflow's seed 0 ran beside another load: compared over seeds 1-3, where the plain loop's
    # median is 10 s and mopflow's 13 s (1.3x), though over all its seeds the plain loop's is 11 s
    rows = [_row("task", "random", 0, 1.0, clean=False)] + [
        _row("task", "random", s, 13.0) for s in (1, 2, 3)
    ]
    rows += [_row("plain", "plain-random", s, t) for s, t in enumerate([20.0, 10.0, 10.0, 12.0])]
    table = summary.summarize(rows, ["task"], ["random", "plain-random"], budget_epochs=720)
    ours = next(e for e in table if e["arm"] == "random")
    assert (ours["vs_plain_ratio"], ours["vs_plain_paired_seeds"]) == (1.3, 3)
    assert "vs_plain_ratio" not in next(e for e in table if e["arm"] == "plain-random")
    assert summary.verdicts(table, ["task"])["task"]["random_vs_plain_random"] == "FAIL"


def test_the_baseline_must_be_among_the_arms() -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["--arms", "tpe+asha"])


def test_the_goal_arms_run_on_every_seed_before_the_others() -> None:
    args = bench.parse_args(["--seeds", "3", "--other-seeds", "1", "--arms", "random,gp+asha,tpe+asha"])
    order = bench.run_order(args)
    assert order[:12] == [
        (s, st, a) for s in range(3) for st in ("task", "mop") for a in ("random", "tpe+asha")
    ]
    assert order[12:] == [(0, "task", "gp+asha"), (0, "mop", "gp+asha")]
    args = bench.parse_args(
        ["--seeds", "3", "--arms", "random,gp+asha", "--strategies", "task", "--from-seed", "2"]
    )
    assert bench.run_order(args) == [(2, "task", "random"), (2, "task", "gp+asha")]


def test_a_search_that_never_reaches_the_target_is_charged_the_whole_budget() -> None:
    reached = {"reached": True, "epochs_to_target": 300}
    failed = {"reached": False, "epochs_to_target": 90}  # pruned hard and gave up early
    assert summary.charged_epochs(reached, 720) == 300
    assert summary.charged_epochs(failed, 720) == 720


def test_added_arms_take_the_recorded_settings_and_replace_only_their_own_runs(tmp_path: Path) -> None:
    recorded = {
        "settings": {"arms": ["random", "tpe+asha"], "strategies": ["task", "mop"], "seeds": 20,
                     "other_seeds": 8, "epochs": 30, "budget_epochs": 720, "target": 0.96, "trials": 200},
        "rows": [{"strategy": "task", "arm": a, "seed": 0, "epochs_to_target": 9, "reached": True,
                  "seconds_to_target": 1.0} for a in ("random", "tpe+asha")],
    }  # fmt: skip
    results = tmp_path / "search.json"
    results.write_text(json.dumps(recorded))
    argv = ["--arms", "tpe+asha+warm", "--strategies", "mop", "--seeds", "5", "--epochs", "3"]
    args = bench.parse_args([*argv, "--add-to", str(results)])
    assert args.to_run == [(s, "mop", "tpe+asha+warm") for s in range(5)]  # only the new runs
    assert args.arms == ["random", "tpe+asha", "tpe+asha+warm"] and args.strategies == ["task", "mop"]
    assert (args.epochs, args.seeds, args.out) == (30, 20, results)  # the file's settings hold
    new = [recorded["rows"][1] | {"epochs_to_target": 7}]
    merged = bench.merge_rows(recorded["rows"], new)
    assert sorted((r["arm"], r["epochs_to_target"]) for r in merged) == [("random", 9), ("tpe+asha", 7)]
    written = bench.write_results(args, merged, partial=False, priors=[])
    assert "recorded" not in written["settings"] and written["settings"]["arms"] == args.arms
    assert json.loads(results.read_text())["rows"] == written["rows"]


def test_a_file_summarized_again_keeps_when_where_and_at_which_commit_it_was_measured(tmp_path: Path) -> None:
    measured = {"commit": "abc123", "date": "2026-11-28T06:44:22+00:00", "machine": {"cpus": 2}}
    recorded = measured | {
        "settings": {"arms": ["random", "plain-random"], "strategies": ["task"], "seeds": 2, "other_seeds": 2,
                     "epochs": 30, "budget_epochs": 720, "target": 0.96, "trials": 200},
        "rows": [_row("task", "random", s, 12.0) for s in range(2)]
        + [_row("plain", "plain-random", s, 10.0) for s in range(2)],
        "verdict": {"task": {"tpe+asha": "FAIL"}},  # a retired target's
    }  # fmt: skip
    results = tmp_path / "search.json"
    results.write_text(json.dumps(recorded))
    assert bench.main(["--summarize", str(results)]) == 0
    rewritten = json.loads(results.read_text())
    assert {k: rewritten[k] for k in measured} == measured
    assert sorted(map(json.dumps, rewritten["rows"])) == sorted(map(json.dumps, recorded["rows"]))
    assert rewritten["resummarized"]["date"] > measured["date"]
    assert rewritten["verdict"]["task"]["random_vs_plain_random"] == "FAIL"  # 1.2x > 1.15x


def test_a_plain_loop_arm_runs_once_per_seed_beside_the_goal_arms() -> None:
    args = bench.parse_args(["--seeds", "2", "--arms", "random,plain-random,gp+asha", "--other-seeds", "1"])
    assert bench.run_order(args) == [
        (0, "task", "random"), (0, "mop", "random"), (0, "plain", "plain-random"),
        (1, "task", "random"), (1, "mop", "random"), (1, "plain", "plain-random"),
        (0, "task", "gp+asha"), (0, "mop", "gp+asha"),
    ]  # fmt: skip


def test_the_warm_arm_runs_with_the_goal_arms_and_needs_an_earlier_study() -> None:
    args = bench.parse_args(["--seeds", "2", "--arms", "random,tpe+asha+warm", "--strategies", "mop"])
    assert bench.run_order(args) == [(s, "mop", a) for s in range(2) for a in ("random", "tpe+asha+warm")]
    assert args.prior_studies == 4
    with pytest.raises(SystemExit):
        bench.parse_args(["--prior-studies", "0"])


def test_each_trained_epoch_is_split_into_passes_what_surrounds_them_and_idle_time() -> None:
    job = {"arm": "random", "seed": 0, "target": 0.9, "workers": 2}
    reports = [(1.0, 0.5), (2.0, 0.95), (3.0, 0.97), (4.0, 0.96)]
    row = summary.search_row(job, "task", reports, 10.0, busy_s=12.0, states=["COMPLETE"], task_s=16.0)
    assert row["per_epoch_s"] == {"pass": 3.0, "around": 1.0, "between": 1.0}  # 20 worker-s / 4 epochs
    assert row["utilisation"] == 0.6
    parts = {"setup": 2.0, "fit": 1.0, "pack": 0.5}
    split = summary.search_row(job, "task", reports, 10.0, 12.0, ["COMPLETE"], 16.0, parts)["per_epoch_s"]
    assert split == row["per_epoch_s"] | {"around_setup": 0.5, "around_fit": 0.25, "around_pack": 0.125}
    assert "0.250 around the loop in the pass" in "\n".join(
        summary.table_lines(
            {
                "summary": [{**summary.summarize([row], ["task"], ["random"], 10)[0], "per_epoch_s": split}],
                "verdict": {},
            },
            0.9,
        )
    )
    assert "per_epoch_s" not in summary.search_row(job, "plain", reports, 10.0, 12.0, ["COMPLETE"])
    table = summary.summarize([row], ["task"], ["random"], budget_epochs=10)
    assert table[0]["per_epoch_s"] == row["per_epoch_s"]
