"""The files ``geotrain train`` writes at the end: the merged ``summary.json`` and ``loss.png``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from geotrain.report.summary import merged_summary


def write_outputs(runs: list[dict[str, Any]], out: Path, plot: bool = True) -> dict[str, Any]:
    """``OUT/summary.json`` (the runs merged) and, with ``plot``, ``OUT/loss.png``; the merged summary."""
    summary = merged_summary(runs)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    if plot:
        from geotrain.report.plots import plot_curves  # matplotlib: only when a plot is drawn

        plot_curves(runs, out / "loss.png")
    return summary
