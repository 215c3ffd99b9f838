"""The engine's rounds under a healing membership (elastic mode, :mod:`geotrain.elastic`): each
site is its own torch.distributed world, and the sites meet once per round.

A round is one call of the membership (:class:`geotrain.sync.base.RoundMembership`): the meeting
(who is in, who heals from whom), the exchange (the part's sum, encoded or masked, weighted) and
the vote (commit everywhere or roll back everywhere). What the engine adds around it is the same
for every schedule and tier:

1. **What this site claims.** The part it syncs (a Streaming fragment; with two tiers, its tier
   too: REGION when it trained since its last round, WORLD when ``region_every`` region rounds
   passed since the last world round, or at the run's end), the rounds it still owes, its pace
   and its link measurements. A part is encoded on the wire as ``2·fragment + tier`` with two
   tiers, else as the fragment.
2. **What the round sums.** The part its heal source syncs (a site about to sync another heals
   from the source and takes the round's average for the source's part, so every site is on one
   schedule after one round); a site that claimed another tier sits the round out (it sends
   nothing) and applies it like the others.
3. **The next boundary.** The first slot end on the lock-step grid past the furthest step a site
   still training had reached (sites that held a postponed round at different steps meet again
   on one schedule); adaptive pace budgets the next round from the fastest claim; quorum rounds
   run each site's own H.
4. **The end.** Every fragment with unsynced steps gets one more round (two tiers: the last one
   reaches the world tier); then a site that has run its steps stays in the others' rounds without
   an update until every site has run its steps, owes no round, and the last round was decided
   alike everywhere: every site ends on one model.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from geotrain.errors import ElasticTimeout, RoundFailed
from geotrain.round.core import EngineCore
from geotrain.round.parts import REGION, WORLD, InFlight, Outcome, done
from geotrain.sync.base import Running

SPLIT_ROUNDS = 10  # most rounds a run's end holds to heal a split last round (one does, unless sites keep failing)
TIER = {REGION: 0, WORLD: 1}  # a part's tier on the wire


class MemberRounds(EngineCore):
    """The rounds of a healing membership, as a part of :class:`~geotrain.round.engine.RoundEngine`."""

    idle = False  # this site has run its steps: it takes part in the others' rounds without an update

    def _claim(self, f: int) -> tuple[int, str] | None:
        """The part (fragment, tier) this site asks for in its next round of fragment ``f``; None: none."""
        trained = self.local_steps > self.schedule.last_sync[f]
        if not self.tiers:
            return (f, WORLD) if trained else None
        if trained:
            return f, REGION
        since = self.region_syncs[f]
        return (f, WORLD) if since and (since >= self.every or self._finishing) else None

    def _wire_part(self, part: tuple[int, str] | None) -> int:
        if part is None:
            return -1
        return 2 * part[0] + TIER[part[1]] if self.tiers else part[0]

    def _from_wire(self, p: int) -> tuple[int, str]:
        return (p // 2, REGION if p % 2 == 0 else WORLD) if self.tiers else (p, WORLD)

    def _part_sizes(self) -> list[int]:
        """Each part's values as they cross sites: this rank's (its shards under FSDP), or whole
        (FSDP over sites of different sizes)."""
        params = self.params if self.resharded else self.local_params()
        sizes = [sum(params[i].numel() for i in frag) for frag in self.schedule.fragments]
        return [n for n in sizes for _ in range(2)] if self.tiers else sizes

    @torch.no_grad()
    def _member_round(self, part: tuple[int, str] | None, rest: int = 0) -> bool:
        """One round in which this site claims ``part`` (None: nothing of its own: it takes part and
        takes the average); ``rest``: the rounds it still owes after this one once its steps are
        run. False: postponed (the round stays due)."""
        m = self.elastic
        assert m is not None
        t, local = self.local_steps, self.local_params()
        for g in list(self.inflight):  # one round in flight: the last one is taken in first
            self._settle(g)
        f, tier = part if part is not None else (0, WORLD)
        steps = self.every * self.H if self.tiers and tier == WORLD else t - self.schedule.last_sync[f] if part is not None else 0
        delta = self.globals.delta(tier, f, local) if part is not None else torch.zeros(0)
        wire = self._wire(delta, f) if part is not None else torch.zeros(self._part_sizes()[0])  # (whole: unequal FSDP)
        idle = self.idle and not (
            self.tiers and tier == WORLD and part is not None
        )  # a finished site still brings its region's Δ₂
        contribute = part is not None and not idle
        if part is not None:
            self.faults.corrupt_update(delta, self.rounds)
        if contribute and self.guard is not None:  # the guard judges this site's own update (see sync.guard)
            site = self.comm.groups.topology.site_names[0]
            contribute = self.guard.own_update_ok(delta, self._key(f), self.rounds, site)
        weight = 0.0 if idle or part is None else m.weight(steps) if self.cfg.weight_by_tokens else 1.0
        extra: dict[str, Any] = {"part": self._wire_part(part), "rest": rest, "sizes": self._part_sizes()}
        if self.clock.adaptive:  # the meeting hears this site's rate and rounds owed (a healer claims neither)
            rate, owed = self.clock.seconds_per_step[0], self.clock.max_rounds - self.rounds - 1
            extra.update(pace=0 if self.idle else round(1e6 * rate), rest=0 if self.idle else max(0, owed))
        if self.adapter is not None:  # the meeting hears what this site last measured
            extra["link"] = _link_claim(self.adapter.codec, self.adapter.link)
            self.adapter.start_average()
        reducer = self.reducer(f, tier)
        if not (self.tiers and tier == WORLD):
            self.clock.exchange(steps)  # this site's steps and rate (its world is its own site: no communication)
        # Streaming's exchange overlaps τ steps of compute unless a site heals (the round then ends at once)
        overlap = self.streaming and self.tau > 0 and part is not None and not (self.idle or self.tiers or self._finishing)
        try:
            got = m.round(
                wire, contribute=contribute, weight=weight, codec=reducer.codec, residual=reducer.residual,
                overlap=overlap, **extra,
            )  # fmt: skip
        except RoundFailed as exc:
            p = self._from_wire(m.part) if m.part >= 0 else part
            self._member_failed(p, part, exc)
            self._next_boundary(p)
            return True
        if got is None:
            return False
        p = self._from_wire(m.part)
        if isinstance(got, int):
            self._member_committed(p, got, steps, None)
        else:  # running: finished τ steps later, before the next round
            self.schedule.synced(p[0], t)
            self.inflight[p[0]] = InFlight(t + self.tau, done(Outcome(True, answer=(got, p, steps, t))), wire)
        self._next_boundary(p)
        return True

    def _settle_member(self, answer: tuple[Running, tuple[int, str], int, int]) -> None:
        """A running round taken in τ steps after it opened: its vote, then its step and merge."""
        running, p, steps, at = answer
        try:
            got = running.finish()
        except RoundFailed as exc:
            self._member_failed(p, p, exc, at)
            return
        self._member_committed(p, got, steps, at, merge_now=True)

    def _member_failed(
        self, p: tuple[int, str] | None, claimed: tuple[int, str] | None, exc: RoundFailed, at: int | None = None
    ) -> None:
        if p is not None and (not self.tiers or p == claimed):  # its part goes back where it was on every site
            self._roll_back_part(p)
        self._note_rollback(str(exc))
        self.rounds += 1
        self._member_note("rolled_back", str(exc), at)
        if self.adapter is not None:
            self.adapter.skip_round()

    def _member_committed(self, p: tuple[int, str], got: int, steps: int, at: int | None, merge_now: bool = False) -> None:
        m = self.elastic
        assert m is not None and m.average is not None
        self.contributors = got
        average = m.average
        if self.resharded:  # this rank's shards of the whole average
            average = torch.cat([t.reshape(-1) for t in self._own_values(average, self.schedule.fragments[p[0]])])
        self._apply_round(p, average, got, at, merge_now)
        if self.tiers and self.cfg.quorum is not None and p[1] == WORLD:  # regions ran their rounds on their own:
            self.rounds = max(self.rounds, self.rounds_rolled_back + m.top)  # a world round (every site) aligns the counts
        self.rounds += 1
        self._member_note("committed", "", at)
        if self.adapter is not None and self._adapted_from_claims(steps):
            self._take_adaptation()

    def _roll_back_part(self, part: tuple[int, str]) -> None:
        """A failed round of ``part``: nothing of it is applied; the fragment's local steps since
        its last round go back to the model above (a world claim of two tiers loses nothing)."""
        f, tier = part
        self.schedule.synced(f, self.local_steps)
        if self.tiers and tier == WORLD:
            return
        self.globals.merge(REGION if self.tiers else WORLD, f, self.local_params(), 0.0)

    def _apply_round(
        self, part: tuple[int, str], average: torch.Tensor, contributors: int, t: int | None, merge_now: bool = False
    ) -> None:
        """A committed round of ``part`` opened at step ``t`` (None: now), on this site's state
        (healed already if it healed); ``merge_now``: it ran τ steps beside compute, its merge is due."""
        f, tier = part
        t = self.local_steps if t is None else t  # (a heal sets this site's step to its source's)
        self.schedule.synced(f, t)
        if self.tiers:
            if tier == REGION:
                if contributors:  # (a region none of whose sites contributed keeps its model)
                    self.globals.step(REGION, f, average, contributors)
                self.region_rounds += 1
                self.region_syncs[f] += 1
            else:
                self.globals.step(WORLD, f, average, contributors)
                self.region_syncs[f] = 0
            self.globals.merge(tier, f, self.local_params(), 0.0 if not self.streaming else self.alpha)
            return
        # the outer step at once: the round's state is then the one a heal sends (a late site takes
        # the global models only) and its record's hash; the local fragment merges τ steps later
        self.globals.step(WORLD, f, average, contributors)
        if self.tau == 0 or self.idle or merge_now:  # (a site that has run its steps merges at once)
            self.globals.merge(WORLD, f, self.local_params(), self.alpha)
            return
        self.inflight[f] = InFlight(t + self.tau, done(Outcome(True, stepped=True, tier=WORLD)), average)

    def _member_note(self, outcome: str, reason: str, step: int | None = None) -> None:
        """The round's record; ``step``: where it opened (a round that ran beside compute ends later)."""
        assert self.elastic is not None
        at = self.local_steps if step is None else step
        self.elastic.note(outcome, reason, self.global_hash(), self.rounds - self.rounds_rolled_back, at)

    def _next_boundary(self, done: tuple[int, str] | None) -> None:
        """After a round of part ``done`` (None: none of this site's), committed or rolled back: the
        next round's end (see the module docstring). Where the sites keep no shared boundary (quorum
        rounds, adaptive pace) the next slot is the one after the fragment the round synced."""
        m = self.elastic
        assert m is not None
        self.in_slot = 0
        s = self.schedule
        if done is not None:
            s.slot += 1 + (done[0] - s.next_fragment) % s.F
        if self.clock.adaptive:
            self.clock.claimed_fastest = m.fastest_seconds()
            self.clock.H = max(1, s.length(s.slot + 1))
            self.clock.next_round(self.rounds)
            if self.clock.max_steps and m.furthest(self.local_steps, 1 << 62) >= self.clock.max_steps:
                self.clock.done = True  # (adapted H: the run ends once the round's furthest site has run the steps)
            return
        self.clock.next_round(self.rounds)
        if self.cfg.quorum is not None:  # each site's own steps per slot (no shared boundary)
            self.clock.limit = max(1, s.length(s.slot + 1))
            return
        k = self.schedule.slot_after(m.furthest(self.local_steps, self._total_steps))
        self.schedule.slot = k - 1
        self.clock.limit = max(1, self.schedule.end(k) - self.local_steps)

    def _member_slot(self) -> bool:
        """The slot under way ends under a healing membership; False if its round was postponed."""
        f = self.schedule.next_fragment
        part = self._claim(f)
        if part is None:
            return self._member_round(None)
        if not self._member_round(part):
            return False
        self.slots += 1
        if self.tiers and part[1] == REGION and (nxt := self._claim(part[0])) is not None and nxt[1] == WORLD:
            if self.cfg.quorum is not None:
                self._world_round(nxt)
            else:
                self._member_round(nxt)  # a region round is followed at once by the world round when one is due
        return True

    def _world_round(self, part: tuple[int, str]) -> None:
        """Quorum rounds of two tiers: the regions run their rounds on their own and meet in world
        rounds, lock-step (a region takes part in a round whole, and a world round holds every
        region: :func:`geotrain.elastic.view.whole_regions`); a region that is due waits for the
        others, as a region's hub does. Bounded by ``liveness.wait_timeout_s``."""
        m = self.elastic
        assert m is not None
        deadline = time.monotonic() + m.live.wait_timeout_s
        while self._claim(part[0]) == part:
            if time.monotonic() > deadline:
                raise ElasticTimeout(
                    f"no world round for {m.live.wait_timeout_s:g}s (liveness.wait_timeout_s): a region did not come"
                )
            self._member_round(part)  # (asked again at once: the round forms when every site is asking)

    def join_round(self) -> None:
        """A restarted site's first round: it syncs nothing of its own and heals."""
        self._member_round(None)

    def _adapted_from_claims(self, steps: int) -> bool:
        assert self.adapter is not None and self.elastic is not None
        return self.adapter.end_elastic(self.rounds, steps, self.elastic.link_claims(), self.elastic.measured)

    def _take_adaptation(self) -> None:
        """The adapted H (and fragment count) on the grid of multiples of H from step 0, which every
        site shares whatever step it met at."""
        assert self.adapter is not None
        self.codec = self.adapter.codec
        if self.tiers:  # the world tier's period, a whole number of region rounds
            self.every = max(1, round(self.adapter.H / self.H))
            self.adapter.H = self.every * self.H
            return
        if (self.adapter.H, self.adapter.F) != (self.H, self.F):
            for f in list(self.inflight):
                self._settle(f)
            self._rebuild(self.adapter.H, max(1, self.adapter.F), 0)

    def _finish_members(self) -> None:
        """Every fragment with unsynced steps gets its round, in order (two tiers: the last reaches
        the world tier; retried while it rolls back), then this site stays in the others' rounds."""
        m = self.elastic
        assert m is not None
        for f in list(self.inflight):
            self._settle(f)
        self._finishing = True
        failed = 0
        while todo := [f for f in range(self.F) if self._claim(f) is not None]:
            f = todo[0]
            if not self._privacy_allows_round():  # the budget is spent, the steps are not released
                self._roll_back_part((f, REGION if self.tiers else WORLD))
                self.region_syncs[f] = 0
                self._note_rollback("privacy budget: the last partial round is not released")
                continue
            rounds = self.rounds - self.rounds_rolled_back
            if not self._member_round(self._claim(f), rest=len(todo) - 1):
                time.sleep(m.retry_seconds)
            elif self.rounds - self.rounds_rolled_back == rounds:
                failed += 1
                if failed > SPLIT_ROUNDS:
                    raise ElasticTimeout(f"the last rounds failed {SPLIT_ROUNDS} times")
            for g in list(self.inflight):
                self._settle(g)
        self._stay_for_the_others()

    def _stay_for_the_others(self) -> None:
        """A site that has run its steps stays in the rounds of the sites still training (it sends
        no update and applies their average), until a round in which every site has run its steps
        (its rounds, with adaptive pace) and owes no other, and which every site decided alike (a
        split heals in one more round). Bounded: a quorum that never forms ends in ElasticTimeout
        after liveness.wait_timeout_s."""
        m = self.elastic
        assert m is not None
        self.idle = m.done = True
        target = self.local_steps
        healing = 0
        while not (finished := m.all_finished(target) and self._settled()) or m.split:
            if finished and healing == SPLIT_ROUNDS:
                raise ElasticTimeout(f"the sites' last round split, and {SPLIT_ROUNDS} more rounds did not heal it")
            rounds = self.rounds
            self._member_round(None)
            if self.rounds == rounds:  # postponed: ask again after a heartbeat
                time.sleep(m.retry_seconds)
            else:
                healing += finished
            for g in list(self.inflight):
                self._settle(g)
        self.idle = False

    def _settled(self) -> bool:
        """Whether this site's state is one every site ends on (two tiers: the last committed round was a world round)."""
        return not self.tiers or not any(self.region_syncs)

    @property
    def staleness_power(self) -> float:
        assert self.cfg.quorum is not None
        return self.cfg.quorum.staleness_power

    def world(self, workers: list[int]) -> float:
        """The run's sites (``workers``: each one's ranks; this site's world is its own) for the
        delayed momentum; returns every site's weight in a round of H steps, what a round's
        weighted sum is divided by (as the syncer divides by a whole world round's tokens)."""
        for d in self.globals.delayed.values():
            d.sites = len(workers)
        if not self.cfg.weight_by_tokens or len(set(workers)) == 1:
            return float(len(workers))
        return float(sum(w * self.H for w in workers))

    def global_state(self) -> dict[str, Any]:
        """What a late site takes in a heal: the global models, their steps, the round counts and
        (two tiers) the region rounds since the last world round, which decide the next world round."""
        keep = ("globals", "rounds", "rolled_back", "format", "region_syncs", "region_rounds", "every")
        return {k: v for k, v in self.checkpoint_state().items() if k in keep}

    @torch.no_grad()
    def load_global_state(self, state: dict[str, Any]) -> None:
        """A late site's heal: the source's global models and round counts; the rest stays its own."""
        self.globals.load_state_dict(state["globals"], self.shards_in, self.optim_in)
        self.rounds, self.rounds_rolled_back = state["rounds"], state["rolled_back"]
        self.region_syncs, self.region_rounds, self.every = list(state["region_syncs"]), state["region_rounds"], state["every"]

    def codec_for(self, claim: str) -> Any:
        """``sync.adapt`` in elastic rounds: the encoder of the codec a site's link claim names (a
        healer encodes its first round as its source does); the configured one for any other claim."""
        assert self.adapter is not None
        name = claim.partition("|")[0]
        codec = name if name in self.adapter.codecs else self.cfg.codec.name
        was, self.codec = self.codec, codec
        try:
            return self.reducer(0).codec
        finally:
            self.codec = was


def _link_claim(codec: str, measured: str) -> str:
    """What an elastic site claims in a round's meeting: the codec it encodes with, and its
    measurements of its last committed round ("" for none)."""
    return f"{codec}|{measured}"
