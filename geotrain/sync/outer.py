"""What DiLoCo and Streaming DiLoCo share: DDP inside a site, fp32 global parameters, the
pseudo-gradient, the outer optimizer step, and the averaging of pseudo-gradients across sites
(token-weighted if configured; guarded; private or elastic when those parts are given), with
rollback of a failed round.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from geotrain.comm.collectives import Collectives
from geotrain.config import SyncConfig
from geotrain.errors import ElasticTimeout, RoundFailed, RoundPostponed
from geotrain.sync.base import PrivateAverage, RoundMembership, SyncAlgorithm, views_like
from geotrain.sync.reducer import SiteReducer

SPLIT_ROUNDS = 10  # elastic: most rounds a run's end holds to heal a split last round (one does, unless sites keep failing)


def pseudo_gradient(global_params: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> torch.Tensor:
    """Δ = θ_global − θ_local, flat fp32."""
    return torch.cat([(g - p.to(torch.float32)).reshape(-1) for g, p in zip(global_params, params, strict=True)])


def outer_step_(optimizer: torch.optim.Optimizer, global_params: Sequence[torch.Tensor], delta: torch.Tensor) -> None:
    """One outer optimizer step on ``global_params`` with the flat ``delta`` as their gradient."""
    for g, v in zip(global_params, views_like(delta, global_params), strict=True):
        g.grad = v
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class OuterSync(SyncAlgorithm):
    """What DiLoCo and Streaming DiLoCo share: DDP inside a site, fp32 global parameters, and the
    averaging of pseudo-gradients across sites (token-weighted if configured) through a reducer.

    Args:
        cfg: the sync section (H, outer SGD settings, token weighting, codec).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        comm: Collectives,
        grad_clip: float,
        cfg: SyncConfig,
    ) -> None:
        super().__init__(model, optimizer, comm, grad_clip)
        self.cfg = cfg
        self.H = cfg.H
        self.weight_by_tokens = cfg.weight_by_tokens
        topo = comm.groups.topology
        self.num_sites = topo.num_sites
        self.site_workers = topo.workers[comm.groups.me.site_index]
        # fp32 outer state, whatever the model's dtype
        self.global_params = [p.detach().clone().to(torch.float32) for p in self.local_params()]  # sharded: own shard
        self.rollback_reasons: list[str] = []
        self.private: PrivateAverage | None = None  # clipping, site DP, secure aggregation
        self.elastic: RoundMembership | None = None  # elastic mode: the cross-site average goes through the membership layer
        self.idle = False  # elastic: this site has run its steps and takes part in the others' rounds without an update
        self.contributors = 0  # elastic: the sites that contributed to the last round (in a region round, of this region)
        # elastic: what a round's claims say besides the step (Streaming DiLoCo's part; adaptive pace's rate)
        self._part_claim: dict[str, Any] = {}
        self.paced = cfg.pace == "adaptive"  # each site runs its own steps in a round (sync.pace, DiLoCo's)
        # FSDP over sites of different sizes: their shards differ, so each site gathers its
        # pseudo-gradient whole in the site and sums it across sites as replicated sites do
        self.resharded = self.sharded and len(set(topo.workers)) > 1

    # a pseudo-gradient's norm grows with the inner steps it spans (not so for Streaming DiLoCo,
    # whose merge keeps alpha of the local drift)
    norms_grow_with_steps = True

    def _make_reducer(self, codec: str, shapes: Sequence[torch.Size], seed: int = 0) -> SiteReducer:
        """A reducer over tensors of ``shapes`` for ``codec`` (the configured one, or one that
        sync.adapt chose; its other settings as configured)."""
        cfg = self.cfg if codec == self.cfg.codec else self.cfg.model_copy(update={"codec": codec})
        if self.resharded:  # whole tensors (DiLoCo's reducers are over every parameter)
            return SiteReducer(cfg, self.comm, [p.shape for p in self.params], seed=seed, sharded=False)
        return SiteReducer(cfg, self.comm, shapes, seed=seed, sharded=self.sharded)

    def _outer_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        lr, momentum, nesterov = self.cfg.outer_sgd
        return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=nesterov)

    def sync_gradients(self) -> None:
        if self.sharded:  # FSDP's reduce-scatter has averaged them over the site
            self._noise_shards()
            self._clip_sharded()
            return
        self._average_gradients(self.site_workers, self.comm.all_reduce_intra)

    def _average_across_sites(
        self, delta: torch.Tensor, reducer: SiteReducer, steps: int, round_id: int = 0, key: int = 0
    ) -> None:
        """Average a site's pseudo-gradient over sites (token-weighted if configured), via ``reducer``;
        with privacy, clipped/noised and summed by :class:`PrivateAggregation` (may raise RoundFailed).
        FSDP over sites of different sizes: over the whole vector, gathered in the site, then cut
        back into this rank's shards."""
        if self.resharded:
            whole = self._whole(delta)
            self._average(whole, reducer, steps, round_id, key)
            delta.copy_(torch.cat([t.reshape(-1) for t in self._own(whole)]))
            return
        self._average(delta, reducer, steps, round_id, key)

    def _average(self, delta: torch.Tensor, reducer: SiteReducer, steps: int, round_id: int, key: int) -> None:
        site = self.comm.groups.topology.site_names[self.comm.groups.me.site_index]
        self.faults.corrupt_update(delta, round_id)
        if self.private is not None:
            weights = self.site_weights(steps, [True] * self.num_sites)  # public: workers x steps (or 1)
            self.private.average(delta, round_id, weights if len(set(weights)) > 1 else None)
            return
        if self.elastic is not None:  # the guard judges this site's own update (see sync.guard)
            contribute = not self.idle and (self.guard is None or self.guard.own_update_ok(delta, key, round_id, site))
            got = self.elastic.round(
                delta,
                contribute=contribute,
                weight=0.0 if self.idle else self.elastic.weight(steps) if self.weight_by_tokens else 1.0,
                codec=reducer.codec,
                residual=reducer.residual,
                **self._part_claim,
            )
            if got is None:
                raise RoundPostponed(f"round {round_id}")
            self.contributors = got
            return
        if self.num_sites == 1:
            return
        included = [True] * self.num_sites
        if self.guard is not None:
            # sync.adapt varies H between rounds: where norms grow with the steps, compare them per inner step
            per_step = self.cfg.adapt is not None and self.norms_grow_with_steps
            included = self.guard.include(delta, key, round_id, per=max(1, steps) if per_step else 1)
            if not any(included):
                raise RoundFailed(f"round {round_id}: every site's update was rejected by the guard")
            if not included[self.comm.groups.me.site_index]:
                delta.zero_()
                reducer.forget_residual()  # else its old error feedback would still be sent
        self._weighted_average(delta, reducer, self.site_weights(steps, included))

    def _stay_for_the_others(self, one_round: Callable[[], bool]) -> None:
        """Elastic: a site that has run its steps stays in the rounds of the sites still training
        (``one_round``: it sends no update and applies their average; False when the round was
        postponed), until a round in which every site has run its steps (its rounds, with
        adaptive pace) and owes no other, and which every site decided alike (after a split, one
        more round heals the sites that rolled it back); so no site commits its last rounds alone
        and all end on one model. Bounded: without other sites its rounds are its own, and a quorum
        that never forms ends in ElasticTimeout after elastic.wait_timeout_s."""
        assert self.elastic is not None
        self.idle = self.elastic.done = True
        target = self.local_steps  # where this site stopped: the run's steps (or the privacy budget's, the same everywhere)
        healing = 0  # rounds held after every site finished, to heal a split
        while not (finished := self.elastic.all_finished(target) and self._settled()) or self.elastic.split:
            if finished and healing == SPLIT_ROUNDS:
                raise ElasticTimeout(f"the sites' last round split, and {SPLIT_ROUNDS} more rounds did not heal it")
            if not one_round():  # postponed: ask again after a heartbeat
                time.sleep(self.elastic.retry_seconds)
            else:
                healing += finished
        self.idle = False

    def _settled(self) -> bool:
        """Elastic: whether this site's state is one that every site ends on (two tiers: the last
        committed round was a world round)."""
        return True

    def join_round(self) -> None:
        """Elastic: a restarted site's first round, in which it heals (see :mod:`geotrain.run.elastic_site`)."""
        raise NotImplementedError(f"{type(self).__name__} has no elastic rounds")

    def _whole(self, flat: torch.Tensor) -> torch.Tensor:
        """A flat vector laid out like :meth:`local_params`, whole: under FSDP the site's ranks
        all-gather their shards (every rank calls it together); else ``flat`` itself."""
        if not self.sharded:
            return flat
        return torch.cat([t.reshape(-1) for t in self.full_tensors(views_like(flat, self.local_params()))])

    def _own(self, theta: torch.Tensor) -> list[torch.Tensor]:
        """This rank's part of each parameter in the whole flat ``theta`` (FSDP: its shards, cut
        where FSDP cuts them, without communication)."""
        if not self.sharded:
            return views_like(theta, self.global_params)
        from torch.distributed.tensor import DTensor, distribute_tensor

        whole = views_like(theta, list(self.params))
        return [
            distribute_tensor(w, p.device_mesh, p.placements, src_data_rank=None).to_local() if isinstance(p, DTensor) else w
            for w, p in zip(whole, self.params, strict=True)
        ]

    def _note(self, outcome: str, reason: str) -> None:
        """Elastic: the round's record, after it was applied or rolled back."""
        if self.elastic is not None:
            self.elastic.note(outcome, reason, self.global_hash(), self.rounds - self.rounds_rolled_back, self.local_steps)

    def _weighted_average(self, delta: torch.Tensor, reducer: SiteReducer, weights: Sequence[float]) -> None:
        """Replace this site's ``delta`` by the average over sites with ``weights`` (one per site, in
        site order; 0 for a site left out, or outside the sites ``reducer`` sums over)."""
        if reducer.sender_mean:  # SparseLoCo: each coordinate's weighted mean over the sites that sent it
            reducer(delta, shares=weights)
            return
        nonzero = [w for w in weights if w]
        if len(set(nonzero)) == 1:  # equal weights: sum, then divide (the same bits whether weighted or not)
            reducer(delta)
            delta.div_(len(nonzero))
        else:
            delta.mul_(weights[self.comm.groups.me.site_index] / sum(weights))
            reducer(delta)

    def site_weights(self, steps: int, included: Sequence[bool]) -> list[float]:
        """Each site's weight in this round's average: the tokens it processed (workers x inner
        steps, every worker taking the same batch) with ``weight_by_tokens``, else 1; 0 for a site
        the guard left out. ``steps`` is this site's count; the others' come from
        :meth:`round_steps`."""
        if not self.weight_by_tokens:
            return [float(x) for x in included]
        workers = self.comm.groups.topology.workers
        return [float(w * n) if ok else 0.0 for w, n, ok in zip(workers, self.round_steps(steps), included, strict=True)]

    def round_steps(self, steps: int) -> list[int]:
        """Every site's inner steps in this round: in lock-step rounds all sites run the same number."""
        return [steps] * self.num_sites

    def global_parameters(self) -> list[torch.Tensor]:
        return self.global_params

    @torch.no_grad()
    def _roll_back(self, indices: Sequence[int], why: str) -> None:
        """A failed round: nothing of it is applied; the parameters ``indices`` go back to the global ones."""
        local = self.local_params()
        for i in indices:
            local[i].copy_(self.global_params[i])
        self.rounds_rolled_back += 1
        self.rollback_reasons.append(why)

    def _privacy_allows_round(self) -> bool:
        if self.elastic is not None and not self.elastic.affords():  # site-level DP inside elastic rounds
            return False
        return self.private is None or self.private.can_afford()

    def checkpoint_state(self) -> dict[str, Any]:
        return {
            **super().checkpoint_state(),
            "global_params": self.shards_out(self.global_params) if self.sharded else [g.clone() for g in self.global_params],
            "guard": None if self.guard is None else self.guard.state_dict(),
        }

    @torch.no_grad()
    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        super().load_checkpoint_state(state)
        for g, saved in zip(self.global_params, self.shards_in(state["global_params"]), strict=True):
            g.copy_(saved)
        if self.guard is not None and state["guard"] is not None:
            self.guard.load_state_dict(state["guard"])
