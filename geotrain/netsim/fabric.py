"""An explicit folded-Clos fabric (numpy link arrays) and its shortest paths.

Structure (the k-ary fat tree of Al-Fares et al. 2008, generalised to any down/up split per tier):

- tier ``t`` has ``down_t`` and ``up_t`` ports; a *level-t block* is everything under one tier-t
  "pod": ``H_t = down_1 * ... * down_t`` hosts. Host ``h`` is in level-t block ``h // H_t``;
- a level-t block holds ``P_t = up_1 * ... * up_{t-1}`` tier-t switches (*planes*), ``P_1 = 1``;
- uplink ``j`` of tier-t switch (block ``b``, plane ``p``) goes to the tier-(t+1) switch of block
  ``b // down_{t+1}`` and plane ``p * up_t + j``; the top tier is one block whose switches take one
  link from every level-(T-1) block.

Every cable is two directed links (full duplex). Link ids are arithmetic, so routing never walks a
graph: at boundary ``t`` (tier t to t+1) the up-link taken by a path that reaches plane ``q`` of
tier t+1 from block ``b`` is ``up_offset[t] + b * P_{t+1} + q``, and the down-link towards block
``b`` through the same plane is ``down_offset[t] + b * P_{t+1} + q``. A path between hosts whose
lowest common tier is ``c`` is fixed by its plane at tier ``c`` (``P_c`` equal-cost paths), and
shares its tier-(t+1) plane ``q = p // (P_c / P_{t+1})`` at every lower boundary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from geotrain.netsim.sizing import hosts_capacity


@dataclass
class Fabric:
    """A built fat tree: nodes, directed links and the arithmetic needed for routing.

    Attributes:
        hosts: number of hosts (ids ``0 .. hosts-1``); switches follow, tier by tier.
        ports: (down, up) per tier, bottom first; top tier ``(radix, 0)``.
        link_src, link_dst: node ids of every directed link.
        link_cap: capacity of every directed link in bytes per second.
        link_tier: boundary of every link: 0 for host links, ``t`` for links between tier t and t+1.
    """

    hosts: int
    ports: list[tuple[int, int]]
    port_bps: float
    block_hosts: list[int]  # H_t for t = 1..T-1 (hosts under one level-t block)
    planes: list[int]  # P_t for t = 1..T
    blocks: list[int]  # populated level-t blocks for t = 1..T
    up_offset: list[int]  # first up-link id of boundary t (index t-1)
    down_offset: list[int]
    link_src: np.ndarray
    link_dst: np.ndarray
    link_cap: np.ndarray
    link_tier: np.ndarray
    switch_tier: np.ndarray  # tier of every switch (node id hosts + i)

    @property
    def tiers(self) -> int:
        return len(self.ports)

    @property
    def num_links(self) -> int:
        return int(self.link_src.size)

    @property
    def num_switches(self) -> int:
        return int(self.switch_tier.size)

    def lca_tier(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """Lowest tier whose block holds both hosts (1 = same leaf switch, T = through the top)."""
        lca = np.full(src.shape, self.tiers, dtype=np.int64)
        for t in range(self.tiers - 1, 0, -1):
            same = (src // self.block_hosts[t - 1]) == (dst // self.block_hosts[t - 1])
            lca[same] = t
        return lca

    def path_count(self, lca: np.ndarray) -> np.ndarray:
        """Equal-cost shortest paths for flows with these lowest common tiers (``P_lca``)."""
        return np.asarray(self.planes, dtype=np.int64)[lca - 1]

    def path_links(self, src: np.ndarray, dst: np.ndarray, lca: int, plane: np.ndarray) -> np.ndarray:
        """Link ids of the path through ``plane`` of tier ``lca`` for flows that all share ``lca``.

        Returns an array of shape (flows, 2 * lca): host up-link, up-links, down-links, host down-link.
        """
        cols = [src]
        downs = []
        top_planes = self.planes[lca - 1]
        for t in range(1, lca):
            q = plane // (top_planes // self.planes[t])  # plane at tier t+1
            p_next = self.planes[t]
            cols.append(self.up_offset[t - 1] + (src // self.block_hosts[t - 1]) * p_next + q)
            downs.append(self.down_offset[t - 1] + (dst // self.block_hosts[t - 1]) * p_next + q)
        cols.extend(reversed(downs))
        cols.append(self.hosts + dst)
        return np.stack(cols, axis=1).astype(np.int64)

    def spray_entries(self, src: np.ndarray, dst: np.ndarray, lca: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(flow index, link, weight) when each flow is split evenly over all its shortest paths.

        At boundary t a flow reaches every tier-(t+1) plane with the same share, so it puts
        ``1 / P_{t+1}`` of its rate on each of ``P_{t+1}`` up-links (and the matching down-links).
        """
        n = src.size
        idx = np.arange(n, dtype=np.int64)
        fl, ln, w = [idx, idx], [src, self.hosts + dst], [np.ones(n), np.ones(n)]
        for t in range(1, lca):
            p_next = self.planes[t]
            q = np.arange(p_next, dtype=np.int64)
            for offset, hosts in ((self.up_offset[t - 1], src), (self.down_offset[t - 1], dst)):
                base = offset + (hosts // self.block_hosts[t - 1]) * p_next
                fl.append(np.repeat(idx, p_next))
                ln.append((base[:, None] + q[None, :]).ravel())
                w.append(np.full(n * p_next, 1.0 / p_next))
        return np.concatenate(fl), np.concatenate(ln), np.concatenate(w)

    def to_networkx(self) -> Any:
        """The fabric as a ``networkx.MultiDiGraph`` (optional dependency) with capacities."""
        import networkx as nx  # type: ignore[import-untyped]

        g = nx.MultiDiGraph()
        for i in range(self.hosts):
            g.add_node(i, kind="host", tier=0)
        for i, t in enumerate(self.switch_tier.tolist()):
            g.add_node(self.hosts + i, kind="switch", tier=t)
        for s, d, c in zip(self.link_src.tolist(), self.link_dst.tolist(), self.link_cap.tolist(), strict=True):
            g.add_edge(s, d, capacity=c)
        return g


def build_fabric(hosts: int, ports: list[tuple[int, int]], port_bps: float) -> Fabric:
    """Build the fat tree holding ``hosts`` hosts (blocks filled in host order; unused blocks omitted).

    Raises:
        ValueError: more hosts than the tiers can hold.
    """
    cap = hosts_capacity(ports)
    if hosts < 2 or hosts > cap:
        raise ValueError(f"hosts must be between 2 and {cap} for these tiers (got {hosts})")
    tiers = len(ports)
    block_hosts = [math.prod(d for d, _ in ports[:t]) for t in range(1, tiers)]
    planes = [math.prod(u for _, u in ports[: t - 1]) for t in range(1, tiers + 1)]
    blocks = [math.ceil(hosts / h) for h in block_hosts] + [1]
    first_switch = [hosts]
    for t in range(tiers):
        first_switch.append(first_switch[-1] + blocks[t] * planes[t])
    switch_tier = np.concatenate([np.full(blocks[t] * planes[t], t + 1, dtype=np.int64) for t in range(tiers)])
    byte_rate = port_bps / 8.0
    h = np.arange(hosts, dtype=np.int64)
    leaf = first_switch[0] + h // ports[0][0]
    src, dst, tier = [h, leaf], [leaf, h], [np.zeros(hosts, np.int64), np.zeros(hosts, np.int64)]
    up_offset, down_offset = [], []
    n = 2 * hosts
    for t in range(1, tiers):
        # link (b, q) of boundary t: lower switch (block b, plane q // up_t), upper (block b // down_{t+1}, plane q)
        p_next = planes[t]
        b = np.repeat(np.arange(blocks[t - 1], dtype=np.int64), p_next)
        q = np.tile(np.arange(p_next, dtype=np.int64), blocks[t - 1])
        lower = first_switch[t - 1] + b * planes[t - 1] + q // ports[t - 1][1]
        upper_block = b // ports[t][0] if t < tiers - 1 else np.zeros_like(b)
        upper = first_switch[t] + upper_block * p_next + q
        count = b.size
        up_offset.append(n)
        down_offset.append(n + count)
        n += 2 * count
        src += [lower, upper]
        dst += [upper, lower]
        tier += [np.full(count, t, np.int64)] * 2
    link_src = np.concatenate(src)
    return Fabric(
        hosts=hosts,
        ports=list(ports),
        port_bps=port_bps,
        block_hosts=block_hosts,
        planes=planes,
        blocks=blocks,
        up_offset=up_offset,
        down_offset=down_offset,
        link_src=link_src,
        link_dst=np.concatenate(dst),
        link_cap=np.full(link_src.size, byte_rate),
        link_tier=np.concatenate(tier),
        switch_tier=switch_tier,
    )
