"""Sharded checkpoints (``sync.within_site=fsdp``): where a rank sits in its site, its state's
DTensors split out (written by the site's ranks into one ``torch.distributed.checkpoint`` folder)
and filled back on load in the current layout, and DCP's ``.metadata`` read through an
unpickler that builds nothing but DCP's records. The files, the manifest and verification are
:mod:`geotrain.run.checkpoint`.
"""

from __future__ import annotations

import hashlib
import io
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from geotrain.comm.groups import is_dtensor
from geotrain.errors import CheckpointError

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

PLACEHOLDER = "dcp-tensor:"  # in a sharded checkpoint's rank file: the key of a tensor in the site's DCP folder


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


def hashed_by(name: str, local_rank: int) -> bool:
    """Whether a file of a site's DCP folder is hashed by ``local_rank``: each rank its own data
    files (``__{rank}_{n}.distcp``), the site's first rank the rest (``.metadata``)."""
    owner = name[2:].split("_", 1)[0] if name.startswith("__") else ""
    return int(owner) == local_rank if owner.isdigit() else local_rank == 0


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a pickle; this one builds only DCP's metadata records for tensors,
    torch sizes, dtypes and layouts and paths, so a doctored file cannot run code. Tensor data is
    read by DCP with ``torch.load(weights_only=True)``; a *bytes* entry (``BytesStorageMetadata``)
    is refused, because DCP loads those with ``torch.load(weights_only=False)``, and geotrain's
    sharded checkpoints hold tensors only."""

    ALLOWED = {
        "torch.distributed.checkpoint.metadata": {
            "Metadata",
            "TensorStorageMetadata",
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


def safe_reader(folder: Path, data: bytes | None = None) -> Any:
    """DCP's file reader of ``folder`` whose ``.metadata`` is parsed once, here, with
    :class:`_MetadataUnpickler`, from ``data`` (the bytes the caller checked against the
    manifest) or else from the file, and never read again: DCP asks for the metadata again inside
    ``dcp.load``, and a file swapped in between would otherwise be parsed unchecked.
    (DCP is imported here, not with this module: replicated runs never pay its import.)

    Raises:
        CheckpointError: the metadata is not DCP's, or holds anything but tensors.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

    path = folder / ".metadata"
    try:
        raw = data if data is not None else path.read_bytes()
        parsed = _MetadataUnpickler(io.BytesIO(raw)).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a DCP metadata file ({exc})") from None
    entries = getattr(parsed, "state_dict_metadata", None)
    if not isinstance(parsed, Metadata) or not isinstance(entries, dict):
        raise CheckpointError(f"{path}: not a DCP metadata file")
    odd = [k for k, v in entries.items() if not isinstance(v, TensorStorageMetadata)]
    if odd:
        raise CheckpointError(f"{path}: holds non-tensor entries ({', '.join(map(str, odd[:3]))}): refused")
    if getattr(parsed, "storage_meta", None) is None:
        parsed.storage_meta = StorageMeta()

    class SafeReader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            parsed.storage_meta.load_id = self.load_id  # type: ignore[union-attr]
            return parsed

    return SafeReader(folder)


def checked_metadata(d: Path, manifest: dict[str, Any], site: str) -> bytes:
    """The bytes of ``site``'s DCP ``.metadata`` in checkpoint ``d``, read once and checked
    against the manifest's sha256 (the file may have changed since the checkpoint was verified).

    Raises:
        CheckpointError: it is missing, unlisted, or not what the manifest recorded.
    """
    name = f"site-{site}/.metadata"
    want = manifest["files"].get(name)
    try:
        raw = (d / name).read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{d / name}: cannot read ({exc.strerror})") from None
    if want is None or hashlib.sha256(raw).hexdigest() != want:
        raise CheckpointError(f"{d / name}: not what the manifest recorded (changed since it was checked?)")
    return raw


def load_sharded(d: Path, manifest: dict[str, Any], where: SiteShards) -> dict[str, Any]:
    """This rank's state from sharded checkpoint ``d`` (verified): its rank file (:meth:`SiteShards.donor`)
    with each placeholder filled by DCP with this rank's shard in the current layout (every rank of
    the site calls it together). Refuses a tensor the site's folder does not hold."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import empty as dtensor_empty

    skeleton = torch.load(d / f"rank{where.donor(manifest)}.pt", map_location="cpu", weights_only=True)
    reader = safe_reader(d / f"site-{where.site}", checked_metadata(d, manifest, where.site))
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
