"""Where every rank lives: the pure arithmetic of sites, workers and links.

Ranks are numbered site by site in config order: with sites A (3 workers) and B (2 workers),
ranks 0-2 are A's local ranks 0-2 and ranks 3-4 are B's. The same numbering is used by the
local launcher and under ``torchrun``, so a rank's site is a function of its global rank.
Nothing here touches torch.distributed; :mod:`geotrain.comm.groups` turns these rank lists into
process groups.

Sites may differ in size. A vector that crosses sites is cut into ``carriers`` = the smallest
site's worker count shards; shard k is carried by local rank k of every site (its cross-site
group), and a larger site's other ranks get the result from the in-site all-gather. The
smallest site must push its whole share through that many ranks whatever the others do, so
spreading the others' share over more ranks would not make a ring across sites faster
(docs/PACE.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from geotrain.config import LinkChangeConfig, LinkConfig, TopologyConfig

REGION, WORLD = 0, 1  # two tiers: a region round, or a world round (what an elastic round of two tiers syncs)


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
    workers: tuple[int, ...]  # each site's worker count, in site order
    intra_link: LinkConfig
    inter_link: LinkConfig
    pair_links: tuple[tuple[frozenset[str], LinkConfig], ...] = ()
    emulate: str = "off"
    region_of: tuple[int, ...] = ()  # each site's region index (empty: no regions, one tier)
    region_names: tuple[str, ...] = ()
    region_links: tuple[LinkConfig | None, ...] = ()  # each region's link between its sites (None: inter)
    changes: tuple[LinkChangeConfig, ...] = ()  # scheduled changes of emulated links
    order: tuple[int, ...] = ()  # site indices in exchange order (topology.exchange.order; empty: config order)
    shape: str = "ring"  # the shape of a sum across all sites (topology.exchange.shape)
    region_shape: str = "ring"  # the shape of a region's sum (two tiers)

    @classmethod
    def from_config(cls, cfg: TopologyConfig) -> Topology:
        names = tuple(s.name for s in cfg.sites)
        return cls(
            site_names=names,
            workers=tuple(s.workers for s in cfg.sites),
            intra_link=cfg.links.intra,
            inter_link=cfg.links.inter,
            pair_links=tuple(
                (frozenset(b.sites), LinkConfig(bandwidth_bps=b.bandwidth_bps, latency_s=b.latency_s)) for b in cfg.links.between
            ),
            emulate=cfg.links.emulate,
            region_of=tuple(next(i for i, r in enumerate(cfg.regions) if s.name in r.sites) for s in cfg.sites)
            if cfg.regions
            else (),
            region_names=tuple(r.name for r in cfg.regions),
            region_links=tuple(r.link for r in cfg.regions),
            changes=tuple(cfg.links.changes),
            order=tuple(names.index(n) for n in cfg.order),
            shape=cfg.exchange.shape,
            region_shape=cfg.exchange.region_shape,
        )

    @property
    def ring_names(self) -> list[str]:
        """The site names in exchange order."""
        return [self.site_names[s] for s in self.order] if self.order else list(self.site_names)

    def ordered(self, ranks: list[int]) -> list[int]:
        """``ranks`` (at most one per site) sorted by their sites' places in the exchange order."""
        place = {s: i for i, s in enumerate(self.order)} if self.order else None
        return sorted(ranks, key=lambda r: place[self.site_of(r)] if place else self.site_of(r))

    def link(self, a: int, b: int) -> LinkConfig:
        """The link between sites ``a`` and ``b`` (indices): a 'between' entry if one names them, else their region's link when they share a region that has one, else 'inter'."""
        pair = frozenset((self.site_names[a], self.site_names[b]))
        for names, link in self.pair_links:
            if names == pair:
                return link
        if self.region_of and self.region_of[a] == self.region_of[b]:
            return self.region_links[self.region_of[a]] or self.inter_link
        return self.inter_link

    def link_at(self, a: int, b: int, seconds: float) -> LinkConfig:
        """The link between sites ``a`` and ``b`` ``seconds`` into the run: :meth:`link` scaled by the
        latest scheduled change of it that has happened (``topology.links.changes``)."""
        link = self.link(a, b)
        pair = {self.site_names[a], self.site_names[b]}
        wide = a != b and (not self.region_of or self.region_of[a] != self.region_of[b])  # what an unnamed change affects
        due = [c for c in self.changes if c.after_s <= seconds and (set(c.sites) == pair if c.sites else wide)]
        if not due:
            return link
        c = max(due, key=lambda c: c.after_s)
        return LinkConfig.model_construct(
            bandwidth_bps=link.bandwidth_bps * c.bandwidth_scale, latency_s=link.latency_s * c.latency_scale
        )

    @property
    def tiered(self) -> bool:
        """Whether sites are grouped in two or more regions."""
        return len(self.region_names) > 1

    def region_name(self, site: int) -> str:
        """The name of site ``site``'s region ("" without regions)."""
        return self.region_names[self.region_of[site]] if self.region_of else ""

    def same_region(self, a: int, b: int) -> bool:
        """Whether sites ``a`` and ``b`` (indices) are in one region (always, without regions)."""
        return not self.region_of or self.region_of[a] == self.region_of[b]

    def region_inter_ranks(self, local_rank: int, site_index: int) -> list[int]:
        """Global ranks holding ``local_rank`` in every site of ``site_index``'s region (empty for a
        local rank that carries nothing across sites)."""
        if local_rank >= self.carriers:
            return []
        return [self.first_rank(s) + local_rank for s in range(self.num_sites) if self.same_region(s, site_index)]

    @property
    def num_sites(self) -> int:
        return len(self.site_names)

    @property
    def world_size(self) -> int:
        return sum(self.workers)

    @property
    def uniform(self) -> bool:
        """Whether every site has the same number of workers."""
        return len(set(self.workers)) == 1

    @property
    def carriers(self) -> int:
        """How many local ranks of each site carry a cross-site exchange: the smallest site's size."""
        return min(self.workers)

    def first_rank(self, site_index: int) -> int:
        return sum(self.workers[:site_index])

    def info(self, rank: int) -> RankInfo:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        s = self.site_of(rank)
        return RankInfo(rank=rank, site_index=s, site=self.site_names[s], local_rank=rank - self.first_rank(s))

    def site_of(self, rank: int) -> int:
        for s in range(self.num_sites):
            rank -= self.workers[s]
            if rank < 0:
                return s
        raise ValueError(f"rank outside world of {self.world_size}")

    def site_ranks(self, site_index: int) -> list[int]:
        """Global ranks of one site, in local-rank order."""
        start = self.first_rank(site_index)
        return list(range(start, start + self.workers[site_index]))

    def inter_ranks(self, local_rank: int) -> list[int]:
        """Global ranks holding ``local_rank`` in every site, in site order (one per site); empty
        for a local rank that carries nothing across sites (``local_rank >= carriers``)."""
        if local_rank >= self.carriers:
            return []
        return [self.first_rank(s) + local_rank for s in range(self.num_sites)]

    def all_ranks(self) -> list[int]:
        return list(range(self.world_size))

    def describe(self) -> str:
        sites = ", ".join(f"{n}x{w}" for n, w in zip(self.site_names, self.workers, strict=True))
        return f"{self.num_sites} sites ({sites}), world {self.world_size}"
