"""Checkpoints: exact resume (DiLoCo mid-round, Streaming DiLoCo with exchanges in flight),
atomic hashed files, truncated/tampered checkpoints refused, auto-resume falls back."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from geotrain.errors import CheckpointError
from geotrain.run.checkpoint import Seal, verify
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
        [  # two tiers: at step 8, 2 region rounds and 1 world round in, mid-round; momentum in each region
            "sync.algorithm=diloco",
            "sync.H=3",
            "topology.sites=[{name: A, workers: 1}, {name: B, workers: 1}, {name: C, workers: 1}, {name: D, workers: 1}]",
            "topology.regions=[{name: eu, sites: [A, B]}, {name: us, sites: [C, D]}]",
            "sync.region_every=2",  # (the guard on: its history per region is in the checkpoint too)
        ],
    ],
    ids=["diloco", "streaming", "tiers"],
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
    assert sa["inter_region_bytes"] == sb["inter_region_bytes"] and sa["region_rounds"] == sb["region_rounds"]


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


def test_sealed_manifest_refuses_edits_and_other_runs_checkpoints(tmp_path: Path) -> None:
    secret_a, secret_b = tmp_path / "a.secret", tmp_path / "b.secret"
    secret_a.write_text("run-a-" + "x" * 20)
    secret_b.write_text("run-b-" + "y" * 20)
    for f in (secret_a, secret_b):
        f.chmod(0o600)  # (a secret file others may read is refused)
    run_a = tmp_path / "a"
    _train(run_a, "sync.H=3", "checkpoint.every=4", "train.steps=8", f"elastic.secret_file={secret_a}")
    d = run_a / "checkpoints" / "step-00000008"
    seal_a, seal_b = Seal.of(secret_a.read_bytes()), Seal.of(secret_b.read_bytes())
    manifest = verify(d, 4, None, seal_a)
    assert manifest["run"] == seal_a.run and len(manifest["mac"]) == 64
    # another run's secret: refused unless allowed; a run without a secret loads it (nothing to protect)
    with pytest.raises(CheckpointError, match="another run"):
        verify(d, 4, 0, seal_b)
    verify(d, 4, 0, seal_b, allow_foreign=True)
    verify(d, 4, 0, None)
    # a rank file altered and the manifest's hash edited to match: the old check (hashes only) passed it
    data = bytearray((d / "rank1.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (d / "rank1.pt").write_bytes(bytes(data))
    edited = json.loads((d / "manifest.json").read_text())
    edited["files"]["rank1.pt"] = hashlib.sha256(bytes(data)).hexdigest()
    (d / "manifest.json").write_text(json.dumps(edited))
    verify(d, 4, None, None)  # without the seal nothing can tell
    with pytest.raises(CheckpointError, match="HMAC does not verify"):
        verify(d, 4, 0, seal_a)
    # a manifest naming files outside the rank files is refused before anything is opened
    odd = {**edited, "files": {**edited["files"], "../../etc/passwd": "0" * 64}}
    (d / "manifest.json").write_text(json.dumps(odd))
    with pytest.raises(CheckpointError, match="lists exactly rank0.pt"):
        verify(d, 4, 0, None)
    # each rank hashes only the file it loads: rank 0 accepts while rank 3's file is corrupt
    good = run_a / "checkpoints" / "step-00000004"
    (good / "rank3.pt").write_bytes(b"corrupt")
    verify(good, 4, 0, seal_a)
    with pytest.raises(CheckpointError, match="rank3.pt: content hash"):
        verify(good, 4, 3, seal_a)
    # end to end: a run with another secret refuses A's checkpoint in one line, nothing started ...
    clean = tmp_path / "clean"
    _train(clean, "sync.H=3", "checkpoint.every=4", "train.steps=4", f"elastic.secret_file={secret_a}")
    ckpt_a = clean / "checkpoints" / "step-00000004"
    proc = _train(tmp_path / "b", "sync.H=3", f"checkpoint.resume={ckpt_a}", f"elastic.secret_file={secret_b}", expect_rc=2)
    assert "another run" in proc.stderr and "checkpoint.allow_foreign" in proc.stderr and "Traceback" not in proc.stderr
    # ... and loads it when told to
    proc = _train(
        tmp_path / "b2",
        "sync.H=3",
        "train.steps=8",
        f"checkpoint.resume={ckpt_a}",
        "checkpoint.allow_foreign=true",
        f"elastic.secret_file={secret_b}",
    )
    assert "after step 4" in proc.stdout


def test_sites_with_disks_of_their_own_write_resume_and_agree(tmp_path: Path) -> None:
    """checkpoint.dir with {site}: each site writes to a folder of its own, as on machines that
    share no disk. Each folder holds its site's rank files and the manifest (0600, folders 0700);
    auto-resume takes the newest step every rank holds: site B lost step 12, so both resume from
    step 8 and go on exactly like the uninterrupted run."""
    disks = tmp_path / "disk-{site}"
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    _train(full, "sync.H=3", "checkpoint.every=4", f"checkpoint.dir={disks}")
    assert not (full / "checkpoints").exists()
    for site, ranks in (("A", ["rank0.pt", "rank1.pt"]), ("B", ["rank2.pt", "rank3.pt"])):
        disk = tmp_path / f"disk-{site}"
        assert sorted(p.name for p in disk.iterdir()) == ["step-00000004", "step-00000008", "step-00000012"]
        for d in disk.iterdir():
            assert sorted(p.name for p in d.iterdir()) == ["manifest.json", *ranks]
            assert d.stat().st_mode & 0o777 == 0o700
            assert all(p.stat().st_mode & 0o777 == 0o600 for p in d.iterdir())
            verify(d, 4, int(ranks[0][4]))  # this disk's manifest lists every rank; this disk's files match it
    assert (tmp_path / "disk-A" / "step-00000008" / "manifest.json").read_bytes() == (
        tmp_path / "disk-B" / "step-00000008" / "manifest.json"
    ).read_bytes()
    shutil.rmtree(tmp_path / "disk-B" / "step-00000012")
    (resumed / "metrics").mkdir(parents=True)
    shutil.copy(full / "metrics" / "rank0.jsonl", resumed / "metrics" / "rank0.jsonl")
    proc = _train(resumed, "sync.H=3", "checkpoint.resume=auto", f"checkpoint.dir={disks}")
    assert "skipping checkpoint step-00000012: held by 2 of 4 ranks" in proc.stdout
    assert proc.stdout.count("(after step 8)") == 1, proc.stdout  # rank 0 says it; every rank took it (same losses)
    a, b = _losses(full), _losses(resumed)
    assert _steps(resumed) == _steps(full) and a == b
    assert read_summary(full)["global_param_hash"] == read_summary(resumed)["global_param_hash"]
    # an explicit checkpoint in each site's folder: checked before launch (each site's part in its
    # folder), then loaded
    again = tmp_path / "again"
    proc = _train(again, "sync.H=3", f"checkpoint.resume={disks / 'step-00000004'}")
    assert "(after step 4)" in proc.stdout
    c = _losses(again)
    assert sorted(c) == list(range(5, 13)) and all(c[s] == a[s] for s in c)


def test_a_manifest_binds_its_step_and_its_sites(tmp_path: Path) -> None:
    """A checkpoint renamed to a later step (a rollback passed off as progress) is refused, and
    auto-resume goes back to the newest honest one; another site's checkpoint is refused."""
    full = tmp_path / "full"
    _train(full, "sync.H=3", "checkpoint.every=4", "train.steps=8")
    ckpts = full / "checkpoints"
    manifest = json.loads((ckpts / "step-00000004" / "manifest.json").read_text())
    assert manifest["step"] == 4 and manifest["site_names"] == ["A", "B"]
    with pytest.raises(CheckpointError, match="written by sites \\['A', 'B'\\], this run's are \\['B', 'A'\\]"):
        verify(ckpts / "step-00000004", 4, 0, names=["B", "A"])
    (ckpts / "step-00000008").rename(ckpts / "step-00000012")
    with pytest.raises(CheckpointError, match="its manifest is for step 8: a renamed or rolled-back checkpoint"):
        verify(ckpts / "step-00000012", 4, 0)
    proc = _train(tmp_path / "resumed", "sync.H=3", "checkpoint.resume=auto", f"checkpoint.dir={ckpts}", "train.steps=8")
    assert "skipping checkpoint" in proc.stdout and "renamed or rolled-back" in proc.stdout and "(after step 4)" in proc.stdout
