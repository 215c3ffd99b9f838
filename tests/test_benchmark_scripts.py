"""The scripts in benchmarks/ still run against the current code (CI runs none of them in full:
a changed signature once broke overhead.py unnoticed). Each runs at its smallest size and must
write its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO


def _run(script: str, args: list[str], out: Path, timeout: float = 240) -> dict:
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result: dict = json.loads(out.read_text())
    return result


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_overhead_script_runs(tmp_path: Path) -> None:
    r = _run("overhead.py", ["--steps", "3", "--reps", "1"], tmp_path / "overhead.json")
    assert r["geotrain_median"] > 0 and r["plain_median"] > 0  # (positive: the script times something)
    assert r["overhead"] == pytest.approx(r["geotrain_median"] / r["plain_median"] - 1)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_launch_start_script_runs(tmp_path: Path) -> None:
    r = _run("launch_start.py", ["--reps", "1"], tmp_path / "launch.json")
    assert set(r["median_s"]) == {"fresh", "forked, zygote starting", "forked"}
    assert all(len(v) == 1 and r["median_s"][k] == v[0] > 0 for k, v in r["seconds"].items())  # one rep: its median
    assert set(r["cli_median_s"]) == set(r["cli_cpu_median_s"]) == {"cli", "cli, fresh zygote", "cli, zygote after checks"}
    assert all(r["cli_cpu_median_s"][k] > 0 for k in r["cli_cpu_median_s"])  # the tree's CPU: launcher, zygote, ranks
    assert r["cli_ratio"] == pytest.approx(r["cli_median_s"]["cli"] / r["cli_median_s"]["cli, zygote after checks"])


@pytest.mark.timeout(120)
def test_planner_and_simulator_speed_scripts_run(tmp_path: Path) -> None:
    assert _run("plan_perf.py", ["--reps", "1"], tmp_path / "plan.json")
    assert _run("netsim_perf.py", ["--reps", "1"], tmp_path / "netsim.json")


@pytest.mark.timeout(120)
def test_compose_script_counts_the_pairs(tmp_path: Path) -> None:
    r = _run("compose.py", ["--only", "pairs"], tmp_path / "compose.json")
    assert r["pairs"]["tried"] == 119 and r["pairs"]["refused"] == len(r["pairs"]["refusals"])
