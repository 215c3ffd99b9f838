"""Eager Streaming DiLoCo (Kale et al., arXiv:2502.12996): a fragment's exchange gets a whole
round. At its sync the outer step is applied at once with the eager pseudo-gradient
Δ_local/M + (the previous round's average − the previous Δ_local/M): this site's fresh
pseudo-gradient stands in for its share, the other sites' one-round-old ones for theirs (in the
first round there are none yet). Sites' global models differ by their own fresh share until the
run's end applies what is still owed and averages them.
"""

from __future__ import annotations

import torch

from geotrain.round.core import EngineCore
from geotrain.round.outer import outer_step_
from geotrain.round.parts import WORLD, InFlight
from geotrain.sync.base import views_like


class EagerSteps(EngineCore):
    """The eager variant's outer steps, as a part of :class:`~geotrain.round.engine.RoundEngine`."""

    def _settle_eager(self, f: int, into: torch.Tensor) -> None:
        """Eager: wait for fragment ``f``'s last exchange and add to ``into`` what that round still
        owes: its average over the sites the guard kept, minus what this site applied at once. A
        round that failed altogether owes only the removal of what was applied at once."""
        if f not in self.inflight:
            return
        x = self.inflight.pop(f)
        applied, average = self.previous.pop(f)
        out = self._wait(x.future)
        if out.ok:
            into.add_(average)
        else:
            self._note_rollback(out.reason)
        into.sub_(applied)

    @torch.no_grad()
    def _eager_step(self, f: int, local: torch.Tensor, steps: int) -> None:
        """The eager outer step of fragment ``f`` (Kale et al. arXiv:2502.12996): what its last round
        owes plus this site's fresh Δ/M at once, while the fresh Δ's exchange starts. The guard
        judges the own Δ before it is applied, by the rule and the history every site shares."""
        step = torch.zeros_like(local)
        self._settle_eager(f, step)
        self.members.faults.corrupt_update(local, self.rounds)
        kept = self.guard is None or self.guard.would_include(local, f)
        applied = local / self.num_sites if kept else torch.zeros_like(local)
        step.add_(applied)
        outgoing = local.clone()
        fut = self._network.submit(self._flat_job(f, outgoing, [steps] * self.num_sites, steps, self.rounds))
        self.inflight[f] = InFlight(0, fut, outgoing)
        self.previous[f] = (applied, outgoing)  # ``outgoing`` becomes the average once the exchange is done
        params = self.globals.params(WORLD, f)
        outer_step_(self.globals.steps[(WORLD, f)], params, step)
        self.globals.merge(WORLD, f, self.local_params(), 0.0)

    @torch.no_grad()
    def _finish_eager(self) -> None:
        """Per fragment, one last blocking outer step: the other sites' shares of the last eager
        round plus, if the fragment trained since its last sync, the exact average of the fresh
        pseudo-gradients; then the sites' global models are averaged."""
        t = self.local_steps
        for f in range(self.F):
            params = self.globals.params(WORLD, f)
            step = torch.zeros(sum(g.numel() for g in params))
            self._settle_eager(f, step)
            if self.schedule.last_sync[f] < t:
                delta = self.globals.delta(WORLD, f, self.local_params())
                steps = t - self.schedule.last_sync[f]
                out = self._wait(self._network.submit(self._flat_job(f, delta, [steps] * self.num_sites, steps, self.rounds)))
                if out.ok:
                    step.add_(delta)
                else:
                    self._note_rollback(out.reason)
                self.schedule.synced(f, t)
                self.rounds += 1
            outer_step_(self.globals.steps[(WORLD, f)], params, step)
        flat = torch.cat([g.reshape(-1) for g in self.global_params])
        self.comm.all_reduce_across_sites(flat)
        flat.div_(self.num_sites)
        for g, v, p in zip(self.global_params, views_like(flat, self.global_params), self.local_params(), strict=True):
            g.copy_(v)
            p.copy_(g)
