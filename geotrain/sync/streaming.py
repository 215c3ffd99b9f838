"""Streaming DiLoCo: fragments synced at staggered steps and merged τ steps later.

Douillard et al., "Streaming DiLoCo with overlapping communication", arXiv:2501.18512: the
parameters are split into F fragments (strided groups of layers); fragment p syncs when the step
count is ≡ p·H/F (mod H), so only 1/F of the model crosses sites at any sync point; its averaged
pseudo-gradient is applied τ inner steps later (the communication has τ steps of compute to
hide behind), and the fresh global fragment is mixed into the local one:
θ_local ← α·θ_local + (1 − α)·θ_global. The eager variant is Kale et al., arXiv:2502.12996.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import torch
import torch.nn as nn

from geotrain.comm.collectives import Collectives
from geotrain.comm.threads import DaemonPool
from geotrain.config import SyncConfig
from geotrain.errors import RoundFailed
from geotrain.sync.adapt import NetworkAdapter
from geotrain.sync.base import views_like
from geotrain.sync.outer import OuterSync, outer_step_, pseudo_gradient
from geotrain.sync.reducer import SiteReducer

T = TypeVar("T")


def fragment_count(cfg: SyncConfig, tensors: int) -> int:
    """How many fragments sync separately: the configured F for streaming (at most one per tensor), else 1."""
    return min(cfg.fragments, tensors) if cfg.algorithm == "streaming" else 1


_LAYER = re.compile(r"(?:^|\.)(\d+)\.")


def strided_fragments(names: Sequence[str], sizes: Sequence[int], fragments: int) -> list[list[int]]:
    """Parameter indices per fragment: layer i goes to fragment i mod F (strided, as in the paper);
    parameters outside numbered layers (embeddings, final norm, head) go to the smallest fragment."""
    out: list[list[int]] = [[] for _ in range(fragments)]
    load = [0] * fragments
    loose = []
    for i, name in enumerate(names):
        m = _LAYER.search(name)
        if m is None:
            loose.append(i)
            continue
        f = int(m.group(1)) % fragments
        out[f].append(i)
        load[f] += sizes[i]
    for i in sorted(loose, key=lambda i: -sizes[i]):
        f = min(range(fragments), key=lambda f: load[f])
        out[f].append(i)
        load[f] += sizes[i]
    return [sorted(f) for f in out]


class StreamingDiLoCo(OuterSync):
    """Streaming DiLoCo: F fragments sync at staggered steps; each merges τ steps after its sync.

    Fragment p syncs after inner step t when t ≡ p·H/F (mod H), t > 0: its pseudo-gradient Δ_p
    is computed and handed to a background thread, which averages it across sites while the
    inner steps go on. At step t + τ the training thread waits for the average (if it is not in
    yet — that wait is the only time compute stalls on the network), the outer optimizer
    applies it to the global fragment and θ_local,p ← α·θ_local,p + (1 − α)·θ_global,p. Every
    fragment has its own outer optimizer.

    Eager variant (``cfg.eager``, Kale et al. arXiv:2502.12996): a fragment's exchange gets a
    whole round. At its sync the outer step is applied at once with the eager pseudo-gradient
    Δ_local/M + (the previous round's average − the previous Δ_local/M): this site's fresh
    pseudo-gradient stands in for its share, the other sites' one-round-old ones for theirs (in
    the first round there are none yet). Sites' global models differ by their own fresh share
    until :meth:`finish` applies what is still owed and averages them.
    """

    name = "streaming"
    norms_grow_with_steps = False  # a merge keeps alpha of the local drift

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        comm: Collectives,
        grad_clip: float,
        cfg: SyncConfig,
    ) -> None:
        super().__init__(model, optimizer, comm, grad_clip, cfg)
        self._names = [n for n, p in model.named_parameters() if p.requires_grad]
        self._sizes = [p.numel() for p in self.params]
        self.tau = cfg.tau
        self.alpha = cfg.alpha
        self.eager = cfg.eager
        self.codec: str = cfg.codec
        self.base = 0  # the step the fragments' schedule counts from (a change of H or F restarts it)
        self._param_sync = [0] * len(self.params)  # each parameter's last sync step
        self.outer: list[torch.optim.Optimizer] = []
        self._reducer_sets: dict[tuple[str, int], list[SiteReducer]] = {}
        self._build(fragment_count(cfg, len(self.params)), 0)
        # fragment -> (merge at step, the exchange in flight, its averaged Δ when done)
        self.pending: dict[int, tuple[int, Future[None], torch.Tensor]] = {}
        self.previous: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # eager: (local Δ, its exchange result)
        self._network = DaemonPool(1, "wan-exchange")  # daemon: a failed rank exits mid-exchange
        self.adapter: NetworkAdapter | None = None  # sync.adapt: H, codec and F follow the measured network
        self._exchanges: list[tuple[int, float]] = []  # exchange thread: (bytes, seconds) of each since the last measurement
        self._decision: tuple[int, Future[bool]] | None = None  # (applied at step, the agreement in flight)
        self._lap_step = 0
        self._exchange_counts: list[int] | None = None  # exchange thread: every site's steps in the fragment it sums (pace)
        if cfg.adapt is not None:
            # counts that leave no fragment empty (layers are dealt out strided; see strided_fragments)
            counts = [f for f in cfg.adapt.fragment_choices(cfg.fragments) if all(strided_fragments(self._names, self._sizes, f))]
            counts = sorted({*counts, self.F})
            self.adapter = NetworkAdapter(cfg.adapt, comm, sum(self._sizes), self.H, self.codec, (self.F, counts, self.tau))

    def _build(self, F: int, t: int) -> None:
        """F fragments, their offsets in the cycle of H steps counted from step ``t``, an outer
        optimizer per fragment (each parameter's momentum carried over from the old ones) and
        the reducers of this codec."""
        self.F = F
        self.fragments = strided_fragments(self._names, self._sizes, F)
        self.offsets = [(f * self.H) // F for f in range(F)]
        carried = {p: state for o in self.outer for p, state in o.state.items()}
        self.outer = [self._outer_optimizer([self.global_params[i] for i in frag]) for frag in self.fragments]
        for o in self.outer:
            for p in o.param_groups[0]["params"]:
                if p in carried:
                    o.state[p] = carried[p]
        self.reducers = self._reducers_for(self.codec)
        self.last_sync = [min(self._param_sync[i] for i in frag) for frag in self.fragments]
        self.base = t

    def _reducers_for(self, codec: str) -> list[SiteReducer]:
        """One reducer per fragment for ``codec`` (made once per codec and fragment count: adaptation's
        codecs are fixed-width, without state to carry)."""
        key = (codec, self.F)
        if key not in self._reducer_sets:
            shapes = [p.shape for p in self.local_params()]
            self._reducer_sets[key] = [
                self._make_reducer(codec, [shapes[i] for i in frag], seed=f) for f, frag in enumerate(self.fragments)
            ]
        return self._reducer_sets[key]

    def _due(self, f: int, t: int) -> bool:
        """Fragment ``f`` syncs after step ``t``."""
        return t > self.base and (t - self.base) % self.H == self.offsets[f]

    def after_step(self) -> None:
        super().after_step()
        t = self.local_steps
        if not self.eager:
            for f in [f for f, (at, _, _) in self.pending.items() if at <= t]:
                self._merge(f)
        if self._decision is not None and self._decision[0] <= t:
            self._apply_decision(t)
        if self.adapter is not None and t > self.base and (t - self.base) % self.H == 0:
            self._measure(t)  # the end of a cycle: before fragment 0's sync, which counts in the next
        for f in range(self.F):
            if self._due(f, t) and (self.eager or f not in self.pending):
                self._sync(f, t)

    def _measure(self, t: int) -> None:
        """sync.adapt, at the end of a cycle of H steps: the agreement on this cycle's measurements
        goes to the exchange thread, behind the fragments' exchanges it measures (every site
        submits the same work in the same order); its choice is applied max(1, tau) steps later,
        when the fragment exchanged before it has merged anyway."""
        assert self.adapter is not None and self._decision is None
        wall, waited = self.adapter.lap()
        steps, self._lap_step = t - self._lap_step, t
        fut = self._network.submit(self._decide, len(self.adapter.log) + 1, steps, wall, waited)
        self._decision = (t + max(1, self.tau), fut)

    def _decide(self, cycle: int, steps: int, wall: float, waited: float) -> bool:
        """Exchange thread: agree on the link from the exchanges since the last measurement, choose."""
        assert self.adapter is not None
        taken, self._exchanges = self._exchanges, []
        return self.adapter.decide(cycle, steps, taken, wall, waited)

    @torch.no_grad()
    def _apply_decision(self, t: int) -> None:
        """The choice of the last measurement: a new codec takes effect at the next sync; a new H or
        fragment count at a quiet point: every exchange in flight is merged now (early), then the
        fragments and their schedule are rebuilt from step ``t``."""
        assert self._decision is not None and self.adapter is not None
        fut, self._decision = self._decision[1], None
        a = self.adapter
        if not self._wait(fut):
            return
        self.codec = a.codec
        if (a.H, a.F) == (self.H, self.F):
            self.reducers = self._reducers_for(self.codec)
            return
        for f in list(self.pending):
            self._merge(f)
        self.H = a.H
        self._build(a.F, t)

    def adapt_log(self) -> list[dict[str, Any]]:
        return [] if self.adapter is None else self.adapter.log

    def budget_exhausted(self) -> bool:
        t = self.local_steps + 1
        return any(self._due(f, t) for f in range(self.F)) and not self._privacy_allows_round()

    def in_flight_bytes(self) -> int:
        """fp32 bytes of pseudo-gradient fragments whose exchange has not finished."""
        return sum(4 * d.numel() for _, fut, d in self.pending.values() if not fut.done())

    def _start(self, f: int, delta: torch.Tensor, steps: int, counts: list[int] | None = None) -> Future[None]:
        # with adaptation the guard keeps a history per (H, fragment count, fragment): a merge keeps
        # alpha of the local drift, so a pseudo-gradient's norm does not scale with its steps
        key = f if self.adapter is None else (self.H * 4097 + self.F) * 4096 + f
        return self._network.submit(self._exchange, delta, self.reducers[f], steps, self.rounds, key, counts)

    def _exchange(
        self, delta: torch.Tensor, reducer: SiteReducer, steps: int, round_id: int, key: int, counts: list[int] | None
    ) -> None:
        """Exchange thread: one fragment's average across sites (timed for sync.adapt); ``counts``:
        every site's steps in it, where sites run different steps (adaptive pace), else None."""
        self._exchange_counts = counts
        sent, t0 = self.comm.stats.inter_bytes, time.perf_counter()
        self._average_across_sites(delta, reducer, steps, round_id, key)
        if self.adapter is not None:
            self._exchanges.append((self.comm.stats.inter_bytes - sent, time.perf_counter() - t0))

    def round_steps(self, steps: int) -> list[int]:
        # (called on the exchange thread, inside the fragment's average)
        return list(self._exchange_counts) if self._exchange_counts is not None else super().round_steps(steps)

    def _sync_counts(self, f: int) -> list[int] | None:
        """Every site's steps since fragment ``f``'s last sync, where they differ (adaptive pace), else None."""
        return None

    def _wait(self, fut: Future[T]) -> T:
        """Block the training thread until ``fut`` is done; the time counts as waiting on the network."""
        t0 = time.perf_counter()
        try:
            return fut.result()
        finally:
            self.comm.add_wait(time.perf_counter() - t0)

    def _part(self, params: list[torch.Tensor], f: int) -> list[torch.Tensor]:
        """Fragment ``f``'s tensors of ``params`` (laid out like the parameters)."""
        return [params[i] for i in self.fragments[f]]

    def _globals(self, f: int) -> list[torch.Tensor]:
        return self._part(self.global_params, f)

    def _settle_eager(self, f: int, into: torch.Tensor) -> None:
        """Eager: wait for fragment ``f``'s last exchange and add to ``into`` what that round still
        owes: its average over the sites the guard kept, minus what this site applied at once (its
        own Δ/M, or nothing if its update was going to be left out). So each round adds exactly the
        guarded average, and a left-out update never enters the outer step. A round the guard
        failed altogether (every update left out) rolls back: it owes only the removal of what was
        applied at once. Nothing before the fragment's first exchange."""
        if f not in self.pending:
            return
        _, fut, _ = self.pending.pop(f)
        applied, average = self.previous.pop(f)
        try:
            self._wait(fut)
            into.add_(average)
        except RoundFailed as exc:  # (nothing of the round is applied: only what was applied at once comes off)
            self._roll_back((), str(exc))
        into.sub_(applied)

    def _mark_synced(self, f: int, t: int) -> None:
        """Fragment ``f`` synced at step ``t``: its sync step and its parameters'."""
        self.last_sync[f] = t
        for i in self.fragments[f]:
            self._param_sync[i] = t

    @torch.no_grad()
    def _sync(self, f: int, t: int) -> None:
        frag = self.fragments[f]
        local = self.local_params()
        delta = pseudo_gradient(self._globals(f), [local[i] for i in frag])
        steps, counts = t - self.last_sync[f], self._sync_counts(f)
        self._mark_synced(f, t)
        if self.eager:
            self.rounds += 1  # for streaming, a round is one fragment's sync
            self._eager_step(f, delta, steps)
            return
        if self.private is not None:
            self.private.reserve()
        fut = self._start(f, delta, steps, counts)  # (its round id is the rounds before this one)
        self.rounds += 1
        self.pending[f] = (t + self.tau, fut, delta)
        if self.tau == 0:
            self._merge(f)

    @torch.no_grad()
    def _merge(self, f: int) -> None:
        _, fut, delta = self.pending.pop(f)
        try:
            self._wait(fut)
        except RoundFailed as exc:
            self._roll_back(self.fragments[f], str(exc))
            return
        globals_ = self._globals(f)
        outer_step_(self.outer[f], globals_, delta)
        local = self.local_params()
        for g, i in zip(globals_, self.fragments[f], strict=True):
            p = local[i]
            p.mul_(self.alpha).add_(g.to(p.dtype), alpha=1 - self.alpha)

    @torch.no_grad()
    def _eager_step(self, f: int, local: torch.Tensor, steps: int) -> None:
        """The eager outer step of fragment ``f``: what its last round owes (it had a whole round to
        arrive) plus this site's fresh Δ/M at once, while the fresh Δ's exchange starts. The guard
        judges the own Δ before it is applied, by the rule and the history every site shares (the
        exchange's decision for this site is the same): a Δ it will leave out is not applied."""
        step = torch.zeros_like(local)
        self._settle_eager(f, step)
        self.faults.corrupt_update(local, self.rounds)
        kept = self.guard is None or self.guard.would_include(local, f)
        applied = local / self.num_sites if kept else torch.zeros_like(local)
        step.add_(applied)
        outgoing = local.clone()
        self.pending[f] = (0, self._start(f, outgoing, steps), outgoing)
        self.previous[f] = (applied, outgoing)  # ``outgoing`` becomes the average once the exchange is done
        globals_ = self._globals(f)
        outer_step_(self.outer[f], globals_, step)
        mine = self.local_params()
        for g, i in zip(globals_, self.fragments[f], strict=True):
            mine[i].copy_(g)

    def finish(self) -> None:
        """Bring every site onto one model: wait for what is in flight, then (τ variant) merge it and
        sync every fragment with unsynced steps, or (eager) apply what is still owed and average
        the sites' global models."""
        if self._decision is not None:  # the last measurement's choice is not applied: the run ends
            self._wait(self._decision[1])
            self._decision = None
        if self.eager:
            self._finish_eager()
        else:
            for f in list(self.pending):
                self._merge(f)
            t = self.local_steps
            for f in range(self.F):
                if self._unsynced(f, t) and not self._privacy_allows_round():
                    self._roll_back(self.fragments[f], "privacy budget: the last partial round is not released")
                    self._mark_synced(f, t)
                elif self._unsynced(f, t):
                    self._sync(f, t)
                    if f in self.pending:
                        self._merge(f)
        self._network.shutdown()

    def _unsynced(self, f: int, t: int) -> bool:
        """Whether fragment ``f`` trained since its last sync (the same on every site)."""
        return self.last_sync[f] < t

    @torch.no_grad()
    def _finish_eager(self) -> None:
        """Per fragment, one last outer step, blocking: the other sites' shares of the last eager
        round (now arrived) plus, if the fragment trained since its last sync, the exact average of
        the fresh pseudo-gradients; then the sites' global models are averaged."""
        t = self.local_steps
        for f in range(self.F):
            globals_ = self._globals(f)
            step = torch.zeros(sum(g.numel() for g in globals_))
            self._settle_eager(f, step)
            if self.last_sync[f] < t:
                local = self.local_params()
                delta = pseudo_gradient(globals_, [local[i] for i in self.fragments[f]])
                fut = self._start(f, delta, t - self.last_sync[f])
                try:
                    self._wait(fut)
                    step.add_(delta)
                except RoundFailed as exc:  # nothing of it is applied
                    self._roll_back((), str(exc))
                self.last_sync[f] = t
                self.rounds += 1
            outer_step_(self.outer[f], globals_, step)
        self._average_global_models()

    @torch.no_grad()
    def _average_global_models(self) -> None:
        flat = torch.cat([g.reshape(-1) for g in self.global_params])
        self.comm.all_reduce_across_sites(flat)
        flat.div_(self.num_sites)
        for g, v, p in zip(self.global_params, views_like(flat, self.global_params), self.local_params(), strict=True):
            g.copy_(v)
            p.copy_(g)

    def close(self) -> None:
        # no join: after finish() the thread is idle, and after a failure it may be blocked on a
        # peer (a daemon: it cannot hold up the exit)
        self._network.shutdown(wait=False)
        super().close()

    def state_dict(self) -> dict[str, Any]:
        return {"reducers": [self.reducer_out(r, frag) for r, frag in zip(self.reducers, self.fragments, strict=True)]}

    def checkpoint_state(self) -> dict[str, Any]:
        """Exchanges in flight are waited for: their averaged Δ and merge step are saved."""
        if self.eager:
            raise ValueError("checkpoints of the eager streaming variant are not supported")
        pending = {}
        for f, (at, fut, delta) in self.pending.items():
            try:
                self._wait(fut)
                ok = True
            except RoundFailed:
                ok = False  # merging it will roll the fragment back
            pending[f] = (at, self.shards_out(delta, self.fragments[f]) if self.sharded else delta.clone(), ok)
        return {
            **super().checkpoint_state(),
            "outer": [self.optim_out(o.state_dict(), frag) for o, frag in zip(self.outer, self.fragments, strict=True)],
            "last_sync": list(self.last_sync),
            "pending": pending,
        }

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        super().load_checkpoint_state(state)
        for o, saved in zip(self.outer, state["outer"], strict=True):
            o.load_state_dict(self.optim_in(saved))
        self.last_sync = list(state["last_sync"])
        for r, saved in zip(self.reducers, state["reducers"], strict=True):
            r.load_state_dict(self.reducer_in(saved))
        self.pending = {}
        for f, (at, delta, ok) in state["pending"].items():
            fut: Future[None] = Future()
            if ok:
                fut.set_result(None)
            else:
                fut.set_exception(RoundFailed("the exchange failed before the checkpoint"))
            self.pending[int(f)] = (at, fut, self.shards_in(delta, flat=True))
