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
feedback (each codec gets its own reducer, made when first chosen, with its kernels loaded then:
the next round's timing holds no kernel load).

**Streaming DiLoCo** (:class:`~geotrain.round.schedule.StreamingDiLoCo` calls :meth:`decide`
in its exchange thread once per cycle of H steps) differs in five ways: a round has several
exchanges, and the link counts those that carried at least half as much as the largest, each
paying the latency term; the rtt is the shortest ping of the last ``PING_WINDOW`` rounds (the
ping runs beside compute); the formula is also inverted on the slowest site's measured wait
(:func:`~geotrain.plan.strategies.streaming_effective_bps`) and the choice takes the slower of
the two bandwidths; the fragment count is chosen too (the fewest that reach the target after
codec and H); and the current settings are held while they are predicted between the target and
the target + ``sync.adapt.hold`` (a change of H or of the fragment count merges early and
rebuilds the fragments, so a change of a few steps costs more than it gains).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from geotrain.comm.collectives import Collectives
from geotrain.config import CODEC_BITS, STREAMING_HOLD, AdaptConfig
from geotrain.plan.strategies import achieved_bps, choose_round, streaming_effective_bps, utilization

PING_WINDOW = 4  # Streaming DiLoCo: the rtt is the shortest ping of the last 4 cycles


class NetworkAdapter:
    """Measures the cross-site exchanges of each round and chooses the next round's H, codec and
    (Streaming DiLoCo) fragment count.

    Args:
        cfg: the ``sync.adapt`` section.
        comm: the collectives (its stats count bytes and waits; control exchanges across sites).
        params: values in one pseudo-gradient (the formula's P).
        H: the first round's H.
        codec: the first round's codec.
        fragments: Streaming DiLoCo: (the first fragment count, the counts to choose from, tau);
            None for DiLoCo.
    """

    def __init__(
        self,
        cfg: AdaptConfig,
        comm: Collectives,
        params: int,
        H: int,
        codec: str,
        fragments: tuple[int, list[int], int] | None = None,
    ) -> None:
        self.cfg = cfg
        self.comm = comm
        # the codecs it may choose (secure aggregation: none only, a masked value being incompressible)
        self.codecs: list[str] = list(cfg.codecs)
        self.params = params
        self.H = H
        self.codec = codec
        self.F, self.counts, self.tau = fragments if fragments is not None else (1, [], 0)
        self.ping_window = PING_WINDOW if fragments is not None else 1  # rounds whose shortest ping is the rtt
        # Streaming: hold the settings while they are predicted a little above the target (a change
        # of H or of the fragment count merges early and rebuilds the fragments)
        self.hold = (STREAMING_HOLD if cfg.hold is None else cfg.hold) if fragments is not None else 0.0
        self._pings: list[float] = []
        self.link = ""  # elastic mode: this site's measurements of its last committed round, for its next claim
        self.log: list[dict[str, Any]] = []
        self._t0 = time.perf_counter()
        self._round_start = self._t0
        self._wait0 = comm.stats.wan_wait_seconds
        self._sent0 = 0
        self._avg_t0 = 0.0
        # sync.pace=adaptive: each site runs its own steps, and a round lasts H steps of the fastest site
        self.paced = False
        # tiers: the link measured is the one between regions (the world tier's), and the formula's
        # ring is over the regions (a region's sites hold one update, which crosses once)
        self.across_regions = False
        self.regions = 0

    def _sent(self) -> int:
        """Bytes this rank has sent over the link being measured."""
        st = self.comm.stats
        return st.inter_region_bytes if self.across_regions else st.inter_bytes

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the settings in force and the pings the rtt is taken from."""
        return {"H": self.H, "codec": self.codec, "F": self.F, "pings": list(self._pings)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.H, self.codec, self.F, self._pings = int(state["H"]), str(state["codec"]), int(state["F"]), list(state["pings"])

    def start_average(self) -> None:
        """Just before the round's cross-site average."""
        self._sent0, self._avg_t0 = self._sent(), time.perf_counter()

    def _clock(self) -> float:
        """Seconds into the run on the clock of scheduled link changes (else since this adapter began)."""
        wan = self.comm.wan
        if wan is not None and wan.links is not None:
            return time.monotonic() - wan.links.t0
        return time.perf_counter() - self._t0

    def skip_round(self) -> None:
        """A round that was rolled back: not measured; the next round's clock starts now."""
        self.lap()

    def lap(self) -> tuple[float, float]:
        """The training thread's wall seconds and seconds waited on the wide-area network since the
        last lap (or the start); the next round's clock starts now."""
        now, wait = time.perf_counter(), self.comm.stats.wan_wait_seconds
        out = (now - self._round_start, wait - self._wait0)
        self._round_start, self._wait0 = now, wait
        return out

    def end_round(self, round_id: int, steps: int | list[int]) -> bool:
        """DiLoCo, just after the round's average was applied (every rank of every site calls it):
        measure, agree, choose; True when H or the codec changed for the next round. ``steps``:
        the round's inner steps, or (adaptive pace) every site's."""
        avg_s = time.perf_counter() - self._avg_t0
        sent = self._sent() - self._sent0
        wall, waited = self.lap()  # the exchanges below count in the next round
        return self.decide(round_id, steps, [(sent, avg_s)], wall, waited)

    def decide(
        self, round_id: int, steps: int | list[int], exchanges: list[tuple[int, float]], wall: float, waited: float
    ) -> bool:
        """Agree on the link from every site's measurements of a round and choose the next round's
        settings (every rank of every site calls it with the same number of ``exchanges``: the
        bytes this rank sent across sites in each and its seconds); True when one changed.

        Streaming DiLoCo calls it in its exchange thread (its control exchanges use lane 0's groups,
        as the fragments' averages do), ``wall`` and ``waited`` being the training thread's."""
        comm, g = self.comm, self.comm.groups
        topo = g.topology
        ping, t = torch.zeros(1, dtype=torch.float64), time.perf_counter()
        comm.gather_sites(ping)  # two one-hop exchanges, back to back: the round trip of the site that
        comm.gather_sites(ping)  # sent last in the first (see the module docstring)
        ping_s = time.perf_counter() - t
        m = len(exchanges)
        mine = torch.tensor(
            [ping_s, wall, waited, *(float(b) for b, _ in exchanges), *(s for _, s in exchanges)], dtype=torch.float64
        )
        if len(g.intra_ranks) > 1:  # per site: bytes summed over its ranks, times averaged
            comm.sum_in_site(mine)
            mine[:3].div_(len(g.intra_ranks))
            mine[3 + m :].div_(len(g.intra_ranks))
        rows = comm.gather_sites(mine)
        per_site = steps if isinstance(steps, list) else [steps] * topo.num_sites
        return self._choose(round_id, per_site, rows, m, topo.num_sites)

    def end_elastic(self, round_id: int, steps: int, claims: list[str], measured: tuple[float, float]) -> bool:
        """Elastic DiLoCo, just after a round committed (every rank of the site calls it): measure
        this round for the next round's claim (:attr:`link`), and choose from what the admitted
        sites claimed in this round's meeting (their measurements of their last committed round:
        the choice follows the link one round later than in lock-step rounds). Each site is its
        own world, so the claims, authenticated in the meeting, stand in for the control exchange;
        every admitted site reads the same ones and makes the same choice. ``measured``: this
        rank's seconds after the meeting and its ping (:attr:`RoundMembership.measured`; zeros for
        a round that healed a site, whose healing traffic is no measure of the link)."""
        sent = self._sent() - self._sent0
        wall, waited = self.lap()
        after, ping = measured
        mine = torch.tensor([ping, float(ping > 0), after - ping, wall, waited, float(sent)], dtype=torch.float64)
        g = self.comm.groups
        if len(g.intra_ranks) > 1:  # per site: bytes summed over its ranks, times averaged (the ping over its carriers)
            self.comm.sum_in_site(mine)
            mine[2:5].div_(len(g.intra_ranks))
        ping_s = float(mine[0] / max(1.0, float(mine[1])))
        values = (ping_s, float(mine[3]), float(mine[4]), steps, float(mine[5]), float(mine[2]))
        self.link = ",".join(f"{v:.6g}" for v in values) if after > 0 else ""  # (a round that healed: nothing to claim)
        rows = [r for r in (_parse_link(c) for c in claims) if r is not None]
        if len(rows) < 2 or not any(r[4] for r in rows):  # nothing crossed sites in what was claimed
            return False
        table = torch.tensor([[r[0], r[1], r[2], r[4], r[5]] for r in rows], dtype=torch.float64)
        return self._choose(round_id, [int(r[3]) for r in rows], table, 1, len(rows))

    def _choose(self, round_id: int, per_site: list[int], rows: torch.Tensor, m: int, n: int) -> bool:
        """From every site's row (ping, wall, waited, then the bytes and the seconds of each of the
        ``m`` exchanges) over a ring of ``n`` sites: the link, the next settings, the log entry."""
        pings, walls, waits = (rows[:, i].tolist() for i in range(3))
        sent_s, secs_s = rows[:, 3 : 3 + m], rows[:, 3 + m :]
        # Streaming pings from its exchange thread, beside the training thread's compute, and a
        # scheduling delay only ever adds: the shortest of the last few rounds' pings
        self._pings = [*self._pings, min(pings)][-self.ping_window :]
        rtt = min(self._pings)
        # per exchange, the most bytes a site sent and the shortest time (a site that arrived late
        # did not wait for the others: its time is the transfer alone), summed over the exchanges
        # that carried at least half as much as the largest: a small fragment's time is nearly all
        # latency, which the formula models only roughly (a codec's direct exchange pays one round
        # trip where the ring's model counts n-1), so it would say more about the model than the link
        most, least = sent_s.amax(0), secs_s.amin(0)  # per exchange (none: empty)
        top = float(most.max()) if m else 0.0
        kept = most >= 0.5 * top
        k = int(kept.sum()) if top > 0 else 0  # 0: nothing crossed sites
        nbytes, secs = float(most[kept].sum()), float(least[kept].sum())
        n = self.regions if self.across_regions else n  # the formula's ring
        link = achieved_bps(nbytes, secs, n, rtt, k) if k else None
        step_s = [(w - x) / max(1, k) for w, x, k in zip(walls, waits, per_site, strict=True)]
        # lock-step: the slowest site's (the exchanges wait for it); adaptive pace: the fastest's (a
        # round's budget is H of its steps, and every site ends within it)
        T = min(step_s) if self.paced else max(step_s)
        steps = max(per_site)
        bps, exposed, u_link = link, None, None
        if self.counts and link is not None:
            # Streaming: the formula inverted on the slowest site's measured wait per cycle of H
            # steps too (site skew, uneven fragments and CPU contention lengthen the exchanges a
            # merge waits for beyond the link's transfer time); the choice takes the slower link
            exposed = waits[step_s.index(T)] / max(1, steps) * self.H
            bits = float(CODEC_BITS[self.codec])
            bps = min(link, streaming_effective_bps(exposed, self.params, bits, T, n, rtt, self.H, self.F, self.tau))
            u_link = utilization("streaming", link, self.params, T, n, rtt, self.H, self.F, self.tau, {"streaming": bits})
        now: dict[str, Any] = {"H": self.H, "codec": self.codec, **({"fragments": self.F} if self.counts else {})}
        choice: dict[str, Any] = (
            choose_round(
                bps,
                self.params,
                T,
                n,
                rtt,
                self.cfg.H_min,
                self.cfg.H_max,
                {c: float(CODEC_BITS[c]) for c in self.codecs},
                self.cfg.target,
                self.counts,
                self.tau,
                (self.codec, self.H, self.F),
                self.hold,
            )
            if bps is not None
            else {**now, "predicted_utilization": None, "meets_target": None}
        )
        changed = any(choice[k] != v for k, v in now.items())
        self.log.append(
            {
                "round": round_id,
                "t_s": round(self._clock(), 3),
                **now,
                "steps": steps,
                "bytes": [int(b) for b in sent_s.sum(1).tolist()],
                # exact: the choice can be recomputed from these (tests do)
                "allreduce_s": secs_s.sum(1).tolist(),
                "exchanges": m,
                "link_exchanges": k,
                # the agreed sums over exchanges: per exchange the most bytes a site sent, the shortest time
                "link_bytes": nbytes,
                "link_seconds": secs,
                **({"fragment_choices": list(self.counts), "tau": self.tau, "hold": self.hold} if self.counts else {}),
                "ping_s": pings,
                "ping_window": self.ping_window,
                "step_s": step_s,
                "waited_s": waits,
                "utilization": [round((w - x) / w, 4) if w > 0 else 0.0 for w, x in zip(walls, waits, strict=True)],
                "params": self.params,
                "link_bps": link,
                **({"exposed_s": exposed, "effective_bps": bps, "predicted_on_link": u_link} if self.counts else {}),
                "rtt_s": rtt,
                "next": choice,
                "changed": changed,
                "why": "no exchange crossed sites in this round: nothing measured, nothing changed"
                if bps is None or link is None
                else _reason(choice, link, bps, rtt, T, self.cfg, self.hold),
            }
        )
        self.H, self.codec, self.F = int(choice["H"]), str(choice["codec"]), int(choice.get("fragments", self.F))
        return changed


LINK_FIELDS = ("ping_s", "wall_s", "waited_s", "steps", "bytes", "seconds")  # an elastic site's claim, in order


def link_claim(codec: str, measured: str) -> str:
    """What an elastic site claims in a round's meeting: the codec it encodes this round with, and
    its measurements of its last committed round (:data:`LINK_FIELDS`; "" for none)."""
    return f"{codec}|{measured}"


def claimed_codec(claim: str) -> str:
    """The codec a ``link`` claim names (what a healer encodes its round with: its source's)."""
    return claim.partition("|")[0]


def _parse_link(claim: str) -> list[float] | None:
    """An admitted site's ``link`` claim's measurements (:data:`LINK_FIELDS`), or None if it holds
    none or they are not six finite, non-negative numbers (an authenticated site can still claim
    false ones: docs/SECURITY.md)."""
    measured = claim.partition("|")[2]
    try:
        values = [float(v) for v in measured.split(",")] if measured else []
    except ValueError:
        return None
    ok = len(values) == len(LINK_FIELDS) and all(math.isfinite(v) and v >= 0 for v in values)
    return values if ok else None


def _reason(choice: dict[str, Any], link: float, bps: float, rtt: float, step_s: float, cfg: AdaptConfig, hold: float) -> str:
    eff = f" (as exposed: {bps / 1e6:.2f})" if bps < link else ""
    seen = f"link {link / 1e6:.2f} Mbit/s{eff}, rtt {rtt * 1e3:.0f} ms, {step_s * 1e3:.0f} ms/step"
    frags = f" with {choice['fragments']} fragment(s)" if "fragments" in choice else ""
    if choice.get("held"):
        return (
            f"{seen}: {choice['codec']} at H={choice['H']}{frags} is predicted {choice['predicted_utilization']:.1%}, "
            f"within {cfg.target:.0%}..{cfg.target + hold:.0%}: held"
        )
    if choice["meets_target"]:
        return (
            f"{seen}: {choice['codec']} is the least compression that reaches {cfg.target:.0%} within H<={cfg.H_max}; "
            f"the smallest H that does is {choice['H']}{frags} ({choice['predicted_utilization']:.1%})"
        )
    return (
        f"{seen}: no codec reaches {cfg.target:.0%} within H<={cfg.H_max}; the most utilisation is "
        f"{choice['codec']} at H={choice['H']}{frags} ({choice['predicted_utilization']:.1%})"
    )
