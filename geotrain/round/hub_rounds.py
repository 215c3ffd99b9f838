"""The engine's rounds through a hub (asynchronous quorum rounds, :mod:`geotrain.round.hub`):
what a slot's end does when the hub, not the sites, steps the global model.

DiLoCo: each site runs the steps the hub gave it (H, or with dynamic local steps its share),
delivers its pseudo-gradient and waits for the answer (on time) or gets it at once (late); a
checkpoint's round is a barrier every live site's update is merged in. Streaming DiLoCo: each
fragment's sync is a delivery on the leader's delivery thread while the inner steps go on, its
answer taken τ steps later (or at the next fragment's sync: one delivery in flight per site)
and mixed in with α. At the end every site delivers each fragment's last update (possibly of no
steps) and takes one exact answer: every site ends on one model.
"""

from __future__ import annotations

import time

import torch

from geotrain.round.core import EngineCore
from geotrain.round.hub import Answer, Hub
from geotrain.round.parts import WORLD, InFlight, Outcome, done
from geotrain.round.syncer import Update
from geotrain.sync.reducer import Codecs


class HubRounds(EngineCore):
    """Slots that end in a delivery to the hub, as a part of :class:`~geotrain.round.engine.RoundEngine`."""

    _round_compute: float = 0.0
    _barrier_passed = False

    def _held(self, f: int) -> torch.Tensor | None:
        """What this site holds of fragment ``f``'s global values, whole (an encoded answer is a
        change from it; under FSDP the site's ranks gather it, so only where answers are encoded)."""
        values = torch.cat([g.reshape(-1) for g in self.globals.params(WORLD, f)])
        if not self.sharded:  # type: ignore[attr-defined]
            return values
        return self._whole(values, self.schedule.fragments[f]) if _encodes(self.hub) else None

    @torch.no_grad()
    def _hub_slot(self) -> bool:
        """The slot under way ends with a delivery to the hub."""
        hub = self.hub
        assert hub is not None
        f = self.schedule.next_fragment
        if self.streaming:
            for g in list(self.inflight):  # one delivery in flight: the last one is taken first
                self._settle(g)
        t = self.local_steps
        steps = t - self.schedule.last_sync[f]
        delta = self._whole(self.globals.delta(WORLD, f, self.local_params()), self.schedule.fragments[f])
        self.faults.corrupt_update(delta, self.rounds)
        barrier = self._barrier_due(steps, t)
        update = Update(hub.site_index, hub.versions[f], steps, self.site_workers, delta if steps else delta[:0], False,
                        self._round_compute, barrier, fragment=f)  # fmt: skip
        held = self._held(f)
        self._round_compute = 0.0
        self.schedule.synced(f, t)
        self.schedule.slot += 1
        self.slots += 1
        self.in_slot = 0
        if self.streaming and not barrier:
            fut = self._network.submit(_delivered, hub, update, held) if hub.leader else done(Outcome(True))
            self.inflight[f] = InFlight(t + self.tau, fut, delta)
            self.rounds += 1
            if self.tau == 0:
                self._settle(f)
            self._follow_H(f)
            self.clock.limit = self.schedule.length(self.schedule.slot + 1)
            return True
        t0 = time.perf_counter()
        answer = hub.deliver(update, held) if hub.leader else None
        if barrier and self.F > 1:  # a barrier's answer is exact: the whole model and every fragment's version
            n = sum(self.params_whole(g) for g in range(self.F))
            self._take(None if answer is None else hub.whole_answer(answer, n), None)
        else:
            self._take(answer, f)
        self._barrier_passed = barrier and hub.checkpoint  # (not granted once a site has ended)
        self.comm.add_wait(time.perf_counter() - t0)
        hub.waits.append(time.perf_counter() - t0)
        self.rounds += int(bool(steps))
        if self.streaming:
            self._follow_H(f)
            self.clock.limit = self.schedule.length(self.schedule.slot + 1)
        else:
            self.clock.limit = hub.next_H
        self.clock.next_round(self.rounds)
        return True

    def _barrier_due(self, steps: int, t: int) -> bool:
        """Whether a slot ending at step ``t`` delivers a checkpoint's barrier: every site reaches it
        at the same count of its rounds (with fixed local steps, at the same step: the first slot
        end at or past each multiple of ``checkpoint.every``)."""
        every = self.checkpoint_every
        if not every or not steps:
            return False
        if self.cfg.dynamic_quorum_steps:
            return (self.rounds + 1) % max(1, every // self.H) == 0
        return t // every > (t - self.in_slot) // every

    def _follow_H(self, f: int) -> None:
        """Streaming DiLoCo in quorum rounds: the H the hub gave this site (adaptation, dynamic local
        steps) takes effect from this step, where fragment ``f``'s slot ended (its fragments keep their turns)."""
        assert self.hub is not None
        if self.hub.next_H != self.H:
            last = list(self.schedule.last_sync)
            self.schedule.resume_after(self.hub.next_H, f, self.local_steps)
            self.schedule.last_sync = last

    @torch.no_grad()
    def _take(self, answer: Answer | None, f: int | None) -> None:
        """Go on from the hub's answer: fragment ``f``'s global values (None: the whole model, in
        parameter order), adopted and mixed into the local ones (the whole model: copied)."""
        hub = self.hub
        assert hub is not None
        which = list(range(len(self.params))) if f is None else self.schedule.fragments[f]  # type: ignore[attr-defined]
        theta = hub.take(answer, sum(self.params[i].numel() for i in which), f)  # type: ignore[attr-defined]
        own = dict(zip(which, self._own_values(theta, which), strict=True))
        for g in range(self.F) if f is None else [f]:
            self.globals.adopt(g, [own[i] for i in self.schedule.fragments[g]])
            self.globals.merge(WORLD, g, self.local_params(), self.alpha if f is not None else 0.0)

    def params_whole(self, f: int) -> int:
        """Values of fragment ``f`` as the hub holds them: whole tensors."""
        return sum(self.params[i].numel() for i in self.schedule.fragments[f])  # type: ignore[attr-defined]

    def _settle_hub(self, f: int, x: InFlight) -> None:
        """A fragment's delivery taken in: its answer waited for, adopted and mixed in."""
        assert self.hub is not None
        t0 = time.perf_counter()
        out = self._wait(x.future)
        self.hub.waits.append(time.perf_counter() - t0)
        self._take(out.answer, f)

    @torch.no_grad()
    def _finish_hub(self) -> None:
        """Each fragment's last update (possibly of no steps), then one exact answer: every site on one model."""
        hub = self.hub
        assert hub is not None
        for f in list(self.inflight):
            self._settle(f)
        t, answer = self.local_steps, None
        n = sum(self.params_whole(f) for f in range(self.F))
        held = [self._held(f) for f in range(self.F)]  # (collective under FSDP: every rank)
        deltas = [
            self._whole(self.globals.delta(WORLD, f, self.local_params()), self.schedule.fragments[f]) for f in range(self.F)
        ]
        for d in deltas:
            self.faults.corrupt_update(d, self.rounds)
        for f in range(self.F) if hub.leader else ():
            steps = t - self.schedule.last_sync[f]
            update = Update(hub.site_index, hub.versions[f], steps, self.site_workers, deltas[f] if steps else deltas[f][:0],
                            True, self._round_compute if f == 0 else 0.0, fragment=f)  # fmt: skip
            last = hub.deliver(update, held[f], answer=f == self.F - 1)  # (one answer, to the last)
            answer = None if last is None else hub.whole_answer(last, n)
        self._take(answer, None)
        if self.F == 1 and t > self.schedule.last_sync[0]:
            self.rounds += 1
        if hub.syncer is not None:
            hub.syncer.close()

    def rejoin_run(self) -> int:
        """This site came back: the hub takes it back, and it goes on from the global model it
        sends; returns the step its data stream and schedule go on from (the steps it had delivered)."""
        hub = self.hub
        assert hub is not None
        n = sum(self.params_whole(f) for f in range(self.F))
        held = [self._held(f) for f in range(self.F)]  # (collective under FSDP: every rank)
        whole = None if any(h is None for h in held) else torch.cat(held)  # type: ignore[arg-type]
        self._take(hub.rejoin_answer(whole, n), None)
        hub.t0 = time.perf_counter() - hub.elapsed  # stop with the others (train.max_seconds)
        self.schedule.last_sync = [0] * self.F
        return hub.site_steps

    @property
    def version(self) -> int:
        assert self.hub is not None
        return self.hub.versions[0]


def _delivered(hub: Hub, update: Update, held: torch.Tensor | None) -> Outcome:
    """Delivery thread: one fragment's update and the hub's answer."""
    return Outcome(True, answer=hub.deliver(update, held))


def _encodes(hub: Hub | None) -> bool:
    return hub is not None and Codecs.encodes(hub.codec_name)
