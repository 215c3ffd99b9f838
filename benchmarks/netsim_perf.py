"""How fast ``geotrain netsim`` simulates one synchronized permutation, on one core.

For 1,024 hosts (k=16 three-tier fat tree) and 8,192 hosts (k=32), and each routing: build the
fabric, draw a random permutation, route it and run the event-driven max-min engine to the last
completion. Prints a table, writes JSON. Targets (issue: netsim): under 0.5 s at 1,024 hosts and
under 5 s at 8,192 hosts.

    python benchmarks/netsim_perf.py [--reps 3] [--subflows-8192] [--json benchmarks/results/netsim_perf.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from geotrain.netsim.engine import simulate
from geotrain.netsim.fabric import build_fabric
from geotrain.netsim.routing import route
from geotrain.netsim.sizing import tier_ports
from geotrain.netsim.traffic import derangement

CASES = [(1024, 16, 0.5), (8192, 32, 5.0)]
ROUTINGS = ["ecmp", "spray", "adaptive", "ecmp_subflows"]


def one_run(hosts: int, radix: int, routing: str, seed: int) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    fabric = build_fabric(hosts, tier_ports(radix, 3), 800e9)
    rng = np.random.default_rng(seed)
    size = np.full(hosts, 3e8)
    flows = route(fabric, routing, np.arange(hosts), derangement(hosts, rng), size, rng, subflows=8)
    res = simulate(flows, fabric.link_cap)
    wall = time.perf_counter() - t0
    return wall, res.makespan / (3e8 / fabric.link_cap[0]), res.events


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--subflows-8192", action="store_true", help="also time ecmp_subflows at 8,192 hosts (minutes)")
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/netsim_perf.json"))
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    rows = []
    for hosts, radix, target in CASES:
        for routing in ROUTINGS:
            if routing == "ecmp_subflows" and hosts > 1024 and not args.subflows_8192:
                continue
            reps = 1 if (routing == "ecmp_subflows" and hosts > 1024) else args.reps
            runs = [one_run(hosts, radix, routing, seed) for seed in range(reps)]
            walls = [r[0] for r in runs]
            row = {
                "hosts": hosts,
                "routing": routing,
                "wall_seconds_median": statistics.median(walls),
                "wall_seconds_max": max(walls),
                "reps": reps,
                "makespan_over_optimal": statistics.mean(r[1] for r in runs),
                "events": statistics.mean(r[2] for r in runs),
                "target_seconds": target,
                "meets_target": statistics.median(walls) < target,
            }
            rows.append(row)
            print(
                f"{hosts:>6} {routing:<14} {row['wall_seconds_median']:8.3f} s (max {row['wall_seconds_max']:.3f})"
                f"  target < {target:g} s: {'yes' if row['meets_target'] else 'NO'}"
                f"  makespan/optimal {row['makespan_over_optimal']:.2f}  events {row['events']:.0f}",
                flush=True,
            )
    out = {
        "benchmark": "netsim synchronized permutation, one core",
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
        "numpy": np.__version__,
        "rows": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
