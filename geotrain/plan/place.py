"""``geotrain place``: which sites of a pool train a job, how many workers each, how they group into
tiers and how their sums cross the links; the shortest predicted time to the token target, or the
lowest cost within a deadline (docs/PLACE.md).

The model, per placement (``G_i`` workers at site i, speed ``s_i``, ``P`` parameters):

- inner step at site i: ``step_s / s_i`` plus its in-site gradient all-reduce (a ring over G_i
  ranks on ``links.intra``);
- a round: H inner steps, then the sum across sites of the pseudo-gradient: the exchange shape
  (ring, tree, hub) and order with the least predicted time on the link matrix
  (:mod:`geotrain.plan.exchange`), or a codec's one-hop encoded sum; two tiers: regions found by
  latency clustering sum every round on their own links, all sites every ``k`` rounds;
- lock-step pace (every site runs H steps: the round lasts the slowest site's) or adaptive pace
  (site i runs H·rate_i/rate_max steps; every site reaches the boundary together);
- H and the codec: the least compression, then the smallest H, whose predicted utilisation
  reaches ``job.utilization`` (the planner's rule, :func:`geotrain.plan.strategies.choose_round`);
- time to target = tokens / (tokens per round / seconds per round); cost = accelerator-hours x price.

Placements are enumerated (each site: none, powers of two, all of its accelerators; a site whose
data may not leave always takes part) up to :data:`MAX_PLACEMENTS`, else sites are dropped
greedily from the full pool while the objective improves.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from geotrain.plan.exchange import SHAPES, best_order, clusters, coded_link_bytes, link_bytes, sum_seconds
from geotrain.plan.pool import CODEC_BITS, Pool

MAX_PLACEMENTS = 20_000


@dataclass
class Placement:
    """One placement and what the model predicts for it."""

    workers: tuple[int, ...]  # per pool site (0: not taking part)
    pace: str = "lockstep"
    shape: str = "ring"
    order: tuple[int, ...] = ()
    regions: tuple[tuple[int, ...], ...] = ()  # two tiers (empty: one)
    region_shape: str = "ring"
    region_every: int = 0
    H: int = 1
    codec: str = "none"
    step_s: dict[int, float] = field(default_factory=dict)  # per site: an inner step
    sync_s: float = 0.0  # exchange seconds per round (two tiers: region + world / k)
    round_s: float = 0.0
    utilization: dict[int, float] = field(default_factory=dict)
    tokens_per_round: float = 0.0
    hours: float = math.inf
    cost: float = 0.0
    meets_utilization: bool = False

    @property
    def sites(self) -> list[int]:
        return [i for i, w in enumerate(self.workers) if w]


class Placer:
    """Evaluates placements of one pool (``params``, ``tokens_per_step``: the job's, resolved;
    ``shapes``: the exchange shapes the base config allows, docs/PLACE.md)."""

    def __init__(self, pool: Pool, params: int, tokens_per_step: int, shapes: tuple[str, ...] = SHAPES) -> None:
        self.pool, self.job, self.P, self.tps, self.shapes = pool, pool.job, params, tokens_per_step, shapes
        self.bw, self.lat = pool.matrix()
        self._orders: dict[tuple[frozenset[int], str, float], tuple[list[int], float]] = {}
        self.searched = 0

    # ------------------------------------------------------------------ the model

    def inner_step(self, site: int, G: int) -> float:
        s, intra = self.pool.sites[site], self.pool.links.intra
        ar = 0.0 if G == 1 else 2 * (G - 1) / G * 4 * self.P * 8 / intra.bandwidth_bps + 2 * (G - 1) * intra.latency_s
        return self.job.step_s / s.speed + ar

    def order(self, sites: list[int], shape: str, nbytes: float) -> tuple[list[int], float]:
        """The best order of ``sites`` for ``shape`` (cached per site set)."""
        key = (frozenset(sites), shape, nbytes)
        if key not in self._orders:
            self._orders[key] = best_order(shape, sites, nbytes, self.bw, self.lat, 5040 if shape == "ring" else 720)
        return self._orders[key]

    def exchange(self, sites: list[int], nbytes: float) -> tuple[str, list[int], float]:
        """(shape, order, seconds) of the fastest fp32 sum over ``sites``."""
        if len(sites) < 2:
            return "ring", sites, 0.0
        best = min(
            ((sh, *self.order(sites, sh, nbytes)) for sh in self.shapes), key=lambda r: (round(r[2], 12), SHAPES.index(r[0]))
        )
        return best[0], list(best[1]), best[2]

    def _choose_round(self, p: Placement, round_compute: float, sync: dict[str, float]) -> tuple[str, int, float]:
        """(codec, H, sync seconds): the least compression, then the smallest H, reaching the utilisation;
        else the most compressed at the largest H."""

        def u(H: int, t: float) -> float:
            return H * round_compute / (H * round_compute + t)

        codecs = sorted(sync, key=lambda c: -CODEC_BITS[c])
        for c in codecs:
            for H in self.job.H:
                if u(H, sync[c]) >= self.job.utilization:
                    return c, H, sync[c]
        c = codecs[-1]
        return c, self.job.H[-1], sync[c]

    def evaluate(self, workers: tuple[int, ...], pace: str, tiers: bool) -> Placement | None:
        """The placement's prediction (None: nothing to predict, e.g. tiers with one region)."""
        p = Placement(workers=workers, pace=pace)
        sites = p.sites
        p.step_s = {i: self.inner_step(i, workers[i]) for i in sites}
        slow, fast = max(p.step_s.values()), min(p.step_s.values())
        per_step = fast if pace == "adaptive" else slow  # the round's compute clock
        S = 4.0 * self.P
        if tiers:
            groups = clusters(sites, self.lat)
            if len(groups) < 2 or all(len(g) == 1 for g in groups):
                return None
            shapes = {sh: max((self.order(g, sh, S)[1] for g in groups if len(g) > 1), default=0.0) for sh in self.shapes}
            p.region_shape = min(self.shapes, key=lambda sh: (round(shapes[sh], 12), SHAPES.index(sh)))
            p.regions = tuple(tuple(self.order(g, p.region_shape, S)[0]) if len(g) > 1 else tuple(g) for g in groups)
            p.shape, order, world = self.exchange(sites, S)
            p.order = tuple(order)
            p.codec = "none"
            for k in (2, 4, 8, 16):
                p.region_every = k
                _, p.H, p.sync_s = self._choose_round(p, per_step, {"none": shapes[p.region_shape] + world / k})
                if p.H * per_step / (p.H * per_step + p.sync_s) >= self.job.utilization:
                    break
        else:
            p.shape, order, t32 = self.exchange(sites, S)
            p.order = tuple(order)
            sync = {"none": t32}
            for c in self.job.codecs:
                if c != "none" and len(sites) > 1:
                    sync[c] = sum_seconds("ring", sites, self.P * CODEC_BITS[c] / 8, self.bw, self.lat, codec=True)
            p.codec, p.H, p.sync_s = self._choose_round(p, per_step, sync)
            if p.codec != "none":  # an encoded sum is one hop whatever the shape: the ring in pool order
                p.shape, p.order = "ring", tuple(sites)
        self._predict(p, per_step)
        self.searched += 1
        return p

    def _predict(self, p: Placement, per_step: float) -> None:
        """Round time, tokens, utilisation, hours and cost from ``p``'s H, sync time and pace
        (``per_step``: the round's compute clock, an inner step of the slowest site or, adaptive,
        of the fastest)."""
        sites = p.sites
        p.round_s = p.H * per_step + p.sync_s
        steps = {i: p.H * (per_step / p.step_s[i] if p.pace == "adaptive" else 1.0) for i in sites}
        p.tokens_per_round = sum(p.workers[i] * self.tps * steps[i] for i in sites)
        p.utilization = {i: steps[i] * p.step_s[i] / p.round_s for i in sites}
        p.hours = self.job.tokens / p.tokens_per_round * p.round_s / 3600
        p.cost = p.hours * sum(p.workers[i] * self.pool.sites[i].cost_per_hour for i in sites)
        p.meets_utilization = min(p.utilization.values()) >= self.job.utilization or len(sites) == 1

    def link_bytes(self, p: Placement) -> dict[tuple[int, int], float]:
        """Bytes each directed link carries per round (two tiers: the world sum's share per round)."""
        if p.codec != "none":
            bits = CODEC_BITS[p.codec]
            return {
                k: float(v) for k, v in coded_link_bytes(list(p.order), self.P, lambda n: math.ceil(n * bits / 8), False).items()
            }
        carriers = min(p.workers[i] for i in p.sites)
        out: dict[tuple[int, int], float] = {}
        if p.regions:
            for g in p.regions:
                for k, v in link_bytes(p.region_shape, list(g), self.P, carriers).items():
                    out[k] = out.get(k, 0.0) + v
            for k, v in link_bytes(p.shape, list(p.order), self.P, carriers).items():
                out[k] = out.get(k, 0.0) + v / p.region_every
            return out
        return {k: float(v) for k, v in link_bytes(p.shape, list(p.order), self.P, carriers).items()}

    # ------------------------------------------------------------------ the search

    def _options(self, i: int) -> list[int]:
        s = self.pool.sites[i]
        opts = {s.accelerators} | {2**k for k in range(11) if 2**k < s.accelerators}
        if s.data_may_leave:
            opts.add(0)
        return sorted(opts)

    def candidates(self) -> list[tuple[int, ...]]:
        n = len(self.pool.sites)
        options = [self._options(i) for i in range(n)]
        if math.prod(len(o) for o in options) <= MAX_PLACEMENTS:
            return [w for w in itertools.product(*options) if any(w)]
        return []  # too many: the greedy search

    def variants(self, workers: tuple[int, ...]) -> list[Placement]:
        speeds = {self.pool.sites[i].speed for i, w in enumerate(workers) if w}
        out = []
        for pace in ("lockstep", "adaptive") if len(speeds) > 1 else ("lockstep",):
            for tiers in (False, True) if self.job.tiers else (False,):
                p = self.evaluate(workers, pace, tiers)
                if p is not None:
                    out.append(p)
        return out

    def key(self, p: Placement) -> tuple[float, ...]:
        """Smaller is better: placements that reach the utilisation first, then the objective."""
        over_budget = self.job.budget is not None and p.cost > self.job.budget
        late = self.job.deadline_h is not None and p.hours > self.job.deadline_h
        if self.job.objective == "cost":
            return (over_budget, late, p.cost if not late else p.hours, p.hours, sum(p.workers))
        return (over_budget, p.hours, p.cost, sum(p.workers))

    def search(self) -> list[Placement]:
        """Every placement evaluated, best first."""
        cands = self.candidates()
        if cands:
            return sorted((p for w in cands for p in self.variants(w)), key=self.key)
        full = tuple(s.accelerators for s in self.pool.sites)
        found = list(self.variants(full))
        best = min(found, key=self.key)
        while True:  # drop the site whose absence helps most, while one does
            trials = [
                p
                for i in best.sites
                if self.pool.sites[i].data_may_leave and len(best.sites) > 1
                for p in self.variants(tuple(0 if j == i else w for j, w in enumerate(best.workers)))
            ]
            found += trials
            better = [p for p in trials if self.key(p) < self.key(best)]
            if not better:
                return sorted(found, key=self.key)
            best = min(better, key=self.key)

    def naive(self, like: Placement) -> Placement:
        """Every site with all its accelerators, pool order, one ring, lock-step; ``like``'s H and codec."""
        p = Placement(workers=tuple(s.accelerators for s in self.pool.sites), H=like.H, codec=like.codec)
        p.order = tuple(p.sites)
        p.step_s = {i: self.inner_step(i, p.workers[i]) for i in p.sites}
        S = 4.0 * self.P if like.codec == "none" else self.P * CODEC_BITS[like.codec] / 8
        p.sync_s = sum_seconds("ring", p.sites, S, self.bw, self.lat, codec=like.codec != "none")
        self._predict(p, max(p.step_s.values()))
        return p
