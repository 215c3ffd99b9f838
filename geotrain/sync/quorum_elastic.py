"""Asynchronous quorum rounds as elastic rounds (``sync.quorum`` with ``elastic.enabled``).

Quorum rounds with a syncer (:mod:`geotrain.sync.quorum`) merge at one site, which the run cannot
lose. Here there is no syncer: every round is an elastic round (Lighthouse membership, meeting,
ring exchange, vote, heal: :mod:`geotrain.elastic.member`), and only who meets changes:

1. **Who meets.** The Lighthouse forms a round once ``sync.quorum.sites`` live sites have asked
   (its ``min_replicas``), plus ``grace_s`` for the others (its join timeout). More than half the
   sites must be in a round: two rounds of disjoint sites would commit two models.
2. **Steps.** Each site runs its own ``sync.H`` steps per round and then asks; rounds do not end
   on shared multiples of H, as lock-step elastic rounds do.
3. **A late site** (alive, but left out of rounds that committed since its last one) brings its
   pseudo-gradient to its next round, weighted by (1 + s)^-p, s being the committed rounds it
   missed and p ``quorum.staleness_power`` (FedAsync's rule, as the syncer's). A round's weighted
   sum is divided by every site's weight, as the syncer divides by a whole world round's tokens:
   a round of two sites of three moves the model by their two thirds, and a late update alone by
   its discounted third. The outer step is the syncer's delayed Nesterov
   (:class:`geotrain.sync.merge.DelayedNesterov`): momentum once a world round's worth of updates
   is in, so rounds of some of the sites do not each get a full momentum step. In that round it
   takes from the heal source only the global part of the state (:meth:`load_global_state`):
   the global parameters, the outer optimizer (with the delayed momentum's pending sum) and the
   round count. Its inner optimizer, schedule, data position, step count and error feedback stay
   its own, and it applies the round's average to that global model as every other site does.
4. **The end.** A site that has run its steps stays in the others' rounds. A round whose members
   have all run their steps and hold one model is not held (:func:`geotrain.elastic.view.nothing_to_do`).
   A finished site leaves once every other site whose round store still answers has run its
   steps and holds its model (:class:`geotrain.elastic.progress.Progress`); a dead site's store
   is gone with it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from geotrain.comm.collectives import Collectives
from geotrain.config import SyncConfig
from geotrain.sync.diloco import DiLoCo
from geotrain.sync.merge import DelayedNesterov


class ElasticQuorum(DiLoCo):
    """DiLoCo whose elastic rounds are quorum rounds (see the module docstring)."""

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, comm: Collectives, grad_clip: float, cfg: SyncConfig
    ) -> None:
        super().__init__(model, optimizer, comm, grad_clip, cfg)
        # the syncer's outer step: momentum once a world round's worth of updates is in (a round of
        # every site, with nothing pending, is one plain outer step); the run's sites: :meth:`world`
        self.delayed = DelayedNesterov(self.global_params, self.outer_optimizer, cfg, 0)

    def _outer(self, delta: torch.Tensor) -> None:
        self.delayed.step(delta, self.contributors)

    def _next_round(self) -> None:
        """Each site's own H steps per round (no shared boundary)."""
        self.clock.next_round(self.rounds)
        self.clock.limit = self.H

    @property
    def staleness_power(self) -> float:
        assert self.cfg.quorum is not None
        return self.cfg.quorum.staleness_power

    def world(self, workers: list[int]) -> float:
        """The run's sites (``workers``: each one's ranks; this site's world is its own) for the
        delayed momentum; returns every site's weight in a round of H steps, as elastic rounds weigh
        sites (tokens where sites differ in size and ``weight_by_tokens``, else 1 each): what a
        round's weighted sum is divided by, as the syncer divides by a whole world round's tokens."""
        self.delayed.sites = len(workers)
        if not self.weight_by_tokens or len(set(workers)) == 1:
            return float(len(workers))
        return float(sum(w * self.H for w in workers))

    def global_state(self) -> dict[str, Any]:
        """What a late site takes in a heal: the global parameters, the outer optimizer state and
        the round counts (under FSDP, this rank's shards), as :meth:`checkpoint_state` lays them out."""
        keep = ("global_params", "outer", "pending", "pending_updates", "rounds", "rolled_back")
        return {k: v for k, v in self.checkpoint_state().items() if k in keep}

    def checkpoint_state(self) -> dict[str, Any]:  # (what a restarted site heals: the delayed momentum too)
        pending = [p.clone() for p in self.delayed.pending]
        return {**super().checkpoint_state(), "pending": pending, "pending_updates": self.delayed.pending_updates}

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        super().load_checkpoint_state(state)
        self._load_pending(state)

    @torch.no_grad()
    def _load_pending(self, state: dict[str, Any]) -> None:
        for p, saved in zip(self.delayed.pending, state["pending"], strict=True):
            p.copy_(saved)
        self.delayed.pending_updates = state["pending_updates"]

    @torch.no_grad()
    def load_global_state(self, state: dict[str, Any]) -> None:
        """A late site's heal: the source's global parameters, outer optimizer state and round
        counts (``state``: the source's :meth:`checkpoint_state`); everything else stays this site's."""
        for g, saved in zip(self.global_params, self.shards_in(state["global_params"]), strict=True):
            g.copy_(saved)
        self.outer_optimizer.load_state_dict(self.optim_in(state["outer"]))
        self._load_pending(state)
        self.rounds, self.rounds_rolled_back = state["rounds"], state["rolled_back"]
