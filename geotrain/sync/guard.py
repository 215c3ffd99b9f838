"""Guarded updates: a site's pseudo-gradient that is non-finite, or whose norm is far outside the
running distribution, is left out of the round's average instead of poisoning the global model.

Before each plain aggregation the sites exchange one number each — the L2 norm of their
pseudo-gradient (a tiny all-reduce across sites) — so every rank applies the same rule to the
same numbers and reaches the same decision without a coordinator:

* excluded if the norm is NaN or infinite;
* excluded if, once ``warmup`` accepted norms are known for this fragment, it exceeds
  ``norm_factor`` × the median of the last ``window`` accepted ones.

With ``sync.adapt`` H changes between rounds and a pseudo-gradient's norm grows with the steps
it spans, so there the norms are per inner step (the norm divided by the round's steps).

An excluded site contributes zeros and the average divides by the sites included; if none is
left the round fails and is rolled back. This protects against faulty sites (a bug, bad
hardware, a diverging replica), not against a malicious one that lies about its norm. With
secure aggregation no norm is revealed: a site checks only its own update for non-finite values
and withdraws it (the protocol then handles it like a dropout).

With multi-tier sync (``sync.region_every``) the rule judges the region rounds, where the
sites' own updates are averaged: the norms are exchanged inside the region, over its fast links,
and each region keeps its own history. The world round averages the regions' models, which only
ever took updates the guard accepted.

In elastic mode the members of a round change from round to round, so there is no fixed site
order to exchange norms in: each site applies the same rule to its own update against the
running median of its own accepted norms (:meth:`UpdateGuard.own_update_ok`) and, if it fails,
withdraws it (it contributes nothing to the round and takes the others' average).
"""

from __future__ import annotations

import math
import statistics
import threading
from collections.abc import Sequence
from typing import Any

import torch

from geotrain.comm.collectives import Collectives
from geotrain.config import GuardConfig


class UpdateGuard:
    """The per-run state of the rule above (identical on every rank)."""

    def __init__(self, cfg: GuardConfig, comm: Collectives) -> None:
        self.cfg = cfg
        self.comm = comm
        topo = comm.groups.topology
        self.site_names = list(topo.site_names)
        self.history: dict[int, list[float]] = {}
        self.rejected = dict.fromkeys(self.site_names, 0)
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self.sharded = False  # set by the algorithm: a site's update is spread over its ranks (FSDP)

    def site_norm(self, delta: torch.Tensor) -> float:
        """The L2 norm of this site's update (sharded: each rank holds a part, the squares are summed in the site)."""
        if not self.sharded:
            return float(delta.to(torch.float64).norm())
        sq = delta.to(torch.float64).square().sum().reshape(1)
        self.comm.sum_in_site(sq)
        return float(sq.sqrt())

    def _why_rejected(self, hist: list[float], v: float, whose: str = "") -> str | None:
        """The rule above for one norm ``v`` against the accepted ``hist``: why it is excluded, or None."""
        ref = statistics.median(hist[-self.cfg.window :]) if len(hist) >= self.cfg.warmup else None
        if not math.isfinite(v):
            return f"non-finite norm {v}"
        if ref is not None and v > self.cfg.norm_factor * ref:
            return f"norm {v:.4g} > {self.cfg.norm_factor:g} x median {ref:.4g}{whose}"
        return None

    def include(
        self, delta: torch.Tensor, key: int, round_id: int, per: int = 1, region: Sequence[int] | None = None
    ) -> list[bool]:
        """Exchange norms (each divided by ``per``, the round's steps when H varies); which sites'
        ``delta`` go into this round's average. ``region``: multi-tier sync's region round, over
        these sites (this rank's region) only; the others are not judged and come back False."""
        norms = self.comm.site_values(self.site_norm(delta) / per, region=region is not None)
        with self._lock:
            hist = self.history.setdefault(key, [])
            ok = []
            for i, v in enumerate(norms):
                if region is not None and i not in region:
                    ok.append(False)
                    continue
                why = self._why_rejected(hist, v)
                ok.append(why is None)
                if why is None:
                    continue
                self.rejected[self.site_names[i]] += 1
                self.events.append({"round": round_id, "fragment": key, "site": self.site_names[i], "why": why})
            hist.extend(v for v, good in zip(norms, ok, strict=True) if good)  # (a region's own sites only)
            del hist[: -self.cfg.window]
        return ok

    def would_include(self, delta: torch.Tensor, key: int) -> bool:
        """Whether :meth:`include` will keep this site's ``delta`` in fragment ``key``'s next
        round, judged before the exchange (eager Streaming DiLoCo applies its own share at once):
        the same rule on the same norm against the history every site shares, so the same
        decision, provided no exchange of ``key`` is in flight. Changes nothing."""
        v = self.site_norm(delta)  # (what include() exchanges; eager streaming is never sharded)
        with self._lock:
            return self._why_rejected(self.history.get(key, []), v) is None

    def own_update_ok(self, delta: torch.Tensor, key: int, round_id: int, site: str) -> bool:
        """Elastic mode: the rule above applied by ``site`` to its own ``delta`` only (no exchange)."""
        v = float(delta.to(torch.float64).norm())
        with self._lock:
            hist = self.history.setdefault(key, [])
            why = self._why_rejected(hist, v, " of its own")
            if why is None:
                hist.append(v)
                del hist[: -self.cfg.window]
                return True
            self.rejected[site] = self.rejected.get(site, 0) + 1
            self.events.append({"round": round_id, "fragment": key, "site": site, "why": why})
            return False

    def state_dict(self) -> dict[str, Any]:
        return {"history": {k: list(v) for k, v in self.history.items()}, "rejected": dict(self.rejected)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = {int(k): list(v) for k, v in state["history"].items()}
        self.rejected = dict(state["rejected"])
