"""The syncer's arithmetic (:mod:`geotrain.sync.syncer`): the weighted mean of a merge's updates
and DiLoCo's outer step with its momentum delayed over a world round."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from geotrain.config import SyncConfig
from geotrain.sync.base import views_like
from geotrain.sync.outer import outer_step_
from geotrain.sync.quorum_adapt import LinkReport


def weighted_mean(deltas: Sequence[torch.Tensor], weights: Sequence[float], total: float) -> torch.Tensor:
    """Σ w·Δ / ``total`` in order, with the synchronous round's arithmetic
    (:meth:`OuterSync._weighted_average`): equal weights that add up to ``total`` sum then divide,
    else scale then sum. ``total`` is a whole world round's undiscounted tokens, so a stale
    update's discount shrinks its contribution outright, even when it is alone in its merge."""
    if len(set(weights)) == 1 and total == sum(weights):
        out = deltas[0].clone()
        for d in deltas[1:]:
            out.add_(d)
        return out.div_(len(deltas))
    out = deltas[0].mul(weights[0] / total)
    for d, w in zip(deltas[1:], weights[1:], strict=True):
        out.add_(d.mul(w / total))
    return out


def averaging(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The plain-averaging step: θ ← θ − Δ̄ is the (weighted) mean of the models."""
    return torch.optim.SGD(params, lr=1.0)


class DelayedNesterov:
    """DiLoCo's outer SGD with its momentum delayed until a world round's worth of updates has
    been merged (the delayed Nesterov of Async Local-SGD, Liu et al. 2024, arXiv:2401.09135).

    A merge's g is its updates' weighted sum over a whole world round's tokens (every site's
    workers × its steps in the merge, or its round's H), so one site's update counts for its
    share of the world, as in a synchronous average, and a fast site that delivers twice as often moves θ
    twice as often. g is applied at once (``lr·g``); once ``sites`` updates have been merged
    since the last time, the momentum buffer takes their sum and its part (``lr·β·m``) is applied
    too. Over a world round θ moves as one synchronous outer step on the round's mean. A merge
    that holds every site's update with nothing pending is exactly that step: the torch
    optimizer itself (so a quorum of every site is lock-step DiLoCo: bit for bit with two sites,
    to rounding with more, whose ring adds in another order); the momentum buffer is the
    optimizer's own in both paths.
    """

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


def first_round_steps(cfg: SyncConfig) -> int:
    """A site's first round: H, or with dynamic local updates max(1, H/10), to measure its pace."""
    assert cfg.quorum is not None
    return max(1, cfg.H // 10) if cfg.dynamic_quorum_steps else cfg.H


def dynamic_steps(rates: Sequence[float], current: Sequence[int], H: int) -> list[int]:
    """Dynamic local updates (Async Local-SGD, Liu et al. 2024): each site whose rate (steps per
    second) is known runs H × its rate / the fastest rate, rounded, at least 1; the others keep
    ``current``."""
    fastest = max(rates)
    return [max(1, min(H, round(H * r / fastest))) if r > 0 else c for r, c in zip(rates, current, strict=True)]


def site_mask(sites: Iterable[int]) -> float:
    """A set of site indices as one float64 field (exact for up to 53 sites)."""
    return float(sum(1 << s for s in set(sites)))


def mask_sites(mask: float, n: int) -> list[int]:
    """The site indices in a :func:`site_mask` field."""
    return [s for s in range(n) if int(mask) >> s & 1]


@dataclass
class Update:
    """One site's delivery to the syncer."""

    site: int
    base: int  # version of the global model its round started from
    steps: int
    workers: int
    delta: torch.Tensor  # flat fp32 pseudo-gradient (empty: a final delivery of no steps)
    final: bool = False
    compute_s: float = 0.0  # seconds of compute (pacing included, network waits not) the steps took
    checkpoint: bool = False  # the round before a checkpoint: answered once every live site has delivered
    link: LinkReport | None = None  # sync.adapt: what the site measured in its last round
    ping: bool = False  # sync.adapt: an empty message, answered at once (the site times it)
    fragment: int = 0  # Streaming DiLoCo: the fragment whose pseudo-gradient this is (versions are per fragment)


def merge_weights(updates: Sequence[Update], version: int, weight_by_tokens: bool, power: float) -> list[float]:
    """Each update's weight in the merge that makes version ``version + 1``: tokens (or 1) times
    (1 + staleness)^-power, staleness = ``version - base``."""
    return [(float(u.workers * u.steps) if weight_by_tokens else 1.0) * (1.0 + (version - u.base)) ** -power for u in updates]
