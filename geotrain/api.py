"""The front door for library users: geotrain's cross-site sync around your own training loop.

You keep your model, your inner optimizer and your loop; geotrain gives the process its place in
the run (sites, process groups, emulated links, byte-counting collectives) and wraps the optimizer
with the configured algorithm — DDP, DiLoCo or Streaming DiLoCo — the way torchft's ``DiLoCo``
wraps one. Start every rank with ``torchrun`` (ranks are numbered site by site)::

    import geotrain

    cfg = geotrain.load_config("my.yaml")  # or geotrain.Config(), or load_config(None, ["sync.H=50"])
    with geotrain.Site(cfg) as site:
        model = MyModel().to(site.device)
        inner = torch.optim.AdamW(model.parameters(), lr=4e-4)
        with site.wrap(model, inner) as sync:
            for x, y in my_batches(site.rank):
                loss = model(x, y)
                inner.zero_grad()
                loss.backward()
                inner.step()  # averages inside the site; every H steps, the outer round across sites
            sync.finish()  # the last round: every site ends on the same global model
        print(site.rank, sync.global_hash(), site.stats.inter_bytes)

Only the sections of the config that concern sync are used: ``topology`` (sites, links and their
emulation), ``sync``, ``guard``, ``optim.grad_clip`` and ``run`` (backend, timeout).
"""

from __future__ import annotations

from types import TracebackType

import torch
import torch.nn as nn

from geotrain.comm.collectives import Collectives, CommStats
from geotrain.comm.emulate import link_mode
from geotrain.comm.session import close_collectives, open_collectives
from geotrain.comm.topology import Topology
from geotrain.config import Config, SyncConfig
from geotrain.round import RoundEngine, build_round
from geotrain.sync import DDP, SyncAlgorithm, UpdateGuard

__all__ = ["DDP", "DiLoCo", "Site", "StreamingDiLoCo", "SyncAlgorithm"]


def DiLoCo(  # noqa: N802 - the algorithm's name, as torchft's
    model: nn.Module, optimizer: torch.optim.Optimizer, comm: Collectives, grad_clip: float = 0.0, cfg: SyncConfig | None = None
) -> RoundEngine:
    """DiLoCo across sites (Douillard et al. 2023), hooked onto ``optimizer``: the round engine
    with ``cfg``'s settings (``sync.algorithm`` is taken to be diloco)."""
    c = (cfg or SyncConfig()).model_copy(update={"algorithm": "diloco"})
    engine = build_round(c, model, optimizer, comm, grad_clip=grad_clip)
    assert isinstance(engine, RoundEngine)
    return engine


def StreamingDiLoCo(  # noqa: N802
    model: nn.Module, optimizer: torch.optim.Optimizer, comm: Collectives, grad_clip: float = 0.0, cfg: SyncConfig | None = None
) -> RoundEngine:
    """Streaming DiLoCo (Douillard et al. 2025), hooked onto ``optimizer``: the round engine with
    ``cfg``'s settings (``sync.algorithm`` is taken to be streaming)."""
    c = (cfg or SyncConfig()).model_copy(update={"algorithm": "streaming"})
    engine = build_round(c, model, optimizer, comm, grad_clip=grad_clip)
    assert isinstance(engine, RoundEngine)
    return engine


class Site:
    """This process's place in a multi-site run: its site, process groups and collectives.

    Creating one is collective: every rank of the run must create its ``Site`` with the same
    config. It initialises torch.distributed from the environment torchrun sets (RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT), unless the caller already did.

    Args:
        cfg: the run's config; its topology must have exactly WORLD_SIZE workers in all.

    Raises:
        RuntimeError: the torch.distributed environment is missing or does not match the topology.
    """

    def __init__(self, cfg: Config | None = None) -> None:
        self.cfg = cfg if cfg is not None else Config()
        self.topology = Topology.from_config(self.cfg.topology)
        mode, self.notice = link_mode(self.cfg.topology.links.emulate)
        self.comm: Collectives = open_collectives(
            self.topology,
            backend=self.cfg.run.backend,
            timeout_s=self.cfg.liveness.group_timeout_s,
            lanes=self.cfg.sync.lanes,
            chunk_bytes=self.cfg.sync.chunk_bytes,
            emulate=mode,
        )
        self._closed = False

    @property
    def rank(self) -> int:
        """This process's rank in the whole run."""
        return self.comm.groups.me.rank

    @property
    def site(self) -> str:
        """The name of this process's site."""
        return self.comm.groups.me.site

    @property
    def local_rank(self) -> int:
        """This process's rank inside its site."""
        return self.comm.groups.me.local_rank

    @property
    def device(self) -> torch.device:
        """Where this rank's model lives (CUDA with NCCL, else CPU)."""
        return self.comm.groups.device

    @property
    def stats(self) -> CommStats:
        """Bytes this rank sent inside its site and to other sites, and time spent waiting on them."""
        return self.comm.stats

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> SyncAlgorithm:
        """Hook the configured sync algorithm (``cfg.sync.algorithm``) onto ``optimizer``.

        Call it on every rank, after the model is on :attr:`device` and identical on every rank.
        Use the result as a context manager (the hooks come off on exit), and call its
        ``finish()`` once after the loop so that every site ends on the global model.

        Args:
            model: the model ``optimizer`` steps.
            optimizer: the inner optimizer; its ``step()`` now also syncs.
        """
        c = self.cfg
        outer = c.sync.algorithm != "ddp"
        guard = UpdateGuard(c.guard, self.comm) if outer and c.guard.enabled and self.topology.num_sites > 1 else None
        return build_round(c.sync, model, optimizer, self.comm, grad_clip=c.optim.grad_clip, guard=guard)

    def close(self) -> None:
        """Release the process groups and the link emulation (collective, like creating the site)."""
        if not self._closed:
            self._closed = True
            close_collectives(self.comm, unlink_links=self.rank == 0)

    def __enter__(self) -> Site:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
