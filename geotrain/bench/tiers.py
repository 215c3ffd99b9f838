"""``geotrain bench tiers``: multi-tier DiLoCo against flat DiLoCo at equal tokens.

Two regions of two sites (one worker each): 10 Gbit/s, 1 ms between the sites of a region,
10 Mbit/s, 40 ms between regions. The default model trains for the same steps in each mode:

* ``flat``: DiLoCo every H steps across all four sites (the regions only shape the links);
* ``tiered``: ``sync.region_every=4``, DiLoCo's outer step inside each region every H steps and
  plain averaging of the regions' models every 4H (``tier_outer=region``, the arrangement geotrain
  uses);
* ``tiered-world``: plain averaging inside a region, the outer step across regions every 4H
  (``tier_outer=world``; the default until it was measured against ``tiered``);
* ``tiered-both``: the outer optimizer at both tiers (``tier_outer=both``, HALoS-like);
* ``flat-same-bytes``: flat DiLoCo every 4H steps, the same bytes over the slow tier as
  ``tiered`` (what the region tier buys at equal slow-tier traffic).

It writes ``runs: [{mode, seed, slow_tier_bytes, eval_loss, utilization, ...}]`` and the targets.

Then one more run (first seed), ``adaptive``: flat DiLoCo (or, ``adapt_algorithm="streaming"``,
Streaming DiLoCo) with ``sync.adapt`` while the links between regions slow 10x mid-run
(:mod:`geotrain.bench.adapt`): its timeline of H, codec (fragments) and utilisation is
``adaptive``. ``adapt_only`` runs only that, then ``held``: the same link, no slowdown, the
settings pinned (H=47, fp32, 4 fragments), each round's measured busy fraction beside the
formula's prediction for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from geotrain.bench.adapt import adapt_overrides, adapt_record, held_overrides, held_record
from geotrain.bench.common import table
from geotrain.config import Config, load_config

REGION_EVERY = 4
HELD_H, HELD_STEPS = 47, 500  # --adapt-only: the settings held to check the formula (H=47, fp32)
MODES = {
    "flat": ["sync.region_every=0"],
    "tiered": [f"sync.region_every={REGION_EVERY}", "sync.tier_outer=region"],
    "tiered-world": [f"sync.region_every={REGION_EVERY}", "sync.tier_outer=world"],
    "tiered-both": [f"sync.region_every={REGION_EVERY}", "sync.tier_outer=both"],
    "flat-same-bytes": ["sync.region_every=0"],  # flat at H = REGION_EVERY x H1: tiered's slow-tier bytes
}
TOPOLOGY = (
    "topology.sites=[{name: A, workers: 1}, {name: B, workers: 1}, {name: C, workers: 1}, {name: D, workers: 1}]",
    "topology.regions=[{name: eu, sites: [A, B], link: {bandwidth_bps: 1.0e+10, latency_s: 0.001}}, "
    "{name: us, sites: [C, D], link: {bandwidth_bps: 1.0e+10, latency_s: 0.001}}]",
    "topology.links.inter.bandwidth_bps=1e7",
    "topology.links.inter.latency_s=0.04",
)


def tiers_config(mode: str, steps: int, H: int, seed: int, extra: list[str] | None = None) -> Config:
    return load_config(
        None,
        [
            *TOPOLOGY,
            "sync.algorithm=diloco",
            f"sync.H={REGION_EVERY * H if mode == 'flat-same-bytes' else H}",
            *MODES[mode],
            "guard.enabled=false",  # in every mode: its norm exchanges would add to the bytes compared
            f"train.steps={steps}",
            f"train.seed={seed}",
            "train.save_final=false",
            "run.baseline=none",
            *(extra or []),
        ],
    )


def bench_tiers(
    out: Path,
    steps: int = 300,
    H: int = 25,
    seeds: tuple[int, ...] = (0, 1),
    extra: list[str] | None = None,
    progress: Callable[[str], None] = print,
    adapt_steps: int = 1200,
    slowdown_s: float = 60.0,
    adapt_target: float = 0.8,
    adapt_algorithm: str = "diloco",
    adapt_only: bool = False,
) -> dict[str, Any]:
    from geotrain.launch.local import launch_local

    t_start = time.perf_counter()
    runs: list[dict[str, Any]] = []
    for seed in () if adapt_only else seeds:
        for mode in MODES:
            s = launch_local(tiers_config(mode, steps, H, seed, extra), out / f"{mode}-{seed}", console_print=None)
            runs.append(
                {
                    "mode": mode,
                    "seed": seed,
                    "slow_tier_bytes": s["inter_region_bytes"],
                    "inter_site_bytes": s["inter_site_bytes"],
                    "eval_loss": s["final_eval_loss"],
                    "utilization": s["utilization"],
                    "tokens": s["tokens"],
                    "world_rounds": s["rounds"],
                    "region_rounds": s["region_rounds"],
                    "wall_seconds": s["wall_seconds"],
                }
            )
            progress(
                f"{mode:>15} seed {seed}: loss {s['final_eval_loss']:.4f}, slow tier {s['inter_region_bytes'] / 1e6:.1f} MB, "
                f"busy {s['utilization']:.0%}"
            )
    adaptive = None
    if adapt_steps:
        cfg = tiers_config(
            "flat",
            adapt_steps,
            H,
            seeds[0],
            [*(extra or []), *adapt_overrides(slowdown_s, adapt_target, 10, 200, adapt_algorithm)],
        )
        adaptive = adapt_record(launch_local(cfg, out / "adaptive", console_print=None), cfg, slowdown_s)
        progress(
            f"{'adaptive':>15} seed {seeds[0]}: {len(adaptive['timeline'])} rounds, links 10x slower at {slowdown_s:g} s, "
            f"followed in {adaptive['rounds_to_follow']} round(s)"
        )
    if adapt_only:  # and the formula's accuracy with the settings held (no change, no slowdown)
        cfg = tiers_config("flat", HELD_STEPS, HELD_H, seeds[0], [*(extra or []), *held_overrides(adapt_algorithm, HELD_H)])
        held = {"H": HELD_H, **held_record(launch_local(cfg, out / "held", console_print=None))}
        progress(
            f"{'held':>15} seed {seeds[0]}: H={HELD_H}, fp32: {held['median_utilization']:.1%} busy, "
            f"{held['median_predicted']:.1%} predicted (medians)"
        )
        return {"adaptive": adaptive, "held": held, "bench_seconds": time.perf_counter() - t_start}
    means = {
        m: {k: sum(r[k] for r in runs if r["mode"] == m) / len(seeds) for k in ("slow_tier_bytes", "eval_loss", "utilization")}
        for m in MODES
    }
    return {
        "steps": steps,
        "H": H,
        "seeds": list(seeds),
        "runs": runs,
        "means": means,
        "targets": tiers_targets(means),
        "adaptive": adaptive,
        "bench_seconds": time.perf_counter() - t_start,
    }


def tiers_targets(means: dict[str, dict[str, float]]) -> dict[str, Any]:
    flat, tiered, same = means["flat"], means["tiered"], means["flat-same-bytes"]
    ratio = flat["slow_tier_bytes"] / max(1.0, tiered["slow_tier_bytes"])
    gap = tiered["eval_loss"] / flat["eval_loss"] - 1
    return {
        "slow_tier_bytes_ratio": ratio,
        "bytes_met": ratio >= 4,
        "tiered_loss_vs_flat": gap,
        "loss_met": abs(gap) <= 0.01,
        "tiered_world_loss_vs_flat": means["tiered-world"]["eval_loss"] / flat["eval_loss"] - 1,
        "tiered_both_loss_vs_flat": means["tiered-both"]["eval_loss"] / flat["eval_loss"] - 1,
        "tiered_loss_vs_flat_same_bytes": tiered["eval_loss"] / same["eval_loss"] - 1,
    }


def print_tiers(result: dict[str, Any], console: Any) -> None:
    if "runs" not in result:  # adapt_only
        print_adapt(result["adaptive"], console)
        h = result["held"]
        on_link = h["median_predicted_on_link"]
        console.print(
            f"held at H={h['H']}, fp32, no slowdown: the slowest site {h['median_utilization']:.1%} busy against "
            f"{h['median_predicted']:.1%} predicted (medians of {len(h['rounds']) - 2} rounds)"
            + ("" if on_link is None else f", {on_link:.1%} by the formula on the link's transfer time alone")
            + f"; {h['utilization']:.1%} over the run"
        )
        return
    t = table(
        f"bench tiers: 2 regions x 2 sites, 10 Gbit/s inside, 10 Mbit/s 40 ms across; {result['steps']} steps, H={result['H']}",
        ["mode", "seed", "world rounds", "region rounds", "slow-tier bytes", "all inter-site bytes", "eval loss", "utilisation"],
    )
    for r in result["runs"]:
        t.add_row(
            r["mode"], str(r["seed"]), str(r["world_rounds"]), str(r["region_rounds"]), f"{r['slow_tier_bytes'] / 1e6:.1f} MB",
            f"{r['inter_site_bytes'] / 1e6:.1f} MB", f"{r['eval_loss']:.4f}", f"{r['utilization']:.1%}",
        )  # fmt: skip
    console.print(t)
    tg = result["targets"]
    console.print(
        f"tiered sends {tg['slow_tier_bytes_ratio']:.2f}x fewer slow-tier bytes than flat (target >= 4x: "
        f"{'met' if tg['bytes_met'] else 'MISSED'}); eval loss {tg['tiered_loss_vs_flat']:+.2%} vs flat (target within 1%: "
        f"{'met' if tg['loss_met'] else 'MISSED'}); the outer step across regions only {tg['tiered_world_loss_vs_flat']:+.2%}, "
        f"at both tiers {tg['tiered_both_loss_vs_flat']:+.2%}; "
        f"tiered vs flat at {REGION_EVERY}H (the same slow-tier bytes) {tg['tiered_loss_vs_flat_same_bytes']:+.2%}"
    )
    if result.get("adaptive"):
        print_adapt(result["adaptive"], console)
    console.print(f"bench took {result['bench_seconds'] / 60:.1f} min")


def print_adapt(run: dict[str, Any], console: Any) -> None:
    t = table(
        f"adaptive: flat {'Streaming DiLoCo' if run.get('algorithm') == 'streaming' else 'DiLoCo'}, sync.adapt (target "
        f"{run['target']:.0%}), links between regions 10x slower at {run['slowdown_s']:g} s",
        [
            "round",
            "ends at",
            "H",
            "codec",
            "fragments",
            "link",
            "rtt",
            "busy (slowest site)",
            "busy (least)",
            "next H",
            "next codec",
            "predicted",
        ],
    )
    for a in run["timeline"]:
        link, pred = a["link_mbps"], a["predicted_utilization"]
        t.add_row(
            str(a["round"]), f"{a['t_s']:.1f} s", str(a["H"]), a["codec"], str(a.get("fragments", "-")),
            "-" if link is None else f"{link:.2f} Mbit/s", f"{a['rtt_ms']:.0f} ms",
            f"{a['utilization']:.1%}", f"{a['utilization_min']:.1%}", str(a["next_H"]), a["next_codec"],
            "-" if pred is None else f"{pred:.1%}",
        )  # fmt: skip
    console.print(t)
    follow = run["rounds_to_follow"]
    console.print(
        f"the slowdown was followed in {follow if follow is not None else 'no'} round(s) after the first round that crossed "
        f"the slowed links (target <= 2: {'met' if run['follow_met'] else 'MISSED'})"
    )
