"""Streaming DiLoCo with adaptive pace (``sync.pace=adaptive``): each fragment's sync ends a slot
of the pace clock.

Lock-step Streaming DiLoCo syncs fragment p after step t when t ≡ p·H/F (mod H): the cycle of H
steps is cut into F slots, and each slot ends with one fragment's sync. Under adaptive pace
(:mod:`geotrain.sync.pace`) a slot is a round of the clock: it gets the time budget the fastest
site needs for the slot's lock-step steps, every site steps until the budget is spent, and the
slot ends with the same fragment's sync on every site (slot k syncs fragment k mod F, as the
lock-step schedule does). Slot 1 is the clock's calibration round. The run lasts the
calibration slot and F · ceil(steps / H) slots more, then every fragment with unsynced steps is
synced once (:meth:`StreamingDiLoCo.finish`).

Weights: a fragment's pseudo-gradient holds the site's steps since that fragment's last sync,
which differ between sites, so each site's update weighs by its tokens over those slots (workers
× steps), the steps every site learns in the control exchange at each slot's end.

What it costs: the control exchange (every site's steps, compute and elapsed time: a few bytes,
one hop) runs on the exchange thread, behind any fragment exchange still in flight, and the
training thread waits for it at each slot's end; the fragment's own exchange still overlaps the
τ steps that follow. The clock's seconds per step count a merge's wait for its exchange: in
DiLoCo the wait is at the round's end, outside the budget, but here it falls inside a slot, and
a budget from compute alone would leave the fastest site short of its steps by its waits. A
fragment whose average has not merged when its next sync is due (a site
that ran fewer than τ steps in F slots) merges first. The site's vote on ending a slot runs on
the training thread's site group, since the exchange thread uses lane 0's meanwhile.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn as nn

from geotrain.comm.collectives import Collectives
from geotrain.config import SyncConfig
from geotrain.sync.base import SyncAlgorithm
from geotrain.sync.pace import RoundClock, round_limit
from geotrain.sync.streaming import StreamingDiLoCo


class PacedStreaming(StreamingDiLoCo):
    """Streaming DiLoCo whose fragment syncs end the rounds of the pace clock (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        comm: Collectives,
        grad_clip: float,
        cfg: SyncConfig,
        adaptive: bool = True,
    ) -> None:
        super().__init__(model, optimizer, comm, grad_clip, cfg)
        self.clock = RoundClock(comm, self._slot_length(1), adaptive)
        self.clock.sum_in_site = comm.all_reduce_intra
        self._slots = 0  # slots ended (each with one fragment's sync)
        self._in_slot = 0  # steps in the slot under way
        self._since = [[0] * self.num_sites for _ in range(self.F)]  # per fragment: every site's steps since its sync

    def _slot_length(self, k: int) -> int:
        """Slot ``k``'s lock-step steps (k ≥ 1): from the sync before it to fragment k mod F's."""
        f = k % self.F
        end = self.offsets[f] if f else self.H
        return max(1, end - self.offsets[(f - 1) % self.F if f else -1])

    def sync_gradients(self) -> None:
        super().sync_gradients()
        self.clock.vote(self._in_slot)  # does the slot end after this step?

    def add_compute(self, seconds: float) -> None:
        self.clock.add_compute(seconds)

    def after_step(self) -> None:
        SyncAlgorithm.after_step(self)
        t, t0 = self.local_steps, time.perf_counter()
        due = [f for f, (at, _, _) in self.pending.items() if at <= t]
        for f in due:
            self._merge(f)
        if due:  # a merge, and its wait for the exchange, is part of this site's time per step (see the module docstring)
            self.clock.add_compute(time.perf_counter() - t0)
        self._in_slot += 1
        if self.clock.ends(self._in_slot):
            self._end_slot(t)

    def _end_slot(self, t: int) -> None:
        """Every site's steps in the slot (the control exchange), then the slot's fragment syncs."""
        self._count_slot()
        self._slots += 1
        f = self._slots % self.F
        if f in self.pending:  # its last average has not merged (fewer than tau steps since): merge it first
            self._merge(f)
        self._sync(f, t)
        self.clock.H = self._slot_length(self._slots + 1)
        self.clock.next_round(self._slots)
        if not self.clock.adaptive:  # lock-step slots: the schedule's steps
            self.clock.limit = self.clock.H

    def _count_slot(self) -> None:
        """The control exchange (on the exchange thread, which uses lane 0): every site's steps in
        the slot, added to each fragment's count since its sync."""
        steps = self._wait(self._network.submit(self.clock.exchange, self._in_slot))
        for since in self._since:
            for s, k in enumerate(steps):
                since[s] += k
        self._in_slot = 0

    def finish(self) -> None:
        if self._in_slot:  # (lock-step: the run's steps ended inside a slot) count its steps before the last syncs
            self._count_slot()
        super().finish()

    def _sync_counts(self, f: int) -> list[int] | None:
        return list(self._since[f])

    def _mark_synced(self, f: int, t: int) -> None:
        super()._mark_synced(f, t)
        self._since[f] = [0] * self.num_sites

    def _unsynced(self, f: int, t: int) -> bool:
        return any(self._since[f])  # (the same on every site: every site steps in every slot)

    def set_limits(self, steps: int, max_seconds: float) -> None:
        if self.clock.adaptive:  # the calibration slot, then ceil(steps / H) cycles (lock-step: the steps end it)
            self.clock.end_after(max_rounds=1 + self.F * -(-steps // self.H))
        self.clock.max_seconds = max_seconds  # (train.max_seconds: the slot end after it, on every site)

    @property
    def done(self) -> bool:
        return self.clock.done

    def step_limit(self, steps: int) -> int:
        if not self.clock.adaptive:
            return steps
        longest = max(self._slot_length(k) for k in range(1, self.F + 1))
        return self.clock.first + (self.clock.max_rounds - 1) * round_limit(longest)

    def _every_slots(self, every: int) -> int:
        return max(1, every * self.F // self.H)

    def eval_due(self, step: int, every: int) -> bool:
        # sites run different steps: evaluate at slot ends, about every ``every`` steps of the fastest
        return self._in_slot == 0 and self._slots % self._every_slots(every) == 0

    def checkpoint_due(self, step: int, every: int) -> int | None:
        # at slot ends (the same slots on every site); the folder is named by the leading site's step
        if self._in_slot or self._slots % self._every_slots(every):
            return None
        return max(self.clock.totals)

    def world_steps(self, step: int) -> int:
        return self.clock.world_steps(list(self.comm.groups.topology.workers))

    def pace_log(self) -> list[dict[str, Any]]:
        return self.clock.log

    def checkpoint_state(self) -> dict[str, Any]:
        return {
            **super().checkpoint_state(),
            "clock": self.clock.state_dict(),
            "slots": self._slots,
            "since": [list(c) for c in self._since],
        }

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        super().load_checkpoint_state(state)
        self.clock.load_state_dict(state["clock"])
        self._slots = state["slots"]
        self._since = [list(c) for c in state["since"]]
        self.clock.H = self._slot_length(self._slots + 1)
