"""How long ``geotrain plan`` takes for every shipped scenario (scenarios/plan/*.yaml), on one
core: the median and the maximum of ``--reps`` runs. Prints a table, writes JSON. Target: under
1 s per scenario (the planner is closed forms; a search over layouts must stay interactive).

    python benchmarks/plan_perf.py [--reps 20] [--json benchmarks/results/plan_perf.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from geotrain.plan.run import run_plan
from geotrain.plan.scenario import load_plan

TARGET_SECONDS = 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/plan_perf.json"))
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    rows = []
    for path in sorted(Path("scenarios/plan").glob("*.yaml")):
        scenario = load_plan(path)
        walls = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            run_plan(scenario)
            walls.append(time.perf_counter() - t0)
        rows.append(
            {
                "scenario": path.stem,
                "wall_seconds_median": statistics.median(walls),
                "wall_seconds_max": max(walls),
                "reps": args.reps,
                "target_seconds": TARGET_SECONDS,
                "meets_target": max(walls) < TARGET_SECONDS,
            }
        )
    print(f"{'scenario':<28} {'median ms':>10} {'max ms':>10}  target")
    for r in rows:
        ok = "ok" if r["meets_target"] else "MISSED"
        print(f"{r['scenario']:<28} {r['wall_seconds_median'] * 1e3:>10.2f} {r['wall_seconds_max'] * 1e3:>10.2f}  {ok}")
    out = {"benchmark": "geotrain plan, every shipped scenario, one core", "python": platform.python_version(), "rows": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
