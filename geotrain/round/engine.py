"""The one driver of rounds: when a part of the model syncs, what it sends, what is done with the
sum, and how the run ends, for every combination of membership, schedule, tiers and policies.

A round is made of parts chosen independently from the config (docs/ROUND.md):

* the **schedule** (:mod:`.schedule`): slots of a cycle of H steps, slot k ending with fragment
  k mod F's sync (DiLoCo: F = 1);
* the **pace** (:class:`geotrain.round.pace.RoundClock`): when a slot ends (its lock-step steps,
  a time budget under ``sync.pace=adaptive``, the boundary the sites agreed on, the hub's steps);
* the **tiers** (``sync.region_every``): each slot's sync is a region round, every
  ``region_every``-th of a fragment's also a world round;
* the **membership and exchange** (:class:`.fixed.FixedWorld`; elastic rounds; a hub): who sums
  the part's pseudo-gradient and how, through the part's codec (:class:`SiteReducer`);
* the **outer step** (:class:`.outer.Globals`): DiLoCo's step and copy, or Streaming DiLoCo's
  merge τ steps later with α (its eager variant applies at once);
* the **policies** that read each round's outcome: pace, network adaptation (``sync.adapt``),
  token weights, the update guard.

The engine is the only optimizer-hook class of rounds: the training loop stays
``zero_grad -> backward -> step``, and the engine's hooks run the rounds.
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
from geotrain.config import SyncConfig
from geotrain.errors import RoundFailed
from geotrain.round.adapt import NetworkAdapter
from geotrain.round.fixed import FixedWorld
from geotrain.round.hub import Hub, Rejoin
from geotrain.round.hub_rounds import HubRounds
from geotrain.round.membership import MemberRounds
from geotrain.round.merge import first_round_steps
from geotrain.round.outer import Globals, outer_step_
from geotrain.round.pace import RoundClock, round_limit
from geotrain.round.parts import REGION, WORLD, InFlight, Outcome, done
from geotrain.round.schedule import Schedule, fragment_count
from geotrain.round.world import region_hubs
from geotrain.sync.base import PrivateAverage, SyncAlgorithm, params_hash, views_like
from geotrain.sync.guard import UpdateGuard
from geotrain.sync.reducer import SiteReducer

T = TypeVar("T")


class RoundEngine(MemberRounds, HubRounds, SyncAlgorithm):
    """DiLoCo and Streaming DiLoCo as one engine (see the module docstring).

    Args:
        cfg: the sync section.
        members: the fixed world's rounds.
        timed: the run ends on ``train.max_seconds`` (the sites agree on the time at slot ends).
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
        timed: bool = False,
        private: PrivateAverage | None = None,
        guard: UpdateGuard | None = None,
        delayed: bool = False,
        region: str = "",
        hub: bool = False,
        rejoin: Rejoin | None = None,
    ) -> None:
        super().__init__(model, optimizer, comm, grad_clip)
        self.region_name = region  # elastic rounds of two tiers: this site's region (its world is its own site)
        self.cfg, self.members, self.name = cfg, members, cfg.algorithm
        self.private, self.guard = private, guard
        topo = comm.groups.topology
        self.num_sites, self.me = topo.num_sites, comm.groups.me.site_index
        self.site_workers = topo.workers[self.me]
        # FSDP over sites of different sizes: each site gathers its pseudo-gradient whole in the
        # site and sums it across sites as replicated sites do, then cuts its shards back out
        self.resharded = self.sharded and len(set(topo.workers)) > 1
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
        self.codec: str = cfg.codec
        self.overlaps = self.streaming  # its exchanges run beside compute, one thread in submission order
        self._network = DaemonPool(1, "wan-exchange")  # daemon: a failed rank exits mid-exchange
        self.clock = RoundClock(comm, self.schedule.length(1), cfg.pace == "adaptive" and not hub)  # (a hub paces quorum rounds)
        self.timed = timed
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
            self.overlaps = self.streaming
            self.clock.limit = first_round_steps(cfg) if not self.streaming else self.clock.limit
            hubs = region_hubs(topo) if cfg.region_every else [0]
            home = rejoin is None and self.me == (hubs[topo.region_of[self.me]] if hubs[1:] else 0)
            theta = self.full_tensors(self.global_params) if home else None  # (under FSDP: the hub holds whole tensors)
            self.hub = Hub(cfg, comm, theta, [p.shape for p in self.local_params()], sum(p.numel() for p in self.params),
                           self.schedule.fragments, rejoin)  # fmt: skip

    # ------------------------------------------------------------------ parts

    @property
    def H(self) -> int:
        return self.schedule.H

    @property
    def F(self) -> int:  # type: ignore[override]
        return self.schedule.F

    def _adapter(self, cfg: SyncConfig) -> NetworkAdapter:
        """``sync.adapt``: its formula's P is the whole pseudo-gradient (under FSDP too: the site's
        shards carry all of it); Streaming chooses the fragment count as well (counts that leave no
        fragment empty); with tiers it chooses the world tier's period and codec."""
        P = sum(p.numel() for p in self.params)
        assert cfg.adapt is not None
        if self.tiers:
            a = NetworkAdapter(cfg.adapt, self.comm, P, self.every * cfg.H, cfg.codec)
            topo = self.comm.groups.topology
            a.across_regions, a.regions = True, len(set(topo.region_of))
        elif self.streaming:
            s = self.schedule
            counts = [f for f in cfg.adapt.fragment_choices(cfg.fragments) if all(s.__class__(s.names, s.sizes, 1, f).fragments)]
            a = NetworkAdapter(cfg.adapt, self.comm, P, cfg.H, cfg.codec, (s.F, sorted({*counts, s.F}), self.tau))
        else:
            a = NetworkAdapter(cfg.adapt, self.comm, P, cfg.H, cfg.codec)
        a.paced = self.clock.adaptive
        return a

    def reducer(self, f: int, tier: str = WORLD) -> SiteReducer:
        """Fragment ``f``'s reducer for ``tier`` in the codec in force (adaptation chooses the world
        tier's), made once per codec, fragment count and tier."""
        codec = self.codec if tier == WORLD or not self.tiers else self.cfg.codec
        key = (codec, self.F, f, tier)
        if key not in self._reducers:
            cfg = self.cfg if codec == self.cfg.codec else self.cfg.model_copy(update={"codec": codec})
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

    def _whole(self, delta: torch.Tensor, f: int) -> torch.Tensor:
        """Fragment ``f``'s values laid out like this rank's parameters, whole: under FSDP gathered
        in the site (every rank together); else ``delta`` itself."""
        if not self.sharded:
            return delta
        from torch.distributed.tensor import DTensor

        frag = self.schedule.fragments[f]
        local = [self.local_params()[i] for i in frag]
        params = [self.params[i] for i in frag]
        whole = [
            DTensor.from_local(t, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()
            if isinstance(p, DTensor)
            else t
            for t, p in zip(views_like(delta, local), params, strict=True)
        ]
        return torch.cat([w.reshape(-1) for w in whole])

    def _own_values(self, wire: torch.Tensor, which: list[int]) -> list[torch.Tensor]:
        """This rank's part of each of the parameters ``which`` in the whole flat ``wire`` (FSDP:
        its shards, cut where FSDP cuts them, without communication)."""
        params = [self.params[i] for i in which]
        if not self.sharded:
            return views_like(wire, params)
        from torch.distributed.tensor import DTensor, distribute_tensor

        return [
            distribute_tensor(w, p.device_mesh, p.placements, src_data_rank=None).to_local() if isinstance(p, DTensor) else w
            for w, p in zip(views_like(wire, params), params, strict=True)
        ]

    def _wire(self, delta: torch.Tensor, f: int) -> torch.Tensor:
        """What crosses sites of fragment ``f``'s Δ in a peer exchange: under FSDP over sites of
        different sizes the whole vector (local rank i holds different shards at different sites)."""
        return self._whole(delta, f) if self.resharded else delta

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
            sent, t0 = self._sent(), time.perf_counter()
            try:
                self.members.sum(across, self.reducer(f, WORLD), since, ids[1] - 1, own=False)
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

    # ------------------------------------------------------------------ network adaptation

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
        self.schedule.build(H, F, t)
        self.globals.build(self.schedule.fragments)
        self._since = [[0] * self.num_sites for _ in range(F)]
        self._since_world = [[0] * self.num_sites for _ in range(F)]
        self.region_syncs = [0] * F
        self.in_slot = 0
        self.clock.H = self.clock.limit = self.schedule.length(1)

    # ------------------------------------------------------------------ eager Streaming DiLoCo

    def _settle_eager(self, f: int, into: torch.Tensor) -> None:
        """Eager: wait for fragment ``f``'s last exchange and add to ``into`` what that round still
        owes: its average over the sites the guard kept, minus what this site applied at once. A
        round that failed altogether owes only the removal of what was applied at once."""
        if f not in self.inflight:
            return
        x = self.inflight.pop(f)
        applied, average = self.previous.pop(f)
        out = self._wait(x.future)
        if out.ok:
            into.add_(average)
        else:
            self._note_rollback(out.reason)
        into.sub_(applied)

    @torch.no_grad()
    def _eager_step(self, f: int, local: torch.Tensor, steps: int) -> None:
        """The eager outer step of fragment ``f`` (Kale et al. arXiv:2502.12996): what its last round
        owes plus this site's fresh Δ/M at once, while the fresh Δ's exchange starts. The guard
        judges the own Δ before it is applied, by the rule and the history every site shares."""
        step = torch.zeros_like(local)
        self._settle_eager(f, step)
        self.members.faults.corrupt_update(local, self.rounds)
        kept = self.guard is None or self.guard.would_include(local, f)
        applied = local / self.num_sites if kept else torch.zeros_like(local)
        step.add_(applied)
        outgoing = local.clone()
        fut = self._network.submit(self._flat_job(f, outgoing, [steps] * self.num_sites, steps, self.rounds))
        self.inflight[f] = InFlight(0, fut, outgoing)
        self.previous[f] = (applied, outgoing)  # ``outgoing`` becomes the average once the exchange is done
        params = self.globals.params(WORLD, f)
        outer_step_(self.globals.steps[(WORLD, f)], params, step)
        self.globals.merge(WORLD, f, self.local_params(), 0.0)

    @torch.no_grad()
    def _finish_eager(self) -> None:
        """Per fragment, one last blocking outer step: the other sites' shares of the last eager
        round plus, if the fragment trained since its last sync, the exact average of the fresh
        pseudo-gradients; then the sites' global models are averaged."""
        t = self.local_steps
        for f in range(self.F):
            params = self.globals.params(WORLD, f)
            step = torch.zeros(sum(g.numel() for g in params))
            self._settle_eager(f, step)
            if self.schedule.last_sync[f] < t:
                delta = self.globals.delta(WORLD, f, self.local_params())
                steps = t - self.schedule.last_sync[f]
                out = self._wait(self._network.submit(self._flat_job(f, delta, [steps] * self.num_sites, steps, self.rounds)))
                if out.ok:
                    step.add_(delta)
                else:
                    self._note_rollback(out.reason)
                self.schedule.synced(f, t)
                self.rounds += 1
            outer_step_(self.globals.steps[(WORLD, f)], params, step)
        flat = torch.cat([g.reshape(-1) for g in self.global_params])
        self.comm.all_reduce_across_sites(flat)
        flat.div_(self.num_sites)
        for g, v, p in zip(self.global_params, views_like(flat, self.global_params), self.local_params(), strict=True):
            g.copy_(v)
            p.copy_(g)

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
            return step if passed and not self.world_broken else None
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

    # ------------------------------------------------------------------ checkpoints

    def checkpoint_state(self) -> dict[str, Any]:
        """Everything to continue exactly; exchanges in flight are waited for first (their
        averaged Δ and merge step are kept)."""
        if self.eager:
            raise ValueError("checkpoints of the eager streaming variant are not supported")
        pending = {}
        for f, x in self.inflight.items():
            try:
                out = self._wait(x.future)
            except RoundFailed as exc:
                out = Outcome(False, str(exc))
            frag = self.schedule.fragments[f]
            avg = None if out.average is None else self.shards_out(out.average, frag) if self.sharded else out.average.clone()
            pending[f] = {"at": x.merge_at, "ok": out.ok, "reason": out.reason, "average": avg, "stepped": out.stepped,
                          "tier": out.tier, "contributors": out.contributors}  # fmt: skip
        reducers = {f"{k[3]}/{k[2]}": self.reducer_out(r, self.schedule.fragments[k[2]]) for k, r in self._reducers.items()
                    if k[0] == (self.codec if k[3] == WORLD or not self.tiers else self.cfg.codec) and k[1] == self.F}  # fmt: skip
        return {
            **super().checkpoint_state(),
            "format": 2,
            "globals": self.globals.state_dict(
                lambda ts: self.shards_out(ts) if self.sharded else [t.clone() for t in ts], self.optim_out
            ),  # fmt: skip
            "schedule": self.schedule.state_dict(),
            "reducers": reducers,
            "pending": pending,
            "since": [list(s) for s in self._since],
            "since_world": [list(s) for s in self._since_world],
            "region_syncs": list(self.region_syncs),
            "region_rounds": self.region_rounds,
            "every": self.every,
            "codec": self.codec,
            "in_slot": self.in_slot,
            "slots": self.slots,
            "clock": self.clock.state_dict(),
            "adapt": None if self.adapter is None else self.adapter.state_dict(),
            "guard": None if self.guard is None else self.guard.state_dict(),
            "region": self.region_name,
            "hub": None if self.hub is None else self.hub.state_dict(),
        }

    @torch.no_grad()
    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        if state.get("format") != 2:
            raise ValueError("this checkpoint's sync state is of an earlier geotrain (before the round engine); start afresh")
        super().load_checkpoint_state(state)
        sched = state["schedule"]
        if (sched["H"], sched["F"]) != (self.H, self.F):
            self._rebuild(int(sched["H"]), int(sched["F"]), int(sched["base"]))
        self.schedule.load_state_dict(sched)
        self.globals.load_state_dict(state["globals"], self.shards_in, self.optim_in)
        self.codec, self.every = state["codec"], int(state["every"])
        for key, saved in state["reducers"].items():
            tier, f = key.split("/")
            self.reducer(int(f), tier).load_state_dict(self.reducer_in(saved))
        self.inflight = {}
        for f, p in state["pending"].items():
            avg = None if p["average"] is None else self.shards_in(p["average"], flat=True)
            out = Outcome(p["ok"], p["reason"], avg, p["stepped"], p["tier"], p["contributors"])
            self.inflight[int(f)] = InFlight(int(p["at"]), done(out), avg if avg is not None else torch.zeros(0))
        self._since = [list(s) for s in state["since"]]
        self._since_world = [list(s) for s in state["since_world"]]
        self.region_syncs = list(state["region_syncs"])
        self.region_rounds = int(state["region_rounds"])
        self.in_slot, self.slots = int(state["in_slot"]), int(state["slots"])
        self.clock.load_state_dict(state["clock"])
        if self.adapter is not None and state.get("adapt") is not None:
            self.adapter.load_state_dict(state["adapt"])
        if self.guard is not None and state["guard"] is not None:
            self.guard.load_state_dict(state["guard"])
        if self.hub is not None and state.get("hub") is not None:
            self.hub.load_state_dict(state["hub"])
        if self.tiers and state.get("region", self.region_name) != self.region_name:
            # a heal from a site of another region (none of this region was alive): the region
            # restarts from the world model, with fresh momentum and no error feedback
            self.globals.region = [g.clone() for g in self.globals.world]
            self.globals.steps = {}
            self.globals.build(self.schedule.fragments)
            for key, r in self._reducers.items():
                if key[3] == REGION:
                    r.forget_residual()

    def forget_feedback(self) -> None:
        """Drop every codec's error-feedback residual (a healed site's state is its source's)."""
        for r in self._reducers.values():
            r.forget_residual()

    # ------------------------------------------------------------------ quorum rounds of a healing membership

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
        """What a late site takes in a heal: the global models, their steps and the round counts."""
        keep = ("globals", "rounds", "rolled_back", "format")
        return {k: v for k, v in self.checkpoint_state().items() if k in keep}

    @torch.no_grad()
    def load_global_state(self, state: dict[str, Any]) -> None:
        """A late site's heal: the source's global models and round counts; the rest stays its own."""
        self.globals.load_state_dict(state["globals"], self.shards_in, self.optim_in)
        self.rounds, self.rounds_rolled_back = state["rounds"], state["rolled_back"]

    def codec_for(self, claim: str) -> Any:
        """``sync.adapt`` in elastic rounds: the encoder of the codec a site's link claim names (a
        healer encodes its first round as its source does); the configured one for any other claim."""
        assert self.adapter is not None
        name = claim.partition("|")[0]
        codec = name if name in self.adapter.codecs else self.cfg.codec
        was, self.codec = self.codec, codec
        try:
            return self.reducer(0).codec
        finally:
            self.codec = was
