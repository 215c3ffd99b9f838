"""Fat-tree (folded Clos) sizing by port counting: pure arithmetic, no simulation.

A tree of ``T`` tiers is described by its switch radix ``k`` (front-panel ports at the host port
speed) and, for every tier below the top, how its ports split into ``down`` (towards hosts) and
``up`` ports; top-tier switches use all ``k`` ports downwards. Oversubscription of a tier is
``down / up`` (1 = full bisection).

Formulas (Al-Fares et al., "A Scalable, Commodity Data Center Network Architecture", SIGCOMM
2008, generalised to any down/up split; Leiserson's fat tree):

- capacity: ``hosts_max = down_1 * down_2 * ... * down_{T-1} * k``. For a k-ary three-tier fat
  tree (down = up = k/2) this is ``k^3/4`` hosts with ``5k^2/4`` switches; for two tiers ``k^2/2``.
- switches for ``N`` hosts, tier by tier: ``S_1 = ceil(N / down_1)``, ``L_t = S_t * up_t`` links
  leave tier ``t``, ``S_{t+1} = ceil(L_t / down_{t+1})``, and the top tier ``S_T = ceil(L_{T-1} / k)``;
- switch-to-switch links ``= sum_t L_t``; host links ``= N``;
- optics: ``transceivers = links * transceivers_per_link`` (2: one per end), cost ``* price``.

Multi-rail (Hoefler et al., "Datacenter Ethernet and RDMA: Issues at Hyperscale", 2023; founding
paper section 5): a host port of speed ``P`` is split into ``R`` rails of ``P/R`` on ``R``
independent planes. A switch box with ``k`` front-panel ports at ``P`` holds ``R`` switching chips
of radix ``k`` at ``P/R`` (51.2 Tbit/s chip: 64 x 800G, or 256 x 200G in a 4-chip box with 256
800G front ports). We size the boxes like a single-rail tree of radix ``k`` and report
``chips = R * boxes`` and ``rail_links = R * links`` (every cable carries ``R`` rail links).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


def split_ports(radix: int, oversubscription: float) -> tuple[int, int]:
    """Split ``radix`` ports into (down, up) with down/up as close to ``oversubscription`` as ports allow.

    ``down = floor(k * o / (o + 1))`` and ``up = ceil(down / o)``; then ``down + up <= k`` and
    ``down / up >= o`` up to rounding. For o = 1 this is (k/2, k/2).
    """
    if radix < 4 or radix % 2:
        raise ValueError(f"radix must be an even number >= 4 (got {radix})")
    if oversubscription < 1:
        raise ValueError(f"oversubscription must be >= 1 (got {oversubscription})")
    down = math.floor(radix * oversubscription / (oversubscription + 1) + 1e-9)
    up = math.ceil(down / oversubscription - 1e-9)
    return down, up


def tier_ports(
    radix: int, tiers: int, oversubscription: list[float] | None = None, ports: list[list[int]] | None = None
) -> list[tuple[int, int]]:
    """(down, up) ports for every tier, bottom first; the top tier is ``(radix, 0)``.

    Give either ``oversubscription`` (one ratio per non-top tier) or explicit ``ports`` (one
    ``[down, up]`` per non-top tier, e.g. the founding paper's ``[[200, 50], [168, 88]]``).
    """
    if tiers not in (2, 3, 4):
        raise ValueError(f"tiers must be 2, 3 or 4 (got {tiers})")
    if ports is not None:
        if len(ports) != tiers - 1:
            raise ValueError(f"ports needs one [down, up] per tier below the top ({tiers - 1}), got {len(ports)}")
        out = []
        for down, up in ports:
            if down < 1 or up < 1 or down + up > radix:
                raise ValueError(f"each [down, up] needs down, up >= 1 and down + up <= radix {radix} (got {[down, up]})")
            out.append((down, up))
    else:
        ratios = oversubscription if oversubscription is not None else [1.0] * (tiers - 1)
        if len(ratios) != tiers - 1:
            raise ValueError(f"oversubscription needs one ratio per tier below the top ({tiers - 1}), got {len(ratios)}")
        out = [split_ports(radix, r) for r in ratios]
    return [*out, (radix, 0)]


def hosts_capacity(ports: list[tuple[int, int]]) -> int:
    """Most hosts the tiers can hold: the product of every tier's down ports."""
    return math.prod(d for d, _ in ports)


@dataclass
class FatTreeSize:
    """Counts for one fat tree; every field is in the ``netsim`` JSON (docs/NETSIM.md)."""

    tiers: int
    radix: int
    port_bps: float
    rails: int
    hosts: int
    hosts_capacity: int
    ports: list[tuple[int, int]]
    oversubscription: list[float]
    switches_per_tier: list[int]
    switches: int
    chips: int
    switch_links_per_tier: list[int]
    switch_links: int
    host_links: int
    rail_links: int
    transceivers: int
    optics_usd: float
    switches_usd: float
    bisection_fraction: float = field(default=1.0)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ports"] = [list(p) for p in self.ports]
        return d


def size_fat_tree(
    hosts: int,
    radix: int,
    tiers: int,
    *,
    oversubscription: list[float] | None = None,
    ports: list[list[int]] | None = None,
    port_bps: float = 800e9,
    rails: int = 1,
    transceiver_usd: float = 1000.0,
    transceivers_per_link: int = 2,
    host_links_optical: bool = False,
    switch_usd: float = 0.0,
) -> FatTreeSize:
    """Size a fat tree for ``hosts`` hosts by port counting (formulas in the module docstring).

    Raises:
        ValueError: bad radix/tiers/ports, or more hosts than the tiers can hold.
    """
    if hosts < 1:
        raise ValueError(f"hosts must be >= 1 (got {hosts})")
    if rails < 1:
        raise ValueError(f"rails must be >= 1 (got {rails})")
    tp = tier_ports(radix, tiers, oversubscription, ports)
    cap = hosts_capacity(tp)
    if hosts > cap:
        raise ValueError(f"{hosts} hosts do not fit in {tiers} tiers of radix {radix} with these ports (at most {cap})")
    switches = [math.ceil(hosts / tp[0][0])]
    links = []
    for t in range(1, tiers):
        links.append(switches[-1] * tp[t - 1][1])
        switches.append(math.ceil(links[-1] / tp[t][0]))
    n_links = sum(links)
    optical = n_links + (hosts if host_links_optical else 0)
    transceivers = optical * transceivers_per_link
    ratios = [d / u for d, u in tp[:-1]]
    return FatTreeSize(
        tiers=tiers,
        radix=radix,
        port_bps=port_bps,
        rails=rails,
        hosts=hosts,
        hosts_capacity=cap,
        ports=tp,
        oversubscription=ratios,
        switches_per_tier=switches,
        switches=sum(switches),
        chips=rails * sum(switches),
        switch_links_per_tier=links,
        switch_links=n_links,
        host_links=hosts,
        rail_links=rails * n_links,
        transceivers=transceivers,
        optics_usd=transceivers * transceiver_usd,
        switches_usd=sum(switches) * switch_usd,
        bisection_fraction=1.0 / math.prod(ratios),
    )
