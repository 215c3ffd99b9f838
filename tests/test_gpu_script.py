"""benchmarks/gpu.py, the GPU check, run on this CPU at a tiny shape (``--smoke``): every case
runs and the JSON holds what docs/SCALE.md reads from it; the coded sums between its two emulated
sites, through the torch-ops path a GPU's tensors take, end bit-identical with the format's bytes.
(Its numbers are measured on a GPU only: where none is, nothing is recorded.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_gpu_check_runs_on_a_cpu_at_a_tiny_shape(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--smoke", "--no-compile", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["smoke"] and {"device", "torch", "cuda", "shape"} <= got.keys()
    assert set(got["training"]) == {"geotrain replicate", "geotrain fsdp", "plain", "plain fsdp2"}
    for case in got["training"].values():
        assert case["tokens_per_second"] > 0 and case["step_seconds"] > 0 and case["flops_per_token"] > 0
    assert set(got["ratios"]) == {"geotrain replicate / plain", "geotrain fsdp / plain fsdp2", "plain fsdp2 / plain"}
    # the same model everywhere: geotrain's FLOPs per token are the plain loop's
    assert got["training"]["geotrain replicate"]["flops_per_token"] == got["training"]["plain"]["flops_per_token"]
    speeds = {r["codec"]: r for r in got["codecs"]["speeds"] if r["path"] == "as run"}
    assert set(speeds) == {"none", "bf16", "fp16", "int8", "int4", "fp4", "topk", "sparseloco"}
    assert speeds["int8"]["rel_error"] < 0.015
    for r in got["codecs"]["two_sites"]:
        assert r["identical"] and r["wire_bytes"] == r["wire_bytes_expected"], r


def test_without_a_gpu_the_check_says_so_in_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py")], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    if proc.returncode == 0:
        pytest.skip("this machine has a GPU")
    assert proc.stderr.strip().splitlines() == [
        "benchmarks/gpu.py: no CUDA device here; --smoke checks the script on a CPU (its numbers mean nothing)"
    ]
