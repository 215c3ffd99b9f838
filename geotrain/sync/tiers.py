"""Multi-tier DiLoCo: sites sync inside their region often, regions sync together rarely.

Sites are grouped in ``topology.regions`` (two datacenters in one metro region on 100 Gbit/s,
a third across an ocean). Every H inner steps the sites of a region run a DiLoCo round among
themselves, over the region's fast links; every ``sync.region_every`` region rounds (H2 =
region_every · H) the regions run one across the slow links:

1. every H steps, inside the region: Δ₁ = θ_region − θ_local, averaged over the region's sites
   (token-weighted), then the region step θ_region ← step(θ_region, Δ̄₁); θ_local ← θ_region;
2. every region_every region rounds, across regions: Δ₂ = θ_world − θ_region, averaged over every
   site (each site holds its region's Δ₂, so with token weights a region counts by its tokens),
   then the world step θ_world ← step(θ_world, Δ̄₂); θ_region, θ_local ← θ_world.

``sync.tier_outer`` says which step is the outer optimizer (SGD with Nesterov momentum) and
which is plain averaging (SGD, lr 1, no momentum):

* ``region`` (the default): the outer optimizer in each region, with momentum of its own; the
  world tier averages the regions' models. Every region runs DiLoCo at H1 and takes as many outer
  steps as flat DiLoCo; the rare world round only pulls the regions together (a Local SGD step
  over the regions' DiLoCo, as in hierarchical Local SGD, Lin et al. 2020, arXiv:1808.07217,
  with DiLoCo as the lower tier).
* ``world``: plain averaging in the region, the outer optimizer only across regions (one set of
  momentum, which takes region_every times fewer steps).
* ``both``: an outer optimizer at both tiers, like HALoS's local and global parameter servers
  (Kim et al. 2025, arXiv:2506.04531).

With region_every = 1, ``region`` and ``world`` are flat DiLoCo up to rounding
(tests/test_hetero.py): the world tier then sees the token-weighted mean of every site's
pseudo-gradient, and in ``region`` the regions start every round from one model, so their
momentum buffers, which are linear in the pseudo-gradients, average to flat DiLoCo's. The
measured choice: docs/HETERO.md. Only step 2 crosses regions, so bytes on the slow tier fall by
region_every. With adaptive pace (``sync.pace=adaptive``) every region round ends on the pace
clock's time budget: one control exchange of every site's steps and rates per region round (a
few bytes across regions), region averages weighted by each site's steps, world averages by its
steps since the last world round. ``train.max_seconds`` ends the run at the first world round after that much
training: the sites agree on the time there (one control exchange of every site's elapsed
seconds), since a region round does not reach the other regions.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from geotrain.comm.collectives import Collectives
from geotrain.config import SyncConfig
from geotrain.errors import RoundFailed
from geotrain.sync.adapt import NetworkAdapter
from geotrain.sync.diloco import DiLoCo
from geotrain.sync.merge import averaging
from geotrain.sync.outer import OuterSync, outer_step_, pseudo_gradient
from geotrain.sync.reducer import SiteReducer


class RegionTier(OuterSync):
    """What both tiered algorithms share: the region's sites, the region's model, and a tier's
    weights, guard and average (DiLoCo's rounds here, Streaming DiLoCo's fragments in
    :mod:`geotrain.sync.streaming_tiers`)."""

    def _regions(self, cfg: SyncConfig) -> None:
        """The region tier's sites and model (a copy of the global model at the start)."""
        topo, me = self.comm.groups.topology, self.comm.groups.me.site_index
        self.every = cfg.region_every
        self.region_sites = [s for s in range(topo.num_sites) if topo.same_region(s, me)]
        self.region_params = [g.clone() for g in self.global_params]
        self._finishing = False

    def _tier_optimizer(self, params: list[torch.Tensor], tier: str) -> torch.optim.Optimizer:
        """The step of ``tier`` ('region' or 'world'): the outer optimizer, or plain averaging (``sync.tier_outer``)."""
        outer = self.cfg.tier_outer
        return self._outer_optimizer(params) if outer in (tier, "both") else averaging(params)

    def _tier_weights(self, sites: list[int], steps: list[int] | None = None) -> list[float]:
        """Each site's weight in a tier's average over ``sites`` (0 for the others): its tokens,
        workers x ``steps`` (adaptive pace: each site's own), else in proportion to its workers
        (every site runs the same steps)."""
        workers = self.comm.groups.topology.workers
        k = steps if steps is not None else [1] * self.num_sites
        return [float(workers[s] * k[s] if self.weight_by_tokens else 1) if s in sites else 0.0 for s in range(self.num_sites)]

    def _tier_average(self, delta: torch.Tensor, reducer: SiteReducer, weights: list[float], round_id: int, region: bool) -> None:
        """Average ``delta`` over one tier's sites (those of nonzero ``weights``): with privacy,
        securely over the region's sites (``region``) or every site (may raise RoundFailed); else
        with ``reducer``."""
        if self.private is None:
            self._weighted_average(delta, reducer, weights)
            return
        weighted = len({w for w in weights if w}) > 1
        self.private.average(delta, round_id, weights if weighted else None, region=region)

    def _region_included(self, delta: torch.Tensor, reducer: SiteReducer, round_id: int, key: int = 0) -> list[int]:
        """The sites of this region whose update goes into the region round ``round_id``: the
        guard's rule over the region's norms (``guard.enabled``, its history under ``key``), after
        the failure injection (``fault.nan``, by region round); a site left out contributes zeros."""
        g = self.comm.groups
        self.faults.corrupt_update(delta, round_id)
        if self.guard is None or self.private is not None:  # (secure aggregation: no norm is revealed; a
            return self.region_sites  # site withdraws its own non-finite update, sync.guard)
        ok = self.guard.include(delta, key, round_id, region=self.region_sites)
        if not ok[g.me.site_index]:
            delta.zero_()
            reducer.forget_residual()  # else its old error feedback would still be sent
        return [s for s in self.region_sites if ok[s]]


class TieredDiLoCo(RegionTier, DiLoCo):
    """DiLoCo in two tiers over ``topology.regions`` (see the module docstring)."""

    name = "diloco"

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, comm: Collectives, grad_clip: float, cfg: SyncConfig
    ) -> None:
        super().__init__(model, optimizer, comm, grad_clip, cfg)
        topo = comm.groups.topology
        self._regions(cfg)
        self.region_reducer = SiteReducer(cfg, comm, [p.shape for p in self.local_params()], sharded=self.sharded, region=True)
        self.region_optimizer = self._tier_optimizer(self.region_params, "region")
        self.outer_optimizer = self._tier_optimizer(self.global_params, "world")
        self._since_world = [0] * topo.num_sites  # adaptive pace: each site's steps since the last world round
        self._region_since_world = 0  # region rounds since the last world round (sync.adapt changes self.every)
        if self.adapter is not None and cfg.adapt is not None:  # it chooses the world tier's period (in steps) and codec
            self.adapter = NetworkAdapter(cfg.adapt, comm, self.adapter.params, self.every * self.H, cfg.codec)
            self.adapter.paced = self.clock.adaptive
            self.adapter.across_regions, self.adapter.regions = True, len(set(topo.region_of))

    def finish(self) -> None:
        if self._steps_in_round or self._region_since_world:  # the world tier closes the run
            self._finishing = True
            self.outer_step()

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "region_reducer": self.reducer_out(self.region_reducer)}

    def checkpoint_state(self) -> dict[str, Any]:
        """DiLoCo's, and the region tier's: its model, its optimizer (momentum with ``tier_outer``
        region or both) and its round count."""
        return {
            **super().checkpoint_state(),
            "region_params": self.shards_out(self.region_params) if self.sharded else [r.clone() for r in self.region_params],
            "region_outer": self.optim_out(self.region_optimizer.state_dict()),
            "region_rounds": self.region_rounds,
            "since_world": list(self._since_world),
            "region_since_world": self._region_since_world,
            "every": self.every,
        }

    @torch.no_grad()
    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        H = self.H
        super().load_checkpoint_state(state)  # (sync.adapt: its H is the world tier's period, not the region's H)
        self.H = self.clock.H = H
        if "clock" in state:
            self.clock.limit = state["clock"]["limit"]
        self.every = int(state.get("every", self.every))
        self._region_since_world = int(state.get("region_since_world", state["region_rounds"] % self.every))
        for r, saved in zip(self.region_params, self.shards_in(state["region_params"]), strict=True):
            r.copy_(saved)
        self.region_optimizer.load_state_dict(self.optim_in(state["region_outer"]))
        self.region_rounds = int(state["region_rounds"])
        self._since_world = list(state.get("since_world", self._since_world))
        self.region_reducer.load_state_dict(self.reducer_in(state["region_reducer"]))

    def _adapt(self, steps: int | list[int]) -> None:
        """sync.adapt, after a world round: the world tier's next period (a whole number of region
        rounds) and codec, from the cross-region link measured in this one."""
        assert self.adapter is not None
        if self.adapter.end_round(self.rounds, steps):
            self.every = max(1, round(self.adapter.H / self.H))
            self.adapter.H = self.every * self.H  # what the next world round will span
            codec = self.adapter.codec
            if codec not in self._reducers:
                self._reducers[codec] = self._make_reducer(codec, [p.shape for p in self.local_params()])
            self.reducer = self._reducers[codec]

    def eval_due(self, step: int, every: int) -> bool:
        if not self.clock.adaptive:
            return super().eval_due(step, every)
        return self._steps_in_round == 0 and self.region_rounds % max(1, every // self.H) == 0

    @torch.no_grad()
    def outer_step(self) -> None:
        paced = self.clock.adaptive  # every site's steps this region round, and their rates (one control exchange)
        steps = self.clock.exchange(self._steps_in_round) if paced else None
        if steps is not None:
            self._since_world = [a + b for a, b in zip(self._since_world, steps, strict=True)]
        # 1. inside the region (a last region round of no steps, at the run's end, has nothing to average)
        delta = pseudo_gradient(self.region_params, self.local_params())
        included = self._region_included(delta, self.region_reducer, self.region_rounds)
        if steps is not None and not any(steps[s] for s in self.region_sites):
            included = []
        elif included:
            try:
                weights = self._tier_weights(included, steps)
                self._tier_average(delta, self.region_reducer, weights, self.region_rounds, region=True)
                outer_step_(self.region_optimizer, self.region_params, delta)
            except RoundFailed as exc:  # secure aggregation below its threshold: the region round is rolled back
                self._roll_back((), f"region round {self.region_rounds}: {exc}")
        else:  # every update of the region was rejected by the guard: the region round is rolled back
            self._roll_back((), f"region round {self.region_rounds}: every site's update was rejected by the guard")
        self.region_rounds += 1
        self._region_since_world += 1
        target = self.region_params
        # 2. across regions, every `every` region rounds (and to close the run)
        if self._region_since_world >= self.every or self._finishing:
            world = pseudo_gradient(self.global_params, self.region_params)
            since = self._since_world if paced else None  # each site's tokens since the last world round
            world_steps = list(self._since_world) if paced else self._region_since_world * self.H
            if self.adapter is not None:
                self.adapter.start_average()
            self._region_since_world = 0
            try:
                weights = self._tier_weights(list(range(self.num_sites)), since)
                self._tier_average(world, self.reducer, weights, self.rounds, region=False)
                committed = True
            except RoundFailed as exc:  # the regions keep their models; the next world round spans these steps too
                self._roll_back((), f"world round {self.rounds}: {exc}")
                if self.adapter is not None:
                    self.adapter.skip_round()
                committed = False
            if committed:
                self._since_world = [0] * self.num_sites
                outer_step_(self.outer_optimizer, self.global_params, world)
                if self.adapter is not None:
                    self._adapt(world_steps)
            if committed or self._finishing:  # (a failed last world round: every site ends on the last world model)
                for r, g in zip(self.region_params, self.global_params, strict=True):
                    r.copy_(g)
                target = self.global_params
            self.rounds += 1
            if self.clock.exchanges and not paced:  # train.max_seconds: agreed at world rounds only, the one tier
                self.clock.exchange(self._steps_in_round)  # every site is in (region rounds are not)
                self.clock.next_round(self.rounds)
        if paced:  # the next region round's budget (and the run's end, counted in region rounds)
            self.clock.next_round(self.region_rounds)
        for g, p in zip(target, self.local_params(), strict=True):
            p.copy_(g)
        self._steps_in_round = 0
