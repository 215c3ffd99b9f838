"""Streaming DiLoCo in asynchronous quorum rounds (``sync.algorithm=streaming`` with ``sync.quorum``).

Each site syncs its F fragments at staggered steps, as lock-step Streaming DiLoCo does
(:mod:`geotrain.sync.streaming`: fragment p after inner step t when t ≡ p·H/F mod H), but each
fragment's sync is a delivery to the syncer (:mod:`geotrain.sync.quorum`), not an all-reduce:

* the syncer keeps a version, an open round and a delayed-Nesterov outer optimizer per fragment,
  and merges fragment p's round by the quorum rules of whole models (on time waits, late goes on,
  staleness counted in fragment p's merges);
* the delivery runs on a thread of its own while the inner steps go on; τ steps after the sync
  (or at the next fragment's sync, if that comes sooner: one delivery in flight per site) the
  site takes the answer, fragment p's global values, and mixes them into its local ones,
  θ_local,p ← α·θ_local,p + (1 − α)·θ_global,p;
* the bytes of a sync are one fragment's, each way: the peak per sync falls by F, as in
  lock-step Streaming DiLoCo.

At the end every site delivers each fragment's last update (possibly of no steps) and waits; the
syncer merges what is left and answers every site with the whole model and every fragment's
version. A site that comes back after it was lost gets the same (its schedule goes on from the
last step its first fragment synced: fragment 0's windows cover every step, so the steps the syncer
counts for a site are fragment 0's). With a quorum of every site and an endless grace window every
site is on time at every fragment: each merge is lock-step Streaming DiLoCo's average of the
fragment, and with two sites the runs agree bit for bit (``tests/test_quorum_streaming.py``).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import torch
import torch.nn as nn

from geotrain.codecs import Residual
from geotrain.comm.collectives import Collectives
from geotrain.comm.mailbox import Message
from geotrain.comm.threads import DaemonPool
from geotrain.config import SyncConfig
from geotrain.sync.base import SyncAlgorithm
from geotrain.sync.merge import Update
from geotrain.sync.outer import pseudo_gradient
from geotrain.sync.quorum import AsyncDiLoCo, Rejoin
from geotrain.sync.streaming import fragment_count, strided_fragments

Answer = tuple[list[float], torch.Tensor]


class AsyncStreaming(AsyncDiLoCo):
    """Streaming DiLoCo's fragments, each synced as an asynchronous quorum delivery (see the module docstring)."""

    name = "streaming"
    norms_grow_with_steps = False  # a merge keeps alpha of the local drift

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        comm: Collectives,
        grad_clip: float,
        cfg: SyncConfig,
        rejoin: Rejoin | None = None,
    ) -> None:
        super().__init__(model, optimizer, comm, grad_clip, cfg, rejoin)
        self.F = len(self.fragments)
        self.tau = cfg.tau
        self.offsets = [(f * self.H) // self.F for f in range(self.F)]
        self.last_sync = [0] * self.F  # each fragment's last sync step
        self.pending: dict[int, tuple[int, Future[Answer | None]]] = {}  # fragment -> (taken at step, its delivery)
        self._residuals = [Residual(decay=self.residual.decay) for _ in range(self.F)] if self.residual is not None else []
        self._network = DaemonPool(1, "quorum-exchange")  # daemon: a failed rank exits mid-delivery
        self._asking = 0  # the fragment whose answer is awaited

    def _fragments(self) -> list[list[int]]:
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        return strided_fragments(names, [p.numel() for p in self.params], fragment_count(self.cfg, len(self.params)))

    def after_step(self) -> None:
        SyncAlgorithm.after_step(self)  # (not DiLoCo's rounds: the fragments' schedule)
        t = self.local_steps
        for f in [f for f, (at, _) in self.pending.items() if at <= t]:
            self._settle(f)
        for f in range(self.F):
            if t > 0 and t % self.H == self.offsets[f]:
                for g in list(self.pending):  # one delivery in flight: the last one is taken first
                    self._settle(g)
                self._sync(f, t)

    def in_flight_bytes(self) -> int:
        return sum(4 * sum(self.params[i].numel() for i in self.fragments[f]) for f in self.pending)

    @torch.no_grad()
    def _sync(self, f: int, t: int) -> None:
        """Fragment ``f`` syncs after step ``t``: its pseudo-gradient goes to the syncer, on the
        delivery thread (the leader's), and its answer is taken τ steps later."""
        frag, local = self.fragments[f], self.local_params()
        delta = pseudo_gradient([self.global_params[i] for i in frag], [local[i] for i in frag])
        steps, self.last_sync[f] = t - self.last_sync[f], t
        self.faults.corrupt_update(delta, self.rounds)
        fut: Future[Answer | None] = Future()
        self._asking = f  # (one delivery in flight: the fragment its answer is of)
        if self.leader:
            update = Update(self.site_index, self.versions[f], steps, self.site_workers, delta, False, self._round_compute)
            fut = self._network.submit(self._deliver_fragment, replace(update, fragment=f))
        else:
            fut.set_result(None)
        self._round_compute = 0.0
        self.rounds += 1
        self.pending[f] = (t + self.tau, fut)
        if self.tau == 0:
            self._settle(f)

    def _deliver_fragment(self, update: Update) -> Answer:
        """Delivery thread: one fragment's update, in that fragment's error feedback, and its answer."""
        if self._residuals:
            self.residual = self._residuals[update.fragment]
        answer = self._deliver(update)
        assert answer is not None
        return self._whole_answer(answer)

    @torch.no_grad()
    def _settle(self, f: int) -> None:
        """Take fragment ``f``'s answer (waiting for it if it is not in) and mix it in."""
        _, fut = self.pending.pop(f)
        t0 = time.perf_counter()
        answer = fut.result()
        waited = time.perf_counter() - t0
        self.comm.add_wait(waited)
        self.waits.append(waited)
        self._take(answer, fragment=f)

    def _whole_answer(self, answer: Answer) -> Answer:
        """An exact answer (the final one; a site's return) holds the whole model and then every
        fragment's version: keep the versions, give back the model."""
        fields, theta = answer
        n = sum(p.numel() for p in self.params)
        if self.F > 1 and theta.numel() == n + self.F:
            self.versions = [int(v) for v in theta[n:].tolist()]
            theta = theta[:n]
        return fields, theta

    def _model_from(self, msg: Message) -> Answer:
        """A syncer's answer: fp32 values, or an encoded change from what this site holds of the
        fragment asked for (exact answers are fp32)."""
        if not msg.fields[7]:
            return self._whole_answer((msg.fields, msg.floats()))
        coder = self.coders.at(int(msg.fields[7]))
        assert coder is not None
        f = self._asking
        held = torch.cat([self.global_params[i].detach().reshape(-1) for i in self.fragments[f]])
        return msg.fields, held + coder.decode(msg.payload.to(held.device), held.numel())

    @torch.no_grad()
    def finish(self) -> None:
        """Each fragment's last update (possibly of no steps), then one exact answer: every site on one model."""
        if self._finished:
            return
        for f in list(self.pending):
            self._settle(f)
        t, local, answer = self.local_steps, self.local_params(), None
        for f in range(self.F) if self.leader else ():
            frag = self.fragments[f]
            steps = t - self.last_sync[f]
            delta = pseudo_gradient([self.global_params[i] for i in frag], [local[i] for i in frag]) if steps else torch.zeros(0)
            update = Update(self.site_index, self.versions[f], steps, self.site_workers, delta, True, fragment=f)
            if self._residuals:
                self.residual = self._residuals[f]
            last = self._deliver(update, answer=f == self.F - 1)  # (one answer, to the last)
            answer = None if last is None else self._whole_answer(last)
        self._take(answer)
        self._finished = True
        self._network.shutdown()
        if self.syncer is not None:
            self.syncer.close()

    def rejoin_run(self) -> int:
        start = super().rejoin_run()  # (the answer's versions: each fragment's, kept by _whole_answer)
        self.last_sync = [0] * self.F
        return start

    def close(self) -> None:
        self._network.shutdown(wait=False)
        super().close()

    def checkpoint_state(self) -> dict[str, Any]:
        raise ValueError("checkpoints of Streaming DiLoCo in asynchronous quorum rounds are not supported")
