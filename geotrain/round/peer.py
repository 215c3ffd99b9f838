"""The engine's syncs in the fixed world: one job per fragment's sync (run inline, or on the
exchange thread where exchanges overlap compute) that sums the part through
:class:`~geotrain.round.fixed.FixedWorld` and, with two tiers, takes its steps there: a region
round, then (every ``region_every``-th, and at the run's end) a world round whose Δ is taken
against the region's model after its step. Under FSDP over sites of different sizes what
crosses sites is the whole vector (local rank i holds different shards at different sites).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from geotrain.errors import RoundFailed
from geotrain.round.core import EngineCore
from geotrain.round.parts import REGION, WORLD, Outcome


class PeerRounds(EngineCore):
    """The engine's syncs in the fixed world (a part of :class:`~geotrain.round.engine.RoundEngine`):
    one job per fragment's sync, run inline or on the exchange thread, that sums the part and
    (two tiers) takes its steps."""

    def _wire(self, delta: torch.Tensor, f: int) -> torch.Tensor:
        """What crosses sites of fragment ``f``'s Δ in a peer exchange: under FSDP over sites of
        different sizes the whole vector (local rank i holds different shards at different sites)."""
        return self._whole(delta, self.schedule.fragments[f]) if self.resharded else delta

    def _unwire(self, wire: torch.Tensor, delta: torch.Tensor, f: int) -> None:
        """``delta`` ← this rank's part of the summed ``wire``."""
        if wire is not delta:
            delta.copy_(torch.cat([t.reshape(-1) for t in self._own_values(wire, self.schedule.fragments[f])]))

    def _flat_job(self, f: int, delta: torch.Tensor, counts: list[int], steps: int, round_id: int) -> Callable[[], Outcome]:
        """Fragment ``f``'s round of one tier: the sites' average of ``delta``, in place."""
        wire = self._wire(delta, f)
        reducer, key, per = self.reducer(f), self._key(f), self._per(steps)

        def job() -> Outcome:
            sent, t0 = self.comm.stats.inter_bytes, time.perf_counter()
            if self.adapter is not None and not self.overlaps:
                self.adapter.start_average()
            try:
                n = self.members.sum(wire, reducer, counts, round_id, own=True, key=key, per=per)
            except RoundFailed as exc:
                return Outcome(False, str(exc))
            finally:
                if self.adapter is not None and self.overlaps:
                    self._exchanges.append((self.comm.stats.inter_bytes - sent, time.perf_counter() - t0))
            self._unwire(wire, delta, f)
            return Outcome(True, average=delta, contributors=n)

        return job

    def _tiered_job(
        self, f: int, delta: torch.Tensor | None, counts: list[int], world: bool, ids: tuple[int, int]
    ) -> Callable[[], Outcome]:
        """Fragment ``f``'s region round (``delta``; None: no steps to average), then, if ``world``,
        its world round. Both steps are taken here: the world's Δ is taken against the region's
        model after its step (between a fragment's sync and its merge nothing else touches its
        models, so this may run on the exchange thread)."""
        wire = self._wire(delta, f) if delta is not None else None
        since = list(self._since_world[f])
        spans: int | list[int] = since if self.clock.adaptive else self.region_syncs[f] * self.H  # the world round's steps
        finishing = self._finishing
        if world:
            self.region_syncs[f], self._since_world[f] = 0, [0] * self.num_sites

        def job() -> Outcome:
            if wire is not None and delta is not None:
                try:
                    n = self.members.sum(wire, self.reducer(f, REGION), counts, ids[0], own=True, region=True, key=f)
                    self._unwire(wire, delta, f)
                    self.globals.step(REGION, f, delta, n)
                except RoundFailed as exc:  # the region model stays; the merge brings this site back to it
                    self._note_rollback(f"region round {ids[0]} (fragment {f}): {exc}")
            if not world:
                return Outcome(True, stepped=True, tier=REGION)
            across = self.globals.delta(WORLD, f, self.local_params())
            wired = self._wire(across, f)  # (FSDP over sites of different sizes: gathered whole; such tiers block)
            sent, t0 = self._sent(), time.perf_counter()
            try:
                self.members.sum(wired, self.reducer(f, WORLD), since, ids[1] - 1, own=False)
                self._unwire(wired, across, f)
            except RoundFailed as exc:  # the regions keep their models; the next world round spans these steps too
                self._note_rollback(f"world round {ids[1] - 1} (fragment {f}): {exc}")
                if finishing:  # a failed last world round: every site on the last world model
                    self.globals.settle_regions(f)
                return Outcome(True, stepped=True, tier=WORLD if finishing else REGION, carry=since)
            measured = (ids[1], spans, self._sent() - sent, time.perf_counter() - t0)
            self.globals.step(WORLD, f, across)
            return Outcome(True, stepped=True, tier=WORLD, world=measured)

        return job

    def _sent(self) -> int:
        st = self.comm.stats
        return st.inter_region_bytes if self.tiers else st.inter_bytes

    def _after_world(self, out: Outcome, f: int) -> None:
        """Two tiers, a world round taken in (training thread): a failed one's steps carried into
        the next; adaptation's choice of the world tier's period and codec from the cross-region
        link it measured; a time limit agreed (every site is in a world round)."""
        if out.carry is not None:
            self._since_world[f] = [a + b for a, b in zip(self._since_world[f], out.carry, strict=True)]
        if self.adapter is not None:
            if out.world is None:
                self.adapter.skip_round()
            else:
                round_id, steps, nbytes, secs = out.world
                if self._control(self.adapter.decide, round_id, steps, [(nbytes, secs)], *self.adapter.lap()):
                    self.every = max(1, round(self.adapter.H / self.H))
                    self.adapter.H = self.every * self.H  # what the next world round will span
                    self.codec = self.adapter.codec
        if self.clock.exchanges and not self.clock.adaptive:  # train.max_seconds: agreed at world rounds only
            self._control(self.clock.exchange, self.in_slot)
            self.clock.next_round(self.rounds)
