"""The syncer of asynchronous quorum rounds: the global model, the outer optimizer and the merge
rule, in a thread beside the first site's local rank 0 (what it does and why:
:mod:`geotrain.sync.quorum`, docs/DESIGN.md §26).

It takes each site's update as it comes (site 0's from a queue in memory, the others' through
:mod:`geotrain.comm.mailbox`), merges a round once a quorum is in (plus the grace window),
discounts late updates by staleness, applies delayed Nesterov, answers each site with the global
model, and treats a site whose connection closed as late forever. A lost site that comes back
(started again by the launcher) asks to rejoin through the run's store; the syncer answers it with
the global model and where to go on from, and takes it back into the world round.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from geotrain.codecs import Codec
from geotrain.comm.alive import SilenceWatch
from geotrain.comm.mailbox import Mailbox, Message, StoreChannel, down_key, join_key, silent_key
from geotrain.config import QuorumConfig, SyncConfig
from geotrain.sync.merge import DelayedNesterov, weighted_mean
from geotrain.sync.quorum_adapt import LinkReport, StarAdapter
from geotrain.sync.reducer import Codecs

# CHECKPOINT: waits for every live site (a checkpoint's barrier); PING: answered at once, empty (sync.adapt)
UPDATE, FINAL, CHECKPOINT, PING = 1.0, 2.0, 3.0, 4.0
# site → syncer: [kind, base, steps, workers, compute s, encoded, link bytes, link s, ping s (sync.adapt; 0: none), 0]
# syncer → site: [version, world steps, next H, live sites, sites ever lost, the site's steps so far, the syncer's
#                 seconds, encoded, seconds the site's update waited here, the codec of its next update]
# encoded: 1 + the index, in the run's codecs (sync.adapt.codecs, else sync.codec), of the codec whose bytes the payload
# is (the pseudo-gradient, or the change since the model the site holds); 0: fp32 (a pseudo-gradient, or the model)
FIELDS = 10
TICK = 0.05  # the syncer's longest wait for input: failed sends, silent sites and restarted sites are checked this often


@dataclass
class Update:
    """One site's delivery to the syncer."""

    site: int
    base: int  # version of the global model its round started from
    steps: int
    workers: int
    delta: torch.Tensor  # flat fp32 pseudo-gradient (empty: a final delivery of no steps)
    final: bool = False
    compute_s: float = 0.0  # seconds of compute (pacing included, network waits not) the steps took
    checkpoint: bool = False  # the round before a checkpoint: answered once every live site has delivered
    link: LinkReport | None = None  # sync.adapt: what the site measured in its last round
    ping: bool = False  # sync.adapt: an empty message, answered at once (the site times it)


def first_round_steps(cfg: SyncConfig) -> int:
    """A site's first round: H, or with dynamic local updates max(1, H/10), to measure its pace."""
    assert cfg.quorum is not None
    return max(1, cfg.H // 10) if cfg.dynamic_quorum_steps else cfg.H


def dynamic_steps(rates: Sequence[float], current: Sequence[int], H: int) -> list[int]:
    """Dynamic local updates (Async Local-SGD, Liu et al. 2024): each site whose rate (steps per
    second) is known runs H × its rate / the fastest rate, rounded, at least 1; the others keep
    ``current``."""
    fastest = max(rates)
    return [max(1, min(H, round(H * r / fastest))) if r > 0 else c for r, c in zip(rates, current, strict=True)]


class Rejoins:
    """Lost sites that came back, read from the run's store (:func:`join_key`), the channel to
    each (``channel(site, incarnation)``), and which of them the launcher saw go down again
    (:func:`down_key`: the store does not close a connection when a site dies)."""

    def __init__(self, connect: Callable[[], Any], channel: Callable[[int, int], StoreChannel]) -> None:
        self.connect, self.channel = connect, channel
        self.seen: dict[int, int] = {}  # the last incarnation of each site taken back
        self._store: Any = None

    def _connected(self) -> Any:
        if self._store is None:
            self._store = self.connect()
        return self._store

    def _read(self, key: str) -> int:
        return int(self._connected().add(key, 0))  # a read that never blocks on a missing key

    def report_silent(self, site: int) -> None:
        """Tell the launcher that ``site``'s current incarnation was lost for silence
        (:func:`silent_key`): it ends that incarnation's processes and may start the site again."""
        self._connected().set(silent_key(site), str(self.seen.get(site, 0)))

    def poll(self, lost: Iterable[int]) -> list[tuple[int, int]]:
        """(site, incarnation) of each of the ``lost`` sites whose new incarnation asked to rejoin."""
        back = []
        for s in sorted(lost):
            k = self._read(join_key(s))
            if k > self.seen.get(s, 0):
                self.seen[s] = k
                back.append((s, k))
        return back

    def down(self, sites: Iterable[int]) -> list[int]:
        """Of ``sites`` (that came back), those whose current incarnation the launcher saw exit."""
        return [s for s in sorted(sites) if self._read(down_key(s)) >= self.seen.get(s, 0)]


def site_mask(sites: Iterable[int]) -> float:
    """A set of site indices as one float64 field (exact for up to 53 sites)."""
    return float(sum(1 << s for s in set(sites)))


def mask_sites(mask: float, n: int) -> list[int]:
    """The site indices in a :func:`site_mask` field."""
    return [s for s in range(n) if int(mask) >> s & 1]


def merge_weights(updates: Sequence[Update], version: int, weight_by_tokens: bool, power: float) -> list[float]:
    """Each update's weight in the merge that makes version ``version + 1``: tokens (or 1) times
    (1 + staleness)^-power, staleness = ``version - base``."""
    return [(float(u.workers * u.steps) if weight_by_tokens else 1.0) * (1.0 + (version - u.base)) ** -power for u in updates]


class QuorumSyncer:
    """The global model, the outer optimizer and the merge rule, in a thread (see the module docstring).

    Args:
        cfg: the quorum settings; ``weight_by_tokens``: weight updates by tokens.
        workers: every site's workers, in site order.
        theta: the initial global model (copied); ``make_optimizer``: the outer optimizer over a list of tensors.
        mailbox: messages to and from the other sites' local rank 0 (``leaders``, in site order).
    """

    def __init__(
        self,
        cfg: QuorumConfig,
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
    ) -> None:
        self.cfg, self.weight_by_tokens, self.workers = cfg, weight_by_tokens, list(workers)
        # the other sites' ranks, watched for silence (a hung site is lost like a dead one); none: not watched
        self.site_ranks = [list(r) for r in site_ranks]
        self.watch = SilenceWatch([r for rs in self.site_ranks[1:] for r in rs], cfg.heartbeat_s, cfg.lost_after_s)
        self.max_H, self.dynamic = sync_cfg.H, sync_cfg.dynamic_quorum_steps
        # every site's next round (H, or dynamic: a first one of max(1, H/10)), and its smoothed steps per compute second
        self.H, self.rates = [first_round_steps(sync_cfg)] * len(self.workers), [0.0] * len(self.workers)
        self.theta = [t.detach().clone() for t in theta]
        self.outer = DelayedNesterov(self.theta, make_optimizer(self.theta), sync_cfg, len(self.workers))
        self.mailbox, self.leaders = mailbox, list(leaders)
        self.version = 0
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
        self.held = {s: flat.clone() for s in range(1, len(self.workers))} if any(map(Codecs.encodes, self.names)) else {}
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

    def start(self) -> None:
        """Start taking updates (after a resumed run has loaded :meth:`load_state_dict`)."""
        if not self._thread.is_alive():
            self._t0 = time.monotonic()
            self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps, taken at a barrier (nothing in flight; every live site holds
        the model exactly): the global model, the outer optimizer with its delayed momentum, the
        version and the merge log, the sites' step counts and measured rates."""
        return {
            "theta": [t.clone() for t in self.theta],
            "optimizer": self.outer.optimizer.state_dict(),
            "pending": [p.clone() for p in self.outer.pending],
            "pending_updates": self.outer.pending_updates,
            "version": self.version,
            "world_steps": self.world_steps,
            "H": list(self.H),
            "rates": list(self.rates),
            "site_steps": list(self.site_steps),
            "log": [dict(e) for e in self.log],
            "adapt": None if self.adapter is None else self.adapter.state_dict(),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (before :meth:`start`)."""
        assert not self._thread.is_alive()
        for t, v in zip(self.theta, state["theta"], strict=True):
            t.copy_(v)
        self.outer.optimizer.load_state_dict(state["optimizer"])
        for p, v in zip(self.outer.pending, state["pending"], strict=True):
            p.copy_(v)
        self.outer.pending_updates = state["pending_updates"]
        self.version, self.world_steps = state["version"], state["world_steps"]
        self.H, self.rates, self.site_steps = list(state["H"]), list(state["rates"]), list(state["site_steps"])
        self.log = list(state["log"])
        if self.adapter is not None and state.get("adapt") is not None:
            self.adapter.load_state_dict(state["adapt"])
            self.codec_name = self.adapter.codec
        flat = torch.cat([t.reshape(-1) for t in self.theta])
        self.held = {s: flat.clone() for s in self.held}  # the barrier's answer was exact

    def _guarded(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - handed to site 0's training thread, which raises it
            self.error = exc

    def _decode(self, msg: Message) -> Update:
        kind, base, steps, workers, compute_s, encoded, link_bytes, link_s, ping_s = msg.fields[:9]
        site = self.leaders.index(msg.src)
        coder = self.coders[self.names[int(encoded) - 1]] if encoded and msg.payload.numel() else None
        delta = coder.decode(msg.payload, sum(t.numel() for t in self.theta)) if coder is not None else msg.floats()
        return Update(
            site,
            int(base),
            int(steps),
            int(workers),
            delta,
            final=kind == FINAL,
            compute_s=compute_s,
            checkpoint=kind == CHECKPOINT,
            link=LinkReport(link_bytes, link_s, ping_s, int(steps), compute_s) if link_s > 0 else None,
            ping=kind == PING,
        )

    def _measure(self, u: Update) -> None:
        """Dynamic local updates: smooth the site's rate (half weight on the newest round) and give
        every measured site H x its rate / the fastest rate steps (at least 1, at most H)."""
        if not self.dynamic or u.steps <= 0 or u.compute_s <= 0:
            return
        rate = u.steps / u.compute_s
        self.rates[u.site] = rate if not self.rates[u.site] else 0.5 * (self.rates[u.site] + rate)
        self.H = dynamic_steps(self.rates, self.H, self.max_H)

    def _run(self) -> None:
        n = len(self.workers)
        for r in self.leaders[1:]:  # each site's messages, until its final one (or its death)
            self.mailbox.listen(r, self.inbox, lambda m: m.fields[0] == FINAL)
        pending: list[tuple[float, Update]] = []
        open_: list[Update] = []
        waiting: list[int] = []
        finals: set[int] = set()
        barrier: set[int] = set()  # sites waiting at a checkpoint's barrier
        gone: set[int] = set()  # sites whose connection closed, lost once their messages in flight are in
        quorum_at: float | None = None
        poll_joins_at = 0.0
        while not self._stop.is_set():
            if self.rejoins is not None and (self.lost or self.channels) and time.monotonic() >= poll_joins_at:
                poll_joins_at = time.monotonic() + 0.1
                for s in self.rejoins.down(self.channels):
                    self._lose(s, "its processes exited (the launcher saw them go)")
                for s, k in self.rejoins.poll(self.lost):
                    pending = [p for p in pending if p[1].site != s]  # its dead incarnation's: late forever
                    finals.discard(s)
                    self._rejoin(s, k)
            now = time.monotonic()
            due = sorted((p for p in pending if p[0] <= now), key=lambda p: p[0])
            pending = [p for p in pending if p[0] > now]
            for s in sorted(gone - {u.site for _, u in pending}):
                gone.discard(s)
                self._lose(s, "its connection closed")
            self._check_sends()
            for s in self._silent_sites(finals):
                self._lose(s, f"silent for over sync.quorum.lost_after_s={self.cfg.lost_after_s:g} s (stopped or hung)")
                if self.rejoins is not None:
                    self.rejoins.report_silent(s)
            for _, u in due:
                if u.site in self.lost:  # sent before it went silent, arrived after it was lost: late forever
                    continue
                if u.ping:
                    self._send(u.site, [0.0] * FIELDS, torch.zeros(0), None)
                    continue
                self._arrived[u.site] = now
                self.site_steps[u.site] += u.steps
                self._measure(u)
                if self.adapter is not None and u.link is not None:
                    self.adapter.report(u.site, u.link)
                if u.final:
                    finals.add(u.site)
                elif u.checkpoint:
                    barrier.add(u.site)
                elif u.base < self.version:  # late: merged later, and it goes on at once
                    self._reply([u.site])
                else:
                    waiting.append(u.site)
                if u.steps > 0:
                    if bool(torch.isfinite(u.delta).all()):
                        open_.append(u)
                    else:
                        self._note("rejected", [u], [], f"site {u.site}: non-finite update left out")
            waiting = [s for s in waiting if s not in self.lost]
            barrier -= self.lost
            running = [s for s in range(n) if s not in finals and s not in self.lost and s not in barrier]
            if not running and barrier:  # a checkpoint: merge what is in, every waiting site gets the same model
                self._merge(open_, "checkpoint")
                self.snapshot = self.state_dict()
                self._reply(sorted(barrier), exact=True)
                open_, quorum_at, barrier = [], None, set()
                continue
            if not running:  # the final round: merge what is left, every live site gets the same model
                self._merge(open_, "final")
                if not open_:  # nothing was left: logged all the same
                    self._note("final", [], [], "nothing left to merge")
                self._reply(sorted(finals - self.lost), exact=True)
                return
            delivered = {u.site for u in open_} | set(waiting)
            if waiting and len(delivered) >= min(self.cfg.sites, len(running)):
                quorum_at = now if quorum_at is None else quorum_at
                if now >= quorum_at + self.cfg.grace_s or set(running) <= delivered:
                    self._merge(open_, "quorum")
                    open_, quorum_at = [], None
                    self._reply(waiting)
                    waiting = []
            # wait for input, at most until the next message lands, the grace window closes, or TICK
            # (failed sends, silent sites and restarted sites are checked that often); at least 1 ms,
            # so a deadline just past never turns the loop into a spin
            deadlines = [p[0] for p in pending] + ([quorum_at + self.cfg.grace_s] if quorum_at is not None and waiting else [])
            self._receive(pending, gone, max(0.001, min([TICK, *(d - time.monotonic() for d in deadlines)])))

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
            elif item.lost:
                gone.add(self.leaders.index(item.src))
            else:
                pending.append((item.arrival, self._decode(item)))
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _merge(self, updates: list[Update], why: str) -> None:
        if not updates:
            return
        ups = sorted(updates, key=lambda u: (u.site, u.base))
        weights = merge_weights(ups, self.version, self.weight_by_tokens, self.cfg.staleness_power)
        # a whole world round's tokens: each site's steps in this merge, or its round's H if it is
        # not in it (a merge of every site: the merge's own tokens)
        steps = [0 if s in self.lost else h for s, h in enumerate(self.H)]
        for s in {u.site for u in ups}:
            steps[s] = max(u.steps for u in ups if u.site == s)
        world = (
            float(sum(w * k for w, k in zip(self.workers, steps, strict=True))) if self.weight_by_tokens else float(len(steps))
        )
        self.outer.step(weighted_mean([u.delta for u in ups], weights, world), len(ups))
        self._note(why, ups, weights, "")
        self.version += 1
        self.world_steps += sum(u.workers * u.steps for u in ups)
        if self.adapter is not None and self.adapter.choose(self.version):  # every site's next H and codec
            self.max_H, self.codec_name, chosen = self.adapter.H, self.adapter.codec, [self.adapter.H] * len(self.workers)
            # (dynamic local steps: the chosen H is the fastest site's, the others' follow their rates)
            self.H = dynamic_steps(self.rates, chosen, self.max_H) if self.dynamic else chosen

    def _note(
        self, why: str, ups: Sequence[Update], weights: Sequence[float], reason: str, sites: Sequence[int] | None = None
    ) -> None:
        """One log entry: a merge of ``ups`` (``reason`` empty), or an event about ``sites`` (default: the updates' sites)."""
        self.log.append(
            {
                "version": self.version + (0 if reason else 1),
                "t": round(time.monotonic() - self._t0, 3),
                "kind": why,
                "sites": [u.site for u in ups] if sites is None else list(sites),
                "staleness": [self.version - u.base for u in ups],
                "steps": [u.steps for u in ups],
                "weights": [round(w, 4) for w in weights],
                **({"next_H": list(self.H)} if self.dynamic else {}),
                **({"why": reason} if reason else {}),
            }
        )

    def _silent_sites(self, finals: set[int]) -> list[int]:
        """Sites (not the first, which holds this thread) still running, one of whose ranks has
        not beaten its heartbeat for ``lost_after_s``."""
        watched = [s for s in range(1, len(self.site_ranks)) if s not in finals and s not in self.lost]
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
        self.outer.sites = len(self.workers) - len(self.lost)
        channel = self.channels.pop(site, None)
        if channel is not None:
            channel.close()
        self._note("lost", [], [], f"site {site}: {why}; late forever", sites=[site])

    def _rejoin(self, site: int, incarnation: int) -> None:
        """Lost ``site`` came back as ``incarnation``: from now on it counts in the world round
        again, its messages come through the run's store, and it is answered at once with the
        global model (its new base) and the steps it had delivered (where its data goes on)."""
        self.lost.discard(site)
        self.outer.sites = len(self.workers) - len(self.lost)
        assert self.rejoins is not None
        channel = self.channels[site] = self.rejoins.channel(site, incarnation)
        channel.listen(self.inbox, lambda m: m.fields[0] == FINAL)
        if self.site_ranks:
            self.watch.restart(self.site_ranks[site])
        why = f"site {site}: incarnation {incarnation} came back; it goes on from version {self.version}, its step {self.site_steps[site]}"
        self._note("rejoined", [], [], why, sites=[site])
        self._reply([site], exact=True)

    def _reply(self, sites: Sequence[int], exact: bool = False) -> None:
        """Answer ``sites`` with the global model: in fp32 to site 0 (in memory), with ``exact`` (the
        final round, a site that came back) and without a codec; else encoded, as the change from
        what the site holds, which this syncer then updates exactly as the site will (so the next
        answer carries what this one's encoding left out)."""
        theta = torch.cat([t.reshape(-1) for t in self.theta])
        live = site_mask([s for s in range(len(self.workers)) if s not in self.lost])
        now = time.monotonic()
        coder, index = self.coders[self.codec_name], 1.0 + self.names.index(self.codec_name)
        for s in sites:
            fields = [
                float(self.version),
                float(self.world_steps),
                float(self.H[s]),
                live,
                site_mask(self.ever_lost),
                float(self.site_steps[s]),
                now - self._t0,
                0.0,
                max(0.0, now - self._arrived[s]),
                index,
            ]
            if s == 0:
                self.outbox.put((fields, theta.clone()))
                continue
            if s in self.lost:  # (a site that came back is reached through its channel until it is lost again)
                continue
            payload, raw = theta, None
            if s in self.held and (exact or coder is None):
                self.held[s] = theta.clone()
            elif coder is not None:
                payload, raw, fields[7] = coder.encode(theta - self.held[s]), 4 * theta.numel(), index
                self.held[s] += coder.decode(payload, theta.numel())
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
            site = self.leaders.index(r)
            if site not in self.channels:  # not a send to the dead incarnation of a site that came back
                self._lose(site, "the answer to it could not be sent")
