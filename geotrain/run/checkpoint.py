"""Checkpoints: every rank's complete state, written atomically, hashed, verified before use.

Layout: ``DIR/step-00000012/rank{r}.pt`` (one per rank) and ``DIR/step-00000012/manifest.json``
(step, world size, sha256 of every rank file). A rank file is written to a temporary name,
flushed to disk and renamed; the manifest is written the same way by global rank 0 only after
every rank reported its hash (a world-group gather), so a checkpoint without a manifest is
incomplete by construction. Files are read with ``torch.load(weights_only=True)`` — tensors and
plain containers only, no pickled code.

When the run has a secret (:class:`Seal`), the manifest carries the run's public id and an
HMAC-SHA256 over its content with a key derived from the secret: a manifest edited to match an
altered rank file is refused, and so is a checkpoint another run wrote (another secret, or
none) unless ``checkpoint.allow_foreign`` says to load it anyway (its file hashes are still
checked). Loading opens only the files the manifest lists under the names a checkpoint uses
(``rank{r}.pt``, one per rank), and each rank hashes only the file it loads; the ranks then agree
(one gather) so they all take the same checkpoint or all refuse. A truncated or tampered file is
refused with a message naming it, and ``resume=auto`` falls back to the newest checkpoint that
verifies on every rank.

A rank's state: the model (local parameters), inner optimizer and LR schedule, the sync
algorithm's state (global parameters, outer optimizer, codec error feedback, Streaming
DiLoCo's exchanges in flight — waited for and saved averaged), the data sampler's position
(its generator state), torch's global RNG, byte counters, and the privacy accountant's history.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from geotrain.elastic.auth import RunKeys
from geotrain.errors import CheckpointError

MANIFEST = "manifest.json"
MANIFEST_MAX_BYTES = 1 << 20


@dataclass(frozen=True)
class Seal:
    """What a run with a secret seals its manifests with: ``key`` (HMAC) and ``run`` (a public id;
    both derived from the secret, so equal ids mean the same secret)."""

    key: bytes
    run: str

    @classmethod
    def of(cls, secret: bytes | None) -> Seal | None:
        """The seal of a run with ``secret`` (None: the run has no secret, manifests are not sealed)."""
        if secret is None:
            return None
        keys = RunKeys(secret)
        return cls(keys.checkpoint, keys.run_id)

    def mac(self, manifest: dict[str, Any]) -> str:
        body = {k: v for k, v in manifest.items() if k != "mac"}
        return hmac.new(self.key, json.dumps(body, sort_keys=True).encode(), hashlib.sha256).hexdigest()


def atomic_write(path: Path, data: bytes) -> None:
    """``data`` at ``path``, whole or not at all: written to a temporary name, fsynced, renamed."""
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


def save(
    root: Path,
    step: int,
    state: dict[str, Any],
    rank: int,
    world: int,
    group: dist.ProcessGroup,
    keep: int,
    seal: Seal | None = None,
) -> Path:
    """Write this rank's ``state`` for ``step``; rank 0 completes it with the manifest (HMAC-sealed
    when ``seal`` is given). Collective."""
    d = step_dir(root, step)
    d.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    atomic_write(d / f"rank{rank}.pt", data)
    digest = hashlib.sha256(data).hexdigest()
    hashes: list[Any] = [None] * world
    dist.all_gather_object(hashes, digest, group=group)
    if rank == 0:
        manifest: dict[str, Any] = {"step": step, "world_size": world, "files": {f"rank{r}.pt": h for r, h in enumerate(hashes)}}
        if seal is not None:
            manifest["run"] = seal.run
            manifest["mac"] = seal.mac(manifest)
        atomic_write(d / MANIFEST, json.dumps(manifest, indent=1).encode())
        for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier(group=group)
    return d


def read_manifest(d: Path, world: int, seal: Seal | None = None, allow_foreign: bool = False) -> dict[str, Any]:
    """The manifest of checkpoint ``d``, checked: well formed, one ``rank{r}.pt`` per rank of a
    ``world``-rank run and nothing else, and (with ``seal``) written by this run. Opens no rank file.

    Raises:
        CheckpointError: naming what is wrong.
    """
    m = d / MANIFEST
    if not m.is_file():
        raise CheckpointError(f"{d}: no {MANIFEST} (incomplete checkpoint)")
    if m.stat().st_size > MANIFEST_MAX_BYTES:
        raise CheckpointError(f"{m}: larger than {MANIFEST_MAX_BYTES} bytes (not a geotrain manifest)")
    try:
        manifest = json.loads(m.read_text())
        files = manifest["files"]  # a TypeError unless the manifest is a JSON object
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{m}: unreadable manifest ({exc})") from None
    if not isinstance(files, dict) or not all(isinstance(h, str) for h in files.values()):
        raise CheckpointError(f"{m}: unreadable manifest (files is not an object of name -> sha256)")
    if manifest.get("world_size") != world:
        raise CheckpointError(f"{d}: written by {manifest.get('world_size')} ranks, this run has {world}")
    expected = {f"rank{r}.pt" for r in range(world)}
    if set(files) != expected:
        odd = sorted(set(files) ^ expected)[:3]
        raise CheckpointError(f"{m}: lists {', '.join(map(repr, odd))}: a checkpoint lists exactly rank0.pt..rank{world - 1}.pt")
    if seal is not None:
        mac = manifest.get("mac")
        if manifest.get("run") == seal.run:
            if not isinstance(mac, str) or not hmac.compare_digest(mac, seal.mac(manifest)):
                raise CheckpointError(f"{m}: its HMAC does not verify with this run's secret (altered manifest)")
        elif not allow_foreign:
            whose = "without a run secret" if manifest.get("run") is None else "by another run (another secret)"
            raise CheckpointError(
                f"{d}: written {whose}; set checkpoint.allow_foreign=true to load it into this secret-protected run"
            )
    return manifest


def verify(d: Path, world: int, rank: int | None = None, seal: Seal | None = None, allow_foreign: bool = False) -> dict[str, Any]:
    """The manifest of checkpoint ``d`` after checking it (:func:`read_manifest`) and the rank
    file ``rank`` loads against it (every rank's when ``rank`` is None); raises CheckpointError
    naming what is wrong."""
    manifest = read_manifest(d, world, seal, allow_foreign)
    files = manifest["files"]
    for name in [f"rank{rank}.pt"] if rank is not None else sorted(files):
        f = d / name
        if not f.is_file():
            raise CheckpointError(f"{f}: missing")
        if _sha256(f) != files[name]:
            raise CheckpointError(f"{f}: content hash does not match the manifest (truncated or tampered)")
    return manifest


def find(
    spec: str,
    root: Path,
    world: int,
    check: Callable[[Path], None],
    agree: Callable[[str | None], list[str | None]],
    warn: Callable[[str], None] | None = None,
) -> Path | None:
    """The checkpoint to resume, chosen alike on every rank: ``spec`` 'auto' = the newest under
    ``root`` that every rank's ``check`` accepts (one that fails is reported through ``warn`` and
    skipped); else ``spec`` itself, which must pass. ``check`` raises CheckpointError for this
    rank's part; ``agree`` gathers every rank's error (None: fine), a collective.

    Raises:
        CheckpointError: ``spec`` is a path that fails on some rank (naming the first failure).
    """
    explicit = spec != "auto"
    candidates = [Path(spec).expanduser()] if explicit else sorted((p for p in root.glob("step-*") if p.is_dir()), reverse=True)
    for d in candidates:
        try:
            check(d)
            mine = None
        except CheckpointError as exc:
            mine = str(exc)
        errors = [e for e in agree(mine) if e is not None]
        if not errors:
            return d
        if explicit:
            raise CheckpointError(errors[0])
        if warn is not None:
            warn(f"skipping checkpoint: {errors[0]}")
    return None


def load(d: Path, rank: int) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(d / f"rank{rank}.pt", map_location="cpu", weights_only=True)
    return state
