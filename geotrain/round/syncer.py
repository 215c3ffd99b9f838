"""The syncer of asynchronous quorum rounds: the global model, the outer optimizer and the merge
rule, in a thread beside the first site's local rank 0 (what it does and why:
:mod:`geotrain.round.hub`, docs/DESIGN.md §26).

It takes each site's update as it comes (site 0's from a queue in memory, the others' through
:mod:`geotrain.comm.mailbox`), merges a round once a quorum is in (plus the grace window),
discounts late updates by staleness, applies delayed Nesterov, answers each site with the global
model, and treats a site whose connection closed as late forever. A lost site that comes back
(started again by the launcher) asks to rejoin through the run's store; the syncer answers it with
the global model and where to go on from, and takes it back into the world round.

In two tiers (``sync.region_every``) each region's first site holds a syncer for the region's
sites, and the syncers run world rounds among themselves (:mod:`geotrain.round.world`).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from geotrain.codecs import Codec
from geotrain.comm.alive import SilenceWatch
from geotrain.comm.mailbox import Mailbox, Message, Rejoins, StoreChannel
from geotrain.config import LivenessConfig, QuorumConfig, SyncConfig
from geotrain.errors import CorruptPayload, SyncerTimeout
from geotrain.round.merge import Update, dynamic_steps, first_round_steps, mask_sites, merge_weights, site_mask
from geotrain.round.outer import DelayedNesterov, weighted_mean
from geotrain.round.star import LinkReport, StarAdapter
from geotrain.round.syncer_state import SyncerState
from geotrain.round.world import WorldTier, last_from_hub
from geotrain.sync.reducer import Codecs

# CHECKPOINT: waits for every live site (a checkpoint's barrier); PING: answered at once, empty (sync.adapt)
UPDATE, FINAL, CHECKPOINT, PING = 1.0, 2.0, 3.0, 4.0
# site → syncer: [kind, base, steps, workers, compute s, encoded, link bytes, link s, ping s (sync.adapt; 0: none),
#                 the fragment (Streaming DiLoCo; else 0), 0]
# syncer → site: [version, world steps, next H, live sites, sites ever lost, the site's steps so far, the syncer's
#                 seconds, encoded, seconds the site's update waited here, the codec of its next update,
#                 1 if the answer ends a checkpoint's barrier (every live site saves)]
# encoded: 1 + the index, in the run's codecs (sync.adapt.codecs, else sync.codec), of the codec whose bytes the payload
# is (the pseudo-gradient, or the change since the model the site holds); 0: fp32 (a pseudo-gradient, or the model)
FIELDS = 11
TICK = 0.05  # the syncer's longest wait for input: failed sends, silent sites and restarted sites are checked this often


class QuorumSyncer(SyncerState):
    """The global model, the outer optimizer and the merge rule, in a thread (see the module docstring).

    Args:
        cfg: the quorum settings; ``live``: when a silent site is lost, how long a round waits;
            ``weight_by_tokens``: weight updates by tokens.
        workers: every site's workers, in site order.
        theta: the initial global model (copied); ``make_optimizer``: the outer optimizer over a list of tensors.
        mailbox: messages to and from the other sites' local rank 0 (``leaders``, in site order).
    """

    def __init__(
        self,
        cfg: QuorumConfig,
        live: LivenessConfig,
        weight_by_tokens: bool,
        workers: Sequence[int],
        theta: Sequence[torch.Tensor],
        make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
        sync_cfg: SyncConfig,
        mailbox: Mailbox,
        leaders: Sequence[int],
        site_ranks: Sequence[Sequence[int]] = (),
        rejoins: Rejoins | None = None,
        codecs: Mapping[str, Codec | None] | None = None,
        adapter: StarAdapter | None = None,
        sites: Sequence[int] = (),
        world: WorldTier | None = None,
        fragments: Sequence[Sequence[int]] = (),
    ) -> None:
        self.cfg, self.live, self.weight_by_tokens, self.workers = cfg, live, weight_by_tokens, list(workers)
        # the sites this syncer merges (two tiers: its region's; else every site), the first of which
        # (its home) holds it; the world tier with the other regions' syncers (None: one tier)
        self.sites = list(sites) or list(range(len(self.workers)))
        self.home, self.world = self.sites[0], world
        # the other sites' ranks, watched for silence (a hung site is lost like a dead one); none: not watched
        self.site_ranks = [list(r) for r in site_ranks]
        watched = [r for s in self.sites[1:] if s < len(self.site_ranks) for r in self.site_ranks[s]]
        self.watch = SilenceWatch(watched, live.hub_heartbeat_s, live.hub_lost_after_s)
        self.max_H, self.dynamic = sync_cfg.H, sync_cfg.dynamic_quorum_steps
        # every site's next round (H, or dynamic: a first one of max(1, H/10)), and its smoothed steps per compute second
        self.H, self.rates = [first_round_steps(sync_cfg)] * len(self.workers), [0.0] * len(self.workers)
        self.theta = [t.detach().clone() for t in theta]
        # Streaming DiLoCo: each fragment's tensors, merged on their own (a version, an open round and an outer
        # optimizer each), its size and where its values lie in the flat model (one fragment: all of it, a slice)
        self.fragments = [list(f) for f in fragments] or [list(range(len(self.theta)))]
        self.sizes = [sum(self.theta[i].numel() for i in f) for f in self.fragments]
        starts = [0, *torch.tensor([t.numel() for t in self.theta]).cumsum(0).tolist()]
        ranges = ([torch.arange(starts[i], starts[i + 1]) for i in f] for f in self.fragments)
        self.index: list[torch.Tensor | slice] = [slice(None)] if len(self.fragments) == 1 else [torch.cat(r) for r in ranges]
        parts = ([self.theta[i] for i in f] for f in self.fragments)
        self.outers = [DelayedNesterov(ts, make_optimizer(ts), sync_cfg, len(self.sites)) for ts in parts]
        self.outer = self.outers[0]
        self.mailbox, self.leaders = mailbox, list(leaders)
        self.versions = [0] * len(self.fragments)
        self.world_steps = 0  # rank-steps merged so far
        self.lost: set[int] = set()  # sites that died: late forever, left out of the world round from then on
        self.ever_lost: set[int] = set()  # sites lost at some point (the world group has their dead ranks)
        self.site_steps = [0] * len(self.workers)  # steps each site has delivered (a site that comes back goes on from there)
        self.rejoins, self.channels = rejoins, dict[int, StoreChannel]()  # lost sites that came back, and how to reach them
        # the codecs by name, in the order messages name them (sync.adapt.codecs, else sync.codec), and
        # the one in force; sync.adapt: the choice of H and codec from the sites' link reports
        self.coders = codecs if codecs is not None else {"none": None}
        self.names, self.adapter = list(self.coders), adapter
        self.codec_name = adapter.codec if adapter is not None else self.names[0]
        # what each other site holds (it got the model in fp32 at the start, then encoded changes);
        # site 0 takes the model in memory, exactly
        flat = torch.cat([t.reshape(-1) for t in self.theta])
        self.held = {s: flat.clone() for s in self.sites[1:]} if any(map(Codecs.encodes, self.names)) else {}
        self._arrived = [0.0] * len(self.workers)  # when each site's last update landed (its wait here, for sync.adapt)
        # site 0's updates (same process) and the other sites' messages (the mailbox's listener
        # threads put them here): the loop blocks on it, so it wakes on input, not on a poll
        self.inbox: queue.Queue[Update | Message] = queue.Queue()
        self.outbox: queue.Queue[tuple[list[float], torch.Tensor]] = queue.Queue()  # to site 0
        self.log: list[dict[str, Any]] = []  # one entry per merge
        self.error: BaseException | None = None
        self.snapshot: dict[str, Any] | None = None  # the state at the last checkpoint's barrier
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._guarded, name="quorum-syncer", daemon=True)

    @property
    def version(self) -> int:
        """The global model's version (Streaming DiLoCo: the first fragment's)."""
        return self.versions[0]

    @version.setter
    def version(self, v: int) -> None:
        self.versions[0] = v

    def start(self) -> None:
        """Start taking updates (after a resumed run has loaded :meth:`load_state_dict`)."""
        if not self._thread.is_alive():
            self._t0 = time.monotonic()
            self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _last(self, msg: Message) -> bool:
        """Whether ``msg`` is a site's last message: its (last fragment's) final update."""
        return msg.fields[0] == FINAL and msg.fields[9] == len(self.fragments) - 1

    def _guarded(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - handed to site 0's training thread, which raises it
            self.error = exc

    def _decode(self, msg: Message) -> Update:
        kind, base, steps, workers, compute_s, encoded, link_bytes, link_s, ping_s = msg.fields[:9]
        site = self.leaders.index(msg.src)
        known = 0 <= msg.fields[9] < len(self.fragments)  # (no such fragment: an empty update, left out as malformed)
        fragment, n = (int(msg.fields[9]), self.sizes[int(msg.fields[9])]) if known else (0, 0)
        coder = self.coders[self.names[int(encoded) - 1]] if encoded and msg.payload.numel() and known else None
        try:
            delta = coder.decode(msg.payload, n) if coder is not None else msg.floats() if known else torch.zeros(0)
        except CorruptPayload:  # an empty update: left out as malformed, as one of the wrong size
            delta = torch.zeros(0)
        delta = delta.to(self.theta[0].device)  # (messages arrive on the host; the global model may live on a GPU)
        return Update(
            site, int(base), int(steps), int(workers), delta, final=kind == FINAL, compute_s=compute_s,
            checkpoint=kind == CHECKPOINT, ping=kind == PING, fragment=fragment,
            link=LinkReport(link_bytes, link_s, ping_s, int(steps), compute_s) if link_s > 0 else None,
        )  # fmt: skip

    def _measure(self, u: Update) -> None:
        """Dynamic local updates: smooth the site's rate (half weight on the newest round) and give
        every measured site H x its rate / the fastest rate steps (at least 1, at most H)."""
        if not self.dynamic or u.steps <= 0 or u.compute_s <= 0:
            return
        rate = u.steps / u.compute_s
        self.rates[u.site] = rate if not self.rates[u.site] else 0.5 * (self.rates[u.site] + rate)
        self.H = dynamic_steps(self.rates, self.H, self.max_H)

    def _run(self) -> None:
        F = len(self.fragments)
        for s in self.sites[1:]:  # each site's messages, until its final one (or its death)
            self.mailbox.listen(self.leaders[s], self.inbox, self._last)
        for hub in [] if self.world is None else self.world.hubs:  # the other regions' syncers, until their last
            if hub != self.leaders[self.home]:
                self.mailbox.listen(hub, self.inbox, last_from_hub)
        pending: list[tuple[float, Update]] = []
        # per fragment: the updates of its open round, the sites waiting on it, when its quorum came in
        open_: list[list[Update]] = [[] for _ in range(F)]
        waiting: list[list[int]] = [[] for _ in range(F)]
        quorum_at: list[float | None] = [None] * F
        finals: set[int] = set()
        parts = [0] * len(self.workers)  # each site's final deliveries so far (one per fragment)
        barrier: set[int] = set()  # sites waiting at a checkpoint's barrier
        gone: set[int] = set()  # sites whose connection closed, lost once their messages in flight are in
        poll_joins_at = 0.0
        while not self._stop.is_set():
            if self.rejoins is not None and (self.lost or self.channels) and time.monotonic() >= poll_joins_at:
                poll_joins_at = time.monotonic() + 0.1
                for s in self.rejoins.down(self.channels):
                    self._lose(s, "its processes exited (the launcher saw them go)")
                for s, k in self.rejoins.poll(self.lost):
                    pending = [p for p in pending if p[1].site != s]  # its dead incarnation's: late forever
                    finals.discard(s)
                    parts[s] = 0
                    self._rejoin(s, k)
            now = time.monotonic()
            due = sorted((p for p in pending if p[0] <= now), key=lambda p: p[0])
            pending = [p for p in pending if p[0] > now]
            for s in sorted(gone - {u.site for _, u in pending}):
                gone.discard(s)
                self._lose(s, "its connection closed")
            self._check_sends()
            for s in self._silent_sites(finals):
                self._lose(s, f"silent for over liveness.hub_lost_after_s={self.live.hub_lost_after_s:g} s (stopped or hung)")
                if self.rejoins is not None:
                    self.rejoins.report_silent(s)
            for _, u in due:
                if u.site in self.lost:  # sent before it went silent, arrived after it was lost: late forever
                    continue
                if u.ping:
                    self._send(u.site, [0.0] * FIELDS, torch.zeros(0), None)
                    continue
                self._arrived[u.site] = now
                f = u.fragment
                self.site_steps[u.site] += u.steps if f == 0 else 0  # (fragment 0's windows cover every step)
                self._measure(u)
                if self.adapter is not None and u.link is not None:
                    self.adapter.report(u.site, u.link)
                if u.final:
                    parts[u.site] += 1
                    if parts[u.site] == F:
                        finals.add(u.site)
                elif u.checkpoint:
                    barrier.add(u.site)
                elif u.base < self.versions[f]:  # late: merged later, and it goes on at once
                    self._reply([u.site], fragment=f)
                else:
                    waiting[f].append(u.site)
                if u.steps > 0:
                    if u.delta.numel() != self.sizes[f]:
                        self._note("rejected", [u], [], f"site {u.site}: an update of {u.delta.numel()} values left out")
                    elif bool(torch.isfinite(u.delta).all()):
                        open_[f].append(u)
                    else:
                        self._note("rejected", [u], [], f"site {u.site}: non-finite update left out")
            waiting = [[s for s in w if s not in self.lost] for w in waiting]
            barrier -= self.lost
            running = [s for s in self.sites if s not in finals and s not in self.lost and s not in barrier]
            if not running and barrier:  # a checkpoint: merge what is in, every waiting site gets the same model
                for f in range(F):
                    self._merge(open_[f], "checkpoint", f)
                # a site that has ended cannot save with the others (a checkpoint is written by every rank)
                granted = not finals
                if granted:
                    self.snapshot = self.state_dict()
                self._reply(sorted(barrier), exact=True, checkpoint=granted)
                open_, quorum_at, barrier = [[] for _ in range(F)], [None] * F, set()
                continue
            if not running:  # the final round: merge what is left, every live site gets the same model
                for f in range(F):
                    self._merge(open_[f], "final", f)
                if not any(open_):  # nothing was left: logged all the same
                    self._note("final", [], [], "nothing left to merge")
                while self.world is not None and not self._world_round(pending, gone, final=True):
                    pass  # (two tiers: until every region has ended, the world rounds of the others)
                self._reply(sorted(finals - self.lost), exact=True)
                return
            for f in range(F):
                delivered = {u.site for u in open_[f]} | set(waiting[f])
                if waiting[f] and len(delivered) >= min(self.cfg.sites, len(running)):
                    quorum_at[f] = now if quorum_at[f] is None else quorum_at[f]
                    if now >= (quorum_at[f] or now) + self.cfg.grace_s or set(running) <= delivered:
                        self._merge(open_[f], "quorum", f)
                        open_[f], quorum_at[f] = [], None
                        if self.world is not None and self.world.since >= self.world.every:
                            self._world_round(pending, gone, final=False)
                        self._reply(waiting[f], fragment=f)
                        waiting[f] = []
            # wait for input, at most until the next message lands, a grace window closes, or TICK
            # (failed sends, silent sites and restarted sites are checked that often); at least 1 ms,
            # so a deadline just past never turns the loop into a spin
            windows = [q + self.cfg.grace_s for q, w in zip(quorum_at, waiting, strict=True) if q is not None and w]
            deadlines = [p[0] for p in pending] + windows
            self._receive(pending, gone, max(0.001, min([TICK, *(d - time.monotonic() for d in deadlines)])))

    def _world_round(self, pending: list[tuple[float, Update]], gone: set[int], final: bool) -> bool:
        """Two tiers: this region's contribution to a world round, the others' (meanwhile the
        region's updates keep coming in, for later), and the world step; whether every region has
        ended. The region's version moves on: updates from before it are one merge stale."""
        assert self.world is not None
        lost, ever = site_mask(self.lost), site_mask(self.ever_lost)
        self.world.contribute(self.theta, final, self.world_steps, int(lost), int(ever))
        deadline = time.monotonic() + self.live.hub_timeout_s
        while self.world.missing():
            if time.monotonic() > deadline:
                raise self.world.timeout()
            landing = self.world.next_arrival()
            wait = TICK if landing is None else min(TICK, landing - time.monotonic())
            self._receive(pending, gone, max(0.001, wait))
        ended, regions = self.world.step(self.theta)
        self.version += 1
        hubs = [self.leaders.index(self.world.hubs[r]) for r in regions]  # (each contributing region's first site)
        self._note("world", [], [], f"world round {self.world.round - 1}", sites=hubs)
        return ended

    def _receive(self, pending: list[tuple[float, Update]], gone: set[int], wait_s: float) -> None:
        """Block up to ``wait_s`` for an update or message, then take every other one already in:
        updates into ``pending`` with the time they land (link emulation), closed connections into ``gone``."""
        try:
            item = self.inbox.get(timeout=wait_s)
        except queue.Empty:
            return
        while True:
            if isinstance(item, Update):
                pending.append((0.0, item))
            elif self.world is not None and item.src in self.world.hubs:
                if item.lost:
                    raise SyncerTimeout(f"lost region {self.world.hubs.index(item.src)}'s syncer: its connection closed")
                self.world.take(item)
            elif item.lost:
                gone.add(self.leaders.index(item.src))
            else:
                pending.append((item.arrival, self._decode(item)))
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _merge(self, updates: list[Update], why: str, f: int = 0) -> None:
        """Merge ``updates`` of fragment ``f`` (the whole model, without fragments)."""
        if not updates:
            return
        ups = sorted(updates, key=lambda u: (u.site, u.base))
        weights = merge_weights(ups, self.versions[f], self.weight_by_tokens, self.cfg.staleness_power)
        # a whole world round's tokens: each site's steps in this merge, or its round's H if it is
        # not in it (a merge of every site: the merge's own tokens)
        steps = [0 if s in self.lost or s not in self.sites else h for s, h in enumerate(self.H)]
        for s in {u.site for u in ups}:
            steps[s] = max(u.steps for u in ups if u.site == s)
        world = (
            float(sum(w * k for w, k in zip(self.workers, steps, strict=True))) if self.weight_by_tokens else float(len(steps))
        )
        self.outers[f].step(weighted_mean([u.delta for u in ups], weights, world), len(ups))
        self._note(why, ups, weights, "", fragment=f)
        self.versions[f] += 1
        if f:  # (fragment 0's windows cover every step: the tokens are counted there)
            return
        self.world_steps += sum(u.workers * u.steps for u in ups)
        if self.world is not None:
            self.world.merged(float(sum(u.workers * u.steps for u in ups)))
        if self.adapter is not None and self.adapter.choose(self.version):  # every site's next H and codec
            self.max_H, self.codec_name, chosen = self.adapter.H, self.adapter.codec, [self.adapter.H] * len(self.workers)
            # (dynamic local steps: the chosen H is the fastest site's, the others' follow their rates)
            self.H = dynamic_steps(self.rates, chosen, self.max_H) if self.dynamic else chosen

    def _note(
        self,
        why: str,
        ups: Sequence[Update],
        weights: Sequence[float],
        reason: str,
        sites: Sequence[int] | None = None,
        fragment: int = 0,
    ) -> None:
        """One log entry: a merge of ``ups`` (``reason`` empty), or an event about ``sites`` (default: the updates' sites)."""
        version = self.versions[fragment]
        self.log.append(
            {
                "version": version + (0 if reason else 1),
                **({"fragment": fragment} if len(self.fragments) > 1 else {}),
                "t": round(time.monotonic() - self._t0, 3),
                "kind": why,
                "sites": [u.site for u in ups] if sites is None else list(sites),
                "staleness": [version - u.base for u in ups],
                "steps": [u.steps for u in ups],
                "weights": [round(w, 4) for w in weights],
                # (dynamic local steps: each site's next H and the smoothed rates, steps per compute second, it follows)
                **({"next_H": list(self.H), "rates": [round(r, 3) for r in self.rates]} if self.dynamic else {}),
                **({"why": reason} if reason else {}),
            }
        )

    def _silent_sites(self, finals: set[int]) -> list[int]:
        """Sites (not the first, which holds this thread) still running, one of whose ranks has
        not beaten its heartbeat for ``lost_after_s``."""
        watched = [s for s in self.sites[1:] if s < len(self.site_ranks) and s not in finals and s not in self.lost]
        if not watched:
            return []
        silent = self.watch.silent([r for s in watched for r in self.site_ranks[s]])
        return [s for s in watched if any(r in silent for r in self.site_ranks[s])]

    def _lose(self, site: int, why: str) -> None:
        """``site`` died: it is late forever. Its updates already in were kept; from now on a world
        round is the live sites' tokens and the delayed momentum waits for their updates only."""
        if site in self.lost:
            return
        self.lost.add(site)
        self.ever_lost.add(site)
        for outer in self.outers:
            outer.sites = len(self.sites) - len(self.lost)
        channel = self.channels.pop(site, None)
        if channel is not None:
            channel.close()
        self._note("lost", [], [], f"site {site}: {why}; late forever", sites=[site])

    def _rejoin(self, site: int, incarnation: int) -> None:
        """Lost ``site`` came back as ``incarnation``: from now on it counts in the world round
        again, its messages come through the run's store, and it is answered at once with the
        global model (its new base) and the steps it had delivered (where its data goes on)."""
        self.lost.discard(site)
        for outer in self.outers:
            outer.sites = len(self.sites) - len(self.lost)
        assert self.rejoins is not None
        channel = self.channels[site] = self.rejoins.channel(site, incarnation)
        channel.listen(self.inbox, self._last)
        if self.site_ranks:
            self.watch.restart(self.site_ranks[site])
        why = f"site {site}: incarnation {incarnation} came back; it goes on from version {self.version}, its step {self.site_steps[site]}"
        self._note("rejoined", [], [], why, sites=[site])
        self._reply([site], exact=True)

    def _reply(self, sites: Sequence[int], exact: bool = False, fragment: int = 0, checkpoint: bool = False) -> None:
        """Answer ``sites`` with the global model: in fp32 to site 0 (in memory), with ``exact`` (the
        final round, a site that came back) and without a codec; else encoded, as the change from
        what the site holds, which this syncer then updates exactly as the site will (so the next
        answer carries what this one's encoding left out). Streaming DiLoCo: an answer carries
        ``fragment``'s values, an exact one the whole model and then every fragment's version.
        ``checkpoint``: the answer ends a checkpoint's barrier (every live site saves its state)."""
        whole = torch.cat([t.reshape(-1) for t in self.theta])
        many, idx = len(self.fragments) > 1, self.index[fragment]
        theta = whole[idx] if many and not exact else whole
        if many and exact:
            theta = torch.cat([whole, torch.tensor(self.versions, dtype=torch.float32)])
        lost, ever = set(self.lost), set(self.ever_lost)
        steps = self.world_steps
        if self.world is not None:  # the other regions' lost sites and steps, as of the last world round
            for r in range(len(self.world.hubs)):
                lost |= set(mask_sites(self.world.lost[r], len(self.workers))) - set(self.sites)
                ever |= set(mask_sites(self.world.ever_lost[r], len(self.workers)))
            steps += self.world.others_steps()
        live = site_mask([s for s in range(len(self.workers)) if s not in lost])
        now = time.monotonic()
        coder, index = self.coders[self.codec_name], 1.0 + self.names.index(self.codec_name)
        for s in sites:
            fields = [
                float(self.versions[fragment]),
                float(steps),
                float(self.H[s]),
                live,
                site_mask(ever),
                float(self.site_steps[s]),
                now - self._t0,
                0.0,
                max(0.0, now - self._arrived[s]),
                index,
                float(checkpoint),
            ]
            if s == self.home:
                self.outbox.put((fields, theta.clone()))
                continue
            if s in self.lost:  # (a site that came back is reached through its channel until it is lost again)
                continue
            payload, raw = theta, None
            if s in self.held and exact:
                self.held[s] = whole.clone()
            elif s in self.held and coder is None:
                self.held[s][idx] = theta
            elif coder is not None:
                payload, raw, fields[7] = coder.encode(theta - self.held[s][idx]), 4 * theta.numel(), index
                self.held[s][idx] += coder.decode(payload, theta.numel())
            self._send(s, fields, payload, raw)
        self._check_sends()

    def _send(self, site: int, fields: list[float], payload: torch.Tensor, raw: int | None) -> None:
        """A message to ``site``'s leader: through its channel if it came back, else the mailbox."""
        if site in self.channels:
            self.channels[site].send(fields, payload, raw)
        else:
            self.mailbox.send(self.leaders[site], fields, payload, raw)

    def _check_sends(self) -> None:
        """Lose the sites an answer could not be sent to (they are gone). Never waits: a site that
        hangs may never take its answer, and the others must not wait for it."""
        for r in self.mailbox.poll():
            if self.world is not None and r in self.world.hubs:
                raise SyncerTimeout(f"lost region {self.world.hubs.index(r)}'s syncer: a world round could not be sent to it")
            site = self.leaders.index(r)
            if site not in self.channels:  # not a send to the dead incarnation of a site that came back
                self._lose(site, "the answer to it could not be sent")
