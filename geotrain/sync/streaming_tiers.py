"""Streaming DiLoCo in two tiers over ``topology.regions``: each fragment syncs in its region at
its staggered step, and across regions every ``sync.region_every`` of its region syncs.

Multi-tier DiLoCo (:mod:`geotrain.sync.tiers`) runs a region round every H steps and a world
round every ``region_every`` region rounds. Here each fragment f runs that schedule on its own,
at its Streaming DiLoCo sync steps (t ≡ f·H/F mod H), in the background exchange thread:

1. Δ₁ = θ_region,f − θ_local,f, averaged over the region's sites (token-weighted, guarded), then
   the region step on θ_region,f;
2. at every ``region_every``-th region sync of f: Δ₂ = θ_world,f − θ_region,f, averaged over every
   site, then the world step on θ_world,f, and θ_region,f ← θ_world,f.

τ steps after the sync the training thread waits for that exchange and merges:
θ_local,f ← α·θ_local,f + (1 − α)·θ_region,f (the world model when the sync reached the world
tier). Both steps run in the exchange thread: between a fragment's sync and its merge no other
thread touches its region and world models. ``sync.tier_outer`` places the outer optimizer as in
multi-tier DiLoCo, one per fragment and tier. So only one fragment in F crosses regions at a
time, and the slow tier carries 1/region_every of the region tier's syncs. A region round that
fails (secure aggregation below its threshold, every update rejected by the guard) leaves the
region model as it was; the merge then brings the site back to it. A world round that fails
leaves the regions on their models, and the next world sync of the fragment spans both. At the
run's end every fragment with unsynced steps, or with region syncs since its last world sync,
syncs across regions once more, so every site ends on one model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from geotrain.comm.collectives import Collectives
from geotrain.config import SyncConfig
from geotrain.errors import RoundFailed
from geotrain.sync.outer import outer_step_, pseudo_gradient
from geotrain.sync.reducer import SiteReducer
from geotrain.sync.streaming import StreamingDiLoCo
from geotrain.sync.tiers import RegionTier


class TieredStreaming(RegionTier, StreamingDiLoCo):
    """Streaming DiLoCo in two tiers (see the module docstring)."""

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, comm: Collectives, grad_clip: float, cfg: SyncConfig
    ) -> None:
        super().__init__(model, optimizer, comm, grad_clip, cfg)
        self._regions(cfg)
        shapes = [p.shape for p in self.local_params()]
        self.region_reducers = [
            SiteReducer(cfg, comm, [shapes[i] for i in frag], seed=f, sharded=self.sharded, region=True)
            for f, frag in enumerate(self.fragments)
        ]
        self.region_outer = [self._tier_optimizer(self._part(self.region_params, f), "region") for f in range(self.F)]
        self.outer = [self._tier_optimizer(self._globals(f), "world") for f in range(self.F)]
        self.region_syncs = [0] * self.F  # per fragment: region syncs since its last world sync

    @torch.no_grad()
    def _sync(self, f: int, t: int) -> None:
        local = self.local_params()
        delta = pseudo_gradient(self._part(self.region_params, f), self._part(local, f))
        trained = t > self.last_sync[f]  # (false at the run's end for a fragment that synced in its region last)
        self._mark_synced(f, t)
        self.region_syncs[f] += int(trained)
        world = self._finishing or self.region_syncs[f] >= self.every
        if world:
            self.region_syncs[f] = 0
        if self.private is not None:
            self.private.reserve()
        ids = (self.region_rounds, self.rounds)
        fut = self._network.submit(self._tiers, f, delta if trained else None, world, ids)
        self.region_rounds += int(trained)
        self.rounds += int(world)
        self.pending[f] = (t + self.tau, fut, delta)
        if self.tau == 0:
            self._merge(f)

    @torch.no_grad()
    def _tiers(self, f: int, delta: torch.Tensor | None, world: bool, ids: tuple[int, int]) -> None:
        """Exchange thread: fragment ``f``'s region round (``delta``; None: no steps to average),
        then, if ``world``, its world round (``ids``: the region and world round ids)."""
        regions, globals_ = self._part(self.region_params, f), self._globals(f)
        if delta is not None:
            included = self._region_included(delta, self.region_reducers[f], ids[0], key=f)
            try:
                if not included:
                    raise RoundFailed("every site's update was rejected by the guard")
                self._tier_average(delta, self.region_reducers[f], self._tier_weights(included), ids[0], region=True)
                outer_step_(self.region_outer[f], regions, delta)
            except RoundFailed as exc:  # the region model stays; the merge brings this site back to it
                self._roll_back((), f"region round {ids[0]} (fragment {f}): {exc}")
        if not world:
            return
        across = pseudo_gradient(globals_, regions)
        try:
            self._tier_average(across, self.reducers[f], self._tier_weights(list(range(self.num_sites))), ids[1], region=False)
            outer_step_(self.outer[f], globals_, across)
        except RoundFailed as exc:  # the regions keep their models; the next world sync spans these steps too
            self._roll_back((), f"world round {ids[1]} (fragment {f}): {exc}")
            if not self._finishing:
                return
        for r, g in zip(regions, globals_, strict=True):  # (a failed last world round: every site on the last world model)
            r.copy_(g)

    @torch.no_grad()
    def _merge(self, f: int) -> None:
        _, fut, _ = self.pending.pop(f)
        self._wait(fut)
        for r, p in zip(self._part(self.region_params, f), self._part(self.local_params(), f), strict=True):
            p.mul_(self.alpha).add_(r.to(p.dtype), alpha=1 - self.alpha)

    def global_parameters(self) -> list[torch.Tensor]:
        # the exchange thread steps the world model: a whole one once the exchanges in flight are done
        for _, fut, _ in self.pending.values():
            fut.result()
        return self.global_params

    def _unsynced(self, f: int, t: int) -> bool:
        return super()._unsynced(f, t) or self.region_syncs[f] > 0

    def finish(self) -> None:
        self._finishing = True  # every fragment's last sync reaches the world tier
        super().finish()

    def state_dict(self) -> dict[str, Any]:
        region = [self.reducer_out(r, frag) for r, frag in zip(self.region_reducers, self.fragments, strict=True)]
        return {**super().state_dict(), "region_reducers": region}

    def checkpoint_state(self) -> dict[str, Any]:
        return {
            **super().checkpoint_state(),
            "region_params": self.shards_out(self.region_params) if self.sharded else [r.clone() for r in self.region_params],
            "region_outer": [
                self.optim_out(o.state_dict(), frag) for o, frag in zip(self.region_outer, self.fragments, strict=True)
            ],
            "region_rounds": self.region_rounds,
            "region_syncs": list(self.region_syncs),
        }

    @torch.no_grad()
    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        super().load_checkpoint_state(state)
        for r, saved in zip(self.region_params, self.shards_in(state["region_params"]), strict=True):
            r.copy_(saved)
        for o, saved in zip(self.region_outer, state["region_outer"], strict=True):
            o.load_state_dict(self.optim_in(saved))
        for reducer, saved in zip(self.region_reducers, state["region_reducers"], strict=True):
            reducer.load_state_dict(self.reducer_in(saved))
        self.region_rounds = int(state["region_rounds"])
        self.region_syncs = list(state["region_syncs"])
