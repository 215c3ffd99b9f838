"""``geotrain bench wan``: real training runs (the default model) swept over inter-site bandwidth
for ddp, diloco, streaming and eager streaming; compute utilisation (compute ÷ wall, min over
ranks), inter-site bytes and final loss; plus a timeline of one run.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from geotrain.bench.common import bps, table
from geotrain.config import Config, load_config


def _ddp_steps(cfg: Config, steps: int, budget_s: float) -> int:
    """Steps for a ddp point: all of ``steps`` unless its wide-area time alone would pass ``budget_s``."""
    from geotrain.models import build_model, count_params

    link = cfg.topology.links.inter
    nbytes = 4 * count_params(build_model(cfg.model))  # per direction per step, hierarchical, 2 sites
    per_step = nbytes * 8 / link.bandwidth_bps + 2 * link.latency_s
    return max(10, min(steps, int(budget_s / per_step)))


def wan_config(algorithm: str, bandwidth_bps: float, latency_s: float, steps: int, extra: list[str] | None = None) -> Config:
    """The default config with ``algorithm`` ('streaming-eager': streaming with sync.eager) on the given link."""
    eager = algorithm == "streaming-eager"
    return load_config(
        None,
        [
            f"sync.algorithm={'streaming' if eager else algorithm}",
            f"sync.eager={str(eager).lower()}",
            "run.baseline=none",
            f"train.steps={steps}",
            "train.save_final=false",
            f"topology.links.inter.bandwidth_bps={bandwidth_bps}",
            f"topology.links.inter.latency_s={latency_s}",
            *(extra or []),
        ],
    )


def bench_wan(
    out: Path,
    speeds: list[float],
    latency_s: float = 0.04,
    algorithms: tuple[str, ...] = ("ddp", "diloco", "streaming", "streaming-eager"),
    steps: int = 150,
    ddp_budget_s: float = 60.0,
    extra: list[str] | None = None,
    timeline_bps: float | None = None,
    progress: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Train every algorithm at every speed (equal steps; ddp fewer where the link is too slow to
    finish in ``ddp_budget_s``) and collect utilisation, bytes and loss; then one streaming run
    with a timeline at ``timeline_bps``. ``extra`` overrides apply to every run (the CLI passes
    ``sync.tau``)."""
    from geotrain.launch.local import launch_local

    points = []
    t_start = time.perf_counter()
    for bw in speeds:
        for alg in algorithms:
            cfg = wan_config(alg, bw, latency_s, steps, extra)
            if alg == "ddp":
                cfg = wan_config(alg, bw, latency_s, _ddp_steps(cfg, steps, ddp_budget_s), extra)
            t0 = time.perf_counter()
            s = launch_local(cfg, out / f"{alg}-{bw:g}", console_print=None)
            points.append(
                {
                    "algorithm": alg,
                    "bandwidth_bps": bw,
                    "latency_s": latency_s,
                    "utilization": s["utilization"],
                    "inter_site_bytes": s["inter_site_bytes"],
                    "final_eval_loss": s["final_eval_loss"],
                    "steps": s["steps"],
                    "H": s["H"],
                    "fragments": s["fragments"],
                    "peak_inter_site_bytes_per_step": s["peak_inter_site_bytes_per_step"],
                    "wan_wait_seconds": s["wan_wait_seconds"],
                    "wall_seconds": s["wall_seconds"],
                }
            )
            progress(
                f"{alg:>9} @ {bw / 1e6:>6g} Mbit/s: utilisation {s['utilization']:.1%}, loss {s['final_eval_loss']:.4f}, "
                f"{s['inter_site_bytes'] / 1e6:.1f} MB ({time.perf_counter() - t0:.0f} s)"
            )
    timeline = None
    if timeline_bps is not None:
        cfg = wan_config("streaming", timeline_bps, latency_s, min(steps, 120), [*(extra or []), "train.timeline=true"])
        launch_local(cfg, out / "timeline-run", console_print=None)
        timeline = str(out / "timeline-run")
    return {
        "points": points,
        "latency_s": latency_s,
        "steps": steps,
        "timeline_run": timeline,
        "targets": wan_targets(points),
        "seconds": time.perf_counter() - t_start,
    }


def wan_targets(points: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, evaluated on the measured points."""
    by = {(p["algorithm"], p["bandwidth_bps"]): p for p in points}
    slow = sorted({bw for (alg, bw), p in by.items() if alg == "ddp" and p["utilization"] <= 0.20})
    out: dict[str, Any] = {"ddp_at_most_20pct_at_bps": slow}
    if slow and ("streaming", slow[-1]) in by and ("diloco", slow[-1]) in by:
        bw = slow[-1]  # the fastest link where ddp is at most 20% busy
        st, di = by[("streaming", bw)], by[("diloco", bw)]
        eager = by.get(("streaming-eager", bw))
        out.update(
            {
                "at_bps": bw,
                "streaming_eager_utilization": None if eager is None else eager["utilization"],
                "streaming_eager_loss_vs_diloco": None if eager is None else eager["final_eval_loss"] / di["final_eval_loss"] - 1,
                "streaming_utilization": st["utilization"],
                "diloco_utilization": di["utilization"],
                "ddp_utilization": by[("ddp", bw)]["utilization"],
                "streaming_loss_vs_diloco": st["final_eval_loss"] / di["final_eval_loss"] - 1,
                "utilization_met": st["utilization"] >= 0.95,
                "loss_met": abs(st["final_eval_loss"] / di["final_eval_loss"] - 1) <= 0.02,
            }
        )
    peaks = []
    for (alg, bw), p in by.items():
        if alg.startswith("streaming") and ("diloco", bw) in by:
            ratio = p["peak_inter_site_bytes_per_step"] / max(1, by[("diloco", bw)]["peak_inter_site_bytes_per_step"])
            peaks.append(
                {
                    "algorithm": alg,
                    "bandwidth_bps": bw,
                    "ratio": ratio,
                    "one_over_F": 1 / p["fragments"],
                    "met": ratio <= 1 / p["fragments"],
                }
            )
    out["peak_bytes_streaming_over_diloco"] = peaks
    return out


def plot_wan(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for alg in dict.fromkeys(p["algorithm"] for p in result["points"]):
        pts = sorted((p for p in result["points"] if p["algorithm"] == alg), key=lambda p: p["bandwidth_bps"])
        bws = [p["bandwidth_bps"] for p in pts]
        a.plot(bws, [100 * p["utilization"] for p in pts], "o-", label=alg)
        b.plot(bws, [p["inter_site_bytes"] / max(1, p["steps"]) / 1e6 for p in pts], "o-", label=alg)
    for ax in (a, b):
        ax.set_xscale("log")
        ax.set_xlabel(f"inter-site bandwidth (bit/s), latency {result['latency_s'] * 1e3:g} ms")
        ax.grid(alpha=0.3)
        ax.legend()
    a.set_ylabel("compute utilisation (%, min over ranks)")
    a.set_ylim(0, 105)
    b.set_yscale("log")
    b.set_ylabel("inter-site MB per inner step")
    fig.suptitle("geotrain bench wan: 2 sites x 2 workers, default model")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_timeline(run_dir: Path, path: Path, window: tuple[float, float] | None = None) -> Path:
    """Per rank, bars of compute and of wide-area network activity over time (OUT/timeline/*.json)."""

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = sorted((run_dir / "timeline").glob("rank*.json"), key=lambda f: int(f.stem[4:]))
    ranks = [json.loads(f.read_text()) for f in files]
    end = max((b for r in ranks for _, b in r["compute"]), default=1.0)
    lo, hi = window or (end * 0.4, end * 0.4 + min(6.0, end * 0.6))
    fig, ax = plt.subplots(figsize=(11, 1 + 0.8 * len(ranks)))
    for i, r in enumerate(ranks):
        y = len(ranks) - 1 - i
        comp = [(a, b - a) for a, b in r["compute"] if b > lo and a < hi]
        net = [(a, b - a) for a, b in r["network"] if b > lo and a < hi]
        ax.broken_barh(comp, (y + 0.05, 0.4), facecolors="tab:blue", label="compute" if i == 0 else None)
        ax.broken_barh(net, (y + 0.5, 0.4), facecolors="tab:orange", alpha=0.6, label="wide-area transfer" if i == 0 else None)
    ax.set_yticks([len(ranks) - 1 - i + 0.5 for i in range(len(ranks))], [f"rank {r['rank']}" for r in ranks])
    ax.set_xlim(lo, hi)
    ax.set_xlabel("seconds since the first step")
    ax.legend(loc="upper right")
    ax.set_title("Streaming DiLoCo: fragments cross the WAN in the background while compute continues")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def print_wan(result: dict[str, Any], console: Any) -> None:
    t = table(
        f"bench wan: latency {result['latency_s'] * 1e3:g} ms",
        ["link", "algorithm", "steps", "utilisation", "wide-area wait", "inter-site bytes", "peak bytes/step", "final eval loss"],
    )
    for p in result["points"]:
        t.add_row(
            bps(p["bandwidth_bps"]), p["algorithm"], str(p["steps"]), f"{p['utilization']:.1%}", f"{p['wan_wait_seconds']:.1f} s",
            f"{p['inter_site_bytes'] / 1e6:.1f} MB", f"{p['peak_inter_site_bytes_per_step'] / 1e6:.2f} MB", f"{p['final_eval_loss']:.4f}",
        )  # fmt: skip
    console.print(t)
    tg = result["targets"]
    if "at_bps" in tg:
        console.print(
            f"at {bps(tg['at_bps'])} (ddp {tg['ddp_utilization']:.1%}): streaming {tg['streaming_utilization']:.1%} "
            f"(target >= 95%: {'met' if tg['utilization_met'] else 'MISSED'}), diloco {tg['diloco_utilization']:.1%}; "
            f"streaming loss vs diloco {tg['streaming_loss_vs_diloco']:+.2%} (target within 2%: {'met' if tg['loss_met'] else 'MISSED'})"
        )
        if tg["streaming_eager_utilization"] is not None:
            console.print(
                f"  eager variant: utilisation {tg['streaming_eager_utilization']:.1%}, loss vs diloco {tg['streaming_eager_loss_vs_diloco']:+.2%}"
            )
    for p in tg["peak_bytes_streaming_over_diloco"]:
        console.print(
            f"{bps(p['bandwidth_bps'])}: {p['algorithm']} peak bytes/step = {p['ratio']:.3f} x diloco's "
            f"(target <= 1/F = {p['one_over_F']:.3f}: {'met' if p['met'] else 'MISSED'})"
        )
    console.print(f"sweep took {result['seconds'] / 60:.1f} min")
