"""bench privacy: the overhead and key-agreement measurements on small inputs, table and CLI checks."""

from __future__ import annotations

import subprocess
import sys

import pytest
from rich.console import Console

from geotrain.bench.privacy import bench_key_agreement, bench_overhead, print_privacy, quality_runs


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_overhead_and_key_agreement_measure_and_print() -> None:
    o = bench_overhead(sites=3, reps=1, latency_s=0.005, H=4, step_reps=2, numel=20_001)  # secure aggregation needs 3
    assert set(o["checks"]) == {"bytes_ratio", "aggregation_time_ratio", "cpu_ratio", "round_time_ratio"}
    # the masked payload is as big as the fp32 ring's; the protocol adds only small messages
    assert 1.0 < o["checks"]["bytes_ratio"] < 1.1
    assert o["met"]["bytes_ratio"] is True
    k = bench_key_agreement((4, 16), numel=1000, reps=1)
    rows = {(r["sites"], r["graph"]): r for r in k["rows"]}
    assert rows[(16, "sparse")]["neighbours"] == 8 and rows[(16, "complete")]["neighbours"] == 15
    assert rows[(16, "sparse")]["setup_bytes_per_site"] < rows[(16, "complete")]["setup_bytes_per_site"]
    console = Console(width=200, record=True)
    print_privacy({"overhead": o, "key_agreement": k}, console)
    text = console.export_text()
    assert "inter-site bytes / round" in text and "sparse" in text


def test_quality_runs_cover_the_issue_table() -> None:
    labels = [label for label, _ in quality_runs(2, 8)]
    assert labels[:2] == ["no privacy", "secure aggregation"] and sum("ε=" in lab for lab in labels) >= 2


def test_bad_parts_option_is_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "geotrain", "bench", "privacy", "--parts", "speed"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and proc.stderr.strip().startswith("geotrain: --parts: choose from")
