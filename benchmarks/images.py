"""Benchmark of distillation on images: how much of the ensemble's gain the student keeps.

What is measured
----------------
The image demo, ``mopflow run --config infra/configs/images.yaml``, end to end in a fresh
``MOPFLOW_HOME``: the generated ``shapes`` dataset (5,000 coloured shapes on noisy backgrounds,
3x16x16, 8 classes; no download), a search over the default image space (a small ResNet and a
plain 2-D CNN), the top trials' ensemble, and a ``cnn2d`` student sized to at most 10% of the
ensemble's parameters, distilled on the training images plus mixup of shifted images labelled
by the ensemble. The distill stage also trains the same student on the hard labels alone (as
many optimizer steps, the same schedule): the baseline.

* ``recovered gain`` = (distilled student - hard-label student) / (ensemble - hard-label
  student), test accuracy on the 20% test split, both students' from the run's evaluation report
  (the run registers whichever validates better). Target: >= 0.80; UNDEFINED when the ensemble
  is not more accurate than the hard-label student.
* ``param ratio`` = student parameters / ensemble parameters. Target: <= 0.10.

Output: a table on stdout, the target lines, and every figure in
``benchmarks/results/images.json`` (with the machine and the date; ``--out`` names another
folder or file, and a ``--quick`` run writes there or into a temporary folder). Wall time is reported for
information; on a shared machine other processes inflate it.

``--storage``: images at real size instead (``benchmarks/studies/image_io.py``): a generated
folder of RGB 64x64 PNGs (``--images``, 20,000 by default) sharded on two Dask workers; shard bytes
against the folder's (target <= 1.2x), the shard stage's wall time, streamed training images/s
of one worker (decoded and augmented batch by batch) against a plain DataLoader over the same
PNGs with the same decode and augmentation (target >= 0.9x), and the peak RSS of a worker
streaming a pass, at ``--images`` and at ten times as many (target: at most 1.2x). Written to
``benchmarks/results/image_storage.json``.

Run it from the repository root::

    .venv/bin/python benchmarks/images.py             # the image demo config
    .venv/bin/python benchmarks/images.py --quick --out /tmp/bench  # smoke test: 800 images, 2 trials, 1 epoch
    .venv/bin/python benchmarks/images.py --storage                 # shards, throughput and RSS
    .venv/bin/python benchmarks/images.py --storage --quick --out /tmp/bench  # the same at 400/4,000 images
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from studies import harness  # noqa: E402

from mopflow.compression.distill.keep import REPORT_NAMES

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "images.json"
STORAGE_RESULTS = REPO / "benchmarks" / "results" / "image_storage.json"
TARGET_BYTES, TARGET_THROUGHPUT, TARGET_RSS = 1.2, 0.9, 1.2
CONFIG = REPO / "infra" / "configs" / "images.yaml"
TARGET_GAIN = 0.80
TARGET_RATIO = 0.10
# --quick: the pipeline at its smallest (every stage runs; the figures mean nothing)
QUICK = [
    "num_samples=800",
    "n_trials=2",
    "epochs=1",
    "min_resource=1",
    "top_k=2",
    "distill_epochs=1",
    "munge_multiplier=1",
]


def run_demo(overrides: list[str], home: Path | None = None) -> tuple[dict, float]:
    """The image demo in a fresh MOPFLOW_HOME (``home``, kept; else a temporary one): its
    summary and wall seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MOPFLOW_", "AIRFLOW", "MLFLOW_"))}
        env["MOPFLOW_HOME"] = str(home or Path(tmp) / "home")
        summary = (home or Path(tmp)) / "summary.json"
        summary.parent.mkdir(parents=True, exist_ok=True)
        sets = [arg for item in overrides for arg in ("--set", item)]
        command = [sys.executable, "-m", "mopflow.infra.cli", "run", "--config", str(CONFIG), *sets]
        started = time.monotonic()
        proc = subprocess.run(
            [*command, "--summary-json", str(summary)], cwd=REPO, env=env, capture_output=True, text=True
        )
        wall = time.monotonic() - started
        if proc.returncode != 0:
            raise SystemExit(f"the image demo failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return json.loads(summary.read_text()), wall


def results_file(out: Path | None, quick: bool) -> Path:
    """Where the JSON goes (:func:`studies.harness.results_file`)."""
    return harness.results_file(out, quick, RESULTS)


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__, " ".join(QUICK))
    harness.add_pipeline_options(parser)
    parser.add_argument(
        "--storage", action="store_true", help="shard bytes, throughput and RSS of PNG images"
    )
    parser.add_argument(
        "--images", type=int, default=20_000, help="--storage: images in the generated folder"
    )
    args = parser.parse_args(argv)
    if args.storage:
        return storage_main(args)
    out = results_file(args.out, args.quick)
    overrides = [*(QUICK if args.quick else []), *args.overrides]
    load_before = list(os.getloadavg())
    summary, wall = run_demo(overrides, args.home)
    ensemble = float(summary["ensemble"]["test_acc"])
    # both students from the evaluation report: the summary's student is the one kept, which is
    # the hard-label twin when that one validates better
    tested = {row["model"]: float(row["test_acc"]) for row in summary["evaluation"]}
    student = tested[REPORT_NAMES["distilled"]]
    hard = tested[REPORT_NAMES["hard_label"]]
    ratio = float(summary["student"]["param_ratio"])
    gain = (student - hard) / (ensemble - hard) if ensemble > hard else None  # no gain to recover
    rows = [
        ("ensemble", ensemble, int(summary["ensemble"]["num_params"])),
        ("best trial", float(summary["best_trial"]["test_acc"]), None),
        ("hard-label student", hard, int(summary["student"]["num_params"])),
        ("distilled student", student, int(summary["student"]["num_params"])),
    ]
    print()
    harness.print_table(
        ["model", "test_acc", "params"], [[name, f"{acc:.4f}", params] for name, acc, params in rows]
    )
    gain_status = "UNDEFINED" if gain is None else "PASS" if gain >= TARGET_GAIN else "FAIL"
    ratio_ok = ratio <= TARGET_RATIO
    print()
    gain_text = "-" if gain is None else f"{gain:.2f}"
    print(f"recovered gain: {gain_text} (target >= {TARGET_GAIN:.2f}): {gain_status}")
    print(
        f"student / ensemble params: {ratio:.3f} (target <= {TARGET_RATIO:.2f}): {'PASS' if ratio_ok else 'FAIL'}"
    )
    kept = summary["student"].get("kept") or {}
    print(
        f"info  student {summary['student']['arch']['family']} {summary['student']['arch']['params']}; "
        f"registered: the {kept.get('model', 'student')} ({kept.get('reason', '')})"
    )
    print(f"info  wall time {wall:.0f} s; load average before {load_before[0]:.1f} on {os.cpu_count()} CPUs")
    report = {
        "benchmark": "images",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": harness.machine(load_before),
        "settings": (settings := {"config": str(CONFIG.relative_to(REPO)), "overrides": overrides}),
        "accuracy": {name: acc for name, acc, _ in rows},
        "params": {"ensemble": rows[0][2], "student": rows[2][2]},
        "recovered_gain": gain,
        "param_ratio": ratio,
        "student_arch": summary["student"]["arch"],
        "kept": kept,
        "evaluation": summary["evaluation"],
        "wall_s": wall,
        "targets": {
            "recovered_gain": {"bound": TARGET_GAIN, "status": gain_status},
            "param_ratio": {"bound": TARGET_RATIO, "status": "PASS" if ratio_ok else "FAIL"},
        },
    }
    harness.write_report(out, report, config=settings)
    return 0


def storage_main(args: argparse.Namespace) -> int:
    """``--storage``: measure, print the figures and their targets, write the JSON."""
    from studies.image_io import measure

    small = 400 if args.quick else args.images
    large = 10 * small
    out = harness.results_file(args.out, args.quick, STORAGE_RESULTS)
    load_before = list(os.getloadavg())
    with tempfile.TemporaryDirectory() as tmp:
        report = measure(Path(tmp), small, large, workers=2, limit=min(small, 5_000))
    first, second = report[str(small)], report[str(large)]
    checks = {
        "shard_over_folder": (first["shard_over_folder"], first["shard_over_folder"] <= TARGET_BYTES),
        "throughput_ratio": (report["throughput_ratio"], report["throughput_ratio"] >= TARGET_THROUGHPUT),
        "rss_ratio": (report["rss_ratio"], report["rss_ratio"] <= TARGET_RSS),
    }
    columns = ["images", "folder MB", "shard MB", "ratio", "shard s", "cols", "peak RSS MB"]
    cells = [
        [
            count,
            f"{row['folder_bytes'] / 1e6:.1f}",
            f"{row['shard_bytes'] / 1e6:.1f}",
            f"{row['shard_over_folder']:.3f}",
            f"{row['shard_wall_s']:.1f}",
            row["columns"],
            f"{row['peak_rss_mb']:.0f}",
        ]
        for count, row in ((small, first), (large, second))
    ]
    print()
    harness.print_table(columns, cells)
    print(
        f"images/s per worker: streamed {report['streamed']['images_per_s']:.0f}, "
        f"DataLoader {report['dataloader']['images_per_s']:.0f}"
    )
    for name, bound in (
        ("shard_over_folder", f"<= {TARGET_BYTES}"),
        ("throughput_ratio", f">= {TARGET_THROUGHPUT}"),
        ("rss_ratio", f"<= {TARGET_RSS}"),
    ):
        value, ok = checks[name]
        print(f"{name}: {value:.3f} (target {bound}): {'PASS' if ok else 'FAIL'}")
    print(
        f"info  load average before {load_before[0]:.1f} on {os.cpu_count()} CPUs (a shared machine inflates times)"
    )
    report |= {
        "benchmark": "image_storage",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": harness.machine(load_before),
        "targets": {
            name: {"value": value, "status": "PASS" if ok else "FAIL"} for name, (value, ok) in checks.items()
        },
    }
    config = {"images": small, "large_images": large, "workers": 2, "quick": args.quick}
    harness.write_report(out, report, config=config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
