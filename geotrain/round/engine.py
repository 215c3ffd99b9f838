"""The one driver of rounds: when a part of the model syncs, what it sends, what is done with the
sum, and how the run ends, for every combination of membership, schedule, tiers and policies.

A round is made of parts chosen independently from the config (docs/ROUND.md):

* the **schedule** (:mod:`.schedule`): slots of a cycle of H steps, slot k ending with fragment
  k mod F's sync (DiLoCo: F = 1);
* the **pace** (:class:`geotrain.round.pace.RoundClock`): when a slot ends (its lock-step steps,
  a time budget under ``sync.pace=adaptive``, the boundary the sites agreed on, the hub's steps);
* the **tiers** (``sync.region_every``): a region round, every ``region_every``-th also a world round;
* the **membership and exchange** (:class:`.fixed.FixedWorld`; elastic rounds; a hub): who sums
  the part's pseudo-gradient and how, through the part's codec (:class:`SiteReducer`);
* the **outer step** (:class:`.outer.Globals`): DiLoCo's step and copy, or Streaming DiLoCo's
  merge τ steps later with α (its eager variant applies at once);
* the **policies** that read each round's outcome: pace, network adaptation (``sync.adapt``),
  token weights, the update guard.

The only optimizer-hook class of rounds: the loop stays ``zero_grad -> backward -> step``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import torch
import torch.nn as nn

from geotrain.comm.collectives import Collectives
from geotrain.comm.threads import DaemonPool
from geotrain.config import LivenessConfig, SyncConfig
from geotrain.round.adapt import NetworkAdapter
from geotrain.round.adaptation import Adaptation
from geotrain.round.eager import EagerSteps
from geotrain.round.fixed import FixedWorld
from geotrain.round.hub import Hub, Rejoin
from geotrain.round.hub_rounds import HubRounds
from geotrain.round.membership import MemberRounds
from geotrain.round.merge import first_round_steps
from geotrain.round.outer import Globals
from geotrain.round.pace import RoundClock, round_limit
from geotrain.round.parts import REGION, WORLD, InFlight
from geotrain.round.peer import PeerRounds
from geotrain.round.schedule import Schedule, fragment_count
from geotrain.round.state import EngineState
from geotrain.round.world import region_hubs
from geotrain.sync.base import PrivateAverage, params_hash
from geotrain.sync.guard import UpdateGuard
from geotrain.sync.reducer import SiteReducer, with_codec

T = TypeVar("T")


class RoundEngine(PeerRounds, MemberRounds, HubRounds, Adaptation, EagerSteps, EngineState):
    """DiLoCo and Streaming DiLoCo as one engine (see the module docstring).

    Args:
        cfg: the sync section.
        members: the fixed world's rounds.
        private, guard: private aggregation and the update guard of the pseudo-gradients.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        comm: Collectives,
        grad_clip: float,
        cfg: SyncConfig,
        members: FixedWorld,
        *,
        private: PrivateAverage | None = None,
        guard: UpdateGuard | None = None,
        delayed: bool = False,
        region: str = "",
        hub: bool = False,
        rejoin: Rejoin | None = None,
        site_sizes: tuple[int, ...] = (),
        heals: bool = False,
        liveness: LivenessConfig | None = None,
    ) -> None:
        super().__init__(model, optimizer, comm, grad_clip)
        self.region_name = region  # elastic rounds of two tiers: this site's region (its world is its own site)
        self.heals = heals
        self.cfg, self.members, self.name = cfg, members, cfg.algorithm
        self.private, self.guard = private, guard
        topo = comm.groups.topology
        self.num_sites, self.me = topo.num_sites, comm.groups.me.site_index
        self.site_workers = topo.workers[self.me]
        # FSDP over sites of different sizes: each site gathers its pseudo-gradient whole in the
        # site and sums it across sites as replicated sites do, then cuts its shards back out
        self.resharded = self.sharded and len(set(site_sizes or topo.workers)) > 1  # (the run's sites, not this world's)
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.schedule = Schedule(names, [p.numel() for p in self.params], cfg.H, fragment_count(cfg, len(self.params)))
        self.tiers = bool(cfg.region_every) and not hub  # (a hub runs the tiers of quorum rounds itself)
        self.every = cfg.region_every
        self.globals = Globals(self.local_params(), cfg, self.tiers, delayed)
        self.globals.build(self.schedule.fragments)
        self.global_params = self.globals.world
        self.streaming = cfg.algorithm == "streaming"
        self.tau, self.eager = (cfg.tau, cfg.eager) if self.streaming else (0, False)
        self.alpha = cfg.alpha if self.streaming else 0.0
        self.codec: str = cfg.codec.name
        # Streaming's exchanges run beside compute, one thread in submission order (but not where a
        # world round of two tiers gathers its Δ whole in the site: FSDP over sites of different sizes)
        self.overlaps = self.streaming and not (self.tiers and self.resharded)
        self._network = DaemonPool(1, "wan-exchange")  # daemon: a failed rank exits mid-exchange
        self.clock = RoundClock(comm, self.schedule.length(1), cfg.pace == "adaptive" and not hub)  # (a hub paces quorum rounds)
        if self.overlaps:  # the exchange thread uses lane 0's site group: the slot vote takes the training thread's
            self.clock.sum_in_site = comm.all_reduce_intra
        self.adapter: NetworkAdapter | None = None
        if cfg.adapt is not None:
            self.adapter = self._adapter(cfg)
        self._reducers: dict[tuple[str, int, int, str], SiteReducer] = {}
        self.inflight: dict[int, InFlight] = {}
        self.previous: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # eager: (applied at once, its exchange's result)
        F = self.schedule.F
        self._since = [[0] * self.num_sites for _ in range(F)]  # per fragment: every site's steps since its sync
        self._since_world = [[0] * self.num_sites for _ in range(F)]  # tiers: ... since its last world round
        self.region_syncs = [0] * F  # tiers: each fragment's region rounds since its last world round
        self.in_slot = 0  # steps in the slot under way
        self.slots = 0  # slots ended in the run
        self.rollback_reasons: list[str] = []
        self.contributors = 0
        self._finishing = False
        self._decision: tuple[int, Future[bool]] | None = None  # streaming adaptation: (applied at step, agreement)
        self._exchanges: list[tuple[int, float]] = []  # (bytes, seconds) of each exchange since the last measurement
        self._lap_step = 0
        self._total_steps = 0
        if hub:  # asynchronous quorum rounds: the hub steps the global model; a site delivers and adopts
            self.clock.limit = first_round_steps(cfg) if not self.streaming else self.clock.limit
            hubs = region_hubs(topo) if cfg.region_every else [0]
            home = rejoin is None and self.me == (hubs[topo.region_of[self.me]] if hubs[1:] else 0)
            theta = self.full_tensors(self.global_params) if home else None  # (under FSDP: the hub holds whole tensors)
            self.hub = Hub(cfg, comm, theta, [p.shape for p in self.local_params()], sum(p.numel() for p in self.params),
                           self.schedule.fragments, rejoin, liveness or LivenessConfig())  # fmt: skip

    # ------------------------------------------------------------------ parts

    @property
    def H(self) -> int:
        return self.schedule.H

    @property
    def F(self) -> int:  # type: ignore[override]
        return self.schedule.F

    def reducer(self, f: int, tier: str = WORLD) -> SiteReducer:
        """Fragment ``f``'s reducer for ``tier`` in the codec in force (adaptation chooses the world
        tier's), made once per codec, fragment count and tier."""
        codec = self.codec if tier == WORLD or not self.tiers else self.cfg.codec.name
        key = (codec, self.F, f, tier)
        if key not in self._reducers:
            cfg = with_codec(self.cfg, codec)
            frag = self.schedule.fragments[f]
            shapes = [(self.params[i].shape if self.resharded else self.local_params()[i].shape) for i in frag]
            self._reducers[key] = SiteReducer(
                cfg, self.comm, shapes, seed=f, sharded=self.sharded and not self.resharded, region=tier == REGION
            )
        return self._reducers[key]

    # ------------------------------------------------------------------ the inner step's hooks

    def sync_gradients(self) -> None:
        if self.sharded:  # FSDP's reduce-scatter has averaged them over the site
            self._noise_shards()
            self._clip_sharded()
        else:
            self._average_gradients(self.site_workers, self.comm.all_reduce_intra)
        self.clock.vote(self.in_slot)  # adaptive pace: does the slot end after this step?

    def add_compute(self, seconds: float) -> None:
        self.clock.add_compute(seconds)
        if self.hub is not None:  # what the hub measures a site's rate from (dynamic local steps)
            if self.hub.t0 is None:
                self.hub.t0 = time.perf_counter() - seconds
            self._round_compute += seconds

    def after_step(self) -> None:
        super().after_step()
        t, t0 = self.local_steps, time.perf_counter()
        if not self.eager:
            due = [f for f, x in self.inflight.items() if x.merge_at <= t]
            for f in due:
                self._settle(f)
            if due and self.clock.exchanges and self.overlaps:  # a merge's wait is part of this site's time per step
                self.clock.add_compute(time.perf_counter() - t0)
        if self._decision is not None and self._decision[0] <= t and self._apply_decision(t):
            return  # a new schedule starts at this step
        self.in_slot += 1
        while self.clock.ends(self.in_slot) and self._end_slot():  # (postponed: retried after the next step)
            pass

    # ------------------------------------------------------------------ slots and syncs

    def _end_slot(self) -> bool:
        """The slot under way ends: every site's steps in it (the control exchange, where pace or a
        time limit needs it), then its fragment's sync. False: its round was postponed."""
        if self.elastic is not None:
            return self._member_slot()
        if self.hub is not None:
            return self._hub_slot()
        s = self.schedule
        f = s.next_fragment
        self._add_slot_counts()
        if self.adapter is not None and self.overlaps and f == 0:
            self._measure(self.local_steps)  # the end of a cycle: before fragment 0's sync, which counts in the next
        if f in self.inflight and not self.eager:  # its last average has not merged yet: merge it first
            self._settle(f)
        s.slot += 1
        self.slots += 1
        self._sync(f)  # (adaptation may rebuild the schedule from this step)
        self.in_slot = 0
        self.clock.H = max(1, s.length(s.slot + 1)) if self.clock.adaptive else s.length(s.slot + 1)
        if not self._tiered_time:
            self.clock.next_round(self.slots)
        if not self.clock.adaptive:
            self.clock.limit = self.clock.H
        return True

    @property
    def _tiered_time(self) -> bool:
        """Two tiers without adaptive pace agree on a time limit at world rounds only (a region
        round does not reach the other regions)."""
        return self.tiers and not self.clock.adaptive

    def _add_slot_counts(self) -> None:
        """Every site's steps in the slot under way, added to each fragment's count since its sync."""
        counts = [self.in_slot] * self.num_sites if self._tiered_time else self._count_slot()
        for since in self._since:
            for site, k in enumerate(counts):
                since[site] += k

    def _count_slot(self) -> list[int]:
        """Every site's steps in this slot (control exchange of steps, compute and elapsed time
        where pace or a time limit needs it: one hop, a few bytes)."""
        if not self.clock.exchanges:
            return self.clock.exchange(self.in_slot)
        return self._control(self.clock.exchange, self.in_slot)

    def _control(self, fn: Callable[..., T], *args: Any) -> T:
        """A control exchange across sites: on the exchange thread where exchanges run beside
        compute (behind them, in the same order on every site: it uses lane 0 as they do)."""
        return self._wait(self._network.submit(fn, *args)) if self.overlaps else fn(*args)

    def _counts(self, f: int) -> list[int]:
        """Every site's steps in fragment ``f``'s sync (reset for the next)."""
        counts, self._since[f] = self._since[f], [0] * self.num_sites
        return counts

    @torch.no_grad()
    def _sync(self, f: int) -> None:
        """Fragment ``f`` syncs at this step: its pseudo-gradient goes to the exchange (in the
        background where the exchange overlaps compute), its merge follows τ steps later."""
        t = self.local_steps
        steps = t - self.schedule.last_sync[f]
        counts = self._counts(f)
        delta = self.globals.delta(REGION if self.tiers else WORLD, f, self.local_params())
        self.schedule.synced(f, t)
        if self.eager:
            self.rounds += 1
            self._eager_step(f, delta, steps)
            return
        if self.tiers:
            self.region_syncs[f] += int(bool(steps))
            self._since_world[f] = [a + b for a, b in zip(self._since_world[f], counts, strict=True)]
            world = self._finishing or self.region_syncs[f] >= self.every
            job = self._tiered_job(f, delta if steps else None, counts, world, (self.region_rounds, self.rounds + 1))
            self.region_rounds += int(bool(steps))
            self.rounds += int(world)
        else:
            job = self._flat_job(f, delta, counts, steps, self.rounds)
            self.rounds += 1
        if self.overlaps:
            if self.private is not None:
                self.private.reserve()
            fut = self._network.submit(job)
        else:
            fut = Future()
            try:
                fut.set_result(job())
            except BaseException as exc:  # noqa: BLE001 - raised where it is settled
                fut.set_exception(exc)
        self.inflight[f] = InFlight(t + self.tau, fut, delta)
        if self.tau == 0:
            self._settle(f)

    def _key(self, f: int) -> int:
        """The guard's history for fragment ``f`` (Streaming with adaptation: one per H, F and
        fragment, a merge keeping alpha of the local drift so that a norm does not scale with steps)."""
        return f if self.adapter is None or not self.streaming else (self.H * 4097 + self.F) * 4096 + f

    def _per(self, steps: int) -> int:
        """The guard's norms per inner step where H varies and a pseudo-gradient's norm grows with its steps (DiLoCo's)."""
        return max(1, steps) if self.cfg.adapt is not None and not self.streaming else 1

    def _note_rollback(self, why: str) -> None:
        self.rounds_rolled_back += 1
        self.rollback_reasons.append(why)

    @torch.no_grad()
    def _settle(self, f: int) -> None:
        """Fragment ``f``'s sync is taken in: its exchange waited for (counted as waiting on the
        network), its step and merge, or its rollback."""
        x = self.inflight.pop(f)
        if self.hub is not None:
            self._settle_hub(f, x)
            return
        out = self._wait(x.future)
        if self.elastic is not None and out.answer is not None:  # an elastic round that ran beside compute
            self._settle_member(out.answer)
            return
        local = self.local_params()
        if out.stepped:
            self.globals.merge(out.tier, f, local, self.alpha)
            if out.world is not None or out.carry is not None:
                self._after_world(out, f)
            return
        if not out.ok:
            if self.adapter is not None and not self.overlaps:  # nothing to measure: the next round keeps H and codec
                self.adapter.skip_round()
            for i in self.schedule.fragments[f]:
                local[i].copy_(self.global_params[i])
            self._note_rollback(out.reason)
            return
        assert out.average is not None
        self.contributors = out.contributors
        self.globals.step(WORLD, f, out.average, out.contributors)
        self.globals.merge(WORLD, f, local, self.alpha)
        if self.adapter is not None and not self.overlaps:
            self._adapt_round()

    def _wait(self, fut: Future[T]) -> T:
        """Block the training thread until ``fut`` is done; the time counts as waiting on the network."""
        if fut.done():
            return fut.result()
        t0 = time.perf_counter()
        try:
            return fut.result()
        finally:
            self.comm.add_wait(time.perf_counter() - t0)

    # ------------------------------------------------------------------ what the loop asks

    def set_limits(self, steps: int, max_seconds: float) -> None:
        self._total_steps = steps
        if self.hub is not None:  # each site checks its own clock; the final round is synchronous
            self.hub.max_seconds = max_seconds
            if self.hub.syncer is not None:  # (after a resume has loaded its state)
                self.hub.syncer.start()
            return
        self.clock.max_seconds = max_seconds
        if self.clock.adaptive:  # the calibration slot, then ceil(steps / H) cycles; with sync.adapt (its H
            # changes) until the site furthest ahead has run the steps
            adapted = self.adapter is not None
            self.clock.end_after(max_rounds=0 if adapted else 1 + self.F * -(-steps // self.H), max_steps=steps if adapted else 0)

    @property
    def done(self) -> bool:
        return self.clock.done if self.hub is None else self.hub.done

    @property
    def world_broken(self) -> bool:
        return self.hub is not None and self.hub.world_broken

    @property
    def lost_sites(self) -> list[int]:  # type: ignore[override]
        return [] if self.hub is None else self.hub.lost_sites

    def gather_records(self, record: Any) -> list[Any]:
        if self.hub is None or not self.world_broken:
            return super().gather_records(record)
        return self.hub.gather_records(record, self.comm.groups.world)

    def step_limit(self, steps: int) -> int:
        if not self.clock.adaptive:
            return steps
        if self.clock.max_steps:  # (sync.adapt) the last round may start just short of the steps, at the longest H
            return steps + round_limit(self.cfg.adapt.H_max if self.cfg.adapt is not None else self.H)
        return self.clock.first + (self.clock.max_rounds - 1) * round_limit(self.schedule.longest())

    def _every_slots(self, every: int) -> int:
        return max(1, every * self.F // self.H)

    def eval_due(self, step: int, every: int) -> bool:
        if self.hub is not None:
            return False  # an evaluation is collective: only at the start and after the final round
        if not self.clock.adaptive:
            return super().eval_due(step, every)
        # sites run different steps: at slot ends, about every ``every`` steps of the fastest site
        return self.in_slot == 0 and self.slots % self._every_slots(every) == 0

    def checkpoint_due(self, step: int, every: int) -> int | None:
        if self.hub is not None:  # after a checkpoint's barrier round, while every site is in the run's world
            passed, self._barrier_passed = self._barrier_passed, False
            if not passed or self.world_broken:
                return None
            # (dynamic local steps: the sites are at different steps; the folder is named by the run's
            # rank-steps at the barrier, the same on every site, and each rank's file holds its own step)
            return self.hub.world_total if self.cfg.dynamic_quorum_steps else step
        if not self.clock.adaptive:
            return super().checkpoint_due(step, every)
        # at slot ends (the same slots on every site); the folder is named by the leading site's step
        if self.in_slot or self.slots % self._every_slots(every):
            return None
        return max(self.clock.totals)

    def world_steps(self, step: int) -> int:
        if self.hub is not None:
            return self.hub.world_total
        if not self.clock.adaptive:
            return super().world_steps(step)
        return self.clock.world_steps(list(self.comm.groups.topology.workers))

    def pace_log(self) -> list[dict[str, Any]]:
        if self.hub is not None:
            return [] if self.hub.syncer is None else list(self.hub.syncer.log)
        return self.clock.log

    def adapt_log(self) -> list[dict[str, Any]]:
        if self.hub is not None:
            s = self.hub.syncer
            return [] if s is None or s.adapter is None else list(s.adapter.log)
        return [] if self.adapter is None else self.adapter.log

    def _privacy_allows_round(self) -> bool:
        if self.elastic is not None and not self.elastic.affords():  # site-level DP inside elastic rounds
            return False
        return self.private is None or self.private.can_afford()

    def budget_exhausted(self) -> bool:
        return self.in_slot == 0 and not self._privacy_allows_round()

    def in_flight_bytes(self) -> int:
        """fp32 bytes of pseudo-gradient fragments whose exchange has not finished."""
        return sum(4 * x.delta.numel() for x in self.inflight.values() if not x.future.done())

    def global_parameters(self) -> list[torch.Tensor]:
        if self.tiers:  # the exchange thread steps the world model: a whole one once the exchanges in flight are done
            for x in self.inflight.values():
                self._wait(x.future)
        return self.global_params

    def global_hash(self) -> str:
        """sha256 of the global model (sharded: gathered in the site; every rank calls it); in
        elastic rounds of two tiers, of the world's and this site's region's: what a heal compares."""
        held = self.full_tensors(self.global_parameters())
        return params_hash(held + self.full_tensors(self.globals.region) if self.tiers and self.elastic is not None else held)

    # ------------------------------------------------------------------ the end of the run

    def finish(self) -> None:
        """Bring every site onto one model: what is in flight, then one more sync of every fragment
        that trained since its last (with two tiers, reaching the world tier), or (eager) what is
        still owed and the sites' global models averaged."""
        if self._decision is not None:  # the last measurement's choice is not applied: the run ends
            self._wait(self._decision[1])
            self._decision = None
        if self.eager:
            self._finish_eager()
            self._network.shutdown()
            return
        if self.elastic is not None:
            self._finish_members()
            self._network.shutdown()
            return
        if self.hub is not None:
            self._finish_hub()
            self._network.shutdown()
            return
        for f in list(self.inflight):
            self._settle(f)
        if self.in_slot:  # the last slot's steps, counted before the last syncs
            self._add_slot_counts()
        self._finishing = True
        t = self.local_steps
        for f in range(self.F):
            if not (self.schedule.last_sync[f] < t or self.region_syncs[f]):
                continue
            if not self._privacy_allows_round():
                local = self.local_params()
                for i in self.schedule.fragments[f]:
                    local[i].copy_(self.global_params[i] if not self.tiers else self.globals.region[i])
                self._note_rollback("privacy budget: the last partial round is not released")
                self.schedule.synced(f, t)
                continue
            self._sync(f)
            if f in self.inflight:
                self._settle(f)
        self.in_slot = 0
        self._network.shutdown()

    def close(self) -> None:
        # no join: after finish() the thread is idle, and after a failure it may be blocked on a peer
        self._network.shutdown(wait=False)
        if self.hub is not None:
            self.hub.close(timeout_s=1.0)
        super().close()
