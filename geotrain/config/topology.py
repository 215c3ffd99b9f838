"""The topology section: sites (datacenters), their workers, and the links between them."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from geotrain.config.base import Section, absolute_path


class LinkConfig(Section):
    """A network link class: bandwidth in bits per second and one-way latency in seconds.

    Inter-site links are emulated (see :mod:`geotrain.comm.emulate`): the bytes each rank sends to another
    site are paced to the link's bandwidth (shared by all ranks of the site) and delayed by its
    latency.
    """

    bandwidth_bps: float = Field(gt=0, description="Link bandwidth in bits per second (e.g. 1.0e+9 for 1 Gbit/s).")
    latency_s: float = Field(ge=0, le=10, description="One-way latency in seconds (0 to 10).")


def site_name(v: str) -> str:
    """A site name: letters, digits, '-' and '_'."""
    if not re.fullmatch(r"[A-Za-z0-9_-]+", v):
        raise ValueError("may contain only letters, digits, '-' and '_'")
    return v


def _two_sites(v: list[str] | None) -> list[str] | None:
    if v is not None and (len(v) != 2 or v[0] == v[1]):
        raise ValueError("must name two different sites")
    return v


class PairLinkConfig(LinkConfig):
    sites: list[str] = Field(description="The two sites this link joins (both directions get the same bandwidth and latency).")

    _pair = field_validator("sites")(_two_sites)


class LinkChangeConfig(Section):
    """A scheduled change of emulated links (e.g. a wide-area link that slows down at night)."""

    after_s: float = Field(
        gt=0, le=1e7, description="When: seconds after the run's link emulation started (the first rank's start)."
    )
    bandwidth_scale: float = Field(
        gt=0, le=1e3, description="The configured bandwidth times this from then on (0.1: 10x slower)."
    )
    latency_scale: float = Field(default=1.0, gt=0, le=1e3, description="The configured latency times this from then on.")
    sites: list[str] | None = Field(
        default=None,
        description="The two sites whose link changes; unset: every link between sites of different regions (every "
        "inter-site link when there are no regions). A later change of a link replaces an earlier one.",
    )

    _pair = field_validator("sites")(_two_sites)


class LinksConfig(Section):
    emulate: Literal["off", "inprocess", "kernel"] = Field(
        default="inprocess",
        description="How inter-site links are emulated on one machine: 'inprocess' (pacing and delay inside geotrain, no root needed), "
        "'kernel' (a network namespace per site, tc bandwidth limits, latency in-process; needs root and ip), 'off' (loopback speed).",
    )

    @field_validator("emulate", mode="before")
    @classmethod
    def _yaml_off(cls, v: Any) -> Any:
        return "off" if v is False else v  # YAML 1.1 reads a bare `off` as false

    intra: LinkConfig = Field(
        default_factory=lambda: LinkConfig(bandwidth_bps=100e9, latency_s=5e-6),
        description="Links between workers of the same site (scale-out fabric inside a datacenter).",
    )
    inter: LinkConfig = Field(
        default_factory=lambda: LinkConfig(bandwidth_bps=1e9, latency_s=0.02),
        description="Links between sites (wide-area network), unless a 'between' entry names the pair.",
    )
    between: list[PairLinkConfig] = Field(
        default_factory=list,
        description="Per site-pair links overriding 'inter', e.g. [{sites: [A, B], bandwidth_bps: 1.0e+8, latency_s: 0.04}].",
    )
    changes: list[LinkChangeConfig] = Field(
        default_factory=list,
        description="Scheduled changes of emulated links (in-process emulation only), e.g. [{after_s: 60, bandwidth_scale: 0.1}] "
        "makes the wide-area links 10x slower one minute into the run.",
    )

    @model_validator(mode="after")
    def _changes_emulated(self) -> LinksConfig:
        if self.changes and self.emulate != "inprocess":
            raise ValueError("changes: scheduled link changes are emulated in-process only; set topology.links.emulate=inprocess")
        return self


class SiteConfig(Section):
    name: str = Field(min_length=1, max_length=64, description="Site (datacenter) name, unique; letters, digits, '-', '_'.")
    workers: int = Field(ge=1, le=1024, description="Number of workers (ranks) in this site.")
    compute_speed: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="Relative speed of this site's hardware (0 < speed <= 1; 1 = as fast as this machine). EMULATION: every "
        "forward+backward is followed by a sleep of (1/speed - 1) times its measured time, so a site at 0.5 takes twice as long per step.",
    )
    corpus: str | None = Field(
        default=None,
        description="This site's private training data (file or directory): its workers read only this; "
        "unset: the site's share of data.corpus. Checked only where the site runs (its data may exist only there).",
    )

    _site_corpus_path = field_validator("corpus")(absolute_path)

    _name_chars = field_validator("name")(site_name)


class RegionConfig(Section):
    name: str = Field(min_length=1, max_length=64, description="Region name, unique.")
    sites: list[str] = Field(min_length=1, description="The sites in this region (each site in exactly one region).")
    link: LinkConfig | None = Field(
        default=None,
        description="The link between two sites of this region (e.g. a metro network); unset: links.inter. "
        "Links between regions are links.inter (or a links.between entry).",
    )


Shape = Literal["ring", "tree", "hub"]


class ExchangeConfig(Section):
    """How an fp32 sum crosses sites: the sites' order and the shape of the exchange (what
    ``geotrain place`` chooses from the link matrix; docs/PLACE.md)."""

    order: list[str] = Field(
        default_factory=list,
        description="The sites in the order the exchange visits them (a ring's neighbours, a tree's heap order, a hub "
        "first); empty: topology.sites' order. Every site exactly once.",
    )
    shape: Shape = Field(
        default="ring",
        description="The shape of the sum across all sites (one tier, or the world tier of two): 'ring' (reduce-scatter + "
        "all-gather, 2(n-1)/n of the vector per link, 2(n-1) latencies), 'tree' (binary tree over the order, rooted at its "
        "first site: the vector up and down each edge, 2 ceil(log2(n+1))-2 latencies) or 'hub' (every site sends the vector "
        "to the first site of the order and gets the sum back: 2 latencies).",
    )
    region_shape: Shape = Field(
        default="ring", description="The shape of a region's sum in two tiers (its sites in the order's order)."
    )


class TopologyConfig(Section):
    sites: list[SiteConfig] = Field(
        default_factory=lambda: [SiteConfig(name="A", workers=2), SiteConfig(name="B", workers=2)],
        description="The sites (datacenters) taking part; ranks are numbered site by site in this order.",
    )
    links: LinksConfig = Field(default_factory=LinksConfig, description="Intra-site and inter-site link properties.")
    regions: list[RegionConfig] = Field(
        default_factory=list,
        description="Optional groups of sites (site -> region -> world) for multi-tier sync (sync.region_every) and per-tier "
        "links and byte counts; empty: one tier. When given, every site is in exactly one region (docs/TIERS.md).",
    )

    exchange: ExchangeConfig = Field(
        default_factory=ExchangeConfig, description="The order and shape of fp32 sums across sites (docs/PLACE.md)."
    )

    @field_validator("sites")
    @classmethod
    def _sites_ok(cls, v: list[SiteConfig]) -> list[SiteConfig]:
        if not v:
            raise ValueError("at least one site is required")
        names = [s.name for s in v]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"site names must be unique (repeated: {', '.join(dup)})")
        return v

    @model_validator(mode="after")
    def _links_name_sites(self) -> TopologyConfig:
        names = [s.name for s in self.sites]
        seen: set[frozenset[str]] = set()
        for i, link in enumerate(self.links.between):
            for name in link.sites:
                if name not in names:
                    raise ValueError(f"links.between[{i}].sites: unknown site {name!r} (sites: {', '.join(names)})")
            pair = frozenset(link.sites)
            if pair in seen:
                raise ValueError(f"links.between[{i}].sites: the link {link.sites[0]}-{link.sites[1]} is given twice")
            seen.add(pair)
        for i, change in enumerate(self.links.changes):
            for name in change.sites or []:
                if name not in names:
                    raise ValueError(f"links.changes[{i}].sites: unknown site {name!r} (sites: {', '.join(names)})")
        self._regions_ok(names)
        order = self.exchange.order
        if order and sorted(order) != sorted(names):
            raise ValueError(f"exchange.order: must name every site once ({', '.join(names)}; got {', '.join(order)})")
        return self

    @property
    def order(self) -> list[str]:
        """The sites in exchange order (``exchange.order``, else config order)."""
        return list(self.exchange.order) or [s.name for s in self.sites]

    def _regions_ok(self, names: list[str]) -> None:
        if not self.regions:
            return
        home: dict[str, str] = {}
        region_names = [r.name for r in self.regions]
        for i, region in enumerate(self.regions):
            if region_names.count(region.name) > 1:
                raise ValueError(f"regions[{i}].name: the region {region.name!r} is given twice")
            for site in region.sites:
                if site not in names:
                    raise ValueError(f"regions[{i}].sites: unknown site {site!r} (sites: {', '.join(names)})")
                if site in home:
                    raise ValueError(f"regions[{i}].sites: the site {site!r} is already in region {home[site]!r}")
                home[site] = region.name
        missing = [n for n in names if n not in home]
        if missing:
            raise ValueError(f"regions: every site must be in a region ({', '.join(missing)} in none)")
