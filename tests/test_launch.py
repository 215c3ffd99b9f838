"""Failure handling of the local launcher: a killed rank stops the job cleanly, no orphans."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_training import TINY


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def _start(tmp_path: Path) -> tuple[subprocess.Popen[str], list[int]]:
    args = [
        sys.executable,
        "-m",
        "geotrain",
        "train",
        "--out",
        str(tmp_path),
        "--set",
        "train.steps=100000",
        "--set",
        "run.baseline=none",
    ] + [a for o in TINY for a in ("--set", o)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    metrics = tmp_path / "metrics" / "rank0.jsonl"
    while time.monotonic() < deadline:
        if metrics.exists() and metrics.stat().st_size > 0 and (tmp_path / "pids.json").exists():
            return proc, json.loads((tmp_path / "pids.json").read_text())["ranks"]
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("training did not start")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_killed_rank_fails_the_job_naming_site_and_rank(tmp_path: Path) -> None:
    proc, pids = _start(tmp_path)
    t0 = time.monotonic()
    os.kill(pids[2], signal.SIGKILL)  # rank 2 = site B, local rank 0
    _, err = proc.communicate(timeout=60)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 1
    assert elapsed < 60
    assert "rank 2 (site B, local rank 0) was killed by SIGKILL" in err, err
    time.sleep(0.5)
    assert not any(_alive(p) for p in pids)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_killing_the_launcher_takes_the_ranks_down(tmp_path: Path) -> None:
    proc, pids = _start(tmp_path)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids)
