"""The search benchmark's statistics: time and epochs to target, paired bootstrap ratios against
random search, worker utilisation, and the verdict on its targets.

Seconds are the primary figure: wall-clock seconds to the target, compared only between searches
measured clean (``row["load"]["clean"]``: other processes used at most 10% of the machine, see
:mod:`studies.machine_load`). Epochs to target are the second figure. A search that never reaches
the target is charged the whole epoch budget and the seconds it ran (it trained the whole budget),
so that a pruned search that fails never looks cheaper than one that succeeds.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from studies import harness

BASELINE = "random"
PLAIN_STRATEGY, PLAIN_BASELINE = "plain", "plain-random"  # plain Optuna + a plain PyTorch loop
# The arms compared with random search first, on every seed: their ratios (seconds and epochs)
# are figures, no longer targets. "TPE+ASHA >= 2x random by the clock" was retired: its space and
# target decide it, not the runtime (1.97x [1.41, 3.10] in epochs over 40 seeds).
COMPARED_ARMS = ("tpe+asha", "tpe+asha+warm")
GOAL_UTILISATION = 0.90  # seconds inside training and validation passes / (workers x wall)
GOAL_VS_PLAIN = 1.15  # mopflow's random search: at most this times the plain loop's seconds
GOAL_BEST, GOAL_BEST_LOWER = 1.25, 1.0  # the plain loop's fastest arm's seconds / mopflow's fastest's
RESAMPLES = 2000
GOALS = (
    f"seconds to target (primary; epochs are the second figure): utilisation >= {GOAL_UTILISATION} for "
    f"every arm; mopflow's random search <= {GOAL_VS_PLAIN}x the plain Optuna loop's seconds on the "
    f"same trials; mopflow's fastest arm reaches the target >= {GOAL_BEST}x sooner than the plain "
    f"loop's fastest arm, with the 95% CI's lower end >= {GOAL_BEST_LOWER}; under task and mop; only "
    "searches measured clean count"
)


def epochs_to_target(
    reports: Sequence[tuple[float, float]], target: float
) -> tuple[int | None, float | None]:
    """Epochs finished and seconds elapsed when the first report of ``val_acc >= target`` arrived
    (None, None if none did). ``reports`` holds (seconds since the search started, val_acc) per
    epoch report, in the order the coordinator received them."""
    for count, (elapsed, val_acc) in enumerate(reports, start=1):
        if val_acc >= target:
            return count, elapsed
    return None, None


def search_row(
    job: Mapping[str, Any],
    strategy: str,
    reports: Sequence[tuple[float, float]],
    total_s: float,
    busy_s: float,
    states: Sequence[str],
    task_s: float | None = None,
    task_parts: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """One search's row: from its epoch reports ((seconds since the start, val_acc), in the order
    they arrived), its wall seconds, the workers' seconds inside training and validation passes,
    its trials' final states and, when known, the workers' seconds inside tasks (for the split of
    each trained epoch's worker-seconds, :func:`epoch_split`, with the parts of the tasks'
    seconds around the loops, ``task_parts``)."""
    epochs, seconds = epochs_to_target(reports, job["target"])
    split = (
        epoch_split(busy_s, task_s, job["workers"] * total_s, len(reports), task_parts) if task_s else None
    )
    return ({"per_epoch_s": split} if split else {}) | {
        "strategy": strategy,
        "arm": job["arm"],
        "seed": job["seed"],
        "reached": epochs is not None,
        "epochs_to_target": epochs if epochs is not None else len(reports),
        "seconds_to_target": round(seconds if seconds is not None else total_s, 2),
        "epochs_trained": len(reports),
        "total_s": round(total_s, 2),
        "best_val_acc": round(max((acc for _, acc in reports), default=0.0), 4),
        "trials": {s: list(states).count(s) for s in ("COMPLETE", "PRUNED", "FAIL")},
        "busy_s": round(busy_s, 2),
        "utilisation": round(busy_s / (job["workers"] * total_s), 3) if total_s > 0 else None,
    }


def epoch_split(
    busy_s: float,
    task_s: float,
    worker_s: float,
    epochs: int,
    parts: Mapping[str, float] | None = None,
) -> dict[str, float] | None:
    """Each trained epoch's worker-seconds in three parts: ``pass`` (inside the training and
    validation loops), ``around`` (inside the tasks, around the loops: the model built, the
    pass set up (a Trainer where one is built), the state unpacked, packed and staged) and ``between`` (no task running: a
    task's dispatch and result, and waits for the coordinator or for a model busy elsewhere).
    ``parts`` (seconds by part of ``around``, ``training.executors.base.task_parts``) adds
    ``around_<part>`` for each."""
    if epochs <= 0 or worker_s <= 0:
        return None
    return {
        "pass": round(busy_s / epochs, 4),
        "around": round(max(0.0, task_s - busy_s) / epochs, 4),
        "between": round(max(0.0, worker_s - task_s) / epochs, 4),
    } | {f"around_{name}": round(seconds / epochs, 4) for name, seconds in (parts or {}).items()}


def bootstrap_ratio(
    baseline: Sequence[float], arm: Sequence[float], resamples: int = RESAMPLES, seed: int = 0
) -> tuple[float, float, float]:
    """median(baseline) / median(arm) and its percentile 95% interval, seeds resampled in pairs."""
    if len(baseline) != len(arm) or not arm:
        raise ValueError(f"paired samples expected, got {len(baseline)} and {len(arm)}")
    rng = random.Random(seed)
    n = len(arm)
    ratios = []
    for _ in range(resamples):
        picks = [rng.randrange(n) for _ in range(n)]
        ratios.append(
            statistics.median(baseline[i] for i in picks) / statistics.median(arm[i] for i in picks)
        )
    ratios.sort()
    low, high = ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples) - 1]
    return statistics.median(baseline) / statistics.median(arm), low, high


def charged_epochs(row: Mapping[str, Any], budget_epochs: int) -> int:
    """The epochs a run is charged: to the target, or the whole epoch budget when it never got
    there (a pruned search that fails is not cheaper than one that succeeds)."""
    return int(row["epochs_to_target"]) if row["reached"] else budget_epochs


def charged_seconds(row: Mapping[str, Any]) -> float:
    """The seconds a run is charged: to the target, or all it ran when it never got there."""
    return (
        float(row["seconds_to_target"])
        if row["reached"]
        else float(row.get("total_s", row["seconds_to_target"]))
    )


def is_clean(row: Mapping[str, Any]) -> bool:
    """Whether the run was measured with at most 10% of the machine used by other processes (a
    run recorded without a load record was not)."""
    return bool(row.get("load", {}).get("clean"))


def _paired(
    base: Mapping[int, Mapping[str, Any]],
    runs: Mapping[int, Mapping[str, Any]],
    figure: Callable[[Any], float],
) -> dict[str, Any]:
    """The ratio of base's median to the arm's over the seeds both ran clean, with its interval."""
    seeds = sorted(s for s in set(base) & set(runs) if is_clean(base[s]) and is_clean(runs[s]))
    if not seeds:
        return {}
    ratio, low, high = bootstrap_ratio([figure(base[s]) for s in seeds], [figure(runs[s]) for s in seeds])
    return {"ratio": round(ratio, 2), "ci95": [round(low, 2), round(high, 2)], "paired_seeds": len(seeds)}


def summarize(
    rows: list[dict[str, Any]], strategies: Sequence[str], arms: Sequence[str], budget_epochs: int
) -> list[dict[str, Any]]:
    """Per strategy and arm: runs (clean ones), runs reaching the target, median seconds and
    epochs charged, median utilisation, and the baseline-to-arm ratios of median seconds
    (``ratio``, the primary figure) and of median epochs (``epochs_ratio``), each with its
    bootstrap 95% interval over the seeds both measured clean. Plain-loop arms are compared with
    the plain loop's random search; mopflow's random search with it too (``vs_plain_ratio``: its
    median seconds over the plain loop's, over the seeds both ran clean)."""
    table = []
    plain_random = {
        r["seed"]: r for r in rows if r["strategy"] == PLAIN_STRATEGY and r["arm"] == PLAIN_BASELINE
    }
    for strategy in [*strategies, PLAIN_STRATEGY]:
        by_arm = {
            arm: {r["seed"]: r for r in rows if r["strategy"] == strategy and r["arm"] == arm} for arm in arms
        }
        base = by_arm.get(PLAIN_BASELINE if strategy == PLAIN_STRATEGY else BASELINE, {})
        for arm, runs in by_arm.items():
            if not runs:
                continue
            clean = [r for r in runs.values() if is_clean(r)]
            used = clean or list(runs.values())  # medians of clean runs when there are any
            entry: dict[str, Any] = {
                "strategy": strategy,
                "arm": arm,
                "runs": len(runs),
                "clean_runs": len(clean),
                "reached": sum(r["reached"] for r in runs.values()),
                "median_s": round(statistics.median(charged_seconds(r) for r in used), 1),
                "median_epochs": statistics.median(charged_epochs(r, budget_epochs) for r in used),
            }
            utilisation = [r["utilisation"] for r in used if r.get("utilisation") is not None]
            if utilisation:
                entry["utilisation"] = round(statistics.median(utilisation), 3)
            splits = [r["per_epoch_s"] for r in used if r.get("per_epoch_s")]
            if splits:  # the parts every row has (rows recorded before a part was measured lack it)
                parts = [k for k in splits[0] if all(k in s for s in splits)]
                entry["per_epoch_s"] = {k: round(statistics.median(s[k] for s in splits), 4) for k in parts}
            if runs is not base:
                entry |= _paired(base, runs, charged_seconds)
                by_epochs = _paired(base, runs, lambda r: charged_epochs(r, budget_epochs))
                entry |= {f"epochs_{k}": v for k, v in by_epochs.items() if k != "paired_seeds"}
            elif strategy != PLAIN_STRATEGY and plain_random:
                # the same trials, seed by seed (the plain loop's random search proposes mopflow's)
                entry |= {f"vs_plain_{k}": v for k, v in _paired(runs, plain_random, charged_seconds).items()}
            table.append(entry)
    _fastest_against_plain(table, rows)
    return table


def _fastest(entries: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The arm with the fewest median seconds to target among those measured clean."""
    clean = [e for e in entries if e["clean_runs"]]
    return min(clean, key=lambda e: e["median_s"]) if clean else None


def _fastest_against_plain(table: list[dict[str, Any]], rows: list[dict[str, Any]]) -> None:
    """On each strategy's fastest arm: the plain loop's fastest arm's median seconds over its own
    (``vs_plain_best_ratio``: above 1 where mopflow is sooner), with the interval, over the seeds
    both ran clean."""
    plain = _fastest([e for e in table if e["strategy"] == PLAIN_STRATEGY])
    if plain is None:
        return
    by_seed: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
    for row in rows:
        by_seed.setdefault((row["strategy"], row["arm"]), {})[row["seed"]] = row
    for strategy in sorted({e["strategy"] for e in table} - {PLAIN_STRATEGY}):
        ours = _fastest([e for e in table if e["strategy"] == strategy])
        if ours is None:
            continue
        paired = _paired(
            by_seed[(PLAIN_STRATEGY, plain["arm"])], by_seed[(strategy, ours["arm"])], charged_seconds
        )
        ours |= {"vs_plain_best_arm": plain["arm"]} | {f"vs_plain_best_{k}": v for k, v in paired.items()}


def verdicts(table: list[dict[str, Any]], strategies: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per strategy: every arm's utilisation (>= 0.90), mopflow's random search against the plain
    loop's (its median seconds <= 1.15x on the same trials), and mopflow's fastest arm against the
    plain loop's fastest (>= 1.25x sooner, the interval's lower end >= 1.0). NOT MEASURED where
    the clean runs to judge are missing."""
    plain = [e for e in table if e["strategy"] == PLAIN_STRATEGY and e["clean_runs"]]
    out: dict[str, dict[str, Any]] = {}
    for strategy in [*strategies, *([PLAIN_STRATEGY] if plain else [])]:
        entries = [e for e in table if e["strategy"] == strategy]
        found: dict[str, Any] = {
            "utilisation": {
                e["arm"]: _pass(e["utilisation"] >= GOAL_UTILISATION)
                if "utilisation" in e and e["clean_runs"]
                else "NOT MEASURED"
                for e in entries
            }
        }
        if strategy != PLAIN_STRATEGY:
            found |= _against_plain([e for e in entries if e["clean_runs"]])
        out[strategy] = found
    return out


def _against_plain(ours: list[dict[str, Any]]) -> dict[str, str]:
    """mopflow's random search against the plain loop's, and the fastest arms of each."""
    mine = next((e for e in ours if e["arm"] == BASELINE), None)
    random_vs = (
        _pass(mine["vs_plain_ratio"] <= GOAL_VS_PLAIN)
        if mine and "vs_plain_ratio" in mine  # paired: the same seeds, the same trials
        else "NOT MEASURED"
    )
    fastest = next((e for e in ours if "vs_plain_best_ratio" in e), None)
    best = (
        _pass(
            fastest["vs_plain_best_ratio"] >= GOAL_BEST
            and fastest["vs_plain_best_ci95"][0] >= GOAL_BEST_LOWER
        )
        if fastest
        else "NOT MEASURED"
    )
    return {"random_vs_plain_random": random_vs, "best_vs_plain_best": best}


def _pass(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def table_lines(result: Mapping[str, Any], target: float) -> list[str]:
    """The summary as a text table, then one line per verdict."""
    columns = ["strategy", "arm", "clean/runs", "reached", "med s", "ratio s", "95% CI", "med ep", "ratio ep"]
    cells = []
    for e in result["summary"]:
        baseline = e["arm"] in (BASELINE, PLAIN_BASELINE)
        ci = (
            f"[{e['ci95'][0]:.2f}, {e['ci95'][1]:.2f}]"
            if "ci95" in e
            else "(baseline)"
            if baseline
            else "(no clean pair)"
        )
        cells.append(
            [
                e["strategy"],
                e["arm"],
                f"{e.get('clean_runs', 0)}/{e['runs']}",
                e["reached"],
                f"{e['median_s']:.1f}",
                f"{e['ratio']:.2f}" if "ratio" in e else "",
                ci,
                f"{e['median_epochs']:.1f}",
                f"{e['epochs_ratio']:.2f}" if "epochs_ratio" in e else "",
                f"[{e['epochs_ci95'][0]:.2f}, {e['epochs_ci95'][1]:.2f}]" if "epochs_ci95" in e else "",
                f"{e['utilisation']:.3f}" if "utilisation" in e else "",
            ]
        )
    lines = harness.table_lines([*columns, "ep 95% CI", "util"], cells)
    for e in result["summary"]:
        if "per_epoch_s" in e:
            part = e["per_epoch_s"]
            lines.append(
                f"{e['strategy']} {e['arm']}: worker-seconds per trained epoch (median): "
                f"{part['pass']:.3f} in passes, {part['around']:.3f} around them in the task"
                + (
                    f" ({part['around_setup']:.3f} before the pass: rows, model, state; "
                    f"{part['around_fit']:.3f} around the loop in the pass; "
                    f"{part['around_pack']:.3f} packing the state)"
                    if all(f"around_{k}" in part for k in ("setup", "fit", "pack"))
                    else ""
                )
                + f", {part['between']:.3f} between tasks"
                + (
                    f"; the coordinator's process used {part['coordinator_cpu']:.3f} CPU-s"
                    if "coordinator_cpu" in part
                    else ""
                )
            )
    for e in result["summary"]:
        if "vs_plain_ratio" in e:
            lines.append(
                f"{e['strategy']} {e['arm']}: seconds to target / the plain loop's random search's, the same "
                f"trials on {e['vs_plain_paired_seeds']} seeds: {e['vs_plain_ratio']:.2f} "
                f"[{e['vs_plain_ci95'][0]:.2f}, {e['vs_plain_ci95'][1]:.2f}]"
            )
        if "vs_plain_best_ratio" in e:
            lines.append(
                f"{e['strategy']}'s fastest arm {e['arm']}: the plain loop's fastest ({e['vs_plain_best_arm']}) "
                f"seconds to target / its own, on {e['vs_plain_best_paired_seeds']} seeds: "
                f"{e['vs_plain_best_ratio']:.2f} [{e['vs_plain_best_ci95'][0]:.2f}, {e['vs_plain_best_ci95'][1]:.2f}]"
            )
    for strategy, found in result["verdict"].items():
        for name, verdict in found.items():
            if isinstance(verdict, dict):
                shown = ", ".join(f"{arm} {v}" for arm, v in verdict.items() if v != "NOT MEASURED")
                lines.append(f"{strategy}: utilisation >= {GOAL_UTILISATION}: {shown or 'NOT MEASURED'}")
            elif name == "random_vs_plain_random":
                lines.append(
                    f"{strategy}: random search <= {GOAL_VS_PLAIN}x the plain loop's seconds: {verdict}"
                )
            else:
                lines.append(
                    f"{strategy}: fastest arm >= {GOAL_BEST}x sooner than the plain loop's fastest to val_acc >= "
                    f"{target} (CI lower end >= {GOAL_BEST_LOWER}): {verdict}"
                )
    return lines
