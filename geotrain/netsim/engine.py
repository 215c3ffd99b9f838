"""Flow-level (fluid) simulation: max-min fair rates, event-driven over flow completions.

Rates: max-min fairness by progressive filling (Bertsekas and Gallager, *Data Networks*, 2nd ed.,
section 6.5.2): raise the rate of every unfrozen flow at the same pace; when a link fills, freeze
the flows crossing it; repeat. A flow may put only a share ``w`` of its rate on a link (a sprayed
flow spreads over many links), so a link fills when ``sum(w_f * r_f) = capacity``.

Time: all flows of a phase start together (a synchronized training step). Between events the
rates are constant; the next event is the earliest completion; completed flows leave and the
rates are recomputed. Each flow's completion time is

    fct = startup_s + (time its bytes drain at the max-min rates) + base RTT,

with base RTT ``= 2 * hops * hop_latency_s`` (one-way propagation and switching per link, there
and back for the last acknowledgement). ``startup_s`` is a fixed per-flow start cost (connection
set-up, a collective's launch). Both are explicit scenario parameters.

What a fluid model leaves out: packets, queues, incast, PFC pauses, congestion-control dynamics
(slow start, reaction delay), retransmissions and reordering. It shows where *routing* wastes
capacity (hash collisions), not what a given transport's control loop does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from geotrain.netsim.routing import FlowSet


def _ranges(ptr: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Concatenated CSR rows ``ids`` (indices ``ptr[i] .. ptr[i+1]-1`` for every ``i``)."""
    starts = ptr[ids]
    counts = ptr[ids + 1] - starts
    ends = np.cumsum(counts)
    return np.repeat(starts - ends + counts, counts) + np.arange(int(ends[-1]) if ends.size else 0)


def _csr(keys: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(keys, kind="stable")
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(keys, minlength=n), out=ptr[1:])
    return order, ptr


class MaxMin:
    """Max-min fair rates of a fixed set of flows, re-computable as flows leave.

    The routing matrix is indexed once (CSR by link and by flow). :meth:`fill` runs progressive
    filling; each round costs O(links still filling + entries of the flows it freezes), because
    link demands are updated by subtraction instead of being recomputed from every entry.

    Incremental refill after completions: if flows with rates ``>= r_min`` leave, every flow that
    froze at a level ``< r_min`` keeps its rate exactly. (Below ``r_min`` no link a departed flow
    crossed had filled, and without those flows such links fill no earlier, so filling up to
    ``r_min`` repeats step for step.) Filling then resumes from the highest kept level. Fast
    flows finish first, so a completion usually re-fills only the top few levels.
    """

    def __init__(self, ent_flow: np.ndarray, ent_link: np.ndarray, ent_weight: np.ndarray, capacity: np.ndarray, num_flows: int):
        self.num_flows = num_flows
        self.ent_flow, self.ent_weight = ent_flow, ent_weight
        links, self.ent_lidx = np.unique(ent_link, return_inverse=True)
        self.n_links = links.size
        self.cap = capacity[links].astype(np.float64)
        by_link, self.link_ptr = _csr(self.ent_lidx, self.n_links)
        self.flows_of_link = ent_flow[by_link]
        by_flow, self.flow_ptr = _csr(ent_flow, num_flows)
        self.links_of_flow, self.weight_of_flow = self.ent_lidx[by_flow], ent_weight[by_flow]

    def fill(self, rate: np.ndarray, fixed: np.ndarray, active: np.ndarray) -> np.ndarray:
        """Rates for the ``active`` flows; those in ``fixed`` keep ``rate`` (see the class docstring)."""
        keep = fixed & active
        out = np.where(keep, rate, 0.0)
        free = active & ~fixed
        if not free.any():
            return out
        level = float(out[keep].max()) if keep.any() else 0.0
        e_free = free[self.ent_flow]
        e_fixed = keep[self.ent_flow]
        demand = np.bincount(self.ent_lidx[e_free], self.ent_weight[e_free], minlength=self.n_links)
        used = np.bincount(self.ent_lidx[e_fixed], self.ent_weight[e_fixed] * out[self.ent_flow[e_fixed]], minlength=self.n_links)
        cap_left = self.cap - used - level * demand
        frozen = ~free
        alive = np.flatnonzero(demand > 1e-12)
        while alive.size:
            d = demand[alive]
            share = cap_left[alive] / d
            inc = max(float(share.min()), 0.0)
            level += inc
            cap_left[alive] -= inc * d
            full = share <= inc * (1 + 1e-9) + 1e-300
            fl = self.flows_of_link[_ranges(self.link_ptr, alive[full])]
            fl = np.unique(fl[~frozen[fl]])
            out[fl] = level
            frozen[fl] = True
            ent = _ranges(self.flow_ptr, fl)
            demand -= np.bincount(self.links_of_flow[ent], self.weight_of_flow[ent], minlength=self.n_links)
            alive = alive[~full]
            alive = alive[demand[alive] > 1e-12]
        return out


def max_min_rates(
    ent_flow: np.ndarray, ent_link: np.ndarray, ent_weight: np.ndarray, capacity: np.ndarray, num_flows: int
) -> np.ndarray:
    """Max-min fair rate of every flow (0 for flows with no entries) by progressive filling."""
    if ent_flow.size == 0:
        return np.zeros(num_flows)
    everyone = np.zeros(num_flows, dtype=bool)
    everyone[ent_flow] = True
    none = np.zeros(num_flows, dtype=bool)
    return MaxMin(ent_flow, ent_link, ent_weight, capacity, num_flows).fill(np.zeros(num_flows), none, everyone)


@dataclass
class SimResult:
    """Outcome of one synchronized phase."""

    fct: np.ndarray  # completion time of every traffic flow (seconds)
    initial_rate: np.ndarray  # bytes/s of every traffic flow when all flows are active
    events: int  # completion events simulated

    @property
    def makespan(self) -> float:
        return float(self.fct.max())


def simulate(flows: FlowSet, capacity: np.ndarray, hop_latency_s: float = 0.0, startup_s: float = 0.0) -> SimResult:
    """Run all flows from time 0 to completion; per-flow completion times (see module docstring)."""
    n = flows.num_flows
    remaining = flows.size.copy()
    done_at = np.zeros(n)
    alive = np.zeros(n, dtype=bool)
    alive[flows.ent_flow] = True
    if not alive.all():
        raise RuntimeError("every flow needs at least one link")
    mm = MaxMin(flows.ent_flow, flows.ent_link, flows.ent_weight, capacity, n)
    rate = np.zeros(n)
    fixed = np.zeros(n, dtype=bool)
    t = 0.0
    initial: np.ndarray | None = None
    events = 0
    while alive.any():
        rate = mm.fill(rate, fixed, alive)
        if initial is None:
            initial = rate.copy()
        idx = np.flatnonzero(alive)
        if np.any(rate[idx] <= 0):
            raise RuntimeError("a flow got no capacity (a link of capacity 0 on its path?)")
        left = remaining[idx] / rate[idx]
        dt = float(left.min())
        t += dt
        finished = left <= dt * (1 + 1e-9)
        remaining[idx] -= rate[idx] * dt
        done_at[idx[finished]] = t
        alive[idx[finished]] = False
        r_min = float(rate[idx[finished]].min())
        fixed = alive & (rate < r_min * (1 - 1e-9))
        events += 1
    assert initial is not None
    sub_fct = done_at + 2.0 * flows.hops * hop_latency_s + startup_s
    fct = np.zeros(flows.num_parents)
    np.maximum.at(fct, flows.parent, sub_fct)
    rate0 = np.bincount(flows.parent, initial, minlength=flows.num_parents)
    return SimResult(fct=fct, initial_rate=rate0, events=events)
