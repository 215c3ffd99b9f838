"""The public API in a plain PyTorch loop: examples/plain_loop.py under torchrun, 2 sites.

This test uses nothing but the example script (which uses nothing but ``import geotrain``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "plain_loop.py"
TWO_SITES = "topology.sites=[{name: A, workers: 1}, {name: B, workers: 1}]"


def _run(*overrides: str, steps: int = 40) -> list[dict[str, Any]]:
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    args = [torchrun, "--standalone", "--nproc-per-node", "2", "--local-addr", "127.0.0.1", str(EXAMPLE), "--steps", str(steps)]
    for o in (TWO_SITES, *overrides):
        args += ["--set", o]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(args, capture_output=True, text=True, timeout=200, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return sorted((json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")), key=lambda r: r["rank"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("algorithm,rounds", [("diloco", 4), pytest.param("ddp", 40, marks=pytest.mark.slow)])
def test_plain_loop_with_the_public_api_across_two_sites(algorithm: str, rounds: int) -> None:
    a, b = _run(f"sync.algorithm={algorithm}", "sync.H=10")
    assert (a["site"], b["site"]) == ("A", "B") and a["algorithm"] == b["algorithm"] == algorithm
    assert a["global_hash"] == b["global_hash"]  # both sites end on one model
    assert a["rounds"] == b["rounds"] == rounds
    assert a["inter_site_bytes"] > 0 and b["inter_site_bytes"] > 0
    assert a["last_loss"] < 0.6 * a["first_loss"] and b["last_loss"] < 0.6 * b["first_loss"]  # it learned
