"""``geotrain bench codec-quality``: eval loss against inter-site bytes at equal tokens, over
several seeds: ddp, diloco fp32 and int8, Streaming DiLoCo with fp4, diloco with the sparse 2-bit
codec at two densities, and MuLoCo (Muon inner optimizer + the 2-bit codec), each trained with the
real launcher. Gaps to DDP are taken at the same seed (same init and data order).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from geotrain.bench.common import table

QUALITY_TARGETS = {
    "streaming_fp4_vs_ddp_loss": 0.015,
    "streaming_fp4_bytes_reduction": 500.0,
    "diloco_int8_vs_diloco_loss": 0.01,
    "best_bytes_ratio_within_1pct": 5000.0,
}
SPARSE_K = (0.01, 0.03)


def quality_runs(streaming_H: int = 100, sparse_k: tuple[float, ...] = SPARSE_K) -> list[tuple[str, list[str]]]:
    """(label, overrides) for every configuration of the sweep: equal tokens, the default model and topology."""
    diloco = "sync.algorithm=diloco"
    runs = [("ddp", ["sync.algorithm=ddp"]), ("diloco", [diloco]), ("diloco+int8", [diloco, "sync.codec=int8"])]
    runs.append((f"streaming+fp4 H={streaming_H}", ["sync.algorithm=streaming", "sync.codec=fp4", f"sync.H={streaming_H}"]))
    runs += [(f"diloco+sparseloco k={k:g}", [diloco, "sync.codec=sparseloco", f"sync.sparse_fraction={k}"]) for k in sparse_k]
    sparse = ["sync.codec=sparseloco", f"sync.sparse_fraction={sparse_k[0]}"]
    runs.append((f"muloco k={sparse_k[0]:g}", [diloco, "optim.name=muon", *sparse]))
    return runs


def codec_quality(
    out: Path,
    extra: list[str] | None = None,
    streaming_H: int = 100,
    seeds: int = 3,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Train every configuration of :func:`quality_runs` with ``seeds`` seeds (the default seed and the
    next ones) through the real launcher; eval loss vs inter-site bytes, and its spread over seeds."""
    from geotrain.config import load_config
    from geotrain.launch.local import launch_local

    say = progress or (lambda _msg: None)
    base = load_config(None, extra or []).train.seed
    points = []
    for label, overrides in quality_runs(streaming_H):
        for seed in range(base, base + seeds):
            cfg = load_config(
                None, [*(extra or []), *overrides, f"train.seed={seed}", "run.baseline=none", "train.save_final=false"]
            )
            run = out / f"{label.replace(' ', '_').replace('=', '')}-seed{seed}"
            s = _finished(run, cfg.model_dump())
            say(f"{label}, seed {seed}: {cfg.train.steps} steps" + (" (finished before: reused)" if s else ""))
            if s is None:
                s = launch_local(cfg, run, console_print=None)
            points.append(
                {
                    "label": label,
                    "seed": seed,
                    "algorithm": s["algorithm"],
                    "codec": s["codec"],
                    "optimizer": cfg.optim.name,
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
    summary = summarise(points)
    by = {r["label"]: r for r in summary}
    stream = by[f"streaming+fp4 H={streaming_H}"]
    within = [r for r in summary if r["mean_gap_to_ddp"] <= 0.01 and r["label"] != "ddp"]
    best = max(within, key=lambda r: r["bytes_ratio_vs_ddp"]) if within else None
    checks = {
        "streaming_fp4_vs_ddp_loss": stream["mean_gap_to_ddp"],
        "streaming_fp4_bytes_reduction": stream["bytes_ratio_vs_ddp"],
        "diloco_int8_vs_diloco_loss": by["diloco+int8"]["mean_eval_loss"] / by["diloco"]["mean_eval_loss"] - 1,
        "best_bytes_ratio_within_1pct": best["bytes_ratio_vs_ddp"] if best else 0.0,
        "best_within_1pct_label": best["label"] if best else None,
    }
    met = {k: (checks[k] <= t if k.endswith("_loss") else checks[k] >= t) for k, t in QUALITY_TARGETS.items()}
    return {"seeds": seeds, "points": points, "summary": summary, "checks": checks, "targets": QUALITY_TARGETS, "met": met}


def _finished(run: Path, config: dict[str, Any]) -> dict[str, Any] | None:
    """The summary of a run this sweep already finished in ``run`` with exactly ``config``, so an
    interrupted sweep restarted on the same ``--out`` does not train it again; else None."""
    summary, saved = run / "summary.json", run / "config.yaml"
    if not (summary.exists() and saved.exists()) or yaml.safe_load(saved.read_text()) != config:
        return None
    done: dict[str, Any] = json.loads(summary.read_text())
    return done


def summarise(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per configuration: mean and standard deviation (over seeds) of the eval loss and of its gap
    to DDP at the same seed, and the inter-site bytes ratio to DDP."""
    ddp = {p["seed"]: p for p in points if p["label"] == "ddp"}
    out = []
    for label in dict.fromkeys(p["label"] for p in points):
        pts = [p for p in points if p["label"] == label]
        losses = [p["final_eval_loss"] for p in pts]
        gaps = [p["final_eval_loss"] / ddp[p["seed"]]["final_eval_loss"] - 1 for p in pts]
        ddp_bytes = statistics.fmean(d["inter_site_bytes"] for d in ddp.values())
        out.append(
            {
                "label": label,
                "seeds": len(pts),
                "mean_eval_loss": statistics.fmean(losses),
                "std_eval_loss": statistics.stdev(losses) if len(losses) > 1 else 0.0,
                "mean_gap_to_ddp": statistics.fmean(gaps),
                "std_gap_to_ddp": statistics.stdev(gaps) if len(gaps) > 1 else 0.0,
                "bytes_ratio_vs_ddp": ddp_bytes / statistics.fmean(p["inter_site_bytes"] for p in pts),
                "inter_site_bytes": statistics.fmean(p["inter_site_bytes"] for p in pts),
                "hashes_agree": all(p["hashes_agree"] for p in pts),
            }
        )
    return out


def print_quality(result: dict[str, Any], console: Any) -> None:
    t = table(
        f"geotrain bench codec-quality: equal tokens, default model, 2 sites x 2 workers, {result['seeds']} seed(s) each",
        ["run", "eval loss (mean ± std)", "gap to ddp (mean ± std)", "inter-site MB", "fewer bytes than ddp", "one model"],
    )
    for r in result["summary"]:
        t.add_row(
            r["label"],
            f"{r['mean_eval_loss']:.4f} ± {r['std_eval_loss']:.4f}",
            f"{100 * r['mean_gap_to_ddp']:+.2f}% ± {100 * r['std_gap_to_ddp']:.2f}",
            f"{r['inter_site_bytes'] / 1e6:,.3f}",
            f"{r['bytes_ratio_vs_ddp']:,.0f}x",
            "yes" if r["hashes_agree"] else "NO",
        )
    console.print(t)
    c, m = result["checks"], result["met"]

    def ok(key: str) -> str:
        return "met" if m[key] else "MISSED"

    console.print(
        f"streaming+fp4 vs ddp: {100 * c['streaming_fp4_vs_ddp_loss']:+.2f}% (target <= +1.5%: {ok('streaming_fp4_vs_ddp_loss')}), "
        f"{c['streaming_fp4_bytes_reduction']:,.0f}x fewer bytes (target >= 500x: {ok('streaming_fp4_bytes_reduction')}); "
        f"diloco+int8 vs diloco: {100 * c['diloco_int8_vs_diloco_loss']:+.2f}% (target <= +1%: {ok('diloco_int8_vs_diloco_loss')}); "
        f"most bytes saved within 1% of ddp: {c['best_bytes_ratio_within_1pct']:,.0f}x by {c['best_within_1pct_label']} "
        f"(target >= 5,000x: {ok('best_bytes_ratio_within_1pct')})"
    )


def plot_quality(result: dict[str, Any], path: Path) -> Path:
    """Eval loss against inter-site bytes, one point per configuration, error bars over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in result["summary"]:
        label = f"{r['label']}: {r['mean_eval_loss']:.3f} ({100 * r['mean_gap_to_ddp']:+.2f}%), {r['bytes_ratio_vs_ddp']:,.0f}x"
        ax.errorbar(r["inter_site_bytes"], r["mean_eval_loss"], yerr=r["std_eval_loss"], fmt="o", capsize=4, label=label)
    ddp = next(r for r in result["summary"] if r["label"] == "ddp")
    ax.axhline(ddp["mean_eval_loss"] * 1.01, color="k", ls="--", lw=1, label="ddp + 1%")
    ax.legend(fontsize=7, loc="upper right")
    ax.set_xscale("log")
    ax.set_xlabel("total inter-site bytes (log)")
    ax.set_ylabel(f"final eval loss (mean ± std over {result['seeds']} seeds)")
    ax.set_title("Eval loss vs bytes across sites, equal tokens")
    ax.grid(True, alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
