"""What a rank's checkpoint holds, saved and restored side by side so the two stay in step;
resuming from a checkpoint; and writing one.

The state: the model (local parameters), inner optimizer and LR schedule, the sync algorithm's
state (global parameters, outer optimizer, codec error feedback, exchanges in flight), the data
sampler's position, torch's RNGs (the CPU's, and the rank's GPU's on CUDA), byte counters and the privacy accountant. The files, their
manifest and verification are :mod:`geotrain.run.checkpoint`; a sharded (FSDP) run writes its
DTensors with DCP and may resume with another number of workers per site.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from geotrain.comm.collectives import Collectives
from geotrain.comm.control import all_gather_json
from geotrain.data import RankData
from geotrain.errors import StartMismatch
from geotrain.privacy.build import Privacy
from geotrain.report.metrics import log
from geotrain.run import checkpoint as ckpt
from geotrain.run.shards import SiteShards, load_sharded
from geotrain.sync import SyncAlgorithm
from geotrain.sync.base import params_hash


def check_same_start(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Before step 1: every rank of ``group`` holds the same initial model (hashes compared on the
    control plane), so a rank started with another seed, config or code is refused at once, not
    found out after the run from disagreeing hashes.

    Raises:
        StartMismatch: names the ranks whose model differs from the group's first rank's.
    """
    hashes = all_gather_json(params_hash(list(model.parameters())), group)
    differ = [r for r, h in enumerate(hashes) if h != hashes[0]]
    if differ:
        raise StartMismatch(
            f"the initial model of rank(s) {', '.join(map(str, differ))} differs from rank 0's: every rank needs the "
            "same config (train.seed, model.*) and geotrain version"
        )


@dataclass
class RankObjects:
    """What a checkpoint holds for one rank: saved and restored side by side, so the two stay in step."""

    model: nn.Module
    optimizer: Any
    scheduler: Any
    sync: SyncAlgorithm
    data: RankData
    comm: Collectives
    privacy: Privacy
    seal: ckpt.Seal | None = None  # the run has a secret: manifests are sealed with it
    allow_foreign: bool = False  # checkpoint.allow_foreign

    def training_state(self, step: int) -> dict[str, Any]:
        """Model, optimizers, schedule and sync state after ``step`` (what a healing site receives)."""
        return {
            "step": step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "sync": self.sync.checkpoint_state(),
        }

    def load_training(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.sync.load_checkpoint_state(state["sync"])

    def state(self, step: int) -> dict[str, Any]:
        """Everything this rank needs to continue exactly after ``step``."""
        st = self.comm.stats
        return {
            **self.training_state(step),
            "data": self.data.train.state(),
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(self.comm.groups.device) if self.comm.groups.device.type == "cuda" else None,
            "bytes": [st.intra_bytes, st.inter_bytes, st.inter_raw_bytes, st.inter_region_bytes],
            "accountant": self.privacy.accountant_state(),
        }

    def load(self, state: dict[str, Any]) -> int:
        """Restore :meth:`state`'s output; the step it was taken after."""
        st = self.comm.stats
        self.load_training(state)
        self.data.train.set_state(state["data"])
        torch.set_rng_state(state["rng"])
        if state.get("cuda_rng") is not None and self.comm.groups.device.type == "cuda":  # (None: written on a CPU)
            torch.cuda.set_rng_state(state["cuda_rng"], self.comm.groups.device)
        st.intra_bytes, st.inter_bytes, st.inter_raw_bytes = state["bytes"][:3]
        st.inter_region_bytes = state["bytes"][3] if len(state["bytes"]) > 3 else 0  # (absent before regions were counted)
        self.privacy.load_accountant_state(state["accountant"])
        return int(state["step"])

    def _shards(self) -> SiteShards | None:
        """Where this rank sits in a sharded (FSDP) run; None when it replicates the model."""
        g = self.comm.groups
        if g.mesh is None:
            return None
        topo = g.topology
        return SiteShards(g.me.site, g.me.local_rank, list(zip(topo.site_names, topo.workers, strict=True)), g.mesh)

    def resume(self, spec: str, root: Path) -> int:
        """Load the checkpoint ``spec`` ('auto' or a path) into this rank's objects; the step it was
        taken after (0 when 'auto' finds none). Each rank checks the manifest and its own file; the
        ranks agree on the verdict, so all choose alike. A sharded run may resume a checkpoint its
        sites wrote with other worker counts (resharded by DCP; the data stream is then reseeded)."""
        groups = self.comm.groups
        me = groups.me
        world = groups.topology.world_size
        where = self._shards()
        manifests: dict[Path, dict[str, Any]] = {}

        def warn(msg: str) -> None:
            if me.rank == 0:
                log(me, 0, msg)

        def check(d: Path) -> None:
            if where is None:
                ckpt.verify(d, world, me.rank, self.seal, self.allow_foreign, names=list(groups.topology.site_names))
            else:
                manifests[d] = ckpt.verify_sharded(d, world, where, self.seal, self.allow_foreign)

        def agree(value: Any) -> list[Any]:  # small control values: folder names, verdicts (JSON, never pickles)
            return all_gather_json(value, groups.world)

        d = ckpt.find(spec, root, world, check, agree, warn)
        if d is None:
            warn(f"no valid checkpoint under {root}: starting from step 0")
            return 0
        if where is None:
            step = self.load(ckpt.load(d, me.rank))
        else:
            manifest = manifests[d]
            step = self.load(load_sharded(d, manifest, where))
            if where.resharded(manifest):
                self._reseed_data(me.rank)
                warn(f"resharded from sites {manifest['sites']} to {[list(s) for s in where.sites]}: data stream reseeded")
        warn(f"resumed from {d} (after step {step})")
        return step

    def _reseed_data(self, rank: int) -> None:
        """After a resharded resume the rank's data shard changed: draw a new stream from the
        restored one (so it depends on the run's seed) and the rank, unlike every other rank's."""
        restored = self.data.train.state()
        seed = int.from_bytes(hashlib.sha256(restored.numpy().tobytes() + rank.to_bytes(4, "little")).digest()[:8], "little")
        self.data.train.set_state(torch.Generator().manual_seed(seed >> 1).get_state())

    def save(self, root: Path, step: int, keep: int, label: int | None = None) -> None:
        """Write this rank's checkpoint after ``step`` under ``root`` (collective over the world),
        in the folder of ``label`` (the same on every rank; default ``step``)."""
        groups = self.comm.groups
        me = groups.me
        world = groups.topology.world_size
        names = list(groups.topology.site_names)
        name = step if label is None else label
        d = ckpt.save(root, name, self.state(step), me.rank, world, groups.world, keep, self.seal, self._shards(), names)
        if me.rank == 0:
            log(me, step, f"checkpoint {d}")
