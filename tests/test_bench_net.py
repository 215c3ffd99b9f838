"""The network benchmarks end to end on small sizes (schema, sanity), and their pure parts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from geotrain.bench.allreduce import alpha_beta_seconds
from geotrain.bench.wan import bench_wan, plot_timeline, plot_wan, wan_targets
from tests.helpers import drawn, lines

CLI = [sys.executable, "-m", "geotrain"]


def test_alpha_beta_model() -> None:
    # 2 sites x 2 workers, 1 Gbit/s, 40 ms, 64 MiB: hierarchical 2 steps and S over the link,
    # flat 6 steps and 1.5 S over the boundary link
    S = 64 << 20
    assert alpha_beta_seconds("hierarchical", S, 2, 2, 1e9, 0.04) == pytest.approx(0.08 + S * 8 / 1e9)
    assert alpha_beta_seconds("flat", S, 2, 2, 1e9, 0.04) == pytest.approx(0.24 + 1.5 * S * 8 / 1e9)


def test_wan_targets_pick_the_fastest_link_where_ddp_is_starved() -> None:
    def p(alg: str, bw: float, util: float, loss: float, peak: int, F: int = 1) -> dict:
        return {"algorithm": alg, "bandwidth_bps": bw, "utilization": util, "final_eval_loss": loss,
                "peak_inter_site_bytes_per_step": peak, "fragments": F}  # fmt: skip

    points = [
        p("ddp", 1e7, 0.05, 2.5, 100), p("diloco", 1e7, 0.6, 2.50, 100), p("streaming", 1e7, 0.97, 2.52, 24, 4),
        p("ddp", 1e8, 0.19, 2.5, 100), p("diloco", 1e8, 0.9, 2.50, 100), p("streaming", 1e8, 0.94, 2.60, 26, 4),
        p("ddp", 1e9, 0.45, 2.5, 100), p("diloco", 1e9, 0.9, 2.50, 100), p("streaming", 1e9, 0.99, 2.52, 24, 4),
    ]  # fmt: skip
    t = wan_targets(points)
    assert t["ddp_at_most_20pct_at_bps"] == [1e7, 1e8] and t["at_bps"] == 1e8
    assert t["streaming_utilization"] == 0.94 and not t["utilization_met"] and not t["loss_met"]
    assert [q["met"] for q in t["peak_bytes_streaming_over_diloco"]] == [True, False, True]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_allreduce_and_link_cli(tmp_path: Path) -> None:
    out = tmp_path / "ar.json"
    r = subprocess.run(
        [*CLI, "bench", "allreduce", "--json", str(out), "--sizes-mib", "0.25,2", "--bandwidth", "1e9", "--latency", "0.01",
         "--reps", "1", "--chunk-mib", "0.5"],
        capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert {p["algorithm"] for p in res["points"]} == {"hierarchical", "flat"}
    for p in res["points"]:
        assert set(p) >= {"algorithm", "bytes", "seconds", "busbw_bps", "link_utilization", "predicted_seconds", "link_bps"}
        # never faster than the link allows: utilisation and busbw bounded by the emulated capacity
        assert 0 < p["link_utilization"] <= 1.02 and p["seconds"] > 0.01
    bad = subprocess.run([*CLI, "bench", "link", "--speeds", "0,1e8"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--speeds: every bandwidth must be > 0" in bad.stderr


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bench_wan_small_sweep_writes_points_and_plots(tmp_path: Path) -> None:
    tiny = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=16", "train.batch_size=4",
            "train.eval_batches=2", "sync.H=4", "sync.tau=1", "sync.fragments=2"]  # fmt: skip
    res = bench_wan(
        tmp_path, [1e9], 0.01, algorithms=("ddp", "streaming"), steps=8, extra=tiny, timeline_bps=1e9, progress=lambda m: None
    )
    assert [p["algorithm"] for p in res["points"]] == ["ddp", "streaming"]
    for p in res["points"]:
        assert set(p) >= {"algorithm", "bandwidth_bps", "latency_s", "utilization", "inter_site_bytes", "final_eval_loss"}
        assert 0 < p["utilization"] <= 1 and p["inter_site_bytes"] > 0
    with drawn() as figs:
        plot_wan(res, tmp_path / "wan.png")
        plot_timeline(Path(res["timeline_run"]), tmp_path / "tl.png")
    util, per_step = (lines(ax) for ax in figs[0].axes)
    for p in res["points"]:  # one point per algorithm here: its utilisation and bytes per step
        assert util[p["algorithm"]] == ([p["bandwidth_bps"]], [100 * p["utilization"]])
        assert per_step[p["algorithm"]] == ([p["bandwidth_bps"]], [p["inter_site_bytes"] / p["steps"] / 1e6])
    ranks = sorted(Path(res["timeline_run"], "timeline").glob("rank*.json"))
    bars = figs[1].axes[0].collections  # per rank: its compute bars, then its network bars
    assert len(bars) == 2 * len(ranks) == 8
    lo, hi = figs[1].axes[0].get_xlim()
    for i, f in enumerate(sorted(ranks, key=lambda f: int(f.stem[4:]))):
        compute = [(a, b) for a, b in json.loads(f.read_text())["compute"] if b > lo and a < hi]
        assert len(bars[2 * i].get_paths()) == len(compute) > 0
