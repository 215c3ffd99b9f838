"""Two tiers in elastic mode: region rounds and world rounds are both elastic rounds.

Membership stays one: every live site meets in every elastic round (the Lighthouse's quorum, the
meeting and the vote cross regions, a few hundred bytes of control each), and a round commits or
rolls back on every site alike, so all sites count the same committed rounds. What crosses sites
is per tier (:func:`geotrain.elastic.view.tier_ring`): a **region round** sums each region's
pseudo-gradients Δ₁ = θ_region − θ_local over that region's admitted sites only, so its bytes stay
on the region's links; a **world round** sums Δ₂ = θ_world − θ_region over every admitted site.
Both steps are those of :class:`~geotrain.sync.tiers.TieredDiLoCo` (``sync.tier_outer`` says
which tier has the outer optimizer).

**Which tier.** Each site claims one in the meeting (the part it syncs): REGION when it ran inner
steps since its last round; WORLD when it ran none and ``sync.region_every`` region rounds (or,
at the run's end, any) passed since the last world round; none otherwise (a restarted site, or
one that has run its steps and synced them). The round is a region round if any admitted site
claims one, else a world round (:func:`geotrain.elastic.meeting.meet`): a site with unsynced
steps brings them to its region first. A site that claimed another tier than the round's sits it
out (it sends nothing) and applies the round like the others. The count of region rounds since
the last world round is committed state, the same on every site, so every site reaches the world
round in the same elastic round.

**Healing.** A site's state is its region's model as well as the world's, so a site that comes
back heals from its own region's source (:func:`geotrain.elastic.view.region_healers`). Where no
site of its region is alive, it heals from any site and its region restarts from the world
model, with fresh region momentum: what the region learnt since the last world round was held
only by sites that died. A region round to which no site of a region contributed (its sites
healed or sat out) leaves that region's model as it was.

**The end.** A site that has run its steps brings its region's Δ₂ to a last world round; then
it stays in the rounds of slower sites (:meth:`OuterSync._stay_for_the_others`) until every site
has run its steps and the last committed round was a world round: every site ends on one model.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn as nn

from geotrain.comm.collectives import Collectives
from geotrain.comm.topology import REGION, WORLD
from geotrain.config import SyncConfig
from geotrain.errors import ElasticTimeout, RoundFailed, RoundPostponed
from geotrain.sync.base import params_hash
from geotrain.sync.outer import SPLIT_ROUNDS, outer_step_, pseudo_gradient
from geotrain.sync.tiers import TieredDiLoCo


class ElasticTiers(TieredDiLoCo):
    """Tiered DiLoCo whose region and world rounds are elastic rounds (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        comm: Collectives,
        grad_clip: float,
        cfg: SyncConfig,
        region: str,
    ) -> None:
        super().__init__(model, optimizer, comm, grad_clip, cfg)
        self.region_name = region  # this site's region (its world is its own site: the run's topology names it)

    def global_hash(self) -> str:
        """sha256 of the model this site holds: the world's and its region's (sharded: gathered in the site)."""
        return params_hash(self.full_tensors(self.global_params) + self.full_tensors(self.region_params))

    def _claim(self) -> int:
        """The tier this site asks for in its next round (REGION, WORLD, or -1: none)."""
        if self._steps_in_round:
            return REGION
        since = self._region_since_world
        return WORLD if since and (since >= self.every or self._finishing) else -1

    def _settled(self) -> bool:
        return not self._steps_in_round and not self._region_since_world

    @torch.no_grad()
    def outer_step(self) -> None:
        if self.elastic is None:  # (no round runs before the site joins)
            super().outer_step()
            return
        if self._rounds(self._claim()):  # (postponed: the round stays due, retried after the next step)
            self._next_round()

    def join_round(self) -> None:
        if self._rounds(-1):
            self._next_round()

    def _rounds(self, claim: int) -> bool:
        """Rounds from one that claims ``claim`` on: a region round is followed at once by the world
        round when one is due (a site that healed in it too); False if postponed."""
        while True:
            tier = self._tier_round(claim)
            if tier is None:
                return False
            claim = self._claim()
            if tier != REGION or claim != WORLD:
                return True

    @torch.no_grad()
    def _tier_round(self, claim: int) -> int | None:
        """One elastic round in which this site claims ``claim``; the round's tier (-1: it synced
        nothing and was rolled back), or None if it was postponed."""
        assert self.elastic is not None
        world = claim == WORLD
        if world:
            delta, reducer, steps = pseudo_gradient(self.global_params, self.region_params), self.reducer, self.every * self.H
        else:
            delta, reducer, steps = (
                pseudo_gradient(self.region_params, self.local_params()),
                self.region_reducer,
                self._steps_in_round,
            )
        self._part_claim = {"part": claim}
        idle, self.idle = self.idle, self.idle and not world  # a site that ran its steps still holds its region's Δ₂
        try:
            self._average_across_sites(delta, reducer, steps, self.rounds, key=int(world))
        except RoundPostponed:
            return None
        except RoundFailed as exc:
            tier = self.elastic.part
            self._roll_back((), str(exc))
            if tier == REGION and claim == REGION:  # its steps since the last round are not applied
                self._from(self.region_params)
            self.rounds += 1
            self._note("rolled_back", str(exc))
            return tier
        finally:
            self.idle = idle
        self._apply(self.elastic.part, self.elastic.average)
        self.rounds += 1
        self._note("committed", "")
        return self.elastic.part

    def _apply(self, tier: int, average: torch.Tensor | None) -> None:
        """A committed round of ``tier``: its step, on this site's state (healed already if it healed)."""
        assert average is not None
        if tier == REGION:
            if self.contributors:  # (a region none of whose sites contributed keeps its model)
                outer_step_(self.region_optimizer, self.region_params, average)
            self.region_rounds += 1
            self._region_since_world += 1
            self._from(self.region_params)
        else:
            outer_step_(self.outer_optimizer, self.global_params, average)
            for r, g in zip(self.region_params, self.global_params, strict=True):
                r.copy_(g)
            self._region_since_world = 0
            self._from(self.global_params)

    def _from(self, params: list[torch.Tensor]) -> None:
        """θ_local ← ``params``; the next round starts."""
        for g, p in zip(params, self.local_params(), strict=True):
            p.copy_(g)
        self._steps_in_round = 0

    def finish(self) -> None:
        """The steps left, then the last world round (retried while it rolls back: every site's
        region must reach it), then the rounds of slower sites (see the module docstring)."""
        if self.elastic is None:
            super().finish()
            return
        self._finishing = True
        failed = 0
        while not self._settled():
            if not self._privacy_allows_round():  # (site-level DP is refused with tiers; a budget of example DP ends here)
                break
            rounds = self.rounds
            self.outer_step()
            if self.rounds == rounds:
                time.sleep(self.elastic.retry_seconds)
            elif not self._settled():
                failed += 1
                if failed > SPLIT_ROUNDS:
                    raise ElasticTimeout(f"the last world round failed {SPLIT_ROUNDS} times")
        self._stay_for_the_others(self._idle_round)

    def checkpoint_state(self) -> dict[str, Any]:
        return {**super().checkpoint_state(), "region": self.region_name}

    @torch.no_grad()
    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Also a heal's state; from a site of another region (none of this region was alive) the
        region restarts from the world model, with fresh momentum and no error feedback."""
        super().load_checkpoint_state(state)
        if state.get("region", self.region_name) != self.region_name:
            for r, g in zip(self.region_params, self.global_params, strict=True):
                r.copy_(g)
            self.region_optimizer = self._tier_optimizer(self.region_params, "region")
            self.region_reducer.forget_residual()
