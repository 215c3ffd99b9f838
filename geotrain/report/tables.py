"""What a person sees at the end: the side-by-side table, the loss-curve PNG, the merged summary.

``OUT/summary.json`` holds the primary run's record at the top level and every run (primary
first, then the baseline) under ``runs``; ``comparison`` compares the two when a baseline ran.
Schema: docs/SUMMARY.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def compare(primary: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    """Ratios of the primary run against the baseline at equal tokens."""
    inter_p, inter_b = primary["inter_site_bytes"], baseline["inter_site_bytes"]
    return {
        "primary": primary["algorithm"],
        "baseline": baseline["algorithm"],
        "equal_tokens": primary["tokens"] == baseline["tokens"],
        "eval_loss_ratio": primary["final_eval_loss"] / baseline["final_eval_loss"],
        "inter_site_bytes_ratio": (inter_b / inter_p) if inter_p else None,
        "wall_seconds_ratio": primary["wall_seconds"] / baseline["wall_seconds"],
    }


def merged_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    top = {k: v for k, v in runs[0].items() if k not in ("per_rank", "config", "eval_curve")}
    top["runs"] = runs
    if len(runs) > 1:
        top["comparison"] = compare(runs[0], runs[1])
    return top


def run_label(r: dict[str, Any]) -> str:
    """'ddp', 'diloco H=50', 'streaming H=100 F=4 + fp4'."""
    label = r["algorithm"]
    if r["algorithm"] != "ddp":
        label += f" H={r['H']}"
    if r["algorithm"] == "streaming":
        label += f" F={r.get('fragments', 1)}"
    if r.get("codec", "none") != "none":
        label += f" + {r['codec']}"
    return label


def _mb(n: float) -> str:
    return f"{n / 1e6:,.2f} MB"


def print_table(runs: list[dict[str, Any]], console: Console) -> None:
    table = Table(title="geotrain: runs side by side (equal tokens)")
    table.add_column("")
    for r in runs:
        table.add_column(run_label(r), justify="right")
    rows: list[tuple[str, Any]] = [
        ("final eval loss", lambda r: f"{r['final_eval_loss']:.4f}"),
        ("tokens", lambda r: f"{r['tokens']:,}"),
        ("inter-site bytes", lambda r: _mb(r["inter_site_bytes"])),
        ("compression (inter-site)", lambda r: f"{r.get('compression_ratio', 1.0):.2f}x"),
        ("peak inter-site bytes / step", lambda r: _mb(r.get("peak_inter_site_bytes_per_step", 0))),
        ("intra-site bytes", lambda r: _mb(r["intra_site_bytes"])),
        ("wall time", lambda r: f"{r['wall_seconds']:.1f} s"),
        ("compute / rank", lambda r: f"{r['compute_seconds']:.1f} s"),
        ("wide-area wait / rank", lambda r: f"{r.get('wan_wait_seconds', r['comm_wait_seconds']):.2f} s"),
        ("compute utilisation (min rank)", lambda r: f"{r['utilization']:.1%}" if "utilization" in r else "-"),
        (
            "global models identical",
            lambda r: "yes" if len(set(r["global_param_hash"].values())) == 1 and r["hashes_agree_within_sites"] else "NO",
        ),
    ]
    for name, fn in rows:
        table.add_row(name, *(fn(r) for r in runs))
    console.print(table)
    if len(runs) > 1:
        c = compare(runs[0], runs[1])
        ratio = c["inter_site_bytes_ratio"]
        console.print(
            f"{c['primary']} vs {c['baseline']}: eval loss {100 * (c['eval_loss_ratio'] - 1):+.2f}%, "
            + (f"{ratio:,.1f}x fewer inter-site bytes" if ratio else "no inter-site bytes")
            + f", wall time x{c['wall_seconds_ratio']:.2f}"
        )


def plot_curves(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in runs:
        xs = [p["tokens"] for p in r["eval_curve"]]
        ys = [p["eval_loss"] for p in r["eval_curve"]]
        label = run_label(r)
        label += f" ({r['inter_site_bytes'] / 1e6:,.1f} MB inter-site)"
        ax.plot(xs, ys, marker="o", markersize=3, label=label)
    ax.set_xlabel("tokens (all ranks)")
    ax.set_ylabel("held-out loss (nats/byte)")
    sites = runs[0]["sites"]
    ax.set_title(f"{len(sites)} sites x {runs[0]['workers_per_site']} workers")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(runs: list[dict[str, Any]], out: Path) -> dict[str, Any]:
    summary = merged_summary(runs)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_curves(runs, out / "loss.png")
    return summary
