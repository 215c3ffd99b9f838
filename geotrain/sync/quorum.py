"""Asynchronous quorum rounds: DiLoCo where no site waits for the slowest one (``sync.quorum``).

After Decoupled DiLoCo (DeepMind 2026, arXiv:2604.21428: learners merge when a quorum has
arrived within a grace window, token-weighted) and HALoS (arXiv:2506.04531: a global
parameter server that sites push to and pull from). A **syncer** (:mod:`geotrain.sync.syncer`)
holds the global model and the outer optimizer; it runs as a thread beside the first site's
local rank 0 (site 0 talks to it in memory; the others by messages,
:mod:`geotrain.comm.mailbox`). This module is a site's side. Each site:

1. runs H inner steps from the global model of version ``base``, then sends its
   pseudo-gradient Δ = θ_base − θ_local with ``base``, its steps and workers;
2. **on time** (``base`` is the syncer's current version): waits for the round to merge;
   **late** (merges happened since ``base``): its update joins the open round and the syncer
   answers at once with the current global model, so a slow site never waits for a quorum it
   would only hold up;
3. continues from the global model it got back (its new ``base``).

A round **merges** once it holds updates from ``quorum.sites`` sites (fewer when fewer are still
running) and someone is waiting on it, after ``quorum.grace_s`` more (or as soon as every
running site has delivered). The merge sums the round's updates in site order, weight = tokens
(workers × steps; 1 without ``weight_by_tokens``) × (1 + staleness)^-``staleness_power``, over a
whole world round's tokens (each site's workers × its steps in the merge, or its round's H if it
is not in it), where staleness is the number of merges between an update's
``base`` and this merge (FedAsync's polynomial rule, Xie et al. 2019, arXiv:1903.03934). The
outer step is DiLoCo's Nesterov SGD with its momentum delayed until a world round's worth of
updates has been merged (:class:`DelayedNesterov`; docs/DESIGN.md §26 has the measured reason).

With ``quorum.local_steps=dynamic`` (Async Local-SGD's dynamic local updates) every site runs a
first round of max(1, H/10) steps; from then on the syncer gives each site about H × its measured
rate / the fastest site's rate steps (rates from each update's steps and compute seconds,
smoothed), with its answer, so every site delivers about as often and few updates are stale.

With ``quorum.sites`` = every site, an infinite grace window and fixed local steps, every site
is always on time, every round holds every site's update from the same base, and the merge does
the synchronous round's arithmetic in the same order: the run equals lock-step DiLoCo bit for
bit (two sites: one addition, which is exact in either order; with more, the ring all-reduce
adds in another order). At the end every site sends a **final** update (possibly of no steps)
and waits; the syncer merges what is left once every site has, and sends every site the same
model.

A site that dies (any but the first, which holds the syncer) is **late forever**: the syncer
learns it from the closed connection (:mod:`geotrain.comm.mailbox`), keeps the updates already in,
and from then on counts a world round over the live sites only. The final answer names the live
sites, so the end of the run (evaluation, rank records) avoids the world group, which holds the
dead ranks (:meth:`AsyncDiLoCo.gather_records`, :class:`geotrain.run.loop.Evaluator`).

Non-finite updates are left out by the syncer (the update guard's cross-site outlier test is a
collective and is not applied here). Every wait is bounded by ``quorum.timeout_s``.
"""

from __future__ import annotations

import queue
import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from geotrain.comm.alive import Heartbeat
from geotrain.comm.collectives import Collectives
from geotrain.comm.groups import leaders_group
from geotrain.comm.mailbox import Mailbox
from geotrain.config import SyncConfig
from geotrain.errors import SyncerTimeout
from geotrain.sync.base import views_like
from geotrain.sync.diloco import DiLoCo
from geotrain.sync.outer import pseudo_gradient
from geotrain.sync.syncer import FIELDS, FINAL, UPDATE, QuorumSyncer, Update, first_round_steps, mask_sites


class AsyncDiLoCo(DiLoCo):
    """DiLoCo with asynchronous quorum rounds (``sync.quorum``; see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        comm: Collectives,
        grad_clip: float,
        cfg: SyncConfig,
    ) -> None:
        super().__init__(model, optimizer, comm, grad_clip, cfg)
        assert cfg.quorum is not None
        self.quorum = cfg.quorum
        g = comm.groups
        topo = g.topology
        self.leaders = topo.inter_ranks(0)
        group = leaders_group(topo)  # collective: every rank
        self.leader = g.me.local_rank == 0
        self.mailbox = Mailbox(comm, group, FIELDS) if self.leader else None
        self.syncer: QuorumSyncer | None = None
        if g.me.rank == self.leaders[0]:
            assert self.mailbox is not None
            self.syncer = QuorumSyncer(
                cfg.quorum,
                cfg.weight_by_tokens,
                topo.workers,
                self.global_params,
                self._outer_optimizer,
                cfg,
                self.mailbox,
                self.leaders,
                [topo.site_ranks(i) for i in range(topo.num_sites)],
            )
        self.heartbeat = Heartbeat(g.me.rank, cfg.quorum.heartbeat_s)  # a site that stops beating is lost
        self.version = 0
        self.world_total = 0
        self.clock.limit = first_round_steps(cfg)  # the syncer sets each later round's (dynamic local updates)
        self._round_compute = 0.0
        self.waits: list[float] = []  # seconds this site waited at each of its boundaries
        self._max_seconds = 0.0
        self._t0: float | None = None
        self._done = False
        self._finished = False

    def add_compute(self, seconds: float) -> None:
        if self._t0 is None:
            self._t0 = time.perf_counter() - seconds
        self._round_compute += seconds

    def set_limits(self, steps: int, max_seconds: float) -> None:
        self._max_seconds = max_seconds  # each site checks its own clock; the final round is synchronous

    @property
    def done(self) -> bool:
        return self._done

    def eval_due(self, step: int, every: int) -> bool:
        return False  # an evaluation is collective: only at the start and after the final round

    def world_steps(self, step: int) -> int:
        return self.world_total

    def pace_log(self) -> list[dict[str, Any]]:
        return [] if self.syncer is None else list(self.syncer.log)

    def gather_records(self, record: Any) -> list[Any]:
        """Every live rank's ``record`` (on global rank 0; the others get their site's). Once a site
        has died the world group cannot be used: each site gathers on its own group, and the other
        live sites' leaders send theirs to rank 0 on the leaders' group."""
        if not self.lost_sites:
            return super().gather_records(record)
        g = self.comm.groups
        mine: list[Any] = [None] * len(g.intra_ranks)
        dist.gather_object(record, mine if self.leader else None, dst=g.intra_ranks[0], group=g.intra)
        if not self.leader:
            return []
        assert self.mailbox is not None
        if g.me.rank != self.leaders[0]:
            dist.send_object_list([mine], dst=self.leaders[0], group=self.mailbox.group)
            return mine
        for s, r in enumerate(self.leaders):
            if s and s not in self.lost_sites:
                box: list[Any] = [None]
                dist.recv_object_list(box, src=r, group=self.mailbox.group)
                mine += box[0]
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
        g = self.comm.groups
        steps = self._steps_in_round
        delta = pseudo_gradient(self.global_params, self.local_params())
        site = g.topology.site_names[g.me.site_index]
        if (site, self.rounds) in self.nan_at:  # failure injection
            delta.fill_(float("nan"))
        t0 = time.perf_counter()
        control = torch.zeros(5, dtype=torch.float64)  # version, world steps, stop, next round's H, live sites
        theta = torch.empty(delta.numel(), dtype=torch.float32)
        if self.leader:
            payload = delta if steps else delta[:0]
            update = Update(g.me.site_index, self.version, steps, self.site_workers, payload, final, self._round_compute)
            fields, theta = self._deliver(update)
            time_up = bool(self._max_seconds) and self._t0 is not None and time.perf_counter() - self._t0 >= self._max_seconds
            control[:] = torch.tensor([fields[0], fields[1], float(time_up), fields[2], fields[3]])
        if len(g.intra_ranks) > 1:  # the site's other ranks get the leader's answer
            for t in (control, theta):
                dist.broadcast(t, g.intra_ranks[0], group=g.intra)
                if self.leader:
                    for r in g.intra_ranks[1:]:
                        self.comm._count(r, t.numel() * t.element_size())
        self.comm.add_wait(time.perf_counter() - t0)
        self.waits.append(time.perf_counter() - t0)
        for gp, v in zip(self.global_params, views_like(theta, self.global_params), strict=True):
            gp.copy_(v)
        for p, gp in zip(self.local_params(), self.global_params, strict=True):
            p.copy_(gp)
        self.version, self.world_total = int(control[0]), int(control[1])
        self._done = bool(control[2])
        self.clock.limit = max(1, int(control[3]))
        n = g.topology.num_sites
        self.lost_sites = [s for s in range(n) if s not in mask_sites(float(control[4]), n)]
        self._round_compute = 0.0
        if steps:
            self.rounds += 1
        self._steps_in_round = 0
        self.clock.next_round(self.rounds)

    def _deliver(self, update: Update) -> tuple[list[float], torch.Tensor]:
        """Hand ``update`` to the syncer; its answer (version, world steps, ...; flat global model)."""
        timeout = self.quorum.timeout_s
        who = f"the syncer (site {self.comm.groups.topology.site_names[0]}'s local rank 0)"
        if self.syncer is not None:
            self.syncer.inbox.put(replace(update, delta=update.delta.clone()))
            deadline = time.monotonic() + timeout
            while True:
                if self.syncer.error is not None:
                    raise RuntimeError(f"sync.quorum: the syncer failed: {self.syncer.error!r}") from self.syncer.error
                try:
                    return self.syncer.outbox.get(timeout=0.01)
                except queue.Empty:
                    if time.monotonic() > deadline:
                        raise SyncerTimeout(f"no answer from {who} within sync.quorum.timeout_s={timeout:g} s") from None
        assert self.mailbox is not None
        fields = [
            FINAL if update.final else UPDATE,
            float(update.base),
            float(update.steps),
            float(update.workers),
            update.compute_s,
        ]
        self.mailbox.send(self.leaders[0], fields, update.delta)
        msg = self.mailbox.receive(self.leaders[0], timeout)
        if msg is None:
            raise SyncerTimeout(f"no answer from {who} within sync.quorum.timeout_s={timeout:g} s")
        if msg.lost:
            raise SyncerTimeout(f"lost {who}: its connection closed (the run cannot go on without the first site)")
        self.mailbox.flush()
        return msg.fields, msg.payload
