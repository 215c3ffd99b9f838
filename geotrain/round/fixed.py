"""Rounds of the fixed world: every site of the run's one torch.distributed world in every round.

Nobody joins, leaves or heals, so a round needs no membership and no vote: every rank derives
the round's outcome from the same collective results (a guard that rejected every update, or
secure aggregation below its threshold, fails it on every site alike). What a round sums:

* a part taken against the local model (DiLoCo's round, a Streaming fragment, a region round)
  after the failure injection (``fault.nan``) and the update guard's collective rule
  (:class:`geotrain.sync.guard.UpdateGuard`): a site left out contributes zeros;
* weighted by tokens (workers × each site's steps in the part) with ``sync.weight_by_tokens``;
* through the codec's reducer (:class:`geotrain.sync.reducer.SiteReducer`), or privately
  (clipping, site DP, secure aggregation: :class:`geotrain.sync.base.PrivateAverage`);
* over every site, or (a region round of two tiers) over the sites of this rank's region.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from geotrain.comm.collectives import Collectives
from geotrain.comm.faults import FaultPlan
from geotrain.config import SyncConfig
from geotrain.errors import RoundFailed
from geotrain.sync.base import PrivateAverage
from geotrain.sync.guard import UpdateGuard
from geotrain.sync.reducer import SiteReducer


def weighted_average(delta: torch.Tensor, reducer: SiteReducer, weights: Sequence[float], me: int) -> None:
    """Replace this site's ``delta`` by the average over sites with ``weights`` (one per site, in
    site order; 0 for a site left out or outside the sites ``reducer`` sums over): equal weights
    sum, then divide (the same bits whether weighted or not); SparseLoCo averages each coordinate
    over the sites that sent it."""
    if reducer.sender_mean:
        reducer(delta, shares=weights)
        return
    nonzero = [w for w in weights if w]
    if len(set(nonzero)) == 1:
        reducer(delta)
        delta.div_(len(nonzero))
    else:
        delta.mul_(weights[me] / sum(weights))
        reducer(delta)


class FixedWorld:
    """The fixed world's rounds (see the module docstring).

    Args:
        private: clipping, site DP and secure aggregation of the updates (None: plain sums).
        guard: the update guard (None: off).
    """

    heals = False  # nobody comes back: no state is ever replaced in a round

    def __init__(
        self,
        comm: Collectives,
        cfg: SyncConfig,
        private: PrivateAverage | None,
        guard: UpdateGuard | None,
        faults: FaultPlan,
    ) -> None:
        self.comm, self.cfg, self.private, self.guard, self.faults = comm, cfg, private, guard, faults
        topo, self.me = comm.groups.topology, comm.groups.me.site_index
        self.num_sites, self.workers = topo.num_sites, list(topo.workers)
        self.region_sites = [s for s in range(topo.num_sites) if topo.same_region(s, self.me)]

    def weights(self, sites: Sequence[int], counts: Sequence[int]) -> list[float]:
        """Each site's weight in a round over ``sites`` (0 for the others): its tokens, workers x
        its steps in the part, with ``weight_by_tokens``; else 1."""
        tokens = self.cfg.weight_by_tokens
        return [float(self.workers[s] * counts[s] if tokens else 1) if s in sites else 0.0 for s in range(self.num_sites)]

    def sum(
        self,
        delta: torch.Tensor,
        reducer: SiteReducer,
        counts: Sequence[int],
        round_id: int,
        *,
        own: bool,
        region: bool = False,
        key: int = 0,
        per: int = 1,
    ) -> int:
        """Replace ``delta`` by the round's average; returns how many sites contributed.

        Args:
            counts: every site's steps in the part (its tokens' weight).
            own: the part is taken against the local model (the site's own update: failure
                injection and the guard apply; a world round of two tiers holds the region's).
            region: sum over this rank's region only (a region round of two tiers).
            key, per: the guard's history for this part, and the steps its norms are divided by.

        Raises:
            RoundFailed: the round fails on every site alike (roll it back).
        """
        sites = self.region_sites if region else list(range(self.num_sites))
        if own:
            self.faults.corrupt_update(delta, round_id)
        if self.private is not None:
            weights = self.weights(sites, counts)
            unequal = len({w for w in weights if w}) > 1
            self.private.average(delta, round_id, weights if unequal else None, region=region)
            return len(sites)
        if len(sites) == 1 and not region:
            return 1
        included = sites
        if own and self.guard is not None:
            ok = self.guard.include(delta, key, round_id, per=per, region=sites if region else None)
            included = [s for s in sites if ok[s]]
            if not included:
                raise RoundFailed(f"round {round_id}: every site's update was rejected by the guard")
            if not ok[self.me]:
                delta.zero_()
                reducer.forget_residual()  # else its old error feedback would still be sent
        weighted_average(delta, reducer, self.weights(included, counts), self.me)
        return len(included)
