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
import io
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from geotrain.comm.authstore import AuthStore, AuthStoreServer
from geotrain.comm.collectives import CommStats
from geotrain.comm.emulate.inprocess import WanEmulator
from geotrain.comm.faults import FaultPlan
from geotrain.comm.identity import Identity
from geotrain.comm.topology import Topology
from geotrain.config import ElasticConfig
from geotrain.elastic import commit, roundstore
from geotrain.elastic import view as views
from geotrain.elastic.auth import RunKeys, SealedStore, load_secret
from geotrain.elastic.commit import TRAILER, Contribution
from geotrain.elastic.coordinator import Coordinator
from geotrain.elastic.exchange import Exchange, backstop
from geotrain.elastic.hints import QuorumHints
from geotrain.elastic.meeting import meet
from geotrain.elastic.records import append_record
from geotrain.elastic.roundstore import Monitor
from geotrain.elastic.view import HealHooks, RoundView, Schedule, group_key, heal_source, same_initial_model
from geotrain.errors import ROUND_FAILURES, ElasticTimeout, MembershipRefused, RoundFailed

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
    ) -> None:
        self.cfg = cfg
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
        self.part, self.average = -1, cast("torch.Tensor | None", None)  # the last round's part (view.round_part), average
        self._hash = ""  # the global model's hash, taken by every rank before rank 0 claims it (sharded: a collective)
        self._pg: tuple[tuple[str, ...], Any] | None = None
        self._last_members: list[str] = []
        self._stores = roundstore.Stores(self.keys.store, self.cfg.heartbeat_timeout_s)
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
            self.coordinator = Coordinator(self.cfg, addr, site, workers, self._host_store.address, log)

    @property
    def retry_seconds(self) -> float:  # how long a postponed round waits before it is retried
        return self.cfg.heartbeat_s

    def rendezvous(self, sites: int, timeout: float) -> list[str]:
        """Before the first step of a fresh run: wait until all ``sites`` sites are in one quorum (or
        ``timeout`` passes, then go on with those present), so no site trains rounds alone while
        the others are still starting; then meet them once, so that a site started from another
        initial model (seed, model settings, code) is refused before it trains, on claims made in
        the meeting (a replayed quorum entry cannot fake a mismatch). Every rank returns the sites
        present."""
        view = RoundView()
        self._hash = self.hooks.global_hash() if self.sharded or self.local == 0 else ""  # (sharded: a collective)
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
            lambda: self._quorum(False), lambda: self._decide(False), sites, timeout, self.cfg.heartbeat_s
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
            store, self.keys, view, self.site, names, self._claims(), self.identity, self.cfg.heartbeat_timeout_s,
            self.cfg.min_sites, self.log, self.region_of,
        )  # fmt: skip
        if view.error:
            self._stores.forget(meeting)
        self.hints.proved(members)
        if view.admitted and not self.hooks.committed() and not self.joining:
            try:
                same_initial_model(self.site, self._hash, members)
            except MembershipRefused:  # peers still read this meeting (maybe from our store): stay so they refuse too
                time.sleep(self.cfg.heartbeat_timeout_s)
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
    ) -> int | None:
        """Average ``delta`` (this site's pseudo-gradient, identical on its ranks) over the admitted
        sites in place, weighted (the arguments: :meth:`geotrain.sync.base.RoundMembership.round`);
        the number of sites that contributed, None if postponed (Lighthouse down). Error feedback
        ``residual`` changes only if the round commits. The round sums :attr:`part`; where that is
        not ``part`` (this site healed from a source on another schedule), the average is in
        :attr:`average`, not in ``delta``.

        Raises:
            RoundFailed: the round cannot commit on every participant; roll it back.
            MembershipRefused: this site failed authentication.
        """
        t0, sent0, raw0, far0 = time.monotonic(), self.inter_bytes, self.raw_bytes, self.region_bytes
        self._hash = self.hooks.global_hash() if self.sharded or self.local == 0 else ""  # only local rank 0 claims it
        self._part, self._rest, self._sizes, self._pace, self._link = part, rest, sizes, pace, link
        try:
            return self._round(delta, can_postpone, t0, Contribution(contribute, weight, codec, residual))
        finally:  # the training thread was blocked on the wide area all along
            seconds = time.monotonic() - t0
            healed = bool(self._current.get("healers"))  # (healing traffic is no measure of the link)
            self.measured = (
                (0.0, 0.0) if healed else (seconds - self._current.get("quorum_s", 0.0), self._current.get("ping_s", 0.0))
            )
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

    def _round(self, delta: torch.Tensor, can_postpone: bool, t0: float, what: Contribution) -> int | None:
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
            return self._exchange_and_vote(delta, view, store, None, what)
        peers = [f"{s}/{self.local}" for s in view.admitted if s != self.site]
        hb_client = roundstore.connect(view.meeting, self.keys.store, self.cfg.heartbeat_timeout_s)
        hb_store = SealedStore(hb_client, self.keys, f"round/{view.round_id}", self.log)
        monitor = Monitor(hb_store, f"{self.site}/{self.local}", peers, self.cfg.heartbeat_s, self.cfg.heartbeat_timeout_s)
        try:
            return self._exchange_and_vote(delta, view, store, monitor, what)
        finally:
            monitor.stop()
            hb_client.close()
            if monitor.culprit:
                self._event(monitor.culprit, "heartbeat timeout")

    def _exchange_and_vote(
        self, delta: torch.Tensor, view: RoundView, store: AuthStore, monitor: Monitor | None, what: Contribution
    ) -> int:
        # the main thread prepares everything the exchange thread reads (it must not touch the model)
        finite = what.contribute and bool(torch.isfinite(delta).all())
        if not finite and what.weight == 0:
            self.log("this site takes part in the round without an update (its steps are run, or synced in another tier)")
        elif not finite:
            self.log("pseudo-gradient withdrawn from this round (" + ("not finite)" if what.contribute else "update guard)"))
        late = views.late_by(view, self.site) if self.stale_power is not None else 0  # quorum rounds: its update counts
        contributes = finite and (self.site not in view.healers or late > 0)
        what.weight *= (1.0 + late) ** -(self.stale_power or 0.0) if contributes else 1.0
        lo, hi = (0, delta.numel()) if self.sharded else commit.span(delta.numel(), self.local, self.carriers)
        ring = views.tier_ring(view, self.site, self.region_of, self.order)  # the round's sites in exchange order
        carry = torch.zeros(hi - lo + TRAILER)  # Gloo: CPU, also under NCCL; then this site's weight and count
        dp = commit.site_dp(self.noise, delta, contributes and what.weight > 0, self.sharded, self.intra)  # every rank
        if self.carries:  # secure: a masked part's weight is its share of the largest site's tokens (at most 1)
            factor = 1.0 if what.weight == 1.0 else self.workers[self.site_index] / max(self.workers)
            part = dp(delta.detach().reshape(-1)[lo:hi].to("cpu", torch.float32))
            where = (lo, self.site, view, self.local, ring)  # masks cancel over the sites summed
            carry = commit.carried(part, what.weight, contributes, self.masker, factor, where)
        outgoing = None
        if view.healed_by(self.site) and (self.local == 0 or self.sharded):
            buf = io.BytesIO()
            only_late = self.hooks.global_state is not None and views.all_late(view, self.site)  # quorum rounds: the global part
            torch.save(self.hooks.global_state() if only_late else self.hooks.state(), buf)  # type: ignore[misc]
            outgoing = buf.getvalue()
        round_store = SealedStore(store, self.keys, f"round/{view.round_id}", self.log)  # rendezvous and votes
        ok, why, heal_blob = torch.ones(1), "", None
        x: Exchange | None = None
        if monitor is not None:
            x = self._exchange(view, monitor, round_store, carry, outgoing, what, ring)
            x.start()
            finished = x.wait()
            self._current["exchange_s"] = time.monotonic() - self._current["start"] - self._current["quorum_s"]
            self._current["seal_s"] = x.seal_seconds
            self._current["open_s"] = x.open_seconds
            self._current["ping_s"] = x.ping_s
            self.raw_bytes += x.raw_bytes
            if not finished:
                ok.zero_()
                why = monitor.failed or "aborted"
                self._drop_group()
            else:
                carry = commit.unmasked(self.masker, carry) if self.masker is not None and x.error is None else carry.float()
                self._pg = (group_key(view, 1), x.group) if x.group is not None else None  # (for the next round)
                if x.error is not None:
                    ok.zero_()
                    if isinstance(x.error, MembershipRefused) or not isinstance(x.error, ROUND_FAILURES):
                        raise x.error  # refused, or a bug in the exchange: stop, do not roll back as if a peer failed
                    first = str(x.error).splitlines()[0][:100] if str(x.error) else type(x.error).__name__
                    why = str(x.error) if isinstance(x.error, RoundFailed) else f"collective failed ({first})"
            heal_blob = x.heal_blob
        if self.site in view.healers:  # complete: the source's state at the start of this round
            heal_blob = commit.share_in_site(heal_blob, self.local, self.G, self.intra, own=self.sharded)
            if heal_blob is not None:
                self._load_healing(heal_blob, view.source_of(self.site), whole=not late)
                if what.residual is not None and not late:  # a healed site starts its error feedback afresh
                    what.residual.tensor = None
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.intra)
        if ok.item() and self.G > 1 and not self.sharded:  # the site's ranks gather the carried parts
            carry = commit.gather_site(carry, delta.numel(), self.carriers, self.G, self.intra)
        committed, self.split = commit.vote(
            round_store, view, monitor, bool(ok.item()), site=self.site, local=self.local, identity=self.identity,
            intra=self.intra, timeout_s=self.cfg.collective_timeout_s, log=self.log, deaf=self.faults.splits(self.hooks.step()),
        )  # fmt: skip
        if not committed or self.split:  # on every site of the round alike (split: some committed): a new group next round
            self._drop_group()
        if not committed:
            self._stores.forget(view.meeting)
            reason = why or (monitor.failed if monitor is not None else None) or "a participant did not confirm the round"
            if self.local == 0:
                self.log(f"round {view.key} rolled back: {reason} (round store {view.meeting})")
            raise RoundFailed(reason)
        if x is not None and what.residual is not None and (self.site not in view.healers or late):
            what.residual.keep(x.residual)  # the round committed: keep what its encoding left out
        total, count = (float(v) for v in carry[-TRAILER:].tolist())
        if (count < 0.5 or total <= 0) and not views.region_round(view, self.region_of):
            raise RoundFailed("no site contributed to the round")  # (tiers: a region of sites that healed or sat out sums 0)
        divisor = self.world_weight or (total if total > 0 else 1.0)  # quorum rounds: a whole world round's weight
        self.average = delta.copy_(carry[:-TRAILER].to(delta.device).view_as(delta)).div_(divisor)
        self._current.update(contributors=int(round(count)), weight=total, **({"late": late} if late else {}))
        return self._current["contributors"]

    def affords(self) -> bool:  # site-level DP: whether the ε budget allows one more noised update
        return self.noise is None or self.noise.affords()

    def _exchange(
        self, view: RoundView, monitor: Monitor, round_store: SealedStore, carry: torch.Tensor, outgoing: bytes | None,
        what: Contribution, ring: list[str] | None,
    ) -> Exchange:  # fmt: skip
        members = group_key(view)
        if self._pg is not None and self._pg[0] != members:
            self._drop_group()  # a new membership gets a new group (a restarted site has a new store address)
        residual = what.residual.tensor if what.residual is not None else None
        if residual is not None and residual.numel() != carry.numel() - TRAILER:
            raise ValueError(f"error-feedback residual of {residual.numel()} values for a part of {carry.numel() - TRAILER}")
        return Exchange(
            view, self.site, self.local, self.names, self.wan, monitor, round_store,
            self._pg[1] if self._pg is not None else None, carry, outgoing,
            lambda nbytes: backstop(self.slowest_link, self.cfg, nbytes, len(view.admitted)), self.cfg.collective_timeout_s, self._count,
            self.on_mid_round, tamper=self.faults.tampers(self.hooks.step()), heals=self.local == 0 or self.sharded,
            codec=what.codec, error_feedback=what.residual is not None, residual=residual,
            add=self.masker.add_ if self.masker is not None else None, ping=self.ping, ring=ring,
        )  # fmt: skip

    def _load_healing(self, blob: bytes, source: str, whole: bool = True) -> None:
        """Main thread: load the state a source sent. From now on this site holds a valid state (the
        source's at the round's start, which a rollback returns to), so it is no longer joining: it
        can be a heal source for others even if this round fails. Not ``whole`` (a late site of
        quorum rounds): only the global part (``hooks.load_global``); its own steps go on."""
        state = torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")
        if whole or self.hooks.load_global is None:
            self.hooks.load(state)
            self.healed_at_step = int(state["step"])
        else:
            self.hooks.load_global(state)
        self.joining = False
        if self.local == 0:
            what = "" if whole else " (its global model only: this site's update was late)"
            self.log(f"healed from {source}: {state['committed']} committed rounds, step {state['step']}{what}")

    def note(self, outcome: str, reason: str, global_hash: str, committed: int, step: int) -> None:
        """Record the round's outcome (after the caller applied or rolled it back): one JSON line."""
        rec = {**self._current, "end": time.monotonic(), "wall_end": time.time(), "outcome": outcome, "reason": reason}
        rec.update(site=self.site, hash=global_hash, committed=committed, step=step)
        self._current = {}
        if self.record_file is not None:
            append_record(self.record_file, rec)

    def close(self) -> None:
        if self.coordinator is not None:
            self.coordinator.close()
        self._drop_group()
        self._stores.close()
        if self._host_store is not None:
            self._host_store.close()
