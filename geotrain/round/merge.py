"""The hub's arithmetic (:mod:`geotrain.round.syncer`): each update's weight in a merge (tokens
discounted by staleness), dynamic local steps, and what a delivery holds. The weighted mean and
the delayed Nesterov step are the outer step's (:mod:`geotrain.round.outer`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from geotrain.config import SyncConfig
from geotrain.round.star import LinkReport


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
