"""Adaptation to the measured network: after every DiLoCo round, measure the wide-area link and
choose the next round's H and codec to hold a target compute utilisation (``sync.adapt``).

The model is the planner's (:mod:`geotrain.plan.strategies`, one formula in the project): a
round of H inner steps of ``T`` seconds and one blocking all-reduce across ``n`` sites of
``V = 2 (n-1)/n · P · bits`` per site, ``t = V / B + (n-1) · rtt``, gives utilisation
``H T / (H T + t)``. Each round:

1. **Measure** (every rank, locally): the bytes this rank sent across sites in the round's
   average and how long the average took; the time of two one-hop control exchanges done back to
   back right after it (a ping: a site cannot send its second message before the others' first
   ones reached it, so from its first send to the others' second messages reaching it is at least
   one round trip to each, and exactly one for the site that sent last, whatever the skew
   between sites); the round's wall time and the part of it spent waiting on the wide-area
   network.
2. **Agree** (one one-hop control exchange, :meth:`Collectives.gather_sites`): every rank gets
   every site's measurements, per site (its ranks' bytes summed, times averaged). From the same
   numbers every rank computes the same link: round-trip time = the shortest ping, the
   all-reduce time = the shortest (a site that arrived late did not wait for the
   others, so its time is the transfer alone), bandwidth =
   :func:`~geotrain.plan.strategies.achieved_bps` (the most bytes a site sent over that time
   less the model's latency), step time ``T`` = the slowest site's non-network seconds per step.
3. **Choose** with :func:`~geotrain.plan.strategies.choose_round`: the least compression among
   ``sync.adapt.codecs`` that reaches ``sync.adapt.target`` with H <= ``H_max``, then the smallest
   such H (>= ``H_min``); when none reaches it, the most compressed codec at ``H_max``.
4. **Log** every round's measurements, choice, predicted utilisation and reason (the summary's
   ``adapt`` list), marking changes.

A change of link is followed in the round after the first average that crossed the changed
link. Switching codecs keeps no state to carry: adaptation uses fixed-width codecs without error
feedback (each codec gets its own reducer, made when first chosen).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from geotrain.comm.collectives import Collectives
from geotrain.config import CODEC_BITS, AdaptConfig
from geotrain.plan.strategies import achieved_bps, choose_round
from geotrain.sync.reducer import SiteReducer


class NetworkAdapter:
    """Measures each round's cross-site exchange and chooses the next round's H and codec.

    Args:
        cfg: the ``sync.adapt`` section.
        comm: the collectives (its stats count bytes and waits; control exchanges across sites).
        params: values in one pseudo-gradient (the formula's P).
        H: the first round's H.
        codec: the first round's codec, whose reducer is ``reducer``.
        reducer: the first round's reducer.
        make_reducer: builds the reducer of another codec.
    """

    def __init__(
        self,
        cfg: AdaptConfig,
        comm: Collectives,
        params: int,
        H: int,
        codec: str,
        reducer: SiteReducer,
        make_reducer: Callable[[str], SiteReducer],
    ) -> None:
        self.cfg = cfg
        self.comm = comm
        self.params = params
        self.H = H
        self.codec = codec
        self.reducers = {codec: reducer}
        self._make_reducer = make_reducer
        self.log: list[dict[str, Any]] = []
        self._t0 = time.perf_counter()
        self._round_start = self._t0
        self._wait0 = comm.stats.wan_wait_seconds
        self._sent0 = 0
        self._avg_t0 = 0.0

    @property
    def reducer(self) -> SiteReducer:
        """The reducer of this round's codec."""
        return self.reducers[self.codec]

    def start_average(self) -> None:
        """Just before the round's cross-site average."""
        self._sent0, self._avg_t0 = self.comm.stats.inter_bytes, time.perf_counter()

    def _clock(self) -> float:
        """Seconds into the run on the clock of scheduled link changes (else since this adapter began)."""
        wan = self.comm.wan
        if wan is not None and wan.links is not None:
            return time.monotonic() - wan.links.t0
        return time.perf_counter() - self._t0

    def skip_round(self) -> None:
        """A round that was rolled back: not measured; the next round's clock starts now."""
        self._round_start, self._wait0 = time.perf_counter(), self.comm.stats.wan_wait_seconds

    def end_round(self, round_id: int, steps: int) -> bool:
        """Just after the round's average was applied (every rank of every site calls it): measure,
        agree, choose; True when H or the codec changed for the next round."""
        comm, g = self.comm, self.comm.groups
        topo = g.topology
        avg_s = time.perf_counter() - self._avg_t0
        sent = comm.stats.inter_bytes - self._sent0
        now = time.perf_counter()
        round_s, waited = now - self._round_start, comm.stats.wan_wait_seconds - self._wait0
        self._round_start, self._wait0 = now, comm.stats.wan_wait_seconds  # the exchanges below count in the next round
        ping, t = torch.zeros(1, dtype=torch.float64), time.perf_counter()
        comm.gather_sites(ping)  # two one-hop exchanges, back to back: the round trip of the site that
        comm.gather_sites(ping)  # sent last in the first (see the module docstring)
        ping_s = time.perf_counter() - t
        mine = torch.tensor([float(sent), avg_s, ping_s, round_s, waited], dtype=torch.float64)
        if len(g.intra_ranks) > 1:  # per site: bytes summed over its ranks, times averaged
            comm.sum_in_site(mine)
            mine[1:].div_(len(g.intra_ranks))
        rows = comm.gather_sites(mine)
        sent_s, avg, pings, wall, wait = (rows[:, i].tolist() for i in range(5))
        n = topo.num_sites
        rtt = min(pings)
        bps = achieved_bps(max(sent_s), min(avg), n, rtt)
        step_s = [(w - x) / max(1, steps) for w, x in zip(wall, wait, strict=True)]
        choice = choose_round(
            bps,
            self.params,
            max(step_s),
            n,
            rtt,
            self.cfg.H_min,
            self.cfg.H_max,
            {c: float(CODEC_BITS[c]) for c in self.cfg.codecs},
            self.cfg.target,
        )
        changed = (choice["H"], choice["codec"]) != (self.H, self.codec)
        self.log.append(
            {
                "round": round_id,
                "t_s": round(self._clock(), 3),
                "H": self.H,
                "codec": self.codec,
                "steps": steps,
                "bytes": [int(b) for b in sent_s],
                # exact: the choice can be recomputed from these (tests do)
                "allreduce_s": avg,
                "ping_s": pings,
                "step_s": step_s,
                "utilization": [round((w - x) / w, 4) if w > 0 else 0.0 for w, x in zip(wall, wait, strict=True)],
                "params": self.params,
                "link_bps": bps,
                "rtt_s": rtt,
                "next": choice,
                "changed": changed,
                "why": _reason(choice, bps, rtt, max(step_s), self.cfg),
            }
        )
        self.H, self.codec = choice["H"], choice["codec"]
        if self.codec not in self.reducers:
            self.reducers[self.codec] = self._make_reducer(self.codec)
        return changed


def _reason(choice: dict[str, Any], bps: float, rtt: float, step_s: float, cfg: AdaptConfig) -> str:
    seen = f"link {bps / 1e6:.2f} Mbit/s, rtt {rtt * 1e3:.0f} ms, {step_s * 1e3:.0f} ms/step"
    if choice["meets_target"]:
        return (
            f"{seen}: {choice['codec']} is the least compression that reaches {cfg.target:.0%} within H<={cfg.H_max}; "
            f"the smallest H that does is {choice['H']} ({choice['predicted_utilization']:.1%})"
        )
    return (
        f"{seen}: no codec reaches {cfg.target:.0%} within H<={cfg.H_max}; the most utilisation is "
        f"{choice['codec']} at H={choice['H']} ({choice['predicted_utilization']:.1%})"
    )
