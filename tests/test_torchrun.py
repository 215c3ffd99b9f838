"""The worker entry point under torchrun (the multi-machine path), here on one machine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_training import TINY


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_torchrun_standalone_2x2(tmp_path: Path) -> None:
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    args = [
        torchrun,
        "--standalone",
        "--nproc-per-node",
        "4",
        "--local-addr",
        "127.0.0.1",
        "-m",
        "geotrain.run.worker",
        "--out",
        str(tmp_path),
        "--set",
        "train.steps=6",
        "--set",
        "sync.H=3",
    ]
    args += [a for o in TINY for a in ("--set", o)]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(args, capture_output=True, text=True, timeout=200, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["algorithm"] == "diloco" and s["sites"] == ["A", "B"] and s["workers_per_site"] == 2
    assert s["rounds"] == 2 and s["inter_site_bytes"] > 0
    assert len(set(s["global_param_hash"].values())) == 1
    assert "[B/0 step" in proc.stdout  # site membership derived from the rank
