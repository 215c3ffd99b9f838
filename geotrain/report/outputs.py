"""The files ``geotrain train`` writes at the end: the merged ``summary.json`` and ``loss.png``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from geotrain.report.plots import plot_curves
from geotrain.report.summary import merged_summary


def write_outputs(runs: list[dict[str, Any]], out: Path) -> dict[str, Any]:
    """``OUT/summary.json`` (the runs merged) and ``OUT/loss.png``; the merged summary."""
    summary = merged_summary(runs)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_curves(runs, out / "loss.png")
    return summary
