"""DiLoCo across sites, synchronous data parallel inside a site.

Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
arXiv:2311.08105, Algorithm 1:

1. inner step: gradients are averaged inside the site only (fast links), then AdamW;
2. every H inner steps: pseudo-gradient Δ = θ_global − θ_local (fp32);
3. Δ is averaged across sites (optionally weighted by tokens processed);
4. the outer optimizer (SGD with Nesterov momentum, fp32 state) steps θ_global with Δ as its
   gradient;
5. θ_local ← θ_global, and the next round starts (the inner optimizer state is kept).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn as nn

from geotrain.comm.collectives import Collectives
from geotrain.config import SyncConfig
from geotrain.errors import RoundFailed, RoundPostponed
from geotrain.sync.adapt import NetworkAdapter, claimed_codec, link_claim
from geotrain.sync.outer import OuterSync, outer_step_, pseudo_gradient
from geotrain.sync.pace import RoundClock, round_limit
from geotrain.sync.reducer import SiteReducer


class DiLoCo(OuterSync):
    """DiLoCo across sites, synchronous data parallel inside a site.

    Settings come from the sync section: H inner steps per outer round, outer SGD (paper: 0.7,
    0.9, Nesterov), token weighting, codec. With ``pace=adaptive`` each site's inner steps per
    round follow its measured speed (:mod:`geotrain.sync.pace`).
    """

    name = "diloco"

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        comm: Collectives,
        grad_clip: float,
        cfg: SyncConfig,
    ) -> None:
        super().__init__(model, optimizer, comm, grad_clip, cfg)
        self.outer_optimizer = self._outer_optimizer(self.global_params)
        self._steps_in_round = 0
        self._total_steps = 0  # the run's inner steps (set_limits)
        shapes = [p.shape for p in self.local_params()]
        self.reducer = self._make_reducer(cfg.codec, shapes)
        self.clock = RoundClock(comm, self.H, cfg.pace == "adaptive")
        self.adapter: NetworkAdapter | None = None  # sync.adapt: H and codec follow the measured network
        if cfg.adapt is not None:
            # the formula's P is the whole pseudo-gradient (under FSDP too: the site's shards carry all of it)
            self.adapter = NetworkAdapter(cfg.adapt, comm, sum(p.numel() for p in self.params), self.H, cfg.codec)
            self.adapter.paced = self.clock.adaptive
            # one reducer per codec chosen (fixed-width codecs: no state to carry between them)
            self._reducers: dict[str, SiteReducer] = {cfg.codec: self.reducer}

    def after_step(self) -> None:
        super().after_step()
        self._steps_in_round += 1
        if self.clock.ends(self._steps_in_round):  # past the limit: a postponed round, retried every step
            self.outer_step()

    def sync_gradients(self) -> None:
        super().sync_gradients()
        self.clock.vote(self._steps_in_round)  # adaptive: does the round end after this step?

    def add_compute(self, seconds: float) -> None:
        self.clock.add_compute(seconds)

    def set_limits(self, steps: int, max_seconds: float) -> None:
        self._total_steps = steps
        self.clock.max_seconds = max_seconds
        # adaptive: the calibration round, then ceil(steps / H) rounds (the fastest site runs H in each);
        # with sync.adapt, whose H changes, until the site furthest ahead has run the steps
        self.clock.end_after(
            max_rounds=1 + -(-steps // self.H) if self.clock.adaptive and self.adapter is None else 0,
            max_steps=steps if self.clock.adaptive and self.adapter is not None else 0,
        )

    @property
    def done(self) -> bool:
        return self.clock.done

    def step_limit(self, steps: int) -> int:
        if not self.clock.adaptive:
            return steps
        if self.clock.max_steps:  # (sync.adapt) the last round may start just short of the steps, at the longest H
            return steps + round_limit(self.cfg.adapt.H_max if self.cfg.adapt is not None else self.H)
        return self.clock.first + (self.clock.max_rounds - 1) * round_limit(self.H)

    def eval_due(self, step: int, every: int) -> bool:
        if not self.clock.adaptive:
            return super().eval_due(step, every)
        # sites run different steps: evaluate at round boundaries, every every/H rounds
        return self._steps_in_round == 0 and self.rounds % max(1, every // self.H) == 0

    def checkpoint_due(self, step: int, every: int) -> int | None:
        if not self.clock.adaptive:
            return super().checkpoint_due(step, every)
        # sites run different steps: at round boundaries, every every/H rounds (the same rounds on
        # every site); the folder is named by the leading site's step, each rank's file holds its own
        if self._steps_in_round or self.rounds % max(1, every // self.H):
            return None
        return max(self.clock.totals)

    def world_steps(self, step: int) -> int:
        if not self.clock.adaptive:
            return super().world_steps(step)
        return self.clock.world_steps(list(self.comm.groups.topology.workers))

    def pace_log(self) -> list[dict[str, Any]]:
        return self.clock.log

    def adapt_log(self) -> list[dict[str, Any]]:
        return [] if self.adapter is None else self.adapter.log

    def round_steps(self, steps: int) -> list[int]:
        return list(self.clock.steps_run)

    def finish(self) -> None:
        if self._steps_in_round:  # a last, shorter round so every site ends on the global model
            if self._privacy_allows_round():
                self.outer_step()
                # postponed: wait for the coordinator (bounded: the membership raises ElasticTimeout
                # after elastic.wait_timeout_s without a quorum)
                while self._steps_in_round and self.elastic is not None:
                    time.sleep(self.elastic.retry_seconds)
                    self.outer_step()
            else:
                self._roll_back(range(len(self.params)), "privacy budget: the last partial round is not released")
                self._steps_in_round = 0
        if self.elastic is not None:
            self._stay_for_the_others(self._idle_round)

    def _idle_round(self) -> bool:
        """One round of a site that has run its steps (no update of its own); False: postponed."""
        rounds = self.rounds
        self.outer_step()
        return self.rounds != rounds

    def join_round(self) -> None:
        self.outer_step()

    def budget_exhausted(self) -> bool:
        return self._steps_in_round == 0 and not self._privacy_allows_round()

    @torch.no_grad()
    def outer_step(self) -> None:
        """Steps 2-5 of DiLoCo: average pseudo-gradients across sites and apply the outer optimizer."""
        # 2. pseudo-gradient, fp32
        delta = pseudo_gradient(self.global_params, self.local_params())
        self.clock.exchange(self._steps_in_round)  # every site's steps (and, adaptive, its pace)
        # 3. average across sites (every local rank carries 1/G of it over the WAN)
        if self.adapter is not None:
            self.adapter.start_average()
        # the meeting hears this site's rate and rounds owed (a site joining to heal claims neither:
        # its fresh clock has no rate, and no round limit until training starts, RoundClock.end_after)
        if self.elastic is not None and self.clock.adaptive:
            rate, owed = self.clock.seconds_per_step[self.comm.groups.me.site_index], self.clock.max_rounds - self.rounds - 1
            self._part_claim = {"pace": 0 if self.idle else round(1e6 * rate), "rest": 0 if self.idle else max(0, owed)}
        if self.elastic is not None and self.adapter is not None:  # the meeting hears what this site last measured
            self._part_claim = {"link": link_claim(self.adapter.codec, self.adapter.link)}
        try:
            self._average_across_sites(delta, self.reducer, self._steps_in_round, self.rounds)
        except RoundPostponed:
            return
        except RoundFailed as exc:
            if self.adapter is not None:  # nothing to measure: the next round keeps H and codec
                self.adapter.skip_round()
            self._roll_back(range(len(self.params)), str(exc))
            self._steps_in_round = 0
            self.rounds += 1
            self._note("rolled_back", str(exc))
            self._next_round()
            return
        # 4. outer optimizer step with Δ as the gradient
        self._outer(delta)
        # 5. local ← global
        for g, p in zip(self.global_params, self.local_params(), strict=True):
            p.copy_(g)
        steps = list(self.clock.steps_run) if self.clock.adaptive else self._steps_in_round
        if self.adapter is not None and self._adapted(steps):
            # the next round's H and codec, chosen from this round's measured link (sync.adapt)
            self.H = self.clock.H = self.clock.limit = self.adapter.H
            codec = self.adapter.codec
            if codec not in self._reducers:
                self._reducers[codec] = self._make_reducer(codec, [p.shape for p in self.local_params()])
            self.reducer = self._reducers[codec]
        self._steps_in_round = 0
        self.rounds += 1
        self._note("committed", "")
        self._next_round()

    def _outer(self, delta: torch.Tensor) -> None:
        """Step 4: the outer optimizer steps the global parameters with the round's average."""
        outer_step_(self.outer_optimizer, self.global_params, delta)

    def _adapted(self, steps: int | list[int]) -> bool:
        """sync.adapt, after a committed round: measure, agree, choose (elastic mode: from the claims
        of the round's meeting); True when H or the codec changed for the next round."""
        assert self.adapter is not None
        if self.elastic is None:
            return self.adapter.end_round(self.rounds + 1, steps)
        assert isinstance(steps, int)
        return self.adapter.end_elastic(self.rounds + 1, steps, self.elastic.link_claims(), self.elastic.measured)

    def codec_for(self, claim: str) -> Any:
        """Elastic mode with sync.adapt: the encoder of the codec a site's link claim names (a
        healer encodes its first round as its source does, before it has the source's state);
        the configured one for a claim that names none of sync.adapt.codecs."""
        assert self.adapter is not None
        name = claimed_codec(claim)
        if name not in self.adapter.codecs:
            name = self.cfg.codec
        if name not in self._reducers:
            self._reducers[name] = self._make_reducer(name, [p.shape for p in self.local_params()])
        return self._reducers[name].codec

    def _next_round(self) -> None:
        """After a round, committed or rolled back: the next round's limit. Elastic rounds end at
        the step every site agrees on (see :meth:`RoundMembership.next_boundary`), not H steps
        after this site's own boundary; with adaptive pace, on the budget of the fastest site's
        claimed rate."""
        if self.elastic is not None and self.clock.adaptive:
            self.clock.claimed_fastest = self.elastic.fastest_seconds()
        self.clock.next_round(self.rounds)
        if self.elastic is not None and not self.clock.adaptive:
            self.clock.limit = max(1, self.elastic.next_boundary(self.local_steps, self.H, self._total_steps) - self.local_steps)

    def state_dict(self) -> dict[str, Any]:
        return {"reducer": self.reducer_out(self.reducer)}

    def checkpoint_state(self) -> dict[str, Any]:
        return {
            **super().checkpoint_state(),
            "outer": self.optim_out(self.outer_optimizer.state_dict()),
            "in_round": self._steps_in_round,
            # sync.adapt: the round's H and codec as chosen (the next choice is measured again)
            "adapt": None if self.adapter is None else self.adapter.state_dict(),
            "clock": self.clock.state_dict(),  # adaptive pace: the measured rates behind the next budget
        }

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        super().load_checkpoint_state(state)
        self.outer_optimizer.load_state_dict(self.optim_in(state["outer"]))
        self._steps_in_round = state["in_round"]
        if "clock" in state:  # (absent from checkpoints before the clock was kept)
            self.clock.load_state_dict(state["clock"])
        if self.adapter is not None and state.get("adapt") is not None:
            self.adapter.load_state_dict(state["adapt"])
            self.H = self.clock.H = self.clock.limit = self.adapter.H
            codec = self.adapter.codec
            if codec not in self._reducers:
                self._reducers[codec] = self._make_reducer(codec, [p.shape for p in self.local_params()])
            self.reducer = self._reducers[codec]
        self.reducer.load_state_dict(self.reducer_in(state["reducer"]))
