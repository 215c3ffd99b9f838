"""Streaming DiLoCo in elastic mode: each fragment's sync is one elastic round.

An elastic round (:mod:`geotrain.elastic`) may heal this site, roll back, or be postponed while
the Lighthouse is down; healing replaces the whole training state. So the round runs on the
training thread, between two inner steps, and blocks them: in elastic mode a fragment's exchange
does not overlap compute. Its average is merged τ inner steps after the sync, as in lock-step
Streaming DiLoCo, so both end on the same model when no site fails (what elastic mode loses is
the overlap, not the arithmetic).

Which fragment a round sums is part of what each site claims in the meeting. The round sums
the fragment its heal source syncs; a site about to sync another fragment (it missed rounds, or
it restarted) heals from the source and takes the round's average for the source's fragment, so
the fragments' schedules are the same on every site after one round. After a round, the next
one is at the first fragment's sync step past the furthest step any site still training had
reached (sites that held a postponed round at different steps meet again on one schedule). A
site that has run its steps syncs its fragments with unsynced steps, one round each, then stays
in the rounds of slower sites without an update until every site has run its steps and synced
all its fragments.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

import torch

from geotrain.errors import RoundFailed, RoundPostponed
from geotrain.sync.outer import pseudo_gradient
from geotrain.sync.streaming import StreamingDiLoCo


class ElasticStreaming(StreamingDiLoCo):
    """Streaming DiLoCo whose fragment syncs are elastic rounds (see the module docstring)."""

    _slot: tuple[int, int] | None = None  # (step, fragment) of the next round
    _total_steps = 0

    def set_limits(self, steps: int, max_seconds: float) -> None:
        super().set_limits(steps, max_seconds)
        self._total_steps = steps

    def _part_sizes(self) -> list[int]:
        """This rank's values of each fragment (its shards under FSDP)."""
        local = self.local_params()
        return [sum(local[i].numel() for i in frag) for frag in self.fragments]

    def _slot_after(self, step: int) -> tuple[int, int]:
        """The first fragment sync after ``step``: (its step, the fragment), on the schedule of
        lock-step Streaming DiLoCo (fragment f at base + f·H/F + k·H, k ≥ 0, past base)."""
        slots = []
        for f, off in enumerate(self.offsets):
            t = self.base + off + max(0, (step - self.base - off) // self.H + 1) * self.H
            slots.append((t if t > self.base else t + self.H, f))
        return min(slots)

    def after_step(self) -> None:
        if self.elastic is None:
            super().after_step()
            return
        super(StreamingDiLoCo, self).after_step()
        t = self.local_steps
        for f in [f for f, (at, _, _) in self.pending.items() if at <= t]:
            self._merge(f)
        if self._slot is None:
            self._slot = self._slot_after(t - 1)
        if t >= self._slot[0]:
            self._round(self._slot[1])  # postponed: the slot stays due, retried after the next step

    def join_round(self) -> None:
        """A restarted site's first round: it syncs no fragment of its own and heals."""
        self._round(-1)

    @torch.no_grad()
    def _round(self, f: int, rest: int = 0) -> bool:
        """One elastic round for fragment ``f`` (-1: none of this site's: it takes part and takes
        the average); ``rest``: the rounds this site still owes after it once its steps are run.
        False: postponed."""
        assert self.elastic is not None
        t = self.local_steps
        if f >= 0 and f in self.pending:
            self._merge(f)
        if f >= 0:
            local = self.local_params()
            delta = pseudo_gradient(self._globals(f), [local[i] for i in self.fragments[f]])
            steps, reducer = t - self.last_sync[f], self.reducers[f]
        else:
            delta, steps, reducer = torch.zeros(0), 0, self.reducers[0]
        self._part_claim = {"part": f, "rest": rest, "sizes": self._part_sizes()}
        try:
            self._average_across_sites(delta, reducer, steps, self.rounds, max(f, 0))
        except RoundPostponed:
            return False
        except RoundFailed as exc:
            p = self.elastic.part if self.elastic.part >= 0 else f
            if p >= 0:  # the fragment goes back to its global value on every site (else nothing was synced)
                self._synced(p)
                self._roll_back(self.fragments[p], str(exc))
            self._note("rolled_back", str(exc))
        else:
            p, average = self.elastic.part, self.elastic.average
            assert p >= 0 and average is not None  # a round with no fragment has no contributor: it fails
            self._synced(p)
            done: Future[None] = Future()
            done.set_result(None)
            self.pending[p] = (self.local_steps + self.tau, done, average)
            if self.tau == 0 or self.idle:  # a site that has run its steps merges at once
                self._merge(p)
            self._note("committed", "")
        # the next round: the first sync past the furthest step a site still training has reached
        self._slot = self._slot_after(self.elastic.furthest(self.local_steps, self._total_steps))
        return True

    def _synced(self, f: int) -> None:
        """Fragment ``f`` was synced at this step, by a round committed or rolled back (one round)."""
        self._mark_synced(f, self.local_steps)
        self.rounds += 1

    def finish(self) -> None:
        """Every fragment with unsynced steps gets one more round, in order (the same on every
        site); then this site stays in the rounds of slower ones (see the module docstring)."""
        if self.elastic is None:
            super().finish()
            return
        for f in list(self.pending):
            self._merge(f)
        while todo := [f for f in range(self.F) if self.last_sync[f] < self.local_steps]:
            if not self._privacy_allows_round():  # site-level DP: the budget is spent, the steps are not released
                self._synced(todo[0])
                self._roll_back(self.fragments[todo[0]], "privacy budget: the last partial round is not released")
                continue
            if not self._round(todo[0], rest=len(todo) - 1):
                time.sleep(self.elastic.retry_seconds)
            for f in list(self.pending):
                self._merge(f)
        self._stay_for_the_others(lambda: self._round(-1))
        self._network.shutdown()

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        super().load_checkpoint_state(state)
        self._slot = None  # from the loaded step (a heal's caller sets it after the round)
