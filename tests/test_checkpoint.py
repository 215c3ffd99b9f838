"""Checkpoints: exact resume (DiLoCo mid-round, Streaming DiLoCo with exchanges in flight),
atomic hashed files, truncated/tampered checkpoints refused, auto-resume falls back."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from geotrain.errors import CheckpointError
from geotrain.run.checkpoint import verify
from tests.helpers import read_summary, train_cli

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def _train(out: Path, *overrides: str, expect_rc: int = 0) -> subprocess.CompletedProcess[str]:
    return train_cli(out, ["train.steps=12", *overrides], expect_rc=expect_rc, timeout=240)


def _steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics" / "rank0.jsonl").read_text().splitlines()]


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics" / "rank0.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.mark.parametrize(
    "algo",
    [
        ["sync.algorithm=diloco", "sync.H=3"],  # the checkpoint at step 8 falls mid-round
        ["sync.algorithm=streaming", "sync.H=4", "sync.fragments=2", "sync.tau=1"],  # an exchange in flight at 8
    ],
    ids=["diloco", "streaming"],
)
def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path: Path, algo: list[str]) -> None:
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    _train(full, *algo, "checkpoint.every=4")
    assert sorted(p.name for p in (full / "checkpoints").iterdir()) == ["step-00000004", "step-00000008", "step-00000012"]
    # the folder resumed into already holds the interrupted run's records, up to step 12: the
    # records after the checkpoint are replaced, not appended to (one record per step)
    (resumed / "metrics").mkdir(parents=True)
    shutil.copy(full / "metrics" / "rank0.jsonl", resumed / "metrics" / "rank0.jsonl")
    proc = _train(resumed, *algo, f"checkpoint.resume={full / 'checkpoints' / 'step-00000008'}")
    assert "resumed from" in proc.stdout
    a, b = _losses(full), _losses(resumed)
    assert _steps(resumed) == _steps(full)
    assert a == b  # bit-identical loss trajectory, after the checkpoint too
    sa, sb = read_summary(full), read_summary(resumed)
    assert sa["global_param_hash"] == sb["global_param_hash"]
    assert sa["final_eval_loss"] == sb["final_eval_loss"] and sa["inter_site_bytes"] == sb["inter_site_bytes"]


def test_tampered_checkpoint_is_refused_and_auto_resume_uses_the_previous_good_one(tmp_path: Path) -> None:
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    _train(full, "sync.H=3", "checkpoint.every=4", "checkpoint.keep=2", "train.steps=8")
    ckpts = full / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000004", "step-00000008"]  # keep=2 prunes nothing yet
    newest = ckpts / "step-00000008"
    verify(newest, 4)
    blob = (newest / "rank2.pt").read_bytes()
    (newest / "rank2.pt").write_bytes(blob[: len(blob) // 2])  # truncated
    with pytest.raises(CheckpointError, match="rank2.pt: content hash does not match"):
        verify(newest, 4)
    # an explicit path to it: one clear line, nothing started
    proc = _train(tmp_path / "x", "sync.H=3", f"checkpoint.resume={newest}", expect_rc=2)
    assert proc.stderr.strip().startswith("geotrain: checkpoint.resume: refused:") and "Traceback" not in proc.stderr
    # auto: skips it, says so, resumes from step 4, and continues exactly like the full run
    proc = _train(resumed, "sync.H=3", "checkpoint.resume=auto", f"checkpoint.dir={ckpts}", "train.steps=8")
    assert "skipping checkpoint" in proc.stdout and "after step 4" in proc.stdout
    a, b = _losses(full), _losses(resumed)
    assert sorted(b) == [5, 6, 7, 8] and all(a[s] == b[s] for s in b)
    # a tampered byte in the middle (same length) is caught too; a missing manifest means incomplete
    good = ckpts / "step-00000004"
    data = bytearray((good / "rank0.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (good / "rank0.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="tampered"):
        verify(good, 4)
    (good / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        verify(good, 4)
