"""Checkpoints: every rank's complete state, written atomically, hashed, verified before use.

Layout: ``DIR/step-00000012/rank{r}.pt`` (one per rank) and ``DIR/step-00000012/manifest.json``
(step, world size, sha256 of every rank file). A rank file is written to a temporary name,
flushed to disk, renamed, and its folder flushed too (so a power loss cannot lose the rename);
files and folders are the owner's only (0600, 0700: in cross-organisation mode a site's
un-aggregated parameters are in them). The manifest is written the same way only after every
rank reported its hash (a world-group gather), so a checkpoint without a manifest is incomplete
by construction. Files are read with ``torch.load(weights_only=True)`` — tensors and plain
containers only, no pickled code.

No disk is assumed shared across sites or machines (``checkpoint.dir`` may name a folder per
site with ``{site}``, or the same path on each machine): every rank writes the manifest, the
same bytes, beside its own file, and prunes its own folder; on a shared disk the writes of one
manifest are atomic renames of identical content. ``resume=auto`` takes the newest step that
*every* rank holds and verifies: the ranks first agree on the steps all of them hold (one
gather), then check those alike, so ranks that see different folders never run different
numbers of collectives. A step some rank lacks is skipped with a message naming how many ranks
hold it. A sharded run's DCP folder is written by the site's ranks together and needs a disk
shared inside the site (DCP's own rule), not across sites.

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

Sharded layout (``sync.within_site=fsdp``, :func:`save` given a :class:`~geotrain.run.shards.SiteShards`): every DTensor of a rank's state
(its shards of the model, the inner optimizer, DiLoCo's global parameters and outer state, error
feedback, fragments in flight) goes into one ``torch.distributed.checkpoint`` (DCP) folder per
site, ``site-{name}/``, written by the site's ranks together; the rest of the state stays in
``rank{r}.pt`` with a placeholder naming each tensor. The manifest lists and hashes both, with
``layout: dcp`` and the sites' worker counts. DCP reshards on load, so a site may resume with
another number of workers (:func:`load_sharded`; docs/SCALE.md).
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from geotrain.comm.control import all_gather_json
from geotrain.elastic.auth import RunKeys
from geotrain.errors import CheckpointError
from geotrain.run.shards import SiteShards, hashed_by, split_dtensors

MANIFEST = "manifest.json"
MANIFEST_MAX_BYTES = 1 << 20
DCP = "dcp"  # the manifest's ``layout`` of a sharded checkpoint


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


def fsync_dir(folder: Path) -> None:
    """Flush ``folder``'s entries (a rename or a new file in it) to disk."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """``data`` at ``path``, whole or not at all, readable by its owner only (0600): written to a
    temporary name of this process and thread (other ranks may write the same file on a shared
    disk), fsynced, renamed, and the folder fsynced so the rename survives a power loss."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


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
    where: SiteShards | None = None,
    names: list[str] | None = None,
) -> Path:
    """Write this rank's ``state`` for ``step``; every rank completes it with the manifest
    (HMAC-sealed when ``seal`` is given) beside its own file. Collective over ``group`` (the
    world). ``where``: a sharded run's rank, whose DTensors go into its site's DCP folder (written
    with the site's ranks) and the rest into ``rank{r}.pt``."""
    d = step_dir(root, step)
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    d.mkdir(exist_ok=True, mode=0o700)
    header: dict[str, Any] = {"step": step, "world_size": world}
    if names is not None:
        header["site_names"] = names  # the sites of this world (in elastic mode: the one site)
    mine: dict[str, str] = {}
    if where is not None:
        folder = d / f"site-{where.site}"
        tensors, state = split_dtensors(state)
        import torch.distributed.checkpoint as dcp  # here: replicated runs never pay its import

        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(folder, sync_files=True), process_group=where.mesh.get_group())
        for f in sorted(folder.iterdir()):
            if f.is_file() and hashed_by(f.name, where.local_rank):
                f.chmod(0o600)  # DCP writes with the umask's mode
                mine[f"{folder.name}/{f.name}"] = _sha256(f)
        folder.chmod(0o700)
        header.update(layout=DCP, sites=[list(s) for s in where.sites])
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    atomic_write(d / f"rank{rank}.pt", data)
    mine[f"rank{rank}.pt"] = hashlib.sha256(data).hexdigest()
    _complete(root, d, header, mine, group, keep, seal)
    return d


def _complete(
    root: Path,
    d: Path,
    header: dict[str, Any],
    mine: dict[str, str],
    group: dist.ProcessGroup,
    keep: int,
    seal: Seal | None,
) -> None:
    """Gather every rank's file hashes (``mine``: name -> sha256); every rank writes the manifest
    (``header`` + the files, sealed when ``seal`` is given; the same bytes everywhere) beside its
    own file and prunes its own folder to ``keep``: no disk is assumed shared."""
    everyone = all_gather_json(mine, group)  # (JSON: the world group crosses sites)
    manifest: dict[str, Any] = {**header, "files": {name: h for part in everyone for name, h in part.items()}}
    if seal is not None:
        manifest["run"] = seal.run
        manifest["mac"] = seal.mac(manifest)
    atomic_write(d / MANIFEST, json.dumps(manifest, indent=1).encode())
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)  # (on a shared disk another rank may be removing it too)
    dist.barrier(group=group)


def read_manifest(
    d: Path,
    world: int,
    seal: Seal | None = None,
    allow_foreign: bool = False,
    sites: list[str] | None = None,
    names: list[str] | None = None,
) -> dict[str, Any]:
    """The manifest of checkpoint ``d``, checked: well formed, one ``rank{r}.pt`` per rank of a
    ``world``-rank run and nothing else, and (with ``seal``) written by this run. Opens no rank file.
    With ``sites`` (a sharded run's site names): a sharded checkpoint of those sites, any number
    of workers each, listing its rank files and files in ``site-{name}/`` only. The manifest
    binds its step (a ``step-N`` folder must hold step N: a renamed or rolled-back checkpoint is
    refused) and, with ``names``, the sites that wrote it (another site's checkpoint, as an
    elastic site's copied into a peer's folder, is refused; manifests from before this record
    are taken).

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
    if sites is None:
        _check_rank_files(d, m, manifest, world)
    else:
        _check_sharded_files(d, m, manifest, sites)
    named = d.name[len("step-") :] if d.name.startswith("step-") else ""
    if named.isdigit() and manifest.get("step") != int(named):
        raise CheckpointError(f"{d}: its manifest is for step {manifest.get('step')!r}: a renamed or rolled-back checkpoint")
    if names is not None and "site_names" in manifest and manifest["site_names"] != names:
        raise CheckpointError(
            f"{d}: written by sites {manifest['site_names']}, this run's are {names} (another site's checkpoint)"
        )
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


def _check_rank_files(d: Path, m: Path, manifest: dict[str, Any], world: int) -> None:
    if manifest.get("layout") == DCP:
        raise CheckpointError(f"{d}: a sharded checkpoint (sync.within_site=fsdp); this run has sync.within_site=replicate")
    if manifest.get("world_size") != world:
        raise CheckpointError(f"{d}: written by {manifest.get('world_size')} ranks, this run has {world}")
    expected = {f"rank{r}.pt" for r in range(world)}
    if set(manifest["files"]) != expected:
        odd = sorted(set(manifest["files"]) ^ expected)[:3]
        raise CheckpointError(f"{m}: lists {', '.join(map(repr, odd))}: a checkpoint lists exactly rank0.pt..rank{world - 1}.pt")


def _check_sharded_files(d: Path, m: Path, manifest: dict[str, Any], sites: list[str]) -> None:
    if manifest.get("layout") != DCP:
        raise CheckpointError(f"{d}: a whole-model checkpoint (sync.within_site=replicate); this run has sync.within_site=fsdp")
    saved: Any = manifest.get("sites")
    ok = isinstance(saved, list) and all(
        isinstance(s, list) and len(s) == 2 and isinstance(s[0], str) and isinstance(s[1], int) and s[1] > 0 for s in saved
    )
    if not ok:
        raise CheckpointError(f"{m}: unreadable manifest (sites is not a list of [name, workers])")
    if [s[0] for s in saved] != sites:
        raise CheckpointError(
            f"{d}: written for sites {[s[0] for s in saved]}, this run has {sites} (resharding keeps the sites)"
        )
    world = sum(s[1] for s in saved)
    if manifest.get("world_size") != world:
        raise CheckpointError(f"{m}: unreadable manifest (world_size is not the sum of the sites' workers)")
    ranks = {f"rank{r}.pt" for r in range(world)}
    folders = {f"site-{name}" for name in sites}
    odd = [
        f
        for f in manifest["files"]
        if f not in ranks and not (f.count("/") == 1 and f.split("/")[0] in folders and f.split("/")[1] not in ("", ".", ".."))
    ]
    missing = ranks - set(manifest["files"])
    if odd or missing:
        bad = sorted(odd)[:2] + sorted(missing)[:1]
        raise CheckpointError(
            f"{m}: lists {', '.join(map(repr, bad))}: a sharded checkpoint lists rank0.pt..rank{world - 1}.pt and files in site-NAME/"
        )


def _check_hashes(d: Path, files: dict[str, str], names: list[str]) -> None:
    for name in names:
        f = d / name
        if not f.is_file():
            raise CheckpointError(f"{f}: missing")
        if _sha256(f) != files[name]:
            raise CheckpointError(f"{f}: content hash does not match the manifest (truncated or tampered)")


def verify(
    d: Path,
    world: int,
    rank: int | None = None,
    seal: Seal | None = None,
    allow_foreign: bool = False,
    sites: list[str] | None = None,
    part: Callable[[str], bool] | None = None,
    names: list[str] | None = None,
) -> dict[str, Any]:
    """The manifest of checkpoint ``d`` after checking it (:func:`read_manifest`) and the rank
    file ``rank`` loads against it (when ``rank`` is None: every file the manifest lists, or those
    ``part`` accepts, the part of the checkpoint on this disk; ``sites``: a sharded run's, see
    :func:`read_manifest`); raises CheckpointError naming what is wrong."""
    manifest = read_manifest(d, world, seal, allow_foreign, sites, names)
    files = manifest["files"]
    wanted = [f"rank{rank}.pt"] if rank is not None else sorted(f for f in files if part is None or part(f))
    _check_hashes(d, files, wanted)
    return manifest


def find(
    spec: str,
    root: Path,
    world: int,
    check: Callable[[Path], None],
    agree: Callable[[Any], list[Any]],
    warn: Callable[[str], None] | None = None,
) -> Path | None:
    """The checkpoint to resume, chosen alike on every rank: ``spec`` 'auto' = the newest step
    that every rank holds under its own ``root`` and every rank's ``check`` accepts (a step some
    rank lacks, or one that fails, is reported through ``warn`` and skipped); else ``spec``
    itself, which must pass. ``check`` raises CheckpointError for this rank's part; ``agree``
    gathers one value from every rank (a collective): first the step folders each holds, then
    each common step's verdict (None: fine), so every rank makes the same calls.

    Raises:
        CheckpointError: ``spec`` is a path that fails on some rank (naming the first failure).
    """
    explicit = spec != "auto"
    if explicit:
        candidates = [Path(spec).expanduser()]
    else:
        held = agree(sorted(p.name for p in root.glob("step-*") if p.is_dir()))
        counts: dict[str, int] = {}
        for names in held:
            for name in set(names):
                counts[name] = counts.get(name, 0) + 1
        newest_common = max((n for n, c in counts.items() if c == world), default="")
        for name in sorted((n for n, c in counts.items() if c < world and n > newest_common), reverse=True):
            if warn is not None:
                warn(f"skipping checkpoint {name}: held by {counts[name]} of {world} ranks (each reads its own checkpoint.dir)")
        candidates = [root / n for n in sorted((n for n, c in counts.items() if c == world), reverse=True)]
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


def verify_sharded(
    d: Path, world: int, where: SiteShards, seal: Seal | None = None, allow_foreign: bool = False
) -> dict[str, Any]:
    """The manifest of sharded checkpoint ``d`` after checking it (:func:`read_manifest`), the
    rank file this rank resumes from and (the site's first rank) every file of its site's folder."""
    names = [s for s, _ in where.sites]
    manifest = read_manifest(d, world, seal, allow_foreign, names, names)
    files = manifest["files"]
    names = [f"rank{where.donor(manifest)}.pt"]
    if where.local_rank == 0:
        names += sorted(f for f in files if f.startswith(f"site-{where.site}/"))
    _check_hashes(d, files, names)
    return manifest
