"""The main job's shape through the real CLI: DiLoCo + DDP baseline, table, merged summary, plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from geotrain.report.plots import plot_curves
from geotrain.report.tables import run_label
from tests.helpers import drawn, lines, png_size
from tests.test_training import TINY


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_train_with_baseline_writes_table_summary_and_plot(tmp_path: Path) -> None:
    args = [sys.executable, "-m", "geotrain", "train", "--out", str(tmp_path), "--set", "train.steps=8", "--set", "sync.H=4"]
    args += [a for o in [*TINY, "report.plot=true"] for a in ("--set", o)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "runs side by side" in proc.stdout and "fewer inter-site bytes" in proc.stdout
    assert "[A/0 step 1]" in proc.stdout and "[B/0 step 1]" in proc.stdout
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["algorithm"] == "diloco" and [r["algorithm"] for r in s["runs"]] == ["diloco", "ddp"]
    c = s["comparison"]
    assert c["equal_tokens"] and c["inter_site_bytes_ratio"] == pytest.approx(4.0, rel=0.02)
    assert c["eval_loss_ratio"] == pytest.approx(s["runs"][0]["final_eval_loss"] / s["runs"][1]["final_eval_loss"])
    assert png_size(tmp_path / "loss.png") == (840, 504)  # 7 x 4.2 in at 120 dpi
    with drawn() as figs:  # what the plot holds: each run's eval curve, labelled with its bytes
        plot_curves(s["runs"], tmp_path / "again.png")
    got = lines(figs[0].axes[0])
    assert len(got) == 2
    for r in s["runs"]:
        (label,) = [k for k in got if k.startswith(run_label(r) + " (")]
        assert got[label] == ([p["tokens"] for p in r["eval_curve"]], [p["eval_loss"] for p in r["eval_curve"]])
        assert f"{r['inter_site_bytes'] / 1e6:,.1f} MB inter-site" in label
    for alg in ("diloco", "ddp"):
        assert (tmp_path / alg / "summary.json").exists() and list((tmp_path / alg / "logs").glob("rank*.log"))
