"""The one place that creates torch.distributed process groups.

:meth:`ProcessGroups.build` is called once per rank after ``init_process_group`` and creates,
in the same order on every rank (``new_group`` is itself collective):

* one **intra-site** group per site (all local ranks of that site),
* one **inter-site** group per carrying local rank *i* (local rank *i* of every site, for
  *i* below the smallest site's size: :attr:`Topology.carriers`),
* the **global** group (the default world group),
* with ``site_mesh``, one more group per site under a 1-D :class:`DeviceMesh` for FSDP2
  (``sync.within_site=fsdp``): FSDP's collectives get a group of their own, so they never
  interleave with geotrain's ring collectives on the site group.

The object is passed explicitly to whoever needs a group; there are no module globals.
:func:`round_group` creates the one other kind: a Gloo group over a store, outside any world
(elastic mode, where sites that are separate jobs meet once per round).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from geotrain.comm.topology import RankInfo, Topology
from geotrain.errors import ConfigError


def world_backend(backend: str) -> str:
    """The backend string the world is initialised with, for data backend ``backend``.

    NCCL takes only CUDA tensors, but control traffic is CPU tensors and objects (evaluation sums,
    elastic round flags and votes, guard norms, token weights, privacy maxima, link-emulation
    headers, hash checks). So a world whose data backend is not Gloo maps ``cpu`` to Gloo and
    ``cuda`` to that backend: one world, and every group cut from it, takes both kinds and sends
    each over the backend made for it. This is the one place that decides."""
    return backend if backend == "gloo" else f"cpu:gloo,cuda:{backend}"


def data_backend(config: str) -> str:
    """The data backend of an initialised world from its backend config (``cpu:gloo,cuda:nccl`` ->
    nccl); a world without a CPU backend is refused (its control traffic could not run)."""
    if ":" in config:
        devices = dict(part.split(":", 1) for part in config.split(","))
    else:
        devices = {"cpu": "gloo", "cuda": "gloo"} if config == "gloo" else {"cuda": config}
    if "cpu" not in devices:
        raise RuntimeError(
            f"the torch.distributed world takes no CPU tensors (backend {config!r}); geotrain's control traffic needs "
            f"them: initialise it with backend={world_backend(devices.get('cuda', 'nccl'))!r}"
        )
    return devices.get("cuda", "gloo")


def gpus_for(ranks: int, backend: str) -> str:
    """Why ``ranks`` ranks of ``backend`` cannot start on this machine ("" if they can): NCCL puts
    one rank on each GPU, so a machine runs at most as many ranks as it has GPUs."""
    if choose_backend(backend) != "nccl":
        return ""
    have = torch.cuda.device_count()
    if ranks <= have:
        return ""
    return (
        f"run.backend: nccl runs one rank per GPU; this machine has {have} GPU(s) and the run starts {ranks} rank(s) here "
        "(topology.sites' workers); give it fewer workers per machine, or use run.backend=gloo"
    )


def choose_backend(requested: str) -> str:
    """'auto' -> nccl when CUDA is usable, else gloo."""
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return requested


def _site_groups(
    topology: Topology, me: RankInfo
) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """Create every site group, every cross-site group and (with regions) every cross-site group
    inside a region (collectively, same order on all ranks); return this rank's (site group,
    cross-site group, region group), None where it carries nothing across sites."""
    intra = inter = None
    for s in range(topology.num_sites):
        g = dist.new_group(topology.site_ranks(s))
        if s == me.site_index:
            intra = g
    for local in range(topology.carriers):
        g = dist.new_group(topology.inter_ranks(local))
        if local == me.local_rank:
            inter = g
    region = None
    if topology.tiered:
        for r in range(len(topology.region_names)):
            first = topology.region_of.index(r)
            for local in range(topology.carriers):
                g = dist.new_group(topology.region_inter_ranks(local, first))
                if local == me.local_rank and topology.region_of[me.site_index] == r:
                    region = g
    assert intra is not None
    return intra, inter, region


def leaders_group(topology: Topology) -> dist.ProcessGroup:
    """A new group of every site's local rank 0, for messages that must not share a group with
    any collective (:mod:`geotrain.comm.mailbox`). Collective: every rank of the world calls it."""
    group = dist.new_group(topology.inter_ranks(0))
    assert group is not None
    return group


@dataclass(frozen=True)
class Lane:
    """One set of groups for chunks in flight: its own site, cross-site and world groups, so
    chunks on different lanes (threads) never share a group with each other or the main thread."""

    intra: dist.ProcessGroup
    inter: dist.ProcessGroup | None
    world: dist.ProcessGroup
    region: dist.ProcessGroup | None = None  # the cross-site group inside this rank's region (multi-tier)


@dataclass
class ProcessGroups:
    """All groups one rank takes part in, cut from the topology.

    Attributes:
        topology: the topology the groups were cut from.
        me: this rank's site and local rank.
        world: the global group (every rank).
        intra: this rank's site group.
        inter: this rank's cross-site group (its local rank in every site); None for a rank of a
            larger site beyond the smallest site's size, which carries nothing across sites.
        backend: 'gloo' or 'nccl'.
        lanes: groups for the pipelined collectives (see :class:`Lane`).
        owns_world: whether :meth:`build` initialised torch.distributed (then :meth:`destroy`
            tears it down; else only the groups it created).
        mesh: the site's device mesh for FSDP2 (None unless built with ``site_mesh``).
    """

    topology: Topology
    me: RankInfo
    world: dist.ProcessGroup
    intra: dist.ProcessGroup
    inter: dist.ProcessGroup | None
    backend: str
    lanes: list[Lane]
    owns_world: bool = True
    mesh: DeviceMesh | None = None

    @property
    def intra_ranks(self) -> list[int]:
        return self.topology.site_ranks(self.me.site_index)

    @property
    def inter_ranks(self) -> list[int]:
        return self.topology.inter_ranks(self.me.local_rank)

    @property
    def region_inter_ranks(self) -> list[int]:
        return self.topology.region_inter_ranks(self.me.local_rank, self.me.site_index)

    @property
    def device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")

    @classmethod
    def build(
        cls, topology: Topology, backend: str = "auto", timeout_s: float = 300, lanes: int = 1, site_mesh: bool = False
    ) -> ProcessGroups:
        """Initialise torch.distributed from the environment (RANK, WORLD_SIZE, MASTER_ADDR,
        MASTER_PORT, as set by geotrain's launcher or torchrun) unless the caller already did, and
        build every group, plus ``lanes`` sets of groups for the pipelined collectives.

        Raises:
            RuntimeError: the environment is missing, or WORLD_SIZE does not match the topology.
        """
        owns_world = not dist.is_initialized()
        if not owns_world:
            backend, world_size, rank = data_backend(dist.get_backend_config()), dist.get_world_size(), dist.get_rank()
        else:
            missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
            if missing:
                raise RuntimeError(
                    f"the torch.distributed environment is not set ({', '.join(missing)} missing): start every rank "
                    "with torchrun or geotrain's launcher"
                )
            backend = choose_backend(backend)
            world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        if world_size != topology.world_size:
            raise RuntimeError(
                f"WORLD_SIZE={world_size} but the topology has {topology.world_size} ranks "
                f"({topology.describe()}); start exactly that many processes"
            )
        if owns_world:
            if backend == "nccl":
                local = int(os.environ.get("LOCAL_RANK", "0"))
                if why := gpus_for(local + 1, backend):  # (torchrun: more processes per node than GPUs)
                    raise ConfigError(why)
                torch.cuda.set_device(local)
            dist.init_process_group(backend=world_backend(backend), timeout=timedelta(seconds=timeout_s))
        me = topology.info(rank)
        intra, inter, _ = _site_groups(topology, me)
        world = dist.group.WORLD
        assert world is not None
        lane_list = []
        for _ in range(lanes):
            l_intra, l_inter, l_region = _site_groups(topology, me)
            lane_list.append(Lane(l_intra, l_inter, dist.new_group(topology.all_ranks()), l_region))
        mesh = None
        if site_mesh:  # every rank creates every site's group, in site order (new_group is collective)
            mesh_groups = [dist.new_group(topology.site_ranks(s)) for s in range(topology.num_sites)]
            device = "cuda" if backend == "nccl" else "cpu"
            mesh = DeviceMesh.from_group(mesh_groups[me.site_index], device, mesh_dim_names=("site",))
        return cls(topology, me, world, intra, inter, backend, lane_list, owns_world, mesh)

    def destroy(self) -> None:
        if not dist.is_initialized():
            return
        if self.owns_world:
            dist.destroy_process_group()
            return
        mine = {self.intra, self.inter, *(x for lane in self.lanes for x in (lane.intra, lane.inter, lane.world, lane.region))}
        if self.mesh is not None:
            mine.add(self.mesh.get_group())
        for g in mine:
            if g is not None and g is not self.world:
                dist.destroy_process_group(g)


def round_group(store: dist.Store, rank: int, size: int, timeout_s: float, address: str | None = None) -> dist.ProcessGroupGloo:
    """A Gloo group of ``size`` members rendezvousing in ``store`` (which the caller prefixes so
    every membership gets fresh keys), outside the torch.distributed world of this process.
    Gloo takes CPU tensors, whatever backend the world uses. ``address``: the local address its
    connections use (the one the other sites reach); default: ``GLOO_SOCKET_IFNAME``'s, as the
    world's groups (a site's own traffic stays on loopback)."""
    if address is None:
        return dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout_s))
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    opts._timeout = timedelta(seconds=timeout_s)
    return dist.ProcessGroupGloo(store, rank, size, opts)


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is an FSDP2 / DCP ``DTensor``, without importing ``torch.distributed.tensor``
    (half a second of every rank's start, measured): if it was never imported, none exists."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)
