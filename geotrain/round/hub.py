"""A site's side of rounds through a hub: asynchronous quorum rounds (``sync.quorum`` without
elastic mode), after Decoupled DiLoCo (arXiv:2604.21428) and HALoS (arXiv:2506.04531).

The hub (:class:`geotrain.round.syncer.QuorumSyncer`, a thread beside the local rank 0 of the
first site, or in two tiers of each region's first site) holds the global model and the outer
optimizer. A site delivers each part's pseudo-gradient Δ = θ_base − θ_local with the version
``base`` it started from, its steps and workers; on time it waits for the round to merge, late
it is answered at once with the current global model; it goes on from the global values it gets
back (where the outer step runs is the exchange's property: here the hub stepped, and the site
adopts). Streaming DiLoCo's fragments each have a version of their own, one delivery in flight
per site.

Site 0 talks to the hub in memory; the others' leaders by messages (:class:`Mailbox`); a site
that comes back after it was lost (its world is its own ranks) through the run's store
(:class:`StoreChannel`). Encoded both ways with ``sync.codec`` (the answer as the change from
what the site holds, so that a codec's error is carried into the next answer). Every wait is
bounded by ``liveness.hub_timeout_s``.
"""

from __future__ import annotations

import json
import queue
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from geotrain.codecs import Residual
from geotrain.comm.alive import Heartbeat, run_store
from geotrain.comm.collectives import Collectives
from geotrain.comm.groups import leaders_group
from geotrain.comm.mailbox import Mailbox, Message, StoreChannel, channel_keys, join_key, link_arrival
from geotrain.comm.topology import Topology
from geotrain.config import LivenessConfig, SyncConfig
from geotrain.errors import SyncerTimeout
from geotrain.round.merge import mask_sites
from geotrain.round.outer import averaging, outer_sgd
from geotrain.round.star import StarAdapter
from geotrain.round.syncer import CHECKPOINT, FIELDS, FINAL, PING, UPDATE, QuorumSyncer, Rejoins, Update
from geotrain.round.world import WorldTier, region_hubs
from geotrain.sync.reducer import Codecs

Answer = tuple[list[float], torch.Tensor]


@dataclass(frozen=True)
class Rejoin:
    """A site that came back (its ranks' world is the site alone): ``full``, the run's topology; ``site``, its index."""

    full: Topology
    site: int


def records_key(site: int) -> str:
    """The run store's key of a site's rank records at the end of a run that lost a site."""
    return f"geotrain/quorum/records/{site}"


class Hub:
    """This site's side of the hub (see the module docstring).

    Args:
        theta: the initial global model, whole (the first site's ranks gather it together under FSDP).
        shapes: this rank's parameters' shapes (the codecs' tiles).
        fragments: the parameters merged together, each list with a version of its own.
        rejoin: this site came back after it was lost.
        live: the hub's heartbeats, when a silent site is lost, and how long a site waits for it.
    """

    def __init__(
        self,
        cfg: SyncConfig,
        comm: Collectives,
        theta: list[torch.Tensor] | None,
        shapes: list[torch.Size],
        params: int,
        fragments: list[list[int]],
        rejoin: Rejoin | None,
        live: LivenessConfig,
    ) -> None:
        assert cfg.quorum is not None
        self.cfg, self.quorum, self.comm, self.rejoin, self.live = cfg, cfg.quorum, comm, rejoin, live
        g = comm.groups
        self.full = g.topology if rejoin is None else rejoin.full  # the whole run
        self.site_index = g.me.site_index if rejoin is None else rejoin.site
        self.site_workers = self.full.workers[self.site_index]
        self.leaders = self.full.inter_ranks(0)
        # the site whose local rank 0 holds this site's hub: the first site (two tiers: of its region)
        self.hubs = region_hubs(self.full) if cfg.region_every else [0]
        self.hub_site = self.hubs[self.full.region_of[self.site_index]] if self.hubs[1:] else 0
        self.leader = g.me.local_rank == 0
        self.mailbox: Mailbox | None = None
        self.channel: StoreChannel | None = None  # a site that came back: to the hub through the run's store
        if rejoin is None:
            group = leaders_group(g.topology)  # collective: every rank
            self.mailbox = Mailbox(comm, group, FIELDS) if self.leader else None
        # sync.codec both ways; with sync.adapt, in the sync.adapt.codecs the hub chose last
        names = list(cfg.adapt.codecs) if cfg.adapt is not None else [cfg.codec.name]
        coders = Codecs(cfg, names, shapes, g.device)  # (SparseLoCo's tiles)
        self.coders = coders.build_all() if self.leader else coders  # (only leaders encode)
        self.codec_name: str = cfg.codec.name
        feeds = Codecs.feeds_back(cfg)
        self.residuals = [Residual(decay=cfg.codec.error_decay) for _ in fragments] if feeds else []
        self._link = (0.0, 0.0, 0.0)  # sync.adapt: this site's last round's bytes both ways, seconds, ping
        self.versions = [0] * len(fragments)
        self.syncer: QuorumSyncer | None = None
        if theta is not None and self.leader:
            assert self.mailbox is not None
            one_tier = not self.hubs[1:]
            region_outer = cfg.tier_outer in ("region", "both") or one_tier
            plain = cfg.model_copy(update={"outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False})
            self.syncer = QuorumSyncer(
                cfg.quorum, live, cfg.weight_by_tokens, self.full.workers, theta,
                outer_sgd(cfg) if region_outer else averaging, cfg if region_outer else plain,
                self.mailbox, self.leaders, [self.full.site_ranks(i) for i in range(self.full.num_sites)],
                rejoins=Rejoins(self._run_store, self._hub_channel), codecs=self.coders,
                adapter=None if cfg.adapt is None else StarAdapter(cfg.adapt, params, cfg.H, cfg.codec.name),
                sites=[s for s in range(self.full.num_sites) if one_tier or self.full.same_region(s, self.site_index)],
                world=None if one_tier else WorldTier(
                    self.full.region_of[self.site_index], [self.leaders[s] for s in self.hubs], theta,
                    outer_sgd(cfg) if cfg.tier_outer in ("world", "both") else averaging, self.mailbox, cfg, self.coders,
                    live.hub_timeout_s,
                ),
                fragments=fragments,
            )  # fmt: skip
        rank = self.full.first_rank(self.site_index) + g.me.local_rank
        self.heartbeat = Heartbeat(rank, live.hub_heartbeat_s)  # a site that stops beating is lost
        self.ever_lost: list[int] = []  # sites lost at some point (the hub's last answer)
        self.lost_sites: list[int] = []
        self.world_total = 0
        self.next_H = cfg.H  # the steps the hub gave this site's next round (dynamic local steps, adaptation)
        self.done = False  # train.max_seconds passed (the answer's time)
        self.site_steps, self.elapsed = 0, 0.0  # the hub's last answer: this site's steps delivered, its seconds
        self.waits: list[float] = []
        self.checkpoint = False
        self.t0: float | None = None
        self.max_seconds = 0.0

    @property
    def world_broken(self) -> bool:
        return bool(self.ever_lost) or self.rejoin is not None

    def _run_store(self) -> Any:
        return run_store(self.live.hub_timeout_s)

    def _hub_name(self) -> str:
        return f"the syncer (site {self.full.site_names[self.hub_site]}'s local rank 0)"

    def _hub_channel(self, site: int, incarnation: int) -> StoreChannel:
        """The hub's end of the channel to ``site``'s ``incarnation`` that came back."""
        up, down = channel_keys(site, incarnation)
        dst, mailbox = self.leaders[site], self.mailbox
        assert mailbox is not None
        return StoreChannel(
            self._run_store, send=down, recv=up, fields=FIELDS, src=dst,
            arrival=lambda n: mailbox.arrival(dst, n), count=lambda n, raw: self.comm._count(dst, n, raw),
        )  # fmt: skip

    # ------------------------------------------------------------------ the leader's messages

    def _encode(self, delta: torch.Tensor, fragment: int) -> tuple[torch.Tensor, int | None, float]:
        """The update's payload, the fp32 bytes it stands for and the header's encoded flag:
        ``sync.codec``'s bytes, or fp32 without a codec, for an empty delta and for a non-finite
        one (the hub leaves it out; codecs refuse to encode it)."""
        codec = self.coders[self.codec_name]
        if codec is None or not delta.numel() or not bool(torch.isfinite(delta).all()):
            return delta, None, 0.0
        residual = self.residuals[fragment] if self.residuals else None
        if residual is not None:
            residual.add_to(delta)
        buf = codec.encode(delta)
        if residual is not None:
            residual.keep(delta - codec.decode(buf, delta.numel()))
        return buf, 4 * delta.numel(), float(self.coders.index(self.codec_name))

    def _model_from(self, msg: Message, held: torch.Tensor | None) -> Answer:
        """A hub's answer: its fields, and the global values (fp32, or what this site holds plus the
        encoded change; exact answers are fp32)."""
        if not msg.fields[7]:
            return msg.fields, msg.floats()
        coder = self.coders.at(int(msg.fields[7]))
        assert coder is not None and held is not None
        return msg.fields, held + coder.decode(msg.payload.to(held.device), held.numel())

    def deliver(self, update: Update, held: torch.Tensor | None, answer: bool = True) -> Answer | None:
        """Hand ``update`` to the hub (local rank 0); its answer, or None if not ``answer``.
        ``held``: what this site holds of the part (to decode an encoded answer)."""
        timeout, who = self.live.hub_timeout_s, self._hub_name()
        if self.syncer is not None:
            self.syncer.inbox.put(replace(update, delta=update.delta.clone()))
            deadline = time.monotonic() + timeout
            while answer:  # a blocking wait, woken every quarter second to see whether the hub failed
                if self.syncer.error is not None:
                    raise RuntimeError(f"sync.quorum: the syncer failed: {self.syncer.error!r}") from self.syncer.error
                try:
                    return self.syncer.outbox.get(timeout=max(0.0, min(0.25, deadline - time.monotonic())))
                except queue.Empty:
                    if time.monotonic() > deadline:
                        raise SyncerTimeout(f"no answer from {who} within liveness.hub_timeout_s={timeout:g} s") from None
            return None
        payload, raw, encoded = self._encode(update.delta, update.fragment)
        kind = FINAL if update.final else CHECKPOINT if update.checkpoint else UPDATE
        fields = [kind, float(update.base), float(update.steps), float(update.workers), update.compute_s, encoded]
        fields += [*self._link, float(update.fragment), 0.0]  # (sync.adapt: what this site measured last; zeros: nothing)
        ping, t0 = 0.0, time.perf_counter()
        if self.cfg.adapt is not None:  # an empty message to the hub and back: the link's round trip
            self._roundtrip([PING] + [0.0] * (FIELDS - 1), torch.zeros(0), None)
            ping, t0 = time.perf_counter() - t0, time.perf_counter()
        msg = self._roundtrip(fields, payload, raw, answer)
        if msg is None:
            return None
        if self.cfg.adapt is not None:  # both ways' bytes, and the seconds less the update's wait at the hub
            moved = payload.numel() * payload.element_size() + msg.payload.numel() * msg.payload.element_size()
            self._link = (float(moved), max(0.0, time.perf_counter() - t0 - msg.fields[8]), ping)
        return self._model_from(msg, held)

    def _roundtrip(self, fields: list[float], payload: torch.Tensor, raw: int | None, answer: bool = True) -> Message | None:
        """Send one message to the hub and take its answer (bounded by liveness.hub_timeout_s)."""
        timeout, who, mailbox = self.live.hub_timeout_s, self._hub_name(), self.mailbox
        if self.channel is not None:  # a site that came back
            self.channel.send(fields, payload, raw)
            msg = self.channel.receive(timeout) if answer else None
        else:
            assert mailbox is not None
            mailbox.send(self.leaders[self.hub_site], fields, payload, raw)
            msg = mailbox.receive(self.leaders[self.hub_site], timeout) if answer else None
        if not answer:
            return None
        if msg is None:
            raise SyncerTimeout(f"no answer from {who} within liveness.hub_timeout_s={timeout:g} s")
        if msg.lost:
            raise SyncerTimeout(f"lost {who}: its connection closed (the run cannot go on without the first site)")
        if mailbox is not None and self.channel is None:
            mailbox.flush()
        return msg

    def whole_answer(self, answer: Answer, n: int) -> Answer:
        """An exact answer (the final one; a site's return) of several fragments holds the whole
        model of ``n`` values and then every fragment's version: keep the versions."""
        fields, theta = answer
        if len(self.versions) > 1 and theta.numel() == n + len(self.versions):
            self.versions = [int(v) for v in theta[n:].tolist()]
            theta = theta[:n]
        return fields, theta

    # ------------------------------------------------------------------ every rank

    def take(self, answer: Answer | None, values: int, fragment: int | None) -> torch.Tensor:
        """The hub's ``answer`` (the leader's; None on the site's other ranks, which get it from the
        leader) on every rank of the site: the global values (``values`` of them), and its version,
        world steps, next H, live and lost sites, this site's steps and seconds, the next codec."""
        g = self.comm.groups
        control = torch.zeros(
            10, dtype=torch.float64
        )  # version, world steps, stop, H, live, lost, steps, seconds, codec, checkpoint
        theta = torch.empty(values, dtype=torch.float32)
        if answer is not None:
            fields, theta = answer
            time_up = bool(self.max_seconds) and self.t0 is not None and time.perf_counter() - self.t0 >= self.max_seconds
            control[:] = torch.tensor([fields[0], fields[1], float(time_up), *fields[2:7], fields[9], fields[10]])
        if len(g.intra_ranks) > 1:  # the site's other ranks get the leader's answer
            for t in (control, theta):
                dist.broadcast(t, g.intra_ranks[0], group=g.intra)
                if self.leader:
                    for r in g.intra_ranks[1:]:
                        self.comm._count(r, t.numel() * t.element_size())
        self.versions[0 if fragment is None else fragment], self.world_total = int(control[0]), int(control[1])
        self.done = bool(control[2])
        self.next_H = max(1, int(control[3]))
        n = self.full.num_sites
        self.lost_sites = [s for s in range(n) if s not in mask_sites(float(control[4]), n)]
        self.ever_lost = mask_sites(float(control[5]), n)
        self.site_steps, self.elapsed = int(control[6]), float(control[7])
        if control[8]:  # the codec the hub chose (sync.adapt; else the configured one)
            self.codec_name = self.coders.names[int(control[8]) - 1]
        self.checkpoint = bool(control[9])  # this answer ended a checkpoint's barrier
        return theta

    def rejoin_answer(self, held: torch.Tensor | None, n: int) -> Answer | None:
        """This site came back: local rank 0 asks the hub to take it back; the hub's exact answer
        (the global model, where to go on from). Every rank then calls :meth:`take`.

        Raises:
            SyncerTimeout: no answer within ``liveness.hub_timeout_s``.
        """
        assert self.rejoin is not None
        if not self.leader:
            return None
        store = self._run_store()
        incarnation = int(store.add(join_key(self.site_index), 1))
        up, down = channel_keys(self.site_index, incarnation)
        wan, other_region = self.comm.wan, not self.full.same_region(self.hub_site, self.site_index)
        self.channel = StoreChannel(
            self._run_store, send=up, recv=down, fields=FIELDS, src=self.leaders[self.hub_site],
            arrival=lambda k: link_arrival(wan, self.hub_site, k),
            count=lambda k, raw: self.comm.count_far(k, raw, other_region=other_region),
        )  # fmt: skip
        msg = self.channel.receive(self.live.hub_timeout_s)
        if msg is None:
            raise SyncerTimeout(
                f"no answer from {self._hub_name()} to this site's rejoin within "
                f"liveness.hub_timeout_s={self.live.hub_timeout_s:g} s"
            )
        return self.whole_answer(self._model_from(msg, held), n)

    def gather_records(self, record: Any, world: Any) -> list[Any]:
        """Every live rank's ``record`` (on global rank 0; the others get their site's). Once a site
        has been lost the world group cannot be used: each site gathers on its own group, and the
        other live sites' leaders put theirs in the run's store for rank 0 (JSON)."""
        g = self.comm.groups
        mine: list[Any] = [None] * len(g.intra_ranks)
        dist.gather_object(record, mine if self.leader else None, dst=g.intra_ranks[0], group=g.intra)
        if not self.leader:
            return []
        store = self._run_store()  # a get waits for its key up to liveness.hub_timeout_s
        if self.site_index:
            store.set(records_key(self.site_index), json.dumps(mine))
            return mine
        for s in range(1, self.full.num_sites):
            if s not in self.lost_sites:
                mine += json.loads(store.get(records_key(s)))
        return mine

    def state_dict(self) -> dict[str, Any]:
        """Taken after a barrier round: this site's base versions and counters, its error feedback,
        and (the hub's site) the hub's state at the barrier."""
        return {
            "versions": list(self.versions),
            "world_total": self.world_total,
            "site_steps": self.site_steps,
            "residuals": [None if r.tensor is None else r.tensor.clone() for r in self.residuals],
            "syncer": None if self.syncer is None else self.syncer.snapshot,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.versions, self.world_total, self.site_steps = list(state["versions"]), state["world_total"], state["site_steps"]
        for r, saved in zip(self.residuals, state["residuals"], strict=True):
            r.tensor = saved
        if self.syncer is not None:
            self.syncer.load_state_dict(state["syncer"])

    def close(self, timeout_s: float = 5.0) -> None:
        self.heartbeat.stop()
        if self.syncer is not None:
            self.syncer.close(timeout_s)
