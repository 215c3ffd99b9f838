"""The run of ``geotrain bench tiers`` where the wide-area link slows 10x mid-run and geotrain
adapts (``sync.adapt``, :mod:`geotrain.round.adapt`), with DiLoCo or (``--adapt-algorithm
streaming``) Streaming DiLoCo, whose fragment count is chosen too.

Flat DiLoCo over the tiers benchmark's two regions of two sites (10 Gbit/s inside a region,
10 Mbit/s and 40 ms between regions). After ``slowdown_s`` seconds the links between regions
become 10x slower (``topology.links.changes``). After every round the job measures the link and
picks H (``H_min..H_max``) and the codec for the next to hold the target utilisation. The
result is a timeline of H, codec and utilisation, and how many rounds it took to follow the
slowdown (target: at most 2).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from geotrain.config import CODEC_BITS, Config

STREAMING_TAU = 10  # streaming: steps a fragment's exchange hides behind (more than the 240 ms latency term here)
STREAMING_FRAGMENTS = [1, 2, 4, 8]


def _algorithm(algorithm: str, adapt: str) -> list[str]:
    """The algorithm (streaming: tau=10, 4 fragments to start), ``sync.adapt={adapt}``, and no
    evaluation inside rounds (it would count as compute in the measurement)."""
    return [
        f"sync.algorithm={algorithm}",
        *([f"sync.tau={STREAMING_TAU}", "sync.fragments=4"] if algorithm == "streaming" else []),
        f"sync.adapt={{{adapt}}}",
        "train.eval_every=1000000",
    ]


def _slowest(a: dict[str, Any]) -> dict[str, Any]:
    """Of one adaptation log entry: the busy fraction of the slowest site (the formula's T is its
    step time; faster sites also wait for it), of the least busy, and the link in Mbit/s (None:
    nothing crossed sites)."""
    return {
        "utilization": a["utilization"][a["step_s"].index(max(a["step_s"]))],
        "utilization_min": min(a["utilization"]),
        "link_mbps": None if a["link_bps"] is None else a["link_bps"] / 1e6,
    }


def adapt_overrides(slowdown_s: float, target: float, H_min: int, H_max: int, algorithm: str = "diloco") -> list[str]:
    """``algorithm`` streaming: Streaming DiLoCo with tau=10, the fragment count chosen too (1, 2, 4 or 8)."""
    if algorithm == "streaming":
        H_min, frags = max(H_min, STREAMING_TAU + 1), f", fragments: {STREAMING_FRAGMENTS}"
    else:
        frags = ""
    return [
        *_algorithm(algorithm, f"target: {target}, H_min: {H_min}, H_max: {H_max}{frags}"),
        f"topology.links.changes=[{{after_s: {slowdown_s}, bandwidth_scale: 0.1}}]",
    ]


def held_overrides(algorithm: str, H: int) -> list[str]:
    """Adaptation pinned to one setting (H, fp32, and for streaming 4 fragments) on a steady link:
    every round measures and predicts the utilisation of the settings it ran, so the formula's
    accuracy shows without any change of settings."""
    frags = ", fragments: [4]" if algorithm == "streaming" else ""
    return _algorithm(algorithm, f"target: 0.8, H_min: {H}, H_max: {H}, codecs: [none]{frags}")


def held_record(summary: dict[str, Any]) -> dict[str, Any]:
    """Per round of the pinned run: the slowest site's measured busy fraction and the formula's
    prediction for the same settings from that round's own measurements; medians without the
    first (warm-up) and the last (shorter) rounds."""
    rounds = [
        {
            "round": a["round"],
            "H": a["H"],
            "fragments": a.get("fragments", 1),
            **_slowest(a),
            "predicted_utilization": a["next"]["predicted_utilization"],
            # streaming: the formula on the link's transfer-time bandwidth alone, without the exposure
            "predicted_on_link": a.get("predicted_on_link"),
            "step_ms": 1e3 * max(a["step_s"]),
        }
        for a in summary["adapt"]
    ]
    core = [r for r in rounds[1:-1] if r["predicted_utilization"] is not None]
    on_link = [r["predicted_on_link"] for r in core if r["predicted_on_link"] is not None]
    return {
        "rounds": rounds,
        "median_utilization": statistics.median(r["utilization"] for r in core) if core else None,
        "median_predicted": statistics.median(r["predicted_utilization"] for r in core) if core else None,
        "median_predicted_on_link": statistics.median(on_link) if on_link else None,
        "utilization": summary["utilization"],
        "wan_wait_seconds": summary["wan_wait_seconds"],
        "wall_seconds": summary["wall_seconds"],
        "steps": summary["steps"],
    }


def adapt_record(summary: dict[str, Any], cfg: Config, slowdown_s: float) -> dict[str, Any]:
    """What the benchmark keeps of the adaptive run: the timeline and how fast it followed the slowdown."""
    log = summary["adapt"]
    timeline = [
        {
            "round": a["round"],
            "t_s": a["t_s"],
            "H": a["H"],
            "codec": a["codec"],
            "bits": CODEC_BITS[a["codec"]],
            **_slowest(a),
            "rtt_ms": 1e3 * a["rtt_s"],
            "next_H": a["next"]["H"],
            "next_codec": a["next"]["codec"],
            **({"fragments": a["fragments"], "next_fragments": a["next"]["fragments"]} if "fragments" in a else {}),
            "predicted_utilization": a["next"]["predicted_utilization"],
            "changed": a["changed"],
            "why": a["why"],
        }
        for a in log
    ]
    # rounds from the first one that ended after the slowdown to the first that measured it (its
    # bandwidth under half the median before, same codec): the choice made there is the planner's
    # answer for the slowed link, and the next round runs it
    first = next((i for i, a in enumerate(timeline) if a["t_s"] >= slowdown_s), None)
    follow = None
    if first is not None:
        measured = [a for a in timeline if a["link_mbps"] is not None]
        same = [a["link_mbps"] for a in timeline[:first] if a["codec"] == timeline[first]["codec"] and a in measured]
        ref = statistics.median(same) if same else measured[0]["link_mbps"]
        seen = next((i for i in range(first, len(timeline)) if (timeline[i]["link_mbps"] or ref) < ref / 2), None)
        follow = None if seen is None else seen - first + 1
    return {
        "mode": "adaptive",
        "algorithm": cfg.sync.algorithm,
        "slowdown_s": slowdown_s,
        "target": cfg.sync.adapt.target if cfg.sync.adapt else None,
        "timeline": timeline,
        "rounds_to_follow": follow,
        "follow_met": follow is not None and follow <= 2,
        "slow_tier_bytes": summary["inter_region_bytes"],
        "eval_loss": summary["final_eval_loss"],
        "utilization": summary["utilization"],
        "tokens": summary["tokens"],
        "wall_seconds": summary["wall_seconds"],
    }


def plot_adapt(run: dict[str, Any], path: Path) -> Path:
    """H, codec bits and utilisation against time, the slowdown marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = run["timeline"]
    t = [a["t_s"] for a in tl]
    frags = "next_fragments" in tl[0]
    fig, axes = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    axes[0].step(t, [a["next_H"] for a in tl], where="post", label="H chosen for the next round")
    axes[0].set_ylabel("H (inner steps)")
    if frags:  # Streaming DiLoCo: the fragment count on the same axes' twin
        twin = axes[0].twinx()
        twin.step(t, [a["next_fragments"] for a in tl], where="post", color="tab:purple", ls="--", label="fragments chosen")
        twin.set_ylabel("fragments")
        twin.legend(loc="upper left", fontsize=8)
    axes[1].step(t, [CODEC_BITS[a["next_codec"]] for a in tl], where="post", color="tab:orange", label="codec chosen")
    axes[1].set_yticks([4, 8, 16, 32], ["fp4", "int8", "bf16", "fp32"])
    axes[1].set_ylabel("codec (bits)")
    axes[2].plot(
        t, [100 * a["utilization"] for a in tl], "o-", color="tab:green", label="measured, slowest site (round ending here)"
    )
    axes[2].plot(t, [100 * a["utilization_min"] for a in tl], ".:", color="tab:olive", label="measured, least busy site")
    axes[2].plot(t, [100 * a["predicted_utilization"] for a in tl], "x--", color="gray", label="predicted for the next round")
    axes[2].axhline(100 * run["target"], color="gray", lw=0.8, ls=":")
    axes[2].set_ylabel("utilisation (%)")
    axes[2].set_ylim(0, 105)
    axes[2].set_xlabel("seconds into the run (end of each round)")
    for ax in axes:
        ax.axvline(run["slowdown_s"], color="tab:red", lw=1, ls="--")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    follow = run["rounds_to_follow"]
    what = "Streaming DiLoCo" if run.get("algorithm") == "streaming" else "DiLoCo"
    fig.suptitle(
        f"{what}: links between regions 10x slower at {run['slowdown_s']:g} s; followed in "
        f"{follow if follow is not None else '-'} round(s)"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
