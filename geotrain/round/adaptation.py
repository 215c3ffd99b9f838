"""The engine's side of network adaptation (``sync.adapt``, :mod:`geotrain.round.adapt`):
DiLoCo measures after each committed round; Streaming DiLoCo once per cycle on the exchange
thread, its choice applied max(1, τ) steps later at a quiet point (a new H or fragment count
merges what is in flight and rebuilds the schedule); two tiers at world rounds
(:mod:`geotrain.round.peer`); elastic rounds from the link claims of the meeting
(:mod:`geotrain.round.membership`).
"""

from __future__ import annotations

import torch

from geotrain.config import SyncConfig
from geotrain.round.adapt import NetworkAdapter
from geotrain.round.core import EngineCore


class Adaptation(EngineCore):
    """The engine's side of ``sync.adapt`` (a part of :class:`~geotrain.round.engine.RoundEngine`):
    DiLoCo measures after each committed round, Streaming once per cycle on the exchange thread
    (its choice applied max(1, τ) steps later), two tiers at world rounds (:class:`PeerRounds`)."""

    def _adapter(self, cfg: SyncConfig) -> NetworkAdapter:
        """``sync.adapt``: its formula's P is the whole pseudo-gradient (under FSDP too: the site's
        shards carry all of it); Streaming chooses the fragment count as well (counts that leave no
        fragment empty, and under a healing membership only the configured one); with tiers it
        chooses the world tier's period and codec."""
        P = sum(p.numel() for p in self.params)
        assert cfg.adapt is not None
        if self.tiers:
            a = NetworkAdapter(cfg.adapt, self.comm, P, self.every * cfg.H, cfg.codec.name)
            topo = self.comm.groups.topology
            a.across_regions, a.regions = True, len(set(topo.region_of))
        elif self.streaming:
            s = self.schedule
            counts = [f for f in cfg.adapt.fragment_choices(cfg.fragments) if all(s.__class__(s.names, s.sizes, 1, f).fragments)]
            if self.heals:  # (a healer claims parts by the source's layout, which must be its own: F stays as configured)
                counts = [s.F]
            a = NetworkAdapter(cfg.adapt, self.comm, P, cfg.H, cfg.codec.name, (s.F, sorted({*counts, s.F}), self.tau))
        else:
            a = NetworkAdapter(cfg.adapt, self.comm, P, cfg.H, cfg.codec.name)
        a.paced = self.clock.adaptive
        return a

    def _adapt_round(self) -> None:
        """DiLoCo, after a committed round: measure, agree, choose the next round's H and codec."""
        assert self.adapter is not None
        steps = list(self.clock.steps_run) if self.clock.adaptive else self.clock.steps_run[0]
        if self.adapter.end_round(self.rounds, steps):
            self.codec = self.adapter.codec
            if self.adapter.H != self.H:
                self.schedule.build(self.adapter.H, 1, self.local_steps)
                self.clock.H = self.clock.limit = self.H

    def _measure(self, t: int) -> None:
        """Streaming, at the end of a cycle of H steps: the agreement on this cycle's measurements
        goes to the exchange thread, behind the fragments' exchanges it measures (every site
        submits the same work in the same order); its choice is applied max(1, tau) steps later."""
        assert self.adapter is not None and self._decision is None
        wall, waited = self.adapter.lap()
        steps, self._lap_step = t - self._lap_step, t
        fut = self._network.submit(self._decide, len(self.adapter.log) + 1, steps, wall, waited)
        self._decision = (t + max(1, self.tau), fut)

    def _decide(self, cycle: int, steps: int, wall: float, waited: float) -> bool:
        assert self.adapter is not None
        taken, self._exchanges = self._exchanges, []
        return self.adapter.decide(cycle, steps, taken, wall, waited)

    @torch.no_grad()
    def _apply_decision(self, t: int) -> bool:
        """The last measurement's choice: a new codec at the next sync; a new H or fragment count
        at a quiet point (every exchange in flight merged now, early), the schedule rebuilt from ``t``."""
        assert self._decision is not None and self.adapter is not None
        fut, self._decision = self._decision[1], None
        a = self.adapter
        if not self._wait(fut):
            return False
        self.codec = a.codec
        if (a.H, a.F) == (self.H, self.F):
            return False
        for f in list(self.inflight):
            self._settle(f)
        self._rebuild(a.H, a.F, t)
        return True

    def _rebuild(self, H: int, F: int, t: int) -> None:
        """A new H and fragment count from step ``t`` (adaptation, or a checkpoint or heal of
        another schedule): the schedule and each fragment's steps rebuilt, momentum carried over."""
        self.schedule.build(H, F, t)
        self.globals.build(self.schedule.fragments)
        self._since = [[0] * self.num_sites for _ in range(F)]
        self._since_world = [[0] * self.num_sites for _ in range(F)]
        self.region_syncs = [0] * F
        self.in_slot = 0
        self.clock.H = self.clock.limit = self.schedule.length(1)
