"""The loss-curve PNG of ``geotrain train``: held-out loss against tokens, one line per run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from geotrain.report.tables import run_label


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
