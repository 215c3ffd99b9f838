"""``geotrain bench codec-quality``: eval loss against inter-site bytes at equal tokens, for ddp,
diloco with every codec, and Streaming DiLoCo with fp4, each trained with the real launcher.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from geotrain.bench.common import table
from geotrain.codecs import CODEC_NAMES

QUALITY_TARGETS = {"streaming_fp4_vs_ddp_loss": 0.015, "streaming_fp4_bytes_reduction": 500.0, "diloco_int8_vs_diloco_loss": 0.01}


def quality_runs(streaming_H: int = 100) -> list[tuple[str, list[str]]]:
    """(label, overrides) for every point of the sweep: equal tokens, the default model and topology."""
    runs = [("ddp", ["sync.algorithm=ddp"])]
    runs += [(f"diloco+{c}", ["sync.algorithm=diloco", f"sync.codec={c}"]) for c in CODEC_NAMES]
    runs.append((f"streaming+fp4 H={streaming_H}", ["sync.algorithm=streaming", "sync.codec=fp4", f"sync.H={streaming_H}"]))
    return runs


def codec_quality(
    out: Path, extra: list[str] | None = None, streaming_H: int = 100, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Train every point of :func:`quality_runs` with the real launcher; eval loss vs inter-site bytes."""
    from geotrain.config import load_config
    from geotrain.launch.local import launch_local

    say = progress or (lambda _msg: None)
    points = []
    for label, overrides in quality_runs(streaming_H):
        cfg = load_config(None, [*(extra or []), *overrides, "run.baseline=none", "train.save_final=false"])
        say(f"{label}: {cfg.train.steps} steps")
        s = launch_local(cfg, out / label.replace(" ", "_").replace("=", ""), console_print=None)
        points.append(
            {
                "label": label,
                "algorithm": s["algorithm"],
                "codec": s["codec"],
                "H": s["H"],
                "fragments": s["fragments"],
                "tokens": s["tokens"],
                "final_eval_loss": s["final_eval_loss"],
                "inter_site_bytes": s["inter_site_bytes"],
                "compression_ratio": s["compression_ratio"],
                "peak_inter_site_bytes_per_step": s["peak_inter_site_bytes_per_step"],
                "wall_seconds": s["wall_seconds"],
                "hashes_agree": s["hashes_agree_within_sites"] and len(set(s["global_param_hash"].values())) == 1,
            }
        )
    by = {p["label"]: p for p in points}
    ddp, diloco, int8 = by["ddp"], by["diloco+none"], by["diloco+int8"]
    stream = points[-1]
    checks = {
        "streaming_fp4_vs_ddp_loss": stream["final_eval_loss"] / ddp["final_eval_loss"] - 1,
        "streaming_fp4_bytes_reduction": ddp["inter_site_bytes"] / stream["inter_site_bytes"],
        "diloco_int8_vs_diloco_loss": int8["final_eval_loss"] / diloco["final_eval_loss"] - 1,
    }
    met = {
        "streaming_fp4_vs_ddp_loss": checks["streaming_fp4_vs_ddp_loss"] <= QUALITY_TARGETS["streaming_fp4_vs_ddp_loss"],
        "streaming_fp4_bytes_reduction": checks["streaming_fp4_bytes_reduction"]
        >= QUALITY_TARGETS["streaming_fp4_bytes_reduction"],
        "diloco_int8_vs_diloco_loss": checks["diloco_int8_vs_diloco_loss"] <= QUALITY_TARGETS["diloco_int8_vs_diloco_loss"],
    }
    return {"points": points, "checks": checks, "targets": QUALITY_TARGETS, "met": met}


def print_quality(result: dict[str, Any], console: Any) -> None:
    ddp = result["points"][0]
    t = table(
        "geotrain bench codec-quality: equal tokens, default model, 2 sites x 2 workers",
        ["run", "final eval loss", "vs ddp", "inter-site MB", "fewer bytes than ddp", "compression", "peak MB/step", "wall s"],
    )
    for p in result["points"]:
        t.add_row(
            p["label"],
            f"{p['final_eval_loss']:.4f}",
            f"{100 * (p['final_eval_loss'] / ddp['final_eval_loss'] - 1):+.2f}%",
            f"{p['inter_site_bytes'] / 1e6:,.2f}",
            f"{ddp['inter_site_bytes'] / p['inter_site_bytes']:,.0f}x",
            f"{p['compression_ratio']:.2f}x",
            f"{p['peak_inter_site_bytes_per_step'] / 1e6:.3f}",
            f"{p['wall_seconds']:.0f}",
        )
    console.print(t)
    c, m = result["checks"], result["met"]
    console.print(
        f"streaming+fp4 vs ddp: eval loss {100 * c['streaming_fp4_vs_ddp_loss']:+.2f}% (target <= +1.5%: {'met' if m['streaming_fp4_vs_ddp_loss'] else 'MISSED'}), "
        f"{c['streaming_fp4_bytes_reduction']:,.0f}x fewer inter-site bytes (target >= 500x: {'met' if m['streaming_fp4_bytes_reduction'] else 'MISSED'}); "
        f"diloco+int8 vs diloco: {100 * c['diloco_int8_vs_diloco_loss']:+.2f}% (target <= +1%: {'met' if m['diloco_int8_vs_diloco_loss'] else 'MISSED'})"
    )


def plot_quality(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for p in result["points"]:
        marker = {"ddp": "s", "diloco": "o", "streaming": "*"}[p["algorithm"]]
        label = f"{p['label']}: {p['final_eval_loss']:.3f}"
        ax.scatter(p["inter_site_bytes"], p["final_eval_loss"], marker=marker, s=120 if marker == "*" else 45, label=label)
    ax.legend(fontsize=8, loc="upper right")
    ax.set_xscale("log")
    ax.set_xlabel("total inter-site bytes (log)")
    ax.set_ylabel("final eval loss")
    ax.set_title("Eval loss vs bytes across sites, equal tokens")
    ax.grid(True, alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
