"""Routing of flows over a :class:`~geotrain.netsim.fabric.Fabric`.

Every routing turns a set of (source, destination, bytes) flows into a :class:`FlowSet`: the
engine's flows (a flow or one of its subflows), each with its bytes, parent flow and hop count,
plus sparse (engine flow, link, weight) entries saying which share of the flow's rate crosses
which link.

- ``ecmp``: one path per flow, drawn uniformly from the equal-cost paths. A switch hashing the
  5-tuple independently at every hop picks each next hop uniformly, which is the same
  distribution; the seed plays the role of the hash salt. (RoCEv2 on ECMP fabrics.)
- ``ecmp_subflows``: each flow sprayed evenly over ``subflows`` paths, each drawn by ECMP hashing
  (a sender cycling through ``subflows`` entropy values, as Ultra Ethernet's packet spraying or
  NCCL's several queue pairs per connection do). In the fluid limit the flow's rate splits evenly
  over those paths; ``subflows = 1`` is ``ecmp``, and as it grows it approaches ``spray``.
  Independently congestion-controlled subflows (uncoupled MPTCP, each with its own max-min
  share and finishing time) are not modelled.
- ``spray``: ideal packet spraying: every flow's rate split evenly over all its shortest paths
  (NDP, Homa-style receiver-driven multipath in the fluid limit).
- ``adaptive``: a central least-loaded placement: flows in random order each take the path whose
  busiest link carries the fewest bytes so far (ties broken at random), as Hedera's Global First
  Fit (Al-Fares et al. NSDI 2010) does with flow demands.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from geotrain.netsim.fabric import Fabric

ROUTINGS = ("ecmp", "ecmp_subflows", "spray", "adaptive")


@dataclass
class FlowSet:
    """Flows ready for the engine (subflows are separate engine flows with a common parent)."""

    size: np.ndarray  # bytes of every engine flow
    parent: np.ndarray  # index of the traffic flow each engine flow belongs to
    hops: np.ndarray  # links on the path (for the base RTT)
    ent_flow: np.ndarray  # sparse routing matrix: engine flow ...
    ent_link: np.ndarray  # ... link ...
    ent_weight: np.ndarray  # ... and the share of the flow's rate on that link
    num_parents: int

    @property
    def num_flows(self) -> int:
        return int(self.size.size)

    def link_bytes(self, num_links: int) -> np.ndarray:
        """Bytes every link carries when all flows complete."""
        return np.bincount(self.ent_link, self.ent_weight * self.size[self.ent_flow], minlength=num_links)

    def link_flows(self, num_links: int) -> np.ndarray:
        """Flows (weighted by their share) crossing every link."""
        return np.bincount(self.ent_link, self.ent_weight, minlength=num_links)


def _by_lca(fabric: Fabric, src: np.ndarray, dst: np.ndarray) -> list[tuple[int, np.ndarray]]:
    lca = fabric.lca_tier(src, dst)
    return [(int(c), np.flatnonzero(lca == c)) for c in np.unique(lca)]


def _hashed_paths(fabric: Fabric, src: np.ndarray, dst: np.ndarray, size: np.ndarray, planes: np.ndarray) -> FlowSet:
    """Each flow spread evenly over the paths through ``planes`` (flows x P planes at each flow's
    lowest common tier; P = 1 is one path per flow, repeated planes carry repeated shares)."""
    per_flow = planes.shape[1]
    fl, ln = [], []
    hops = np.zeros(src.size, dtype=np.int64)
    for c, idx in _by_lca(fabric, src, dst):
        links = fabric.path_links(np.repeat(src[idx], per_flow), np.repeat(dst[idx], per_flow), c, planes[idx].ravel())
        fl.append(np.repeat(idx, per_flow * links.shape[1]))
        ln.append(links.ravel())
        hops[idx] = links.shape[1]
    ent_flow = np.concatenate(fl)
    return FlowSet(
        size=size.astype(np.float64),
        parent=np.arange(src.size),
        hops=hops,
        ent_flow=ent_flow,
        ent_link=np.concatenate(ln),
        ent_weight=np.full(ent_flow.size, 1.0 / per_flow),
        num_parents=src.size,
    )


def ecmp(fabric: Fabric, src: np.ndarray, dst: np.ndarray, size: np.ndarray, rng: np.random.Generator) -> FlowSet:
    """One uniformly random equal-cost path per flow."""
    n_paths = fabric.path_count(fabric.lca_tier(src, dst))
    return _hashed_paths(fabric, src, dst, size, rng.integers(0, n_paths)[:, None])


def ecmp_subflows(
    fabric: Fabric, src: np.ndarray, dst: np.ndarray, size: np.ndarray, rng: np.random.Generator, subflows: int
) -> FlowSet:
    """Each flow spread evenly over ``subflows`` independently hashed paths (repeats allowed)."""
    n_paths = fabric.path_count(fabric.lca_tier(src, dst))
    planes = np.zeros((src.size, subflows), dtype=np.int64)
    for _, idx in _by_lca(fabric, src, dst):  # drawn group by group, lowest common tier first
        planes[idx] = rng.integers(0, n_paths[idx][:, None], size=(idx.size, subflows))
    return _hashed_paths(fabric, src, dst, size, planes)


def spray(fabric: Fabric, src: np.ndarray, dst: np.ndarray, size: np.ndarray) -> FlowSet:
    """Every flow split evenly over all its shortest paths."""
    fl, ln, w = [], [], []
    hops = np.zeros(src.size, dtype=np.int64)
    for c, idx in _by_lca(fabric, src, dst):
        f, li, wi = fabric.spray_entries(src[idx], dst[idx], c)
        fl.append(idx[f])
        ln.append(li)
        w.append(wi)
        hops[idx] = 2 * c
    return FlowSet(
        size=size.astype(np.float64),
        parent=np.arange(src.size),
        hops=hops,
        ent_flow=np.concatenate(fl),
        ent_link=np.concatenate(ln),
        ent_weight=np.concatenate(w),
        num_parents=src.size,
    )


def adaptive(fabric: Fabric, src: np.ndarray, dst: np.ndarray, size: np.ndarray, rng: np.random.Generator) -> FlowSet:
    """Greedy least-loaded placement (Hedera's Global First Fit with byte demands)."""
    load = np.zeros(fabric.num_links)
    lca = fabric.lca_tier(src, dst)
    planes = np.zeros(src.size, dtype=np.int64)
    candidates: dict[int, np.ndarray] = {}
    for i in rng.permutation(src.size):
        c = int(lca[i])
        n_paths = fabric.planes[c - 1]
        if c not in candidates:
            candidates[c] = np.arange(n_paths, dtype=np.int64)
        options = fabric.path_links(np.full(n_paths, src[i]), np.full(n_paths, dst[i]), c, candidates[c])
        worst = load[options].max(axis=1)
        best = np.flatnonzero(worst <= worst.min() * (1 + 1e-12))
        choice = int(best[rng.integers(best.size)]) if best.size > 1 else int(best[0])
        planes[i] = choice
        load[options[choice]] += size[i]
    return _hashed_paths(fabric, src, dst, size, planes[:, None])


def route(
    fabric: Fabric,
    routing: str,
    src: np.ndarray,
    dst: np.ndarray,
    size: np.ndarray,
    rng: np.random.Generator,
    subflows: int = 8,
) -> FlowSet:
    """Route flows with one of :data:`ROUTINGS`."""
    if routing == "ecmp":
        return ecmp(fabric, src, dst, size, rng)
    if routing == "ecmp_subflows":
        return ecmp_subflows(fabric, src, dst, size, rng, subflows)
    if routing == "spray":
        return spray(fabric, src, dst, size)
    if routing == "adaptive":
        return adaptive(fabric, src, dst, size, rng)
    raise ValueError(f"routing must be one of {', '.join(ROUTINGS)} (got {routing!r})")
