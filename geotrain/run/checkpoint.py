"""Checkpoints: every rank's complete state, written atomically, hashed, verified before use.

Layout: ``DIR/step-00000012/rank{r}.pt`` (one per rank) and ``DIR/step-00000012/manifest.json``
(step, world size, sha256 of every rank file). A rank file is written to a temporary name,
flushed to disk and renamed; the manifest is written the same way by global rank 0 only after
every rank reported its hash (a world-group gather), so a checkpoint without a manifest is
incomplete by construction. Loading recomputes every file's hash: a truncated or tampered
file is refused with a message naming it, and ``resume=auto`` falls back to the newest
checkpoint that verifies. Files are read with ``torch.load(weights_only=True)`` — tensors and
plain containers only, no pickled code.

A rank's state: the model (local parameters), inner optimizer and LR schedule, the sync
algorithm's state (global parameters, outer optimizer, codec error feedback, Streaming
DiLoCo's exchanges in flight — waited for and saved averaged), the data sampler's position
(its generator state), torch's global RNG, byte counters, and the privacy accountant's history.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from geotrain.errors import CheckpointError

MANIFEST = "manifest.json"


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def save(root: Path, step: int, state: dict[str, Any], rank: int, world: int, group: dist.ProcessGroup, keep: int) -> Path:
    """Write this rank's ``state`` for ``step``; rank 0 seals it with the manifest. Collective."""
    d = step_dir(root, step)
    d.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    _atomic_write(d / f"rank{rank}.pt", data)
    digest = hashlib.sha256(data).hexdigest()
    hashes: list[Any] = [None] * world
    dist.all_gather_object(hashes, digest, group=group)
    if rank == 0:
        manifest = {"step": step, "world_size": world, "files": {f"rank{r}.pt": h for r, h in enumerate(hashes)}}
        _atomic_write(d / MANIFEST, json.dumps(manifest, indent=1).encode())
        for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier(group=group)
    return d


def verify(d: Path, world: int) -> dict[str, Any]:
    """The manifest of checkpoint ``d`` after checking every rank file against it; raises
    CheckpointError naming what is wrong."""
    m = d / MANIFEST
    if not m.is_file():
        raise CheckpointError(f"{d}: no {MANIFEST} (incomplete checkpoint)")
    try:
        manifest = json.loads(m.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{m}: unreadable manifest ({exc})") from None
    if manifest.get("world_size") != world:
        raise CheckpointError(f"{d}: written by {manifest.get('world_size')} ranks, this run has {world}")
    for name, digest in files.items():
        f = d / name
        if not f.is_file():
            raise CheckpointError(f"{f}: missing")
        if _sha256(f) != digest:
            raise CheckpointError(f"{f}: content hash does not match the manifest (truncated or tampered)")
    return manifest


def find(spec: str, root: Path, world: int, warn: Any = None) -> Path | None:
    """The checkpoint to resume: ``spec`` 'auto' = the newest under ``root`` that verifies (a bad
    one is reported through ``warn`` and skipped); else ``spec`` itself, which must verify."""
    if spec != "auto":
        d = Path(spec).expanduser()
        verify(d, world)
        return d
    for d in sorted((p for p in root.glob("step-*") if p.is_dir()), reverse=True):
        try:
            verify(d, world)
            return d
        except CheckpointError as exc:
            if warn is not None:
                warn(f"skipping checkpoint: {exc}")
    return None


def load(d: Path, rank: int) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(d / f"rank{rank}.pt", map_location="cpu", weights_only=True)
    return state
