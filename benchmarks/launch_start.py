"""How long a local run takes to start: ranks forked from the zygote against a fresh interpreter
per rank (docs/DESIGN.md §5).

One tiny run (2 sites x 2 workers, 4 steps) launched again and again, in three ways, in rotating
order so that machine noise hits all alike:

- ``fresh``: every rank a new ``python -m geotrain.run.worker`` (as before the zygote);
- ``forked, zygote starting``: the zygote is stopped first, so the launch pays its imports;
- ``forked``: the zygote is already running (every launch after the first in one process).

The statistic is the median over repetitions of the launch's wall time, from ``launch_local``'s
call to its return (start, rendezvous, 4 steps, evaluation, summary).

The same run through the command line, ``python -m geotrain train`` from the interpreter's start
to its exit (outputs and plot included), in three ways, also rotating, with the CPU seconds of
the whole process tree (the launcher's children's, each process reaped by its parent):

- ``cli``: the launcher imports torch and forks itself into the zygote before its own checks,
  which then overlap the zygote's import of the worker (since 2026-11-27);
- ``cli, fresh zygote``: ``GEOTRAIN_ZYGOTE_FORK=0``, the zygote is a fresh interpreter started
  before the checks, so it imports torch a second time (2026-11-26 to 27);
- ``cli, zygote after checks``: ``GEOTRAIN_ZYGOTE_EARLY=0``, the zygote starts with the first rank
  (as before 2026-11-26).

Prints a table and writes JSON.

    python benchmarks/launch_start.py [--reps 5] [--json benchmarks/results/launch_start.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
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
CLI_MODES = ("cli", "cli, fresh zygote", "cli, zygote after checks")
CLI_ENV = {
    "cli": {"GEOTRAIN_ZYGOTE_EARLY": "1", "GEOTRAIN_ZYGOTE_FORK": "1"},
    "cli, fresh zygote": {"GEOTRAIN_ZYGOTE_EARLY": "1", "GEOTRAIN_ZYGOTE_FORK": "0"},
    "cli, zygote after checks": {"GEOTRAIN_ZYGOTE_EARLY": "0", "GEOTRAIN_ZYGOTE_FORK": "1"},
}


def launch(mode: str, out: Path) -> float:
    if mode == "forked, zygote starting":
        spawn.stop_zygote()
    cfg = load_config(None, RUN)
    t = time.perf_counter()
    summary = launch_local(cfg, out, console_print=None, fork=mode != "fresh")
    elapsed = time.perf_counter() - t
    assert summary["steps"] == 4 and summary["world_size"] == 4, summary
    return elapsed


def launch_cli(mode: str, out: Path) -> tuple[float, float]:
    """The wall and CPU seconds (user + system, the whole process tree) of one ``geotrain train``."""
    cmd = [sys.executable, "-m", "geotrain", "train", "--out", str(out), *(x for o in RUN for x in ("--set", o))]
    env = {**os.environ, **CLI_ENV[mode]}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    elapsed = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert json.loads((out / "summary.json").read_text())["runs"][0]["steps"] == 4
    return elapsed, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def table(times: dict[str, list[float]], base: str) -> dict[str, float]:
    median = {m: statistics.median(v) for m, v in times.items()}
    print(f"{'mode':<26}{'median s':>10}{'min s':>8}{'max s':>8}{'vs ' + base:>{max(10, len(base) + 5)}}")
    for m, v in times.items():
        print(f"{m:<26}{median[m]:>10.2f}{min(v):>8.2f}{max(v):>8.2f}{median[m] / median[base]:>9.2f}x")
    return median


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
        cli: dict[str, list[float]] = {m: [] for m in CLI_MODES}
        cpu: dict[str, list[float]] = {m: [] for m in CLI_MODES}
        for rep in range(args.reps):
            for i in range(len(CLI_MODES)):
                mode = CLI_MODES[(rep + i) % len(CLI_MODES)]
                wall, used = launch_cli(mode, Path(tmp) / f"cli-{rep}-{i}")
                cli[mode].append(wall)
                cpu[mode].append(used)
    median = table(times, "fresh")
    print()
    cli_median = table(cli, "cli, zygote after checks")
    print("\nCPU seconds of the process tree")
    cpu_median = table(cpu, "cli, zygote after checks")
    if args.json:
        result = {
            "run": RUN,
            "reps": args.reps,
            "cores": len(os.sched_getaffinity(0)),
            "python": platform.python_version(),
            "seconds": times,
            "median_s": median,
            "ratio_to_fresh": {m: median[m] / median["fresh"] for m in MODES},
            "cli_seconds": cli,
            "cli_median_s": cli_median,
            "cli_ratio": cli_median["cli"] / cli_median["cli, zygote after checks"],
            "cli_cpu_seconds": cpu,
            "cli_cpu_median_s": cpu_median,
        }
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
