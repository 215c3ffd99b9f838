"""Where every rank lives: the pure arithmetic of sites, workers and links.

Ranks are numbered site by site in config order: with sites A (2 workers) and B (2 workers),
ranks 0-1 are A's local ranks 0-1 and ranks 2-3 are B's. The same numbering is used by the
local launcher and under ``torchrun``, so a rank's site is a function of its global rank.
Nothing here touches torch.distributed; :mod:`geotrain.comm.groups` turns these rank lists into
process groups.
"""

from __future__ import annotations

from dataclasses import dataclass

from geotrain.config import LinkConfig, TopologyConfig


@dataclass(frozen=True)
class RankInfo:
    rank: int
    site_index: int
    site: str
    local_rank: int

    @property
    def tag(self) -> str:
        """Log prefix body: ``site/local_rank``."""
        return f"{self.site}/{self.local_rank}"


@dataclass(frozen=True)
class Topology:
    """Immutable view of the topology config with rank arithmetic."""

    site_names: tuple[str, ...]
    workers_per_site: int
    regions: tuple[str | None, ...]
    intra_link: LinkConfig
    inter_link: LinkConfig
    pair_links: tuple[tuple[frozenset[str], LinkConfig], ...] = ()
    emulate: str = "off"

    @classmethod
    def from_config(cls, cfg: TopologyConfig) -> Topology:
        return cls(
            site_names=tuple(s.name for s in cfg.sites),
            workers_per_site=cfg.sites[0].workers,
            regions=tuple(s.region for s in cfg.sites),
            intra_link=cfg.links.intra,
            inter_link=cfg.links.inter,
            pair_links=tuple(
                (frozenset(b.sites), LinkConfig(bandwidth_bps=b.bandwidth_bps, latency_s=b.latency_s)) for b in cfg.links.between
            ),
            emulate=cfg.links.emulate,
        )

    def link(self, a: int, b: int) -> LinkConfig:
        """The link between sites ``a`` and ``b`` (indices): a 'between' entry if one names them, else 'inter'."""
        pair = frozenset((self.site_names[a], self.site_names[b]))
        for names, link in self.pair_links:
            if names == pair:
                return link
        return self.inter_link

    @property
    def num_sites(self) -> int:
        return len(self.site_names)

    @property
    def world_size(self) -> int:
        return self.num_sites * self.workers_per_site

    def info(self, rank: int) -> RankInfo:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        s, local = divmod(rank, self.workers_per_site)
        return RankInfo(rank=rank, site_index=s, site=self.site_names[s], local_rank=local)

    def site_of(self, rank: int) -> int:
        return rank // self.workers_per_site

    def site_ranks(self, site_index: int) -> list[int]:
        """Global ranks of one site, in local-rank order."""
        start = site_index * self.workers_per_site
        return list(range(start, start + self.workers_per_site))

    def inter_ranks(self, local_rank: int) -> list[int]:
        """Global ranks holding ``local_rank`` in every site, in site order (one per site)."""
        return [s * self.workers_per_site + local_rank for s in range(self.num_sites)]

    def all_ranks(self) -> list[int]:
        return list(range(self.world_size))

    def describe(self) -> str:
        sites = ", ".join(f"{n}x{self.workers_per_site}" for n in self.site_names)
        return f"{self.num_sites} sites ({sites}), world {self.world_size}"
