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

Sharded layout (``sync.within_site=fsdp``, :func:`save` given a :class:`SiteShards`): every DTensor of a rank's state
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
import pickle
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from geotrain.elastic.auth import RunKeys
from geotrain.errors import CheckpointError
from geotrain.sync.base import is_dtensor

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

MANIFEST = "manifest.json"
MANIFEST_MAX_BYTES = 1 << 20
DCP = "dcp"  # the manifest's ``layout`` of a sharded checkpoint
PLACEHOLDER = "dcp-tensor:"  # in a sharded checkpoint's rank file: the key of a tensor in the site's DCP folder


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
    where: SiteShards | None = None,
) -> Path:
    """Write this rank's ``state`` for ``step``; global rank 0 completes it with the manifest
    (HMAC-sealed when ``seal`` is given). Collective over ``group`` (the world). ``where``: a
    sharded run's rank, whose DTensors go into its site's DCP folder (written with the site's
    ranks) and the rest into ``rank{r}.pt``."""
    d = step_dir(root, step)
    d.mkdir(parents=True, exist_ok=True)
    header: dict[str, Any] = {"step": step, "world_size": world}
    mine: dict[str, str] = {}
    if where is not None:
        folder = d / f"site-{where.site}"
        tensors, state = split_dtensors(state)
        import torch.distributed.checkpoint as dcp  # here: replicated runs never pay its import

        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(folder, sync_files=True), process_group=where.mesh.get_group())
        for f in sorted(folder.iterdir()):
            if f.is_file() and _mine(f.name, where.local_rank):
                mine[f"{folder.name}/{f.name}"] = _sha256(f)
        header.update(layout=DCP, sites=[list(s) for s in where.sites])
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    atomic_write(d / f"rank{rank}.pt", data)
    mine[f"rank{rank}.pt"] = hashlib.sha256(data).hexdigest()
    _complete(root, d, header, mine, rank, group, keep, seal)
    return d


def _complete(
    root: Path,
    d: Path,
    header: dict[str, Any],
    mine: dict[str, str],
    rank: int,
    group: dist.ProcessGroup,
    keep: int,
    seal: Seal | None,
) -> None:
    """Gather every rank's file hashes (``mine``: name -> sha256); global rank 0 writes the
    manifest (``header`` + the files, sealed when ``seal`` is given) and prunes to ``keep``."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    if rank == 0:
        manifest: dict[str, Any] = {**header, "files": {name: h for part in everyone for name, h in part.items()}}
        if seal is not None:
            manifest["run"] = seal.run
            manifest["mac"] = seal.mac(manifest)
        atomic_write(d / MANIFEST, json.dumps(manifest, indent=1).encode())
        for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier(group=group)


def read_manifest(
    d: Path, world: int, seal: Seal | None = None, allow_foreign: bool = False, sites: list[str] | None = None
) -> dict[str, Any]:
    """The manifest of checkpoint ``d``, checked: well formed, one ``rank{r}.pt`` per rank of a
    ``world``-rank run and nothing else, and (with ``seal``) written by this run. Opens no rank file.
    With ``sites`` (a sharded run's site names): a sharded checkpoint of those sites, any number
    of workers each, listing its rank files and files in ``site-{name}/`` only.

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
) -> dict[str, Any]:
    """The manifest of checkpoint ``d`` after checking it (:func:`read_manifest`) and the rank
    file ``rank`` loads against it (every file when ``rank`` is None; ``sites``: a sharded run's,
    see :func:`read_manifest`); raises CheckpointError naming what is wrong."""
    manifest = read_manifest(d, world, seal, allow_foreign, sites)
    files = manifest["files"]
    _check_hashes(d, files, [f"rank{rank}.pt"] if rank is not None else sorted(files))
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


@dataclass(frozen=True)
class SiteShards:
    """Where a rank of a sharded (FSDP) run sits, for :func:`save` and :func:`load_sharded`:
    its ``site`` name and rank in it, the run's ``sites`` (name, workers) in order, and the site's
    ``mesh`` (its process group writes and reads the site's DCP folder)."""

    site: str
    local_rank: int
    sites: list[tuple[str, int]]
    mesh: DeviceMesh

    def donor(self, manifest: dict[str, Any]) -> int:
        """The rank file this rank resumes from: its own when its site kept its workers, else that
        of the same rank of the site, or the site's last when the site had fewer."""
        offset = 0
        for name, workers in manifest["sites"]:
            if name == self.site:
                return offset + min(self.local_rank, workers - 1)
            offset += workers
        raise CheckpointError(f"no site {self.site} in the checkpoint")  # read_manifest checked the names

    def resharded(self, manifest: dict[str, Any]) -> bool:
        return [tuple(s) for s in manifest["sites"]] != list(self.sites)


def split_dtensors(state: Any, path: str = "") -> tuple[dict[str, DTensor], Any]:
    """``state`` with every DTensor replaced by a placeholder naming it, and the DTensors by name."""
    found: dict[str, DTensor] = {}

    def walk(x: Any, at: str) -> Any:
        if is_dtensor(x):
            found[at] = x
            return PLACEHOLDER + at
        if isinstance(x, dict):
            return {k: walk(v, f"{at}/{k}") for k, v in x.items()}
        if isinstance(x, list | tuple):
            return type(x)(walk(v, f"{at}/{i}") for i, v in enumerate(x))
        return x

    return found, walk(state, path)


def _placeholders(skeleton: Any) -> list[str]:
    if isinstance(skeleton, str) and skeleton.startswith(PLACEHOLDER):
        return [skeleton[len(PLACEHOLDER) :]]
    if isinstance(skeleton, dict):
        skeleton = list(skeleton.values())
    if isinstance(skeleton, list | tuple):
        return [p for v in skeleton for p in _placeholders(v)]
    return []


def _fill(skeleton: Any, tensors: dict[str, DTensor]) -> Any:
    if isinstance(skeleton, str) and skeleton.startswith(PLACEHOLDER):
        return tensors[skeleton[len(PLACEHOLDER) :]]
    if isinstance(skeleton, dict):
        return {k: _fill(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list | tuple):
        return type(skeleton)(_fill(v, tensors) for v in skeleton)
    return skeleton


def _mine(name: str, local_rank: int) -> bool:
    """Whether a file of a site's DCP folder is hashed by ``local_rank``: each rank its own data
    files (``__{rank}_{n}.distcp``), the site's first rank the rest (``.metadata``)."""
    owner = name[2:].split("_", 1)[0] if name.startswith("__") else ""
    return int(owner) == local_rank if owner.isdigit() else local_rank == 0


def verify_sharded(
    d: Path, world: int, where: SiteShards, seal: Seal | None = None, allow_foreign: bool = False
) -> dict[str, Any]:
    """The manifest of sharded checkpoint ``d`` after checking it (:func:`read_manifest`), the
    rank file this rank resumes from and (the site's first rank) every file of its site's folder."""
    manifest = read_manifest(d, world, seal, allow_foreign, [s for s, _ in where.sites])
    files = manifest["files"]
    names = [f"rank{where.donor(manifest)}.pt"]
    if where.local_rank == 0:
        names += sorted(f for f in files if f.startswith(f"site-{where.site}/"))
    _check_hashes(d, files, names)
    return manifest


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a pickle; this one builds only DCP's metadata records, torch sizes,
    dtypes and layouts and paths, so a doctored file cannot run code (tensor data is read by
    DCP with ``torch.load(weights_only=True)``)."""

    ALLOWED = {
        "torch.distributed.checkpoint.metadata": {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        },
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.serialization": {"_get_layout"},
        "pathlib": {"PosixPath", "PurePosixPath"},
        "collections": {"OrderedDict"},
        "torch": {"Size"},
    }

    def find_class(self, module: str, name: str) -> Any:
        if name in self.ALLOWED.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


def safe_reader(folder: Path) -> Any:
    """DCP's file reader of ``folder`` with :class:`_MetadataUnpickler` for its ``.metadata``
    (DCP is imported here, not with this module: replicated runs never pay its import)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class SafeReader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            path = Path(self._get_metadata_path(kwargs.get("rank")))
            try:
                with open(path, "rb") as f:
                    metadata: Metadata = _MetadataUnpickler(f).load()
            except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as exc:
                raise CheckpointError(f"{path}: not a DCP metadata file ({exc})") from None
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id  # type: ignore[union-attr]
            return metadata

    return SafeReader(folder)


def load_sharded(d: Path, manifest: dict[str, Any], where: SiteShards) -> dict[str, Any]:
    """This rank's state from sharded checkpoint ``d`` (verified): its rank file (:meth:`SiteShards.donor`)
    with each placeholder filled by DCP with this rank's shard in the current layout (every rank of
    the site calls it together). Refuses a tensor the site's folder does not hold."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import empty as dtensor_empty

    skeleton = torch.load(d / f"rank{where.donor(manifest)}.pt", map_location="cpu", weights_only=True)
    reader = safe_reader(d / f"site-{where.site}")
    saved = reader.read_metadata().state_dict_metadata
    tensors: dict[str, DTensor] = {}
    for name in _placeholders(skeleton):
        meta = saved.get(name)
        if not isinstance(meta, TensorStorageMetadata):
            raise CheckpointError(f"{d}: site-{where.site} holds no tensor {name!r} (incomplete checkpoint)")
        tensors[name] = dtensor_empty(*meta.size, dtype=meta.properties.dtype, device_mesh=where.mesh, placements=[Shard(0)])
    dcp.load(tensors, storage_reader=reader, process_group=where.mesh.get_group())
    state: dict[str, Any] = _fill(skeleton, tensors)
    return state
