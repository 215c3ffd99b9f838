"""``geotrain chaos``: a bounded soak of elastic training under random site failures, quiet or
with the machine's cores kept busy.

N sites (one worker each, a small model) train DiLoCo for a fixed number of rounds while
randomly chosen sites are SIGKILLed or SIGSTOPped — most of them in the middle of the cross-site
all-reduce, the rest during inner steps — and restarted ``restart_after`` seconds later (they
heal from a live peer). The plan is drawn from ``seed`` before the run; a site is never hit
again before it can have rejoined. The report says, from every site's round records, how many
rounds committed or rolled back, whether every committed round maps to one global model and all
survivors end identical, how much wall time each failure cost the survivors, and the goodput:
the steps whose work committed rounds took in, per second, as a share of what the same sites
commit per second in a run of the same config without failures, under the same load (run
beside the seeds; the failure schedule is written in each run's report).

With ``cpu_hogs`` > 0, that many busy-looping processes run beside the soak (one per core to
load the machine fully): each is bounded in time and stopped by its PID when the soak ends.
"""

from __future__ import annotations

import contextlib
import os
import random
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from geotrain.config import Config
from geotrain.config.load import model_from_data


def plan_faults(sites: list[str], rounds: int, H: int, failures: int, spacing: int, seed: int) -> list[tuple[str, int, str]]:
    """``failures`` (site, step, kind) picks over rounds 2..rounds-2: one per round at most, spread
    out (every other round while there is room), a site at least ``spacing`` rounds after its
    previous fault; 70% at a round's last step (in the all-reduce), the rest at a random inner step."""
    rng = random.Random(seed)
    candidates = list(range(2, max(2, rounds - 1)))
    last: dict[str, int] = {}
    plan: list[tuple[str, int, str]] = []
    previous = -2
    for r in sorted(candidates):
        if len(plan) == failures:
            break
        if r - previous < 2 and len(plan) + (rounds - 1 - r) // 2 >= failures:  # spread out while it can
            continue
        free = [s for s in sites if r - last.get(s, -spacing) >= spacing]
        if not free:
            continue
        site = rng.choice(free)
        last[site] = previous = r
        step = r * H if rng.random() < 0.7 else (r - 1) * H + rng.randint(1, H - 1)
        plan.append((site, step, rng.choice(["kill", "hang"])))
    return plan


def chaos_config(
    sites: int,
    rounds: int,
    H: int,
    failures: int,
    seed: int,
    restart_after: float,
    spacing: int,
    workers: int = 1,
    overrides: list[str] | None = None,
) -> Config:
    """The soak's config: ``sites`` sites of ``workers`` each, a failure plan drawn from ``seed``,
    then ``overrides`` (``KEY=VALUE``, as ``geotrain train --set``: any combination to soak).

    Raises:
        ConfigError: an override names a bad field or value (one line).
    """
    names = [chr(ord("A") + i) for i in range(sites)]
    plan = plan_faults(names, rounds, H, failures, spacing, seed)
    return model_from_data(
        Config,
        {
            "topology": {"sites": [{"name": n, "workers": workers} for n in names]},
            "model": {"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 32},
            "train": {"steps": rounds * H, "batch_size": 8, "eval_every": 0, "log_every": 100_000, "eval_batches": 4},
            "optim": {"warmup_steps": 0},
            "sync": {"algorithm": "diloco", "H": H},
            "run": {"baseline": "none"},
            "elastic": {"enabled": True, "min_sites": 2},
            "fault": {
                "kill": [f"{s}@{step}" for s, step, k in plan if k == "kill"],
                "hang": [f"{s}@{step}" for s, step, k in plan if k == "hang"],
                "restart_after": restart_after,
            },
        },
        overrides,
    )


_HOG = """
import os, sys, time
from geotrain.comm.procs import die_with_parent
die_with_parent()
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    pass
"""


@contextlib.contextmanager
def cpu_hogs(n: int, seconds: float) -> Iterator[list[int]]:
    """``n`` busy-looping processes for at most ``seconds`` (they also die with this process);
    yields their PIDs and stops them by PID on exit."""
    env = {**os.environ, "GEOTRAIN_PARENT_PID": str(os.getpid())}
    procs = [subprocess.Popen([sys.executable, "-c", _HOG, str(seconds)], env=env) for _ in range(n)]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def run_chaos(
    out: Path,
    sites: int = 4,
    rounds: int = 30,
    H: int = 200,
    failures: int = 12,
    seed: int = 0,
    restart_after: float = 1.0,
    spacing: int = 6,
    console_print: Any = print,
    hogs: int = 0,
    hog_seconds: float = 3600.0,
    workers: int = 1,
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """Run the soak (with ``hogs`` busy-looping processes beside it); the report (also the
    summary's essentials)."""
    from geotrain.elastic.records import read_rounds, useful_steps
    from geotrain.launch.local import launch_local

    cfg = chaos_config(sites, rounds, H, failures, seed, restart_after, spacing, workers, overrides)
    with cpu_hogs(hogs, hog_seconds) as hog_pids:
        summary = launch_local(cfg, out, console_print=console_print)
    injected = [f for f in summary["failures"] if f["kind"] in ("kill", "hang")]
    lost = summary["seconds_lost"]
    useful = useful_steps(read_rounds(out), tiers=cfg.topology.regions is not None and cfg.sync.region_every > 0)
    schedule = [
        {"site": s, "step": int(at), "kind": kind}
        for kind in ("kill", "hang")
        for s, at in (f.split("@") for f in getattr(cfg.fault, kind))
    ]
    return {
        "seed": seed,
        "cpu_hogs": hogs,
        "cpu_hog_pids": hog_pids,
        "sites": sites,
        "workers": workers,
        "overrides": list(overrides or []),
        "codec": cfg.sync.codec.name,
        "H": H,
        "rounds_planned": rounds,
        "failures_planned": len(cfg.fault.kill) + len(cfg.fault.hang),
        "schedule": sorted(schedule, key=lambda f: (f["step"], f["site"])),
        "restart_after_s": restart_after,
        "useful_site_steps": useful,
        "useful_steps_per_second": sum(useful.values()) / summary["wall_seconds"],
        "rounds": summary["rounds"],
        "committed": summary["rounds"] - summary["rounds_rolled_back"] - summary["rounds_split"],
        "global_rounds_committed": summary["rounds_committed"],
        "rolled_back": summary["rounds_rolled_back"],
        "split_then_healed": summary["rounds_split"],
        "failures_injected": len(injected),
        "failures_skipped": len(summary["faults_skipped"]),
        "consistent": summary["consistent"],
        "seconds_lost": lost,
        "seconds_lost_per_failure": lost / max(1, len(injected)),
        "bound_seconds": 2 * summary["heartbeat_timeout_s"] + summary["round_seconds"],
        "round_seconds": summary["round_seconds"],
        "heartbeat_timeout_s": summary["heartbeat_timeout_s"],
        "survivors": summary["survivors"],
        "global_param_hash": summary["global_param_hash"],
        "failures": summary["failures"],
        "max_detection_seconds": max((f["detection_seconds"] or 0.0 for f in injected), default=0.0),
        "max_excluded_after_seconds": max((f["excluded_after_seconds"] or 0.0 for f in injected), default=0.0),
        # restarted and healed before any quorum left it out: the others never had to act
        "healed_before_excluded": sum(
            1 for f in injected if f["excluded_after_seconds"] is None and f["healed_after_seconds"] is not None
        ),
        "final_eval_loss": summary["final_eval_loss"],
        "wall_seconds": summary["wall_seconds"],
    }


def run_soaks(out: Path, seeds: list[int], hog_counts: list[int], reference: bool = True, **kwargs: Any) -> dict[str, Any]:
    """:func:`run_chaos` for every load in ``hog_counts`` and every seed (each run in its own
    folder), and per load (with ``reference``) one run of the same config without failures, the
    goodput's denominator; the runs, the references and, per load, the totals."""
    refs = {}
    if reference:
        refs = {h: run_chaos(out / f"reference-hogs{h}", hogs=h, **{**kwargs, "failures": 0}) for h in hog_counts}
    runs = [run_chaos(out / f"seed{s}-hogs{h}", seed=s, hogs=h, **kwargs) for h in hog_counts for s in seeds]
    for r in runs:
        ref = refs.get(r["cpu_hogs"])
        r["goodput"] = r["useful_steps_per_second"] / ref["useful_steps_per_second"] if ref else None
        # a run without failures loses a few seconds too (quorum waits above their median): per failure, beyond those
        r["seconds_lost_per_failure_beyond_reference"] = (
            (r["seconds_lost"] - ref["seconds_lost"]) / max(1, r["failures_injected"]) if ref else None
        )
    summary = []
    for h in hog_counts:
        rs = [r for r in runs if r["cpu_hogs"] == h]
        summary.append(
            {
                "cpu_hogs": h,
                "runs": len(rs),
                "all_consistent": all(r["consistent"] for r in rs),
                "rounds": sum(r["rounds"] for r in rs),
                "committed": sum(r["committed"] for r in rs),
                "rolled_back": sum(r["rolled_back"] for r in rs),
                "split_then_healed": sum(r["split_then_healed"] for r in rs),
                "failures_injected": sum(r["failures_injected"] for r in rs),
                "mean_seconds_lost_per_failure": statistics.mean(r["seconds_lost_per_failure"] for r in rs),
                "mean_seconds_lost_per_failure_beyond_reference": (
                    statistics.mean(r["seconds_lost_per_failure_beyond_reference"] for r in rs) if h in refs else None
                ),
                "max_detection_seconds": max(r["max_detection_seconds"] for r in rs),
                "max_excluded_after_seconds": max(r["max_excluded_after_seconds"] for r in rs),
                "healed_before_excluded": sum(r["healed_before_excluded"] for r in rs),
                "goodput": [r["goodput"] for r in rs],
                "mean_goodput": statistics.mean(r["goodput"] for r in rs) if h in refs else None,
                "reference_useful_steps_per_second": refs[h]["useful_steps_per_second"] if h in refs else None,
            }
        )
    return {"runs": runs, "references": list(refs.values()), "summary": summary}


def chaos_table(report: dict[str, Any], title: str) -> Any:
    """One row per run of :func:`run_soaks`' report (a rich Table)."""
    from rich.table import Table

    table = Table(title=title)
    cols = ["hogs", "seed", "rounds", "committed", "rolled back", "split", "failures", "consistent"]
    # seconds lost per failure (beyond what the run without failures lost to slow quorums)
    for col in [*cols, "healed early", "s lost/failure (net)", "max detect s", "goodput"]:
        table.add_column(col, justify="right")
    for r in [*report.get("references", []), *report["runs"]]:
        keys = ("cpu_hogs", "seed", "rounds", "committed", "rolled_back", "split_then_healed", "failures_injected", "consistent")
        cells = [str(r[k]) for k in (*keys, "healed_before_excluded")]
        if "goodput" not in r:
            cells[1] = "ref"
        goodput = "(ref)" if "goodput" not in r else "-" if r["goodput"] is None else f"{100 * r['goodput']:.1f}%"
        lost = f"{r['seconds_lost']:.2f} in all" if "goodput" not in r else f"{r['seconds_lost_per_failure']:.2f}"
        beyond = r.get("seconds_lost_per_failure_beyond_reference")
        lost += f" ({beyond:.2f})" if beyond is not None else ""
        table.add_row(*cells, lost, f"{r['max_detection_seconds']:.2f}", goodput)
    return table


def schedule_lines(report: dict[str, Any]) -> list[str]:
    """One line per run of :func:`run_soaks`' report: the failure schedule it ran."""
    return [
        f"seed {r['seed']}, {r['cpu_hogs']} hogs: "
        + (", ".join(f"{f['kind']} {f['site']}@{f['step']}" for f in r["schedule"]) or "no failures")
        + f"; each restarted {r['restart_after_s']:g} s later"
        for r in report["runs"]
    ]
