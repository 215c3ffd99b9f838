"""netsim scenarios: the paper's case, the shipped files, JSON and plot, bad input through the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from geotrain.errors import ConfigError
from geotrain.netsim.run import plot_fct_cdf, run_scenario
from geotrain.netsim.scenario import load_scenario
from tests.helpers import drawn, lines, png_size

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ROOT / "scenarios" / "netsim"
PAPER = SCENARIOS / "paper-100T.yaml"


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "geotrain", "netsim", *args], capture_output=True, text=True, timeout=timeout)


def test_paper_case_ecmp_about_five_times_optimal_and_spraying_within_five_percent() -> None:
    sc = load_scenario(PAPER, ["transport.routings=[ecmp, spray]", "trials=8"])
    out, flows = run_scenario(sc)
    by = {r["routing"]: r for r in out["results"]}
    # paper: optimal "just under 3 ms" (0.3 GB at 800 Gbit/s), ECMP 15 ms, multipath within 5%
    assert by["spray"]["optimal_seconds"] == pytest.approx(3.0e-3, rel=0.01)
    assert 4.0 <= by["ecmp"]["ratio_to_optimal"] <= 7.0, by["ecmp"]
    assert by["spray"]["ratio_to_optimal"] <= 1.05
    assert 0.40 <= by["ecmp"]["mean_throughput_fraction"] <= 0.50
    assert set(flows) == {"ecmp", "spray"} and flows["ecmp"].fct.size == 1024
    assert flows["ecmp"].fct.max() == pytest.approx(by["ecmp"]["fct_percentiles_seconds"]["100"])
    sizing = {c["name"]: c for c in out["sizing"]}
    four = next(c for n, c in sizing.items() if n.startswith("800K GPUs, 64 x 800G"))
    assert four["ours"]["switches"] == 87_500 and four["paper"]["switches"] == 75_000 and four["note"]


def test_rails_split_flows_over_independent_planes() -> None:
    base = ["fabric.hosts=128", "fabric.radix=8", "transport.routings=[spray, ecmp]", "trials=2"]
    one, _ = run_scenario(load_scenario(PAPER, base))
    four, _ = run_scenario(load_scenario(PAPER, [*base, "fabric.rails=4"]))
    spray1, spray4 = one["results"][0], four["results"][0]
    assert spray4["makespan_seconds"] == pytest.approx(spray1["makespan_seconds"], rel=1e-9)  # same bytes/capacity
    assert four["topology"]["simulated"]["links"] == 4 * one["topology"]["simulated"]["links"]
    # a flow ends with its slowest rail, so hashing on every plane keeps ECMP's collisions (paper section 5)
    assert four["results"][1]["ratio_to_optimal"] > 1.5


@pytest.mark.parametrize("path", sorted(SCENARIOS.glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_scenarios_are_valid(path: Path) -> None:
    sc = load_scenario(path)
    assert sc.fabric.hosts >= 2 and sc.transport.routings


@pytest.mark.timeout(120)
def test_cli_writes_json_and_cdf_plot(tmp_path: Path) -> None:
    proc = _cli(
        str(SCENARIOS / "allreduce-oversubscribed.yaml"),
        "--set",
        "trials=1",
        "--json",
        str(tmp_path / "out.json"),
        "--plot",
        str(tmp_path),
        "--flows",
        str(tmp_path / "flows.csv"),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Synchronized phase per routing" in proc.stdout and "Scope: Fluid" in proc.stdout
    out = json.loads((tmp_path / "out.json").read_text())
    topo = out["topology"]
    for key in ("tiers", "switches", "switch_links", "host_links", "hosts_capacity"):
        assert key in topo
    assert topo["tiers"] == 2 and topo["hosts_capacity"] == 64 * 48
    assert [r["routing"] for r in out["results"]] == ["ecmp", "ecmp_subflows", "spray", "adaptive"]
    for r in out["results"]:
        for key in ("makespan_seconds", "optimal_seconds", "mean_throughput_fraction", "max_link_load"):
            assert isinstance(r[key], float)
        assert r["makespan_seconds"] >= r["optimal_seconds"] * (1 - 1e-9)
    assert png_size(tmp_path / "fct_cdf.png") == (768, 480)  # 6.4 x 4 in at 120 dpi
    rows = (tmp_path / "flows.csv").read_text().splitlines()
    assert rows[0] == "routing,phase,src,dst,bytes,fct_seconds" and len(rows) == 1 + 4 * 2048
    # what the CDF draws: per routing, its flows' completion times in order, up to a fraction of 1
    fct: dict[str, list[float]] = {}
    for r in rows[1:]:
        fct.setdefault(r.split(",")[0], []).append(float(r.split(",")[-1]))
    with drawn() as figs:
        plot_fct_cdf({k: types.SimpleNamespace(fct=np.array(v)) for k, v in fct.items()}, tmp_path / "again.png", "t")  # type: ignore[misc]
    curves = lines(figs[0].axes[0])
    assert set(curves) == set(fct) == {r["routing"] for r in out["results"]}
    for routing, (x, y) in curves.items():
        assert x == pytest.approx(sorted(v * 1e3 for v in fct[routing])) and y[-1] == 1.0 and len(y) == 2048
    ecmp_max = max(float(r.split(",")[-1]) for r in rows[1:] if r.startswith("ecmp,"))
    assert ecmp_max == pytest.approx(out["results"][0]["fct_percentiles_seconds"]["100"], rel=1e-6)


BAD = [
    (["fabric.radix=15"], "fabric.radix", "even number >= 4"),
    (["fabric.radix=2"], "fabric.radix", "even number >= 4"),
    (["fabric.hosts=5000"], "fabric.hosts", "exceed"),
    (["fabric.oversubscription=[0.5, 1]"], "fabric.oversubscription[0]", "greater than or equal to 1"),
    (["fabric.tiers=5"], "fabric.tiers", "2, 3 or 4"),
    (["fabric.ports=[[8, 8]]"], "fabric.ports", "one [down, up] per tier"),
    (["fabric.ports=[[12, 8], [8, 8]]"], "fabric.ports", "down + up <= radix"),
    (["fabric.bogus=1"], "fabric.bogus", "unknown key"),
    (["transport.routings=[ecmp, teleport]"], "transport.routings[1]", "ecmp"),
    (["traffic.pattern=hierarchical", "traffic.group_size=7"], "traffic.group_size", "divide"),
    (["traffic.model={hidden: 8, seq_len: 8}"], "traffic[0]", "exactly one of message_bytes or model"),
    (["trials=0"], "trials", "greater than or equal to 1"),
]


@pytest.mark.parametrize("overrides,field,words", BAD, ids=[b[1] + "-" + b[0][0].split("=")[1][:12] for b in BAD])
def test_bad_scenarios_rejected_naming_the_field(overrides: list[str], field: str, words: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_scenario(PAPER, overrides)
    msg = str(exc.value)
    assert msg.startswith(field + ":") and words in msg, msg


@pytest.mark.timeout(60)
def test_cli_bad_input_exits_2_with_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("fabric: {hosts: 64, radix: 7}\ntraffic: {message_bytes: 1.0e+6}\n")
    too_big = [str(PAPER), "--set", "max_entries=100000"]  # 1,024 sprayed flows need 1,024 x 146 entries
    for args in ([str(bad)], [str(PAPER), "--set", "fabric.hosts=1025"], [str(tmp_path / "missing.yaml")], too_big):
        proc = _cli(*args)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("geotrain: scenario error: "), proc.stderr
        assert "Traceback" not in proc.stderr
    assert "fabric.radix" in _cli(str(bad)).stderr
    assert "max_entries: 1,024 flows" in _cli(*too_big).stderr
