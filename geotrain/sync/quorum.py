"""Asynchronous quorum rounds: DiLoCo where no site waits for the slowest one (``sync.quorum``).

After Decoupled DiLoCo (DeepMind 2026, arXiv:2604.21428: learners merge when a quorum has
arrived within a grace window, token-weighted) and HALoS (arXiv:2506.04531: a global
parameter server that sites push to and pull from). A **syncer** holds the global model and
the outer optimizer; it runs as a thread beside the first site's local rank 0 (site 0 talks to
it in memory; the others by messages, :mod:`geotrain.comm.mailbox`). Each site:

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

Non-finite updates are left out by the syncer (the update guard's cross-site outlier test is a
collective and is not applied here). Every wait is bounded by ``quorum.timeout_s``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from geotrain.comm.collectives import Collectives
from geotrain.comm.groups import leaders_group
from geotrain.comm.mailbox import Mailbox, Message
from geotrain.config import QuorumConfig, SyncConfig
from geotrain.errors import SyncerTimeout
from geotrain.sync.base import views_like
from geotrain.sync.diloco import DiLoCo
from geotrain.sync.outer import outer_step_, pseudo_gradient

UPDATE, FINAL = 1.0, 2.0
FIELDS = 5  # site → syncer: [kind, base, steps, workers, compute s]; syncer → site: [version, world steps, next H, 0, 0]


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


def first_round_steps(cfg: SyncConfig) -> int:
    """A site's first round: H, or with dynamic local updates max(1, H/10), to measure its pace."""
    assert cfg.quorum is not None
    return max(1, cfg.H // 10) if cfg.quorum.local_steps == "dynamic" else cfg.H


def dynamic_steps(rates: Sequence[float], current: Sequence[int], H: int) -> list[int]:
    """Dynamic local updates (Async Local-SGD, Liu et al. 2024): each site whose rate (steps per
    second) is known runs H × its rate / the fastest rate, rounded, at least 1; the others keep
    ``current``."""
    fastest = max(rates)
    return [max(1, min(H, round(H * r / fastest))) if r > 0 else c for r, c in zip(rates, current, strict=True)]


def merge_weights(updates: Sequence[Update], version: int, weight_by_tokens: bool, power: float) -> list[float]:
    """Each update's weight in the merge that makes version ``version + 1``: tokens (or 1) times
    (1 + staleness)^-power, staleness = ``version - base``."""
    return [(float(u.workers * u.steps) if weight_by_tokens else 1.0) * (1.0 + (version - u.base)) ** -power for u in updates]


def weighted_mean(deltas: Sequence[torch.Tensor], weights: Sequence[float], total: float) -> torch.Tensor:
    """Σ w·Δ / ``total`` in order, with the synchronous round's arithmetic
    (:meth:`OuterSync._weighted_average`): equal weights that add up to ``total`` sum then divide,
    else scale then sum. ``total`` is a whole world round's undiscounted tokens, so a stale
    update's discount shrinks its contribution outright, even when it is alone in its merge."""
    if len(set(weights)) == 1 and total == sum(weights):
        out = deltas[0].clone()
        for d in deltas[1:]:
            out.add_(d)
        return out.div_(len(deltas))
    out = deltas[0].mul(weights[0] / total)
    for d, w in zip(deltas[1:], weights[1:], strict=True):
        out.add_(d.mul(w / total))
    return out


class DelayedNesterov:
    """DiLoCo's outer SGD with its momentum delayed until a world round's worth of updates has
    been merged (the delayed Nesterov of Async Local-SGD, Liu et al. 2024, arXiv:2401.09135).

    A merge's g is its updates' weighted sum over a whole world round's tokens (every site's
    workers × its steps in the merge, or its round's H), so one site's update counts for its
    share of the world, as in a synchronous average, and a fast site that delivers twice as often moves θ
    twice as often. g is applied at once (``lr·g``); once ``sites`` updates have been merged
    since the last time, the momentum buffer takes their sum and its part (``lr·β·m``) is applied
    too. Over a world round θ moves as one synchronous outer step on the round's mean. A merge
    that holds every site's update with nothing pending is exactly that step: the torch
    optimizer itself (so a quorum of every site is lock-step DiLoCo bit for bit); the momentum
    buffer is the optimizer's own in both paths.
    """

    def __init__(self, theta: list[torch.Tensor], optimizer: torch.optim.Optimizer, cfg: SyncConfig, sites: int) -> None:
        self.theta, self.optimizer, self.sites = theta, optimizer, sites
        self.lr, self.beta, self.nesterov = cfg.outer_lr, cfg.outer_momentum, cfg.nesterov
        self.pending = [torch.zeros_like(t) for t in theta]
        self.pending_updates = 0

    @torch.no_grad()
    def step(self, g: torch.Tensor, updates: int) -> None:
        if not self.pending_updates and updates >= self.sites:  # a whole synchronous round
            outer_step_(self.optimizer, self.theta, g)
            return
        self.pending_updates += updates
        for t, p, v in zip(self.theta, self.pending, views_like(g, self.theta), strict=True):
            t.add_(v, alpha=-self.lr)
            p.add_(v)
        if self.pending_updates < self.sites or not self.beta:
            return
        for t, p in zip(self.theta, self.pending, strict=True):
            state = self.optimizer.state[t]
            buf = state.get("momentum_buffer")
            old = torch.zeros_like(p) if buf is None else buf.clone()
            new = p.clone() if buf is None else buf.mul_(self.beta).add_(p)
            state["momentum_buffer"] = new
            t.add_(new if self.nesterov else old, alpha=-self.lr * self.beta)  # Nesterov: g + β·m_new; heavy ball: g + β·m_old
            p.zero_()
        self.pending_updates = 0


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
    ) -> None:
        self.cfg, self.weight_by_tokens, self.workers = cfg, weight_by_tokens, list(workers)
        self.max_H = sync_cfg.H
        self.dynamic = cfg.local_steps == "dynamic"
        # every site's next round: H, or (dynamic) a first round of max(1, H/10) to measure its pace
        self.H = [first_round_steps(sync_cfg)] * len(self.workers)
        self.rates = [0.0] * len(self.workers)  # steps per second of compute, smoothed (dynamic)
        self.theta = [t.detach().clone() for t in theta]
        self.outer = DelayedNesterov(self.theta, make_optimizer(self.theta), sync_cfg, len(self.workers))
        self.mailbox, self.leaders = mailbox, list(leaders)
        self.version = 0
        self.world_steps = 0  # rank-steps merged so far
        self.inbox: queue.Queue[Update] = queue.Queue()  # from site 0 (same process)
        self.outbox: queue.Queue[tuple[list[float], torch.Tensor]] = queue.Queue()  # to site 0
        self.log: list[dict[str, Any]] = []  # one entry per merge
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._guarded, name="quorum-syncer", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def _guarded(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - handed to site 0's training thread, which raises it
            self.error = exc

    def _decode(self, msg: Message) -> Update:
        kind, base, steps, workers, compute_s = msg.fields
        site = self.leaders.index(msg.src)
        return Update(site, int(base), int(steps), int(workers), msg.payload, final=kind == FINAL, compute_s=compute_s)

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
        incoming: queue.Queue[Message] = queue.Queue()
        for r in self.leaders[1:]:  # each site's messages, until its final one
            self.mailbox.listen(r, incoming, lambda m: m.fields[0] == FINAL)
        pending: list[tuple[float, Update]] = []
        open_: list[Update] = []
        waiting: list[int] = []
        finals: set[int] = set()
        quorum_at: float | None = None
        while not self._stop.is_set():
            while not incoming.empty():
                m = incoming.get_nowait()
                pending.append((m.arrival, self._decode(m)))
            while not self.inbox.empty():
                pending.append((0.0, self.inbox.get_nowait()))
            now = time.monotonic()
            due = sorted((p for p in pending if p[0] <= now), key=lambda p: p[0])
            pending = [p for p in pending if p[0] > now]
            for _, u in due:
                self._measure(u)
                if u.final:
                    finals.add(u.site)
                elif u.base < self.version:  # late: merged later, and it goes on at once
                    self._reply([u.site])
                else:
                    waiting.append(u.site)
                if u.steps > 0:
                    if bool(torch.isfinite(u.delta).all()):
                        open_.append(u)
                    else:
                        self._note("rejected", [u], [], f"site {u.site}: non-finite update left out")
            running = [s for s in range(n) if s not in finals]
            if len(finals) == n:  # the final round: merge what is left, every site gets the same model
                self._merge(open_, "final")
                self._reply(sorted(finals))
                return
            delivered = {u.site for u in open_} | set(waiting)
            if waiting and len(delivered) >= min(self.cfg.sites, len(running)):
                quorum_at = now if quorum_at is None else quorum_at
                if now >= quorum_at + self.cfg.grace_s or set(running) <= delivered:
                    self._merge(open_, "quorum")
                    open_, quorum_at = [], None
                    self._reply(waiting)
                    waiting = []
            time.sleep(0.001)

    def _merge(self, updates: list[Update], why: str) -> None:
        if not updates:
            return
        ups = sorted(updates, key=lambda u: (u.site, u.base))
        weights = merge_weights(ups, self.version, self.weight_by_tokens, self.cfg.staleness_power)
        # a whole world round's tokens: each site's steps in this merge, or its round's H if it is
        # not in it (a merge of every site: the merge's own tokens)
        steps = list(self.H)
        for s in {u.site for u in ups}:
            steps[s] = max(u.steps for u in ups if u.site == s)
        world = (
            float(sum(w * k for w, k in zip(self.workers, steps, strict=True))) if self.weight_by_tokens else float(len(steps))
        )
        self.outer.step(weighted_mean([u.delta for u in ups], weights, world), len(ups))
        self._note(why, ups, weights, "")
        self.version += 1
        self.world_steps += sum(u.workers * u.steps for u in ups)

    def _note(self, why: str, ups: Sequence[Update], weights: Sequence[float], reason: str) -> None:
        self.log.append(
            {
                "version": self.version + (0 if reason else 1),
                "t": round(time.monotonic() - self._t0, 3),
                "kind": why,
                "sites": [u.site for u in ups],
                "staleness": [self.version - u.base for u in ups],
                "steps": [u.steps for u in ups],
                "weights": [round(w, 4) for w in weights],
                **({"next_H": list(self.H)} if self.dynamic else {}),
                **({"why": reason} if reason else {}),
            }
        )

    def _reply(self, sites: Sequence[int]) -> None:
        theta = torch.cat([t.reshape(-1) for t in self.theta])
        for s in sites:
            fields = [float(self.version), float(self.world_steps), float(self.H[s]), 0.0, 0.0]
            if s == 0:
                self.outbox.put((fields, theta.clone()))
            else:
                self.mailbox.send(self.leaders[s], fields, theta)
        self.mailbox.flush()  # each site posted its receive when it delivered


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
            )
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

    def finish(self) -> None:
        if not self._finished:
            self._exchange(final=True)
            self._finished = True
            if self.syncer is not None:
                self.syncer.close()

    def close(self) -> None:
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
        control = torch.zeros(4, dtype=torch.float64)  # version, world steps, stop, next round's H
        theta = torch.empty(delta.numel(), dtype=torch.float32)
        if self.leader:
            payload = delta if steps else delta[:0]
            update = Update(g.me.site_index, self.version, steps, self.site_workers, payload, final, self._round_compute)
            fields, theta = self._deliver(update)
            time_up = bool(self._max_seconds) and self._t0 is not None and time.perf_counter() - self._t0 >= self._max_seconds
            control[:] = torch.tensor([fields[0], fields[1], float(time_up), fields[2]])
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
        self.mailbox.flush()
        return msg.fields, msg.payload
