"""One site's part in the elastic rounds: sites that die, hang or come back without stopping the others.

In elastic mode (``elastic.enabled``) every site is its own torch.distributed job; sites meet
once per DiLoCo outer round. A round is built from parts, each in its own module:

1. **membership**: local rank 0 asks torchft's Lighthouse for the round's quorum
   (:mod:`geotrain.elastic.coordinator`), a hint of who to meet and where
   (:mod:`geotrain.elastic.hints`); fewer than ``min_sites`` pauses training, a Lighthouse that
   is down postpones the round (inner steps go on, it is asked again every step);
2. **meeting** (:mod:`geotrain.elastic.meeting`): in one site's authenticated round store
   (:mod:`geotrain.comm.authstore`) every site proves the run's key over fresh nonces and
   claims what it holds; one agreed view names the round, its heal source and its healers
   (:mod:`geotrain.elastic.view`); a site that cannot prove it is left out;
3. **exchange** (:mod:`geotrain.elastic.exchange`, a thread): healing state from the source to the healers
   (once per site), then each carrier sums its part with the same local rank of every admitted site, fp32,
   encoded or masked, weighted; every wait watches the peers' heartbeats (:class:`~.roundstore.Monitor`);
4. **commit** (:mod:`geotrain.elastic.commit`): the site's ranks agree, every site writes a signed vote, and
   any missing or negative vote rolls the round back everywhere (the caller restores the global parameters;
   error feedback keeps its old residual). A site that missed a commit heals at the next round.

docs/ELASTIC.md describes the protocol, its bounds and what was measured; the Lighthouse is
supervised by the launcher (:class:`geotrain.elastic.lighthouse.LighthouseProcess`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from geotrain.comm.authstore import AuthStoreServer
from geotrain.comm.collectives import CommStats
from geotrain.comm.emulate.inprocess import WanEmulator
from geotrain.comm.faults import FaultPlan
from geotrain.comm.identity import Identity
from geotrain.comm.topology import Topology
from geotrain.config import ElasticConfig, LivenessConfig
from geotrain.elastic import commit, roundstore
from geotrain.elastic import view as views
from geotrain.elastic.auth import RunKeys, SealedStore, load_secret
from geotrain.elastic.commit import Contribution
from geotrain.elastic.coordinator import Coordinator
from geotrain.elastic.hints import QuorumHints
from geotrain.elastic.meeting import meet
from geotrain.elastic.roundstore import Monitor
from geotrain.elastic.running import RunningRound, record
from geotrain.elastic.view import HealHooks, RoundView, Schedule, heal_source, same_initial_model
from geotrain.errors import ElasticTimeout, MembershipRefused, RoundFailed

# --------------------------------------------------------------------------- one site's member


def _fatal(exc: MembershipRefused | ElasticTimeout) -> RoundView:
    """A view that stops every rank of the site with ``exc`` (decided by local rank 0)."""
    return RoundView(fatal=str(exc), fatal_timeout=isinstance(exc, ElasticTimeout))


class SiteMember(Schedule):
    """This rank's part in the elastic rounds (see the module docstring).

    Args:
        cfg: the elastic section; ``topology``: the whole run (site names, links).
        site: this site's name; ``local_rank``/``workers``: this rank within the site.
        intra: the site's process group (the site's own torch.distributed world).
        wan: the link emulation (None: loopback speed); ``site_index`` names our end of a link.
        hooks: reads and replaces the training state for healing.
        log: writes one line to this rank's log.
        on_mid_round: called between the reduce-scatter and all-gather of the exchange
            (failure injection "in the middle of an all-reduce").
        identity: makes this site's identity (its own key and the run's pinned keys:
            ``elastic.site_keys``); None: the shared secret only.
    """

    def __init__(
        self,
        cfg: ElasticConfig,
        topology: Topology,
        site: str,
        site_index: int,
        local_rank: int,
        workers: int,
        intra: dist.ProcessGroup,
        wan: WanEmulator | None,
        hooks: HealHooks,
        log: Callable[[str], None],
        on_mid_round: Callable[[], None] | None = None,
        stats: CommStats | None = None,
        incarnation: int = 0,
        identity: Callable[[], Identity] | None = None,
        sharded: bool = False,
        tiers: bool = False,
        collective: bool = False,
        live: LivenessConfig | None = None,
    ) -> None:
        self.cfg, self.live = cfg, live or LivenessConfig()  # (live: failure detection's timing, every wait's bound)
        self.stats = stats if stats is not None else CommStats()
        self.site, self.site_index, self.local, self.G = site, site_index, local_rank, workers
        self.names, self.order = list(topology.site_names), topology.ring_names
        links = [topology.link(a, b) for a in range(topology.num_sites) for b in range(a + 1, topology.num_sites)]
        # the slowest inter-site link (bandwidth, latency): sizes the exchange's backstop timeouts
        self.slowest_link = (min((x.bandwidth_bps for x in links), default=1e9), max((x.latency_s for x in links), default=0.0))
        self.intra, self.wan, self.hooks, self.log, self.on_mid_round = intra, wan, hooks, log, on_mid_round
        self.keys, self.incarnation = RunKeys(load_secret(self.cfg)), incarnation  # (the secret itself is not kept)
        self.faults = FaultPlan(site)  # failure injection: frames altered after sealing, votes missed (fault.tamper, split)
        self.masker: commit.Masker | None = None  # privacy.secure_aggregation: parts masked (PairMasks)
        self.noise: commit.Noise | None = None  # privacy.dp.unit=site: each site's update clipped and noised (RoundNoise)
        # bytes this rank sent to other sites (pseudo-gradients, healing state); what fp32 rings would have sent for
        # them; those of them that left this site's region
        self.inter_bytes = self.raw_bytes = self.region_bytes = 0
        # two tiers (sync.region_every): each site's region; a round's part says its tier (REGION or WORLD)
        self.region_of = {s: topology.region_name(i) for i, s in enumerate(self.names)} if tiers else None
        self.sharded = sharded  # FSDP: each rank carries its own shard, and heals from the same local rank of the source
        # the site's ranks read its state and hash together (FSDP; over sites of different sizes the
        # site carries and heals whole vectors, as replicated sites do, but gathers them first)
        self.collective = sharded or collective
        self.carriers = workers if sharded else topology.carriers
        Schedule.__init__(self, list(topology.workers), site_index)
        self._bytes_lock = threading.Lock()
        self.events: list[dict[str, Any]] = []  # failures this site detected
        self.healed_at_step: int | None = None
        self.joining = False  # a restarted site with no valid state yet: it heals before it trains
        self.record_file: Path | None = None  # local rank 0: one JSON line per round
        self._current: dict[str, Any] = {}
        self._part, self._rest, self._sizes, self._pace, self._link = -1, 0, cast("list[int] | None", None), 0, ""
        self.ping, self.measured = False, (0.0, 0.0)  # sync.adapt: ping the ring first; (seconds after the meeting, ping)
        self.split = False  # the last round that reached its vote committed on some sites only: a finished site stays
        self.codec_for: Callable[[str], commit.Encoder | None] | None = None  # sync.adapt: the codec a link claim names
        self.top = 0  # the most committed rounds a member of the last round held
        self.part, self.average = -1, cast("torch.Tensor | None", None)  # the last round's part (view.round_part), average
        self._hash = ""  # the global model's hash, taken by every rank before rank 0 claims it (sharded: a collective)
        self._pg: tuple[tuple[str, ...], Any] | None = None
        self._last_members: list[str] = []
        self._stores = roundstore.Stores(self.keys.store, self.live.heartbeat_timeout_s)
        self.done = False  # this site has run its steps (it claims so)
        self.stale_power: float | None = None  # quorum rounds: a late site's update counts, times (1 + late)^-power
        self.world_weight = 0.0  # quorum rounds: what a round's weighted sum is divided by (every site's weight, on time)
        self._host_store, self.coordinator = cast("AuthStoreServer | None", None), cast("Coordinator | None", None)
        addr = self.cfg.lighthouse or os.environ.get("GEOTRAIN_LIGHTHOUSE", "")
        if not addr:
            raise MembershipRefused("no Lighthouse address: set elastic.lighthouse (HOST:PORT)")
        self.identity: Identity | None = None
        identity_error = ""  # raised as MembershipRefused by rank 0 where every rank hears it
        if local_rank == 0 and identity is not None:
            try:
                self.identity = identity()
            except (ValueError, OSError) as exc:
                identity_error = f"elastic.site_keys: {exc}"
        self.hints = QuorumHints(site, self.names, self.keys, self.identity, identity_error, log)
        if local_rank == 0:
            bind = os.environ.get("GEOTRAIN_BIND_ADDR", "127.0.0.1")
            self._host_store = AuthStoreServer(bind, self.keys.store, log=log)
            self.coordinator = Coordinator(self.cfg, addr, site, workers, self._host_store.address, log, self.live)

    @property
    def retry_seconds(self) -> float:  # how long a postponed round waits before it is retried
        return self.live.heartbeat_s

    def rendezvous(self, sites: int, timeout: float) -> list[str]:
        """Before the first step of a fresh run: wait until all ``sites`` sites are in one quorum (or
        ``timeout`` passes, then go on with those present), so no site trains rounds alone while
        the others are still starting; then meet them once, so that a site started from another
        initial model (seed, model settings, code) is refused before it trains, on claims made in
        the meeting (a replayed quorum entry cannot fake a mismatch). Every rank returns the sites
        present."""
        view = RoundView()
        self._hash = self.hooks.global_hash() if self.collective or self.local == 0 else ""  # (sharded: a collective)
        if self.local == 0:
            try:
                present = self._present(sites, timeout)
            except (MembershipRefused, ElasticTimeout) as exc:
                view = _fatal(exc)
            else:
                self._last_members = view.admitted = present
        return self._broadcast(view).admitted

    def _present(self, sites: int, timeout: float) -> list[str]:  # local rank 0: the sites present (hints.rendezvous)
        return self.hints.rendezvous(
            lambda: self._quorum(False), lambda: self._decide(False), sites, timeout, self.live.heartbeat_s
        )

    def _claims(self) -> dict[str, Any]:
        """What this site holds now (local rank 0): in its quorum request, and again inside the round."""
        assert self.coordinator is not None
        return {
            "hash": self._hash, "step": self.hooks.step(), "joining": self.joining, "committed": self.hooks.committed(),
            "store": self.coordinator.store_address, "incarnation": self.incarnation, "session": self.hints.session,
            "part": self._part + 1, "rest": self._rest, "pace": self._pace, "link": self._link, "done": self.done,
        }  # fmt: skip

    def _idle(self, hints: list[views.Member]) -> bool:  # (local rank 0) quorum rounds: the round is not worth holding
        return False

    def _quorum(self, can_postpone: bool, once: bool = False) -> Any:  # local rank 0 (once: Coordinator.quorum's)
        assert self.coordinator is not None
        claims = self._claims()
        claims["tag"] = self.keys.member_tag(self.site, claims)
        return self.coordinator.quorum(can_postpone, committed=claims["committed"], joining=self.joining, data=claims, once=once)

    def _decide(self, can_postpone: bool) -> RoundView:
        """Local rank 0: quorum (who to meet, where), authentication and claims inside the round,
        healing plan from those claims."""
        q = self._quorum(can_postpone)
        if q is None:
            return RoundView(postponed=True)
        hints = self.hints.usable(q)
        if self._idle(hints):  # ask again later
            return RoundView(postponed=True)
        names = sorted(m.site for m in hints)
        if self.site not in names:  # our own request was displaced at the Lighthouse (by a replay): ask again
            return RoundView(postponed=True)
        host = heal_source(hints)  # where to meet: the same on every site, since all see one quorum
        if host is None:  # every member is a restarted site without a state: nobody to heal from (yet)
            return RoundView(postponed=True)
        for s in self._last_members:
            if s not in names:
                self._event(s, "left quorum")
        self._last_members = names
        key = f"{q.quorum_id}-{q.created.seconds}-{q.created.nanos}"
        meeting = next(m.store for m in hints if m.site == host)
        view = RoundView(key=key, meeting=meeting, members=hints)
        try:
            store = self._stores.get(meeting)
        except RoundFailed as exc:
            view.error = str(exc)
            return view
        view, members = meet(
            store, self.keys, view, self.site, names, self._claims(), self.identity, self.live.heartbeat_timeout_s,
            self.cfg.min_sites, self.log, self.region_of, self.stale_power is not None,
        )  # fmt: skip
        if view.error:
            self._stores.forget(meeting)
        self.hints.proved(members)
        if view.admitted and not self.hooks.committed() and not self.joining:
            try:
                same_initial_model(self.site, self._hash, members)
            except MembershipRefused:  # peers still read this meeting (maybe from our store): stay so they refuse too
                time.sleep(self.live.heartbeat_timeout_s)
                raise
        return view

    def _event(self, site: str, how: str) -> None:
        self.events.append({"site": site, "how": how, "time": time.monotonic(), "by": self.site})

    def _broadcast(self, view: RoundView) -> RoundView:
        """Local rank 0's view to every rank of the site; a fatal one raises on every rank."""
        box: list[Any] = [view]
        dist.broadcast_object_list(box, src=0, group=self.intra)
        got: RoundView = box[0]
        if got.fatal:
            raise (ElasticTimeout if got.fatal_timeout else MembershipRefused)(got.fatal)
        return got

    # ------------------------------------------------------------------ the round (every rank)

    def _count(self, nbytes: int, to: str) -> None:
        """Bytes this rank sent to site ``to`` (called by exchange threads)."""
        with self._bytes_lock:
            self.inter_bytes += nbytes
            if self.region_of is not None and self.region_of[to] != self.region_of[self.site]:
                self.region_bytes += nbytes

    def _drop_group(self) -> None:
        if self._pg is not None:
            with contextlib.suppress(Exception):
                self._pg[1].abort()
            self._pg = None

    def round(
        self,
        delta: torch.Tensor,
        can_postpone: bool = True,
        *,
        contribute: bool = True,
        weight: float = 1.0,
        codec: commit.Encoder | None = None,
        residual: commit.Feedback | None = None,
        part: int = -1,
        rest: int = 0,
        sizes: list[int] | None = None,
        pace: int = 0,
        link: str = "",
        overlap: bool = False,
    ) -> int | RunningRound | None:
        """Average ``delta`` (this site's pseudo-gradient, identical on its ranks) over the admitted
        sites in place, weighted (the arguments: :meth:`geotrain.sync.base.RoundMembership.round`);
        the number of sites that contributed, None if postponed (Lighthouse down). Error feedback
        ``residual`` changes only if the round commits. The round sums :attr:`part`; where that is
        not ``part`` (this site healed from a source on another schedule), the average is in
        :attr:`average`, not in ``delta``. With ``overlap``, a round in which no site heals returns
        running (its exchange in a thread): the caller finishes it later (:meth:`RunningRound.finish`),
        before its next round.

        Raises:
            RoundFailed: the round cannot commit on every participant; roll it back.
            MembershipRefused: this site failed authentication.
        """
        t0 = time.monotonic()
        counters = (t0, self.inter_bytes, self.raw_bytes, self.region_bytes)
        self._hash = self.hooks.global_hash() if self.collective or self.local == 0 else ""  # only local rank 0 claims it
        self._part, self._rest, self._sizes, self._pace, self._link = part, rest, sizes, pace, link
        run = None
        try:
            run = self._round(delta, can_postpone, t0, Contribution(contribute, weight, codec, residual), counters)
            if run is None:
                return None
            run.blocked += time.monotonic() - t0
            if overlap and not run.view.healers:
                return run
            return run.finish()
        finally:
            if run is None:  # postponed, or failed before its exchange
                self._account(None, counters)

    def _account(self, run: RunningRound | None, counters: tuple[float, int, int, int] | None = None) -> None:
        """A round's bytes and the time the training thread waited on it, into the run's counters;
        what ``sync.adapt`` measures of it (nothing from a round that healed a site)."""
        t0, sent0, raw0, far0 = run.counters if run is not None else counters  # type: ignore[misc]
        seconds = run.blocked if run is not None else time.monotonic() - t0
        healed = bool(self._current.get("healers"))  # (healing traffic is no measure of the link)
        took = self._current.get("exchange_s", seconds - self._current.get("quorum_s", 0.0))
        self.measured = (0.0, 0.0) if healed else (took, self._current.get("ping_s", 0.0))
        st = self.stats
        st.inter_bytes += self.inter_bytes - sent0
        st.inter_raw_bytes += self.raw_bytes - raw0
        st.inter_region_bytes += self.region_bytes - far0
        st.comm_seconds += seconds
        st.wan_wait_seconds += seconds
        st.network_seconds += seconds

    @property
    def carries(self) -> bool:
        """This local rank carries a part across sites: one of the first ``carriers`` (the smallest site's size)."""
        return self.local < self.carriers

    def _round(
        self, delta: torch.Tensor, can_postpone: bool, t0: float, what: Contribution, counters: tuple[float, int, int, int]
    ) -> RunningRound | None:
        view = RoundView()
        if self.local == 0:
            try:
                view = self._decide(can_postpone and not self.joining)
            except (MembershipRefused, ElasticTimeout) as exc:
                view = _fatal(exc)
        view = self._broadcast(view)
        if view.postponed:
            return None
        self.heard([m for m in view.members if m.site in view.admitted])
        if self.codec_for is not None and self.site in view.healers:  # sync.adapt: a healer encodes as its source does
            what.codec = self.codec_for(next(m.link for m in view.members if m.site == view.source_of(self.site)))
        self.part = view.part
        # (quorum rounds of two tiers: a world round aligns the sites' round counts to the round's most)
        self.top = max((m.committed for m in view.members), default=0)
        sizes = self._sizes if self.region_of is None else [delta.numel()] * 2  # two tiers: parts 0 and 1 are tiers
        if sizes is not None and not -1 <= view.part < len(sizes):  # a claim no site of this run makes
            view.error = f"round {view.key}: it sums part {view.part}, which this run does not have"
        elif view.part != self._part and view.part >= 0 and sizes is not None:  # a healer, or (tiers) it sits out
            delta, what = torch.zeros(sizes[view.part], device=delta.device), Contribution(False, 0.0, what.codec, None)
        self._current = {
            "key": view.key, "start": t0, "quorum_s": time.monotonic() - t0, "members": sorted(m.site for m in view.members),
            "admitted": view.admitted, "healers": view.healers,
            **({"part": view.part, "region": self.region_of[self.site]} if self.region_of is not None else {}),
        }  # fmt: skip
        if view.error:
            raise RoundFailed(view.error)
        if self.masker is not None and (why := views.too_few_to_mask(view, self.region_of)):  # every site decides alike
            raise RoundFailed(why)
        store = self._stores.get(view.meeting)
        if not self.carries:  # nothing crosses sites from this rank: no exchange, no heartbeats to watch
            run = RunningRound(self, delta, view, store, None, lambda: None, what, counters)
            run.start()
            return run
        peers = [f"{s}/{self.local}" for s in view.admitted if s != self.site]
        hb_client = roundstore.connect(view.meeting, self.keys.store, self.live.heartbeat_timeout_s)
        hb_store = SealedStore(hb_client, self.keys, f"round/{view.round_id}", self.log)
        monitor = Monitor(hb_store, f"{self.site}/{self.local}", peers, self.live.heartbeat_s, self.live.heartbeat_timeout_s)

        def close() -> None:
            monitor.stop()
            hb_client.close()
            if monitor.culprit:
                self._event(monitor.culprit, "heartbeat timeout")

        run = RunningRound(self, delta, view, store, monitor, close, what, counters)
        try:
            run.start()
        except BaseException:
            close()
            raise
        return run

    def affords(self) -> bool:  # site-level DP: whether the ε budget allows one more noised update
        return self.noise is None or self.noise.affords()

    def note(self, outcome: str, reason: str, global_hash: str, committed: int, step: int) -> None:
        """Record the round's outcome (after the caller applied or rolled it back): one JSON line."""
        record(self, outcome, reason, global_hash, committed, step)

    def close(self) -> None:
        if self.coordinator is not None:
            self.coordinator.close()
        self._drop_group()
        self._stores.close()
        if self._host_store is not None:
            self._host_store.close()
