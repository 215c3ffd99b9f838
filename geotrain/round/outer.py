"""What a round does to the model: the pseudo-gradient, the outer step and the merge back into
the local model (DiLoCo, Douillard et al. 2023, arXiv:2311.08105, Algorithm 1 steps 2-5).

:class:`Globals` holds the models rounds step, fp32 whatever the model's dtype and laid out like
the local parameters (under FSDP: this rank's shards): θ_world, and with two tiers θ_region. A
round of part (fragment f, tier) takes Δ = θ_above − θ_below over f's parameters (region:
θ_region − θ_local; world: θ_world − θ_region with tiers, θ_world − θ_local without), and once
the sites' average of Δ is in, the part's optimizer steps θ_above with it as the gradient.
``sync.tier_outer`` says which tier's step is the outer optimizer (SGD with Nesterov momentum)
and which is plain averaging (SGD, lr 1). The local fragment then moves to the new θ_above:
copied (DiLoCo) or mixed, θ_local ← α·θ_local + (1 − α)·θ_above (Streaming DiLoCo).

:class:`DelayedNesterov` is the outer step of rounds that hold only some sites' updates (the
delayed Nesterov of Async Local-SGD, Liu et al. 2024, arXiv:2401.09135).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from geotrain.config import SyncConfig
from geotrain.round.parts import REGION, WORLD
from geotrain.sync.base import views_like


def pseudo_gradient(above: Sequence[torch.Tensor], below: Sequence[torch.Tensor]) -> torch.Tensor:
    """Δ = θ_above − θ_below, flat fp32."""
    return torch.cat([(g - p.to(torch.float32)).reshape(-1) for g, p in zip(above, below, strict=True)])


def outer_step_(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], delta: torch.Tensor) -> None:
    """One optimizer step on ``params`` with the flat ``delta`` as their gradient."""
    for g, v in zip(params, views_like(delta, params), strict=True):
        g.grad = v
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def averaging(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The plain-averaging step: θ ← θ − Δ̄ is the (weighted) mean of the models."""
    return torch.optim.SGD(params, lr=1.0)


def outer_sgd(cfg: SyncConfig) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    lr, momentum, nesterov = cfg.outer_sgd
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=nesterov)


def weighted_mean(deltas: Sequence[torch.Tensor], weights: Sequence[float], total: float) -> torch.Tensor:
    """Σ w·Δ / ``total`` in order, with a synchronous round's arithmetic: equal weights that add
    up to ``total`` sum then divide, else scale then sum. ``total`` is a whole world round's
    undiscounted tokens, so a stale update's discount shrinks its contribution outright."""
    if len(set(weights)) == 1 and total == sum(weights):
        out = deltas[0].clone()
        for d in deltas[1:]:
            out.add_(d)
        return out.div_(len(deltas))
    out = deltas[0].mul(weights[0] / total)
    for d, w in zip(deltas[1:], weights[1:], strict=True):
        out.add_(d.mul(w / total))
    return out


class DelayedNesterov:
    """DiLoCo's outer SGD with its momentum delayed until a world round's worth of updates has
    been merged. A merge's g (its updates' weighted sum over a whole world round's tokens) is
    applied at once (``lr·g``); once ``sites`` updates have been merged since the last time, the
    momentum buffer takes their sum and its part (``lr·β·m``) is applied too. A merge of every
    site with nothing pending is exactly one synchronous outer step: the torch optimizer itself,
    whose momentum buffer both paths share."""

    def __init__(self, theta: list[torch.Tensor], optimizer: torch.optim.Optimizer, cfg: SyncConfig, sites: int) -> None:
        self.theta, self.optimizer, self.sites = theta, optimizer, sites
        self.lr, self.beta, self.nesterov = cfg.outer_sgd
        self.pending = [torch.zeros_like(t) for t in theta]
        self.pending_updates = 0

    @torch.no_grad()
    def step(self, g: torch.Tensor, updates: int) -> None:
        if not self.pending_updates and updates >= self.sites:  # a whole synchronous round
            outer_step_(self.optimizer, self.theta, g)
            return
        self.pending_updates += updates
        for t, p, v in zip(self.theta, self.pending, views_like(g, self.theta), strict=True):
            t.add_(v, alpha=-self.lr)
            p.add_(v)
        if self.pending_updates < self.sites or not self.beta:
            return
        for t, p in zip(self.theta, self.pending, strict=True):
            state = self.optimizer.state[t]
            buf = state.get("momentum_buffer")
            old = torch.zeros_like(p) if buf is None else buf.clone()
            new = p.clone() if buf is None else buf.mul_(self.beta).add_(p)
            state["momentum_buffer"] = new
            t.add_(new if self.nesterov else old, alpha=-self.lr * self.beta)  # Nesterov: g + β·m_new; heavy ball: g + β·m_old
            p.zero_()
        self.pending_updates = 0

    def state_dict(self) -> dict[str, Any]:
        return {"pending": [p.clone() for p in self.pending], "pending_updates": self.pending_updates}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        for p, saved in zip(self.pending, state["pending"], strict=True):
            p.copy_(saved)
        self.pending_updates = int(state["pending_updates"])


class Globals:
    """The models rounds step, and one step per fragment and tier (see the module docstring).

    Args:
        local: this rank's parameters (whole tensors, or its FSDP shards).
        tiers: two tiers (a region model beside the world's).
        delayed: rounds of some of the sites (elastic quorum rounds): the world step is
            :class:`DelayedNesterov` over that many sites (set later by the membership).
        world_step: None: the site holds no outer optimizer (a hub steps the model: quorum rounds).
    """

    def __init__(self, local: Sequence[torch.Tensor], cfg: SyncConfig, tiers: bool, delayed: bool = False) -> None:
        self.cfg, self.tiers, self.delayed_rounds = cfg, tiers, delayed
        self.world = [p.detach().clone().to(torch.float32) for p in local]
        self.region = [g.clone() for g in self.world] if tiers else []
        self.steps: dict[tuple[str, int], torch.optim.Optimizer] = {}
        self.delayed: dict[int, DelayedNesterov] = {}
        self.fragments: list[list[int]] = []

    def _maker(self, tier: str) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
        outer = self.cfg.tier_outer
        if not self.tiers or outer in (tier, "both"):
            return outer_sgd(self.cfg)
        return averaging

    def build(self, fragments: list[list[int]]) -> None:
        """A step per fragment and tier, each parameter's optimizer state carried over from the old ones."""
        carried = {id(p): state for o in self.steps.values() for p, state in o.state.items()}
        self.fragments = fragments
        self.steps = {}
        for tier in (REGION, WORLD) if self.tiers else (WORLD,):
            for f in range(len(fragments)):
                params = self.params(tier, f)
                o = self._maker(tier)(params)
                for p in params:
                    if id(p) in carried:
                        o.state[p] = carried[id(p)]
                self.steps[(tier, f)] = o
        if self.delayed_rounds:
            sites = next(iter(self.delayed.values())).sites if self.delayed else 0
            self.delayed = {
                f: DelayedNesterov(self.params(WORLD, f), self.steps[(WORLD, f)], self.cfg, sites) for f in range(len(fragments))
            }

    def params(self, tier: str, f: int) -> list[torch.Tensor]:
        """Fragment ``f``'s tensors of ``tier``'s model."""
        model = self.region if tier == REGION else self.world
        return [model[i] for i in self.fragments[f]]

    def below(self, tier: str, f: int, local: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """What a round of ``tier`` takes its Δ against: the local fragment, or (the world tier of
        two) the region's model."""
        if tier == WORLD and self.tiers:
            return self.params(REGION, f)
        return [local[i] for i in self.fragments[f]]

    def delta(self, tier: str, f: int, local: Sequence[torch.Tensor]) -> torch.Tensor:
        return pseudo_gradient(self.params(tier, f), self.below(tier, f, local))

    @torch.no_grad()
    def step(self, tier: str, f: int, average: torch.Tensor, contributors: int = 0) -> None:
        """The part's step with the sites' average of Δ; with two tiers a world step sets the
        region's model to the world's."""
        if tier == WORLD and f in self.delayed:
            self.delayed[f].step(average, contributors)
        else:
            outer_step_(self.steps[(tier, f)], self.params(tier, f), average)
        if tier == WORLD and self.tiers:
            self.settle_regions(f)

    @torch.no_grad()
    def settle_regions(self, f: int) -> None:
        """θ_region ← θ_world over fragment ``f``."""
        for r, g in zip(self.params(REGION, f), self.params(WORLD, f), strict=True):
            r.copy_(g)

    @torch.no_grad()
    def adopt(self, f: int, values: Sequence[torch.Tensor]) -> None:
        """The world model of fragment ``f`` as a hub stepped it."""
        for g, v in zip(self.params(WORLD, f), values, strict=True):
            g.copy_(v)

    def target(self, tier: str) -> list[torch.Tensor]:
        """The model local parameters move to after a round of ``tier``."""
        return self.region if tier == REGION else self.world

    @torch.no_grad()
    def merge(self, tier: str, f: int, local: Sequence[torch.Tensor], alpha: float) -> None:
        """θ_local ← θ_above over fragment ``f``: copied (α = 0), else α-mixed."""
        model = self.target(tier)
        for i in self.fragments[f]:
            p, g = local[i], model[i]
            if alpha:
                p.mul_(alpha).add_(g.to(p.dtype), alpha=1 - alpha)
            else:
                p.copy_(g)

    def state_dict(self, out: Callable[[list[torch.Tensor]], Any], optim_out: Callable[..., Any]) -> dict[str, Any]:
        return {
            "world": out(self.world),
            "region": out(self.region) if self.tiers else None,
            "steps": {f"{t}/{f}": optim_out(o.state_dict(), self.fragments[f]) for (t, f), o in self.steps.items()},
            "delayed": {f: d.state_dict() for f, d in self.delayed.items()},
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any], into: Callable[[Any], Any], optim_in: Callable[..., Any]) -> None:
        for g, saved in zip(self.world, into(state["world"]), strict=True):
            g.copy_(saved)
        if self.tiers and state["region"] is not None:
            for r, saved in zip(self.region, into(state["region"]), strict=True):
                r.copy_(saved)
        for key, saved in state["steps"].items():
            t, f = key.split("/")
            if (t, int(f)) in self.steps:
                self.steps[(t, int(f))].load_state_dict(optim_in(saved))
        for f, saved in state["delayed"].items():
            if int(f) in self.delayed:
                self.delayed[int(f)].load_state_dict(saved)
