"""Draw docs/img/gantt.png: the schedule mopflow's MOP scheduler produces for a small sweep.

The schedule comes from ``mopflow.training.executors.scheduler.MopScheduler`` itself (the pure, seeded
state machine the ``mop`` executor drives): 4 models, 3 partitions held by 3 workers, 2 epochs,
seed 0. Every unit is drawn one step long, so the picture shows the order and placement of the
units (which model trains on which partition, on which worker, when), not measured timings.

Run from the repository root: ``.venv/bin/python docs/img/make_gantt.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mopflow.training.executors.gantt import check_invariants
from mopflow.training.executors.scheduler import MopScheduler, round_robin

MODELS = ["m0", "m1", "m2", "m3"]
PARTITIONS = ["p0", "p1", "p2"]
WORKERS = ["worker 0", "worker 1", "worker 2"]
EPOCHS = 2
SEED = 0
OUT = Path(__file__).resolve().parent / "gantt.png"


def schedule() -> list[dict[str, Any]]:
    """Unit records (model, partition, worker, epoch, start, end) of every epoch, one step per unit."""
    scheduler = MopScheduler(round_robin(PARTITIONS, WORKERS), seed=SEED)
    records: list[dict[str, Any]] = []
    step = 0
    for epoch in range(EPOCHS):
        scheduler.start_epoch(MODELS)
        epoch_records: list[dict[str, Any]] = []
        while not scheduler.epoch_finished:
            started = scheduler.assign([w for w in WORKERS if w not in scheduler.running])
            for worker, unit in started:
                epoch_records.append(
                    {
                        "model": unit.model,
                        "partition": unit.partition,
                        "worker": worker,
                        "epoch": epoch,
                        "start": step,
                        "end": step + 1,
                    }
                )
            for worker, _ in started:
                scheduler.complete(worker)
            step += 1
        check_invariants(epoch_records, MODELS, PARTITIONS)
        records += epoch_records
    return records


def draw(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colours = plt.get_cmap("tab10")
    end = max(r["end"] for r in records)
    fig, ax = plt.subplots(figsize=(9, 2.8))
    for r in records:
        row = WORKERS.index(r["worker"])
        colour = colours(MODELS.index(r["model"]))
        ax.barh(row, r["end"] - r["start"], left=r["start"], color=colour, edgecolor="black", height=0.6)
        ax.text(
            r["start"] + 0.5, row, f"{r['model']} · {r['partition']}", ha="center", va="center", fontsize=8
        )
    boundaries = sorted({max(r["end"] for r in records if r["epoch"] == e) for e in range(EPOCHS)})
    for x in boundaries[:-1]:
        ax.axvline(x, color="grey", linestyle="--", linewidth=1)
    holders = {w: [p for p in PARTITIONS if round_robin(PARTITIONS, WORKERS)[p] == w] for w in WORKERS}
    ax.set_yticks(
        range(len(WORKERS)), labels=[f"{w} (holds {', '.join(holders[w])})" for w in WORKERS], fontsize=8
    )
    ax.invert_yaxis()
    ax.set_xlim(0, end)
    ax.set_xticks(range(end + 1))
    ax.set_xlabel("scheduling step (each unit drawn one step long; epoch boundary dashed)", fontsize=8)
    ax.set_title(
        f"MOP schedule (MopScheduler, seed {SEED}): {len(MODELS)} models, {len(PARTITIONS)} partitions "
        f"on {len(WORKERS)} workers, {EPOCHS} epochs",
        fontsize=9,
    )
    ax.legend(
        handles=[Patch(color=colours(i), label=m) for i, m in enumerate(MODELS)],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    records = schedule()
    draw(records, OUT)
    print(f"wrote {OUT} ({len(records)} units)")


if __name__ == "__main__":
    main()
