"""How long a local run takes to start: ranks forked from the zygote against a fresh interpreter
per rank (docs/DESIGN.md §5).

One tiny run (2 sites x 2 workers, 4 steps) launched again and again, in three ways, in rotating
order so that machine noise hits all alike:

- ``fresh``: every rank a new ``python -m geotrain.run.worker`` (as before the zygote);
- ``forked, zygote starting``: the zygote is stopped first, so the launch pays its imports;
- ``forked``: the zygote is already running (every launch after the first in one process).

The statistic is the median over repetitions of the launch's wall time, from ``launch_local``'s
call to its return (start, rendezvous, 4 steps, evaluation, summary). Prints a table and writes JSON.

    python benchmarks/launch_start.py [--reps 5] [--json benchmarks/results/launch_start.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from geotrain.config import load_config
from geotrain.launch import spawn
from geotrain.launch.local import launch_local

RUN = [
    "topology.sites=[{name: A, workers: 2}, {name: B, workers: 2}]",
    "model.n_layer=1",
    "model.n_embd=32",
    "model.n_head=2",
    "model.block_size=16",
    "train.batch_size=4",
    "train.eval_batches=4",
    "train.log_every=1000",
    "train.steps=4",
    "sync.H=2",
    "run.baseline=none",
]
MODES = ("fresh", "forked, zygote starting", "forked")


def launch(mode: str, out: Path) -> float:
    if mode == "forked, zygote starting":
        spawn.stop_zygote()
    cfg = load_config(None, RUN)
    t = time.perf_counter()
    summary = launch_local(cfg, out, console_print=None, fork=mode != "fresh")
    elapsed = time.perf_counter() - t
    assert summary["steps"] == 4 and summary["world_size"] == 4, summary
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    times: dict[str, list[float]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        launch("forked", Path(tmp) / "warm-up")  # file caches; not counted
        for rep in range(args.reps):
            for i in range(len(MODES)):
                mode = MODES[(rep + i) % len(MODES)]
                times[mode].append(launch(mode, Path(tmp) / f"{rep}-{i}"))
    spawn.stop_zygote()
    median = {m: statistics.median(v) for m, v in times.items()}
    print(f"{'mode':<26}{'median s':>10}{'min s':>8}{'max s':>8}{'vs fresh':>10}")
    for m in MODES:
        print(f"{m:<26}{median[m]:>10.2f}{min(times[m]):>8.2f}{max(times[m]):>8.2f}{median[m] / median['fresh']:>9.2f}x")
    if args.json:
        result = {
            "run": RUN,
            "reps": args.reps,
            "cores": len(os.sched_getaffinity(0)),
            "python": platform.python_version(),
            "seconds": times,
            "median_s": median,
            "ratio_to_fresh": {m: median[m] / median["fresh"] for m in MODES},
        }
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
