"""Asynchronous quorum rounds: DiLoCo where no site waits for the slowest one (``sync.quorum``).

After Decoupled DiLoCo (DeepMind 2026, arXiv:2604.21428: learners merge when a quorum has
arrived within a grace window, token-weighted) and HALoS (arXiv:2506.04531: a global
parameter server that sites push to and pull from). A **syncer** (:mod:`geotrain.sync.syncer`)
holds the global model and the outer optimizer; it runs as a thread beside the first site's
local rank 0 (site 0 talks to it in memory; the others by messages, :mod:`geotrain.comm.mailbox`).
This module is a site's side. Each site:

1. runs H inner steps from the global model of version ``base``, then sends its
   pseudo-gradient Δ = θ_base − θ_local with ``base``, its steps and workers;
2. **on time** (``base`` is the syncer's current version): waits for the round to merge;
   **late** (merges happened since ``base``): its update joins the open round and the syncer
   answers at once with the current global model, so a slow site never waits for a quorum it
   would only hold up;
3. continues from the global model it got back (its new ``base``).

When a round **merges**, with which weights (tokens discounted by staleness, FedAsync's rule)
and its delayed Nesterov step: :mod:`geotrain.sync.syncer`, docs/DESIGN.md §26. With
``quorum.local_steps=dynamic`` the syncer gives each site about H × its rate / the fastest
rate steps with its answer (Async Local-SGD's dynamic local updates). Streaming DiLoCo's
fragments sync the same way, each with a version of its own (:mod:`.quorum_streaming`).

With ``quorum.sites`` = every site, an endless grace window and fixed local steps, the run is
lock-step DiLoCo (bit for bit with two sites; with more, the ring adds in another order). At the
end every site sends a **final** update (possibly of no steps) and waits; the syncer merges what
is left and sends every site the same model.

A site that dies (any but the first, which holds the syncer) is **late forever**: the syncer
learns it from the closed connection, keeps the updates already in, and counts a world round over
the live sites. Every answer names the sites ever lost, so the end of the run avoids the world
group (it holds the dead ranks: :meth:`AsyncDiLoCo.gather_records`).

A lost site **comes back** when the launcher starts it again (``fault.restart_after``). Its new
ranks form a torch.distributed world of their own (:class:`Rejoin`), since the run's world cannot
grow; its leader adds 1 to the site's join counter in the run's store and talks to the syncer
through store keys (:class:`geotrain.comm.mailbox.StoreChannel`). The syncer answers with the
global model (the site's new base), the steps the site had delivered (its data stream and
schedule go on from there: the round it died in is lost) and the run's elapsed time (so it stops
with the others), and counts it in the world round again (:meth:`QuorumSyncer._rejoin`).

Non-finite updates are left out by the syncer (the update guard's cross-site outlier test is a
collective and is not applied here). Every wait is bounded by ``quorum.timeout_s``.
"""

from __future__ import annotations

import json
import queue
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from geotrain.codecs import Residual
from geotrain.comm.alive import Heartbeat, run_store
from geotrain.comm.collectives import Collectives
from geotrain.comm.groups import leaders_group
from geotrain.comm.mailbox import Mailbox, Message, StoreChannel, channel_keys, join_key, link_arrival
from geotrain.comm.topology import Topology
from geotrain.config import SyncConfig
from geotrain.errors import SyncerTimeout
from geotrain.sync.base import views_like
from geotrain.sync.diloco import DiLoCo
from geotrain.sync.merge import averaging
from geotrain.sync.outer import pseudo_gradient
from geotrain.sync.pace import RoundClock
from geotrain.sync.quorum_adapt import StarAdapter
from geotrain.sync.quorum_world import WorldTier, region_hubs
from geotrain.sync.reducer import Codecs
from geotrain.sync.syncer import (
    CHECKPOINT,
    FIELDS,
    FINAL,
    PING,
    UPDATE,
    QuorumSyncer,
    Rejoins,
    Update,
    first_round_steps,
    mask_sites,
)


@dataclass(frozen=True)
class Rejoin:
    """A site that came back (its ranks' world is the site alone): ``full``, the run's topology; ``site``, its index."""

    full: Topology
    site: int


def records_key(site: int) -> str:
    """The run store's key of a site's rank records at the end of a run that lost a site."""
    return f"geotrain/quorum/records/{site}"


class AsyncDiLoCo(DiLoCo):
    """DiLoCo with asynchronous quorum rounds (``sync.quorum``; see the module docstring).
    ``rejoin``: this site came back after it was lost (its world is its own ranks)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        comm: Collectives,
        grad_clip: float,
        cfg: SyncConfig,
        rejoin: Rejoin | None = None,
    ) -> None:
        super().__init__(model, optimizer, comm, grad_clip, cfg)
        assert cfg.quorum is not None
        self.quorum = cfg.quorum
        g = comm.groups
        self.rejoin = rejoin
        self.full = g.topology if rejoin is None else rejoin.full  # the whole run
        self.site_index = g.me.site_index if rejoin is None else rejoin.site
        self.leaders = self.full.inter_ranks(0)
        # the site whose local rank 0 holds this site's syncer: the first site (two tiers: of its region)
        self.hubs = region_hubs(self.full) if cfg.region_every else [0]
        self.hub_site = self.hubs[self.full.region_of[self.site_index]] if self.hubs[1:] else 0
        self.leader = g.me.local_rank == 0
        self.mailbox: Mailbox | None = None
        self.channel: StoreChannel | None = None  # a site that came back: to the syncer through the run's store
        if rejoin is None:
            group = leaders_group(g.topology)  # collective: every rank
            self.mailbox = Mailbox(comm, group, FIELDS) if self.leader else None
        # sync.codec: the update is sent encoded (with error feedback where the codec uses it), the syncer's answers as
        # encoded changes from the site's model; with sync.adapt, in the sync.adapt.codecs the syncer chose last
        names = list(cfg.adapt.codecs) if cfg.adapt is not None else [cfg.codec]
        coders = Codecs(cfg, names, [p.shape for p in self.local_params()], g.device)  # (SparseLoCo's tiles)
        self.coders = coders.build_all() if self.leader else coders  # (only leaders encode)
        self.codec_name: str = cfg.codec
        self.residual = Residual(decay=cfg.error_decay) if Codecs.feeds_back(cfg) else None
        self.adapter = None  # (sync.adapt: the syncer chooses, from the links the sites measure: quorum_adapt)
        self._link = (0.0, 0.0, 0.0)  # sync.adapt: this site's last round's bytes both ways, seconds, ping
        self.syncer: QuorumSyncer | None = None
        self.fragments = self._fragments()
        self.versions = [0] * len(self.fragments)  # (Streaming: a version each)
        # FSDP: the syncer holds whole tensors; the first site's ranks gather its initial model together
        hub = rejoin is None and self.site_index == self.hub_site
        initial = self.full_tensors(self.global_params) if self.sharded and hub else None
        if hub and self.leader:
            assert self.mailbox is not None
            theta = initial if initial is not None else self.global_params
            region_outer = cfg.tier_outer in ("region", "both") or not self.hubs[1:]
            self.syncer = QuorumSyncer(
                cfg.quorum,
                cfg.weight_by_tokens,
                self.full.workers,
                theta,
                self._outer_optimizer if region_outer else averaging,
                cfg if region_outer else cfg.model_copy(update={"outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False}),
                self.mailbox,
                self.leaders,
                [self.full.site_ranks(i) for i in range(self.full.num_sites)],
                rejoins=Rejoins(self._run_store, self._syncer_channel),
                codecs=self.coders,
                adapter=None
                if cfg.adapt is None
                else StarAdapter(cfg.adapt, sum(p.numel() for p in self.params), cfg.H, cfg.codec),
                sites=[s for s in range(self.full.num_sites) if self.full.same_region(s, self.site_index) or not self.hubs[1:]],
                world=None
                if not self.hubs[1:]
                else WorldTier(
                    self.full.region_of[self.site_index],
                    [self.leaders[s] for s in self.hubs],
                    theta,
                    self._outer_optimizer if cfg.tier_outer in ("world", "both") else averaging,
                    self.mailbox,
                    cfg,
                    self.coders,
                ),
                fragments=self.fragments,
            )
        rank = self.full.first_rank(self.site_index) + g.me.local_rank
        self.heartbeat = Heartbeat(rank, cfg.quorum.heartbeat_s)  # a site that stops beating is lost
        self.ever_lost: list[int] = []  # sites lost at some point (the syncer's last answer)
        self.world_total = 0
        # the syncer sets each later round's steps (dynamic local updates: what adaptive pace is here)
        self.clock = RoundClock(comm, self.H, adaptive=False)
        self.clock.limit = first_round_steps(cfg)
        self._round_compute = 0.0
        self.waits: list[float] = []  # seconds this site waited at each of its boundaries
        self._max_seconds = 0.0
        self._t0: float | None = None
        self._site_steps, self._elapsed = 0, 0.0  # the syncer's last answer: this site's steps delivered, its seconds
        self._done = False
        self._finished = False
        self._held: torch.Tensor | None = None  # FSDP with a codec: the whole model this site holds
        self._barrier_passed = False  # a checkpoint's barrier round just ended: every site holds one model

    def _fragments(self) -> list[list[int]]:
        """The parameters merged together, each list with a version of its own: all of them."""
        return [list(range(len(self.params)))]

    version = property(lambda self: self.versions[0])

    def add_compute(self, seconds: float) -> None:
        if self._t0 is None:
            self._t0 = time.perf_counter() - seconds
        self._round_compute += seconds

    def set_limits(self, steps: int, max_seconds: float) -> None:
        self._max_seconds = max_seconds  # each site checks its own clock; the final round is synchronous
        if self.syncer is not None:  # after a resume has loaded its state
            self.syncer.start()

    def checkpoint_due(self, step: int, every: int) -> int | None:
        """After a checkpoint's barrier round (every checkpoint.every / H rounds; the same steps on
        every site, which all run H per round), while every site is in the run's world."""
        passed, self._barrier_passed = self._barrier_passed, False
        return step if passed and not self.world_broken else None

    @property
    def done(self) -> bool:
        return self._done

    def eval_due(self, step: int, every: int) -> bool:
        return False  # an evaluation is collective: only at the start and after the final round

    def world_steps(self, step: int) -> int:
        return self.world_total

    def pace_log(self) -> list[dict[str, Any]]:
        return [] if self.syncer is None else list(self.syncer.log)

    def adapt_log(self) -> list[dict[str, Any]]:
        return [] if self.syncer is None or self.syncer.adapter is None else list(self.syncer.adapter.log)

    @property
    def world_broken(self) -> bool:
        return bool(self.ever_lost) or self.rejoin is not None

    def _run_store(self) -> Any:
        return run_store(self.quorum.timeout_s)

    def _syncer_channel(self, site: int, incarnation: int) -> StoreChannel:
        """The syncer's end of the channel to ``site``'s ``incarnation`` that came back."""
        up, down = channel_keys(site, incarnation)
        dst, mailbox = self.leaders[site], self.mailbox
        assert mailbox is not None
        return StoreChannel(
            self._run_store,
            send=down,
            recv=up,
            fields=FIELDS,
            src=dst,
            arrival=lambda n: mailbox.arrival(dst, n),
            count=lambda n, raw: self.comm._count(dst, n, raw),
        )

    @torch.no_grad()
    def rejoin_run(self) -> int:
        """This site came back: ask the syncer to take it back and go on from the global model it
        sends; returns the step its data stream and schedule go on from (the steps it had delivered).

        Raises:
            SyncerTimeout: no answer within ``sync.quorum.timeout_s``.
        """
        assert self.rejoin is not None
        answer = None
        self._hold()
        if self.leader:
            store = self._run_store()
            incarnation = int(store.add(join_key(self.site_index), 1))
            up, down = channel_keys(self.site_index, incarnation)
            wan, other_region = self.comm.wan, not self.full.same_region(self.hub_site, self.site_index)
            self.channel = StoreChannel(
                self._run_store,
                send=up,
                recv=down,
                fields=FIELDS,
                src=self.leaders[self.hub_site],
                arrival=lambda n: link_arrival(wan, self.hub_site, n),
                count=lambda n, raw: self.comm.count_far(n, raw, other_region=other_region),
            )
            msg = self.channel.receive(self.quorum.timeout_s)
            if msg is None:
                raise SyncerTimeout(
                    f"no answer from {self._syncer_name()} to this site's rejoin within "
                    f"sync.quorum.timeout_s={self.quorum.timeout_s:g} s"
                )
            answer = self._model_from(msg)
        self._take(answer)
        self._t0 = time.perf_counter() - self._elapsed  # stop with the others (train.max_seconds)
        return self._site_steps

    def gather_records(self, record: Any) -> list[Any]:
        """Every live rank's ``record`` (on global rank 0; the others get their site's). Once a site
        has been lost the world group cannot be used: each site gathers on its own group, and the
        other live sites' leaders put theirs in the run's store for rank 0 (JSON)."""
        if not self.world_broken:
            return super().gather_records(record)
        g = self.comm.groups
        mine: list[Any] = [None] * len(g.intra_ranks)
        dist.gather_object(record, mine if self.leader else None, dst=g.intra_ranks[0], group=g.intra)
        if not self.leader:
            return []
        store = self._run_store()  # a get waits for its key up to sync.quorum.timeout_s
        if self.site_index:
            store.set(records_key(self.site_index), json.dumps(mine))
            return mine
        for s in range(1, self.full.num_sites):
            if s not in self.lost_sites:
                mine += json.loads(store.get(records_key(s)))
        return mine

    def finish(self) -> None:
        if not self._finished:
            self._exchange(final=True)
            self._finished = True
            if self.syncer is not None:
                self.syncer.close()

    def close(self) -> None:
        self.heartbeat.stop()
        if self.syncer is not None:
            self.syncer.close(timeout_s=1.0)
        super().close()

    @torch.no_grad()
    def outer_step(self) -> None:
        self._exchange(final=False)

    @torch.no_grad()
    def _exchange(self, final: bool) -> None:
        """Deliver this round's update (final: the last one, possibly of no steps), take the global
        model the syncer sends back, and go on from it."""
        steps = self._steps_in_round
        delta = self._whole(pseudo_gradient(self.global_params, self.local_params()))
        self.faults.corrupt_update(delta, self.rounds)
        every = max(1, self.checkpoint_every // self.H)
        barrier = bool(self.checkpoint_every and steps and not final and (self.rounds + 1) % every == 0)
        t0 = time.perf_counter()
        self._hold()
        answer = None
        if self.leader:
            payload = delta if steps else delta[:0]
            answer = self._deliver(
                Update(self.site_index, self.version, steps, self.site_workers, payload, final, self._round_compute, barrier)
            )
        self._barrier_passed = barrier
        self._take(answer)
        self.comm.add_wait(time.perf_counter() - t0)
        self.waits.append(time.perf_counter() - t0)
        self._round_compute = 0.0
        if steps:
            self.rounds += 1
        self._steps_in_round = 0
        self.clock.next_round(self.rounds)

    def checkpoint_state(self) -> dict[str, Any]:
        """Taken after a barrier round: this site's base version and counters, its error feedback,
        and (site 0) the syncer's state at the barrier."""
        return {
            **super().checkpoint_state(),
            "quorum": {
                "version": self.version,
                "world_total": self.world_total,
                "site_steps": self._site_steps,
                "residual": None if self.residual is None or self.residual.tensor is None else self.residual.tensor.clone(),
                "syncer": None if self.syncer is None else self.syncer.snapshot,
            },
        }

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        super().load_checkpoint_state(state)
        q = state["quorum"]
        self.versions[0], self.world_total, self._site_steps = q["version"], q["world_total"], q["site_steps"]
        if self.residual is not None:
            self.residual.tensor = q["residual"]
        if self.syncer is not None:
            self.syncer.load_state_dict(q["syncer"])

    def _take(self, answer: tuple[list[float], torch.Tensor] | None, fragment: int | None = None) -> None:
        """Go on from the syncer's ``answer`` (the leader's; None on the site's other ranks, which
        get it from the leader): the global model, version, next H, live and lost sites. With a
        ``fragment``, the answer holds its parameters, mixed into the local ones as Streaming DiLoCo mixes."""
        g, which = self.comm.groups, list(range(len(self.params))) if fragment is None else self.fragments[fragment]
        control = torch.zeros(9, dtype=torch.float64)  # version, world steps, stop, H, live, lost, steps, seconds, codec
        theta = torch.empty(sum(self.params[i].numel() for i in which), dtype=torch.float32)  # whole (FSDP: every shard)
        if answer is not None:
            fields, theta = answer
            time_up = bool(self._max_seconds) and self._t0 is not None and time.perf_counter() - self._t0 >= self._max_seconds
            control[:] = torch.tensor([fields[0], fields[1], float(time_up), *fields[2:7], fields[9]])
        if len(g.intra_ranks) > 1:  # the site's other ranks get the leader's answer
            for t in (control, theta):
                dist.broadcast(t, g.intra_ranks[0], group=g.intra)
                if self.leader:
                    for r in g.intra_ranks[1:]:
                        self.comm._count(r, t.numel() * t.element_size())
        local, a = self.local_params(), self.cfg.alpha
        for i, v in zip(
            which, self._own(theta) if fragment is None else views_like(theta, [local[i] for i in which]), strict=True
        ):
            gp = self.global_params[i].copy_(v)
            local[i].copy_(gp) if fragment is None else local[i].mul_(a).add_(gp, alpha=1 - a)
        self.versions[0 if fragment is None else fragment], self.world_total = int(control[0]), int(control[1])
        self._done = bool(control[2])
        self.clock.limit = max(1, int(control[3]))
        n = self.full.num_sites
        self.lost_sites = [s for s in range(n) if s not in mask_sites(float(control[4]), n)]
        self.ever_lost = mask_sites(float(control[5]), n)
        self._site_steps, self._elapsed = int(control[6]), float(control[7])
        if control[8]:  # the codec the syncer chose (sync.adapt; else the configured one)
            self.codec_name = self.coders.names[int(control[8]) - 1]

    def _hold(self) -> None:
        """FSDP with a codec: the syncer answers with an encoded change from the model the site
        holds, which the leader needs whole; the site's ranks gather it before the leader asks."""
        self._held = None
        if self.sharded and Codecs.encodes(self.codec_name):
            self._held = self._whole(torch.cat([p.reshape(-1) for p in self.global_params]))

    def _encode(self, delta: torch.Tensor) -> tuple[torch.Tensor, int | None, float]:
        """The update's payload, the fp32 bytes it stands for, and the header's encoded flag:
        ``sync.codec``'s bytes, or fp32 without a codec, for an empty delta, and for a non-finite
        one (the syncer leaves it out; codecs refuse to encode it)."""
        codec = self.coders[self.codec_name]
        if codec is None or not delta.numel() or not bool(torch.isfinite(delta).all()):
            return delta, None, 0.0
        if self.residual is not None:
            self.residual.add_to(delta)
        buf = codec.encode(delta)
        if self.residual is not None:
            self.residual.keep(delta - codec.decode(buf, delta.numel()))
        return buf, 4 * delta.numel(), float(self.coders.index(self.codec_name))

    def _model_from(self, msg: Message) -> tuple[list[float], torch.Tensor]:
        """A syncer's answer: its fields, and the global model (fp32, or the model this site holds
        plus the encoded change)."""
        if not msg.fields[7]:
            return msg.fields, msg.floats()
        coder = self.coders.at(int(msg.fields[7]))
        assert coder is not None
        held = self._held if self._held is not None else torch.cat([p.detach().reshape(-1) for p in self.global_params])
        return msg.fields, held + coder.decode(msg.payload.to(held.device), held.numel())

    def _syncer_name(self) -> str:
        return f"the syncer (site {self.full.site_names[self.hub_site]}'s local rank 0)"

    def _deliver(self, update: Update, answer: bool = True) -> tuple[list[float], torch.Tensor] | None:
        """Hand ``update`` to the syncer; its answer (version, world steps, ...; flat model), or None if not ``answer``."""
        timeout, who = self.quorum.timeout_s, self._syncer_name()
        if self.syncer is not None:
            self.syncer.inbox.put(replace(update, delta=update.delta.clone()))
            deadline = time.monotonic() + timeout
            while answer:  # a blocking wait, woken every quarter second to see whether the syncer failed
                if self.syncer.error is not None:
                    raise RuntimeError(f"sync.quorum: the syncer failed: {self.syncer.error!r}") from self.syncer.error
                try:
                    return self.syncer.outbox.get(timeout=max(0.0, min(0.25, deadline - time.monotonic())))
                except queue.Empty:
                    if time.monotonic() > deadline:
                        raise SyncerTimeout(f"no answer from {who} within sync.quorum.timeout_s={timeout:g} s") from None
            return None  # (no answer asked for)
        payload, raw, encoded = self._encode(update.delta)
        kind = FINAL if update.final else CHECKPOINT if update.checkpoint else UPDATE
        fields = [kind, float(update.base), float(update.steps), float(update.workers), update.compute_s, encoded]
        fields += [*self._link, float(update.fragment)]  # (sync.adapt: what this site measured last; zeros: nothing)
        ping, t0 = 0.0, time.perf_counter()
        if self.cfg.adapt is not None:  # an empty message to the syncer and back: the link's round trip
            self._roundtrip([PING] + [0.0] * (FIELDS - 1), torch.zeros(0), None)
            ping, t0 = time.perf_counter() - t0, time.perf_counter()
        msg = self._roundtrip(fields, payload, raw, answer)
        if msg is None:
            return None
        if self.cfg.adapt is not None:  # both ways' bytes, and the seconds less the update's wait at the syncer
            moved = payload.numel() * payload.element_size() + msg.payload.numel() * msg.payload.element_size()
            self._link = (float(moved), max(0.0, time.perf_counter() - t0 - msg.fields[8]), ping)
        return self._model_from(msg)

    def _roundtrip(self, fields: list[float], payload: torch.Tensor, raw: int | None, answer: bool = True) -> Message | None:
        """Send one message to the syncer and take its answer (bounded by sync.quorum.timeout_s;
        None without ``answer``)."""
        timeout, who, mailbox = self.quorum.timeout_s, self._syncer_name(), self.mailbox
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
            raise SyncerTimeout(f"no answer from {who} within sync.quorum.timeout_s={timeout:g} s")
        if msg.lost:
            raise SyncerTimeout(f"lost {who}: its connection closed (the run cannot go on without the first site)")
        if mailbox is not None and self.channel is None:
            mailbox.flush()
        return msg
