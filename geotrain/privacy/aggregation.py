"""Private aggregation of pseudo-gradients: clip, add this site's share of the noise (site-level
DP), and sum across sites securely (:mod:`geotrain.privacy.secagg`) or in the clear; account
ε; write the audit log (one JSON line per aggregation).
"""

from __future__ import annotations

import math
import threading
from typing import Any, NoReturn

import torch

from geotrain.comm.collectives import Collectives
from geotrain.comm.faults import FaultPlan
from geotrain.config import PrivacyConfig
from geotrain.errors import RoundFailed, SecAggAborted
from geotrain.privacy.audit import AuditChain
from geotrain.privacy.dp import Accountant, calibrate_noise, gaussian_noise, secure_generator
from geotrain.privacy.secagg import RoundReport, SecureAggregator


class PrivateAggregation:
    """Clip, noise (site DP) and sum pseudo-gradients across sites, securely or in the clear.

    Every rank of every site calls :meth:`average` with the same round number and its site's
    pseudo-gradient (identical on the ranks of a site); it becomes the average over the sites
    that survived. Raises :class:`SecAggAborted` when the round cannot complete: the caller
    must roll it back.
    """

    def __init__(
        self,
        cfg: PrivacyConfig,
        comm: Collectives,
        seed: int,
        rounds_planned: int,
        audit: AuditChain | None,
        faults: FaultPlan | None = None,
    ) -> None:
        self.cfg = cfg
        self.comm = comm
        g = comm.groups
        self.num_sites = g.topology.num_sites
        # the first `carriers` local ranks (the smallest site's size) carry the vector across sites;
        # under FSDP (sites of one size) every rank carries its own shard
        self.carries = g.me.local_rank < g.topology.carriers
        # (FSDP over sites of different sizes: the rounds hand over the site's whole vector, gathered in the site)
        self.sharded = g.mesh is not None and len(set(g.topology.workers)) == 1
        self.site_names = list(g.topology.site_names)
        self.site = g.me.site_index
        self.site_dp = cfg.dp.unit == "site"
        self.bound = cfg.dp.clip_norm if self.site_dp else cfg.update_bound
        self.secagg = (
            SecureAggregator(comm, cfg.graph, cfg.threshold, self.bound, seed)
            if cfg.secure_aggregation and self.num_sites > 1 and self.carries
            else None
        )
        self.secure = cfg.secure_aggregation and self.num_sites > 1  # (a rank that carries nothing has no aggregator)
        self.threshold = self.secagg.t if self.secagg is not None else self.num_sites
        if self.secure:  # the site's ranks agree on the threshold (a rank that carries nothing has no aggregator)
            self.threshold = int(self._site_max(float(self.threshold if self.secagg is not None else 0)))
        self.accountant = Accountant(cfg.dp.accountant, cfg.dp.delta, cfg.dp.epsilon) if self.site_dp else None
        self.noise_multiplier = 0.0
        if self.site_dp:
            d = cfg.dp
            nm = d.noise_multiplier
            if nm is None:  # calibrated so that even rounds with only `threshold` survivors fit the budget
                nm = calibrate_noise(d.epsilon or 0.0, d.delta, 1.0, rounds_planned, d.accountant)
                nm *= math.sqrt(self.num_sites / self.threshold)
            self.noise_multiplier = nm
        # fixed-point range per value: the clip bound plus 8 standard deviations of this site's noise
        self.noise_std = self.noise_multiplier * self.bound / math.sqrt(self.num_sites)
        if self.secagg is not None:
            self.secagg.set_range(self.bound + 8 * self.noise_std)
        self.gen = secure_generator()
        self.seed = seed
        # multi-tier DiLoCo: region rounds sum securely over the region's sites alone (made on first use)
        topo = g.topology
        self.region_sites = [s for s in range(self.num_sites) if topo.same_region(s, self.site)]
        self._region_secagg: SecureAggregator | None = None
        self.faults = faults if faults is not None else FaultPlan(self.site_names[self.site])  # dropouts to inject
        self.audit = audit
        self.aggregations = 0
        self.dropouts = 0
        self.failed = 0
        self._pending = 0  # reserved (background) aggregations not yet accounted
        self._lock = threading.Lock()

    def min_noise_multiplier(self) -> float:
        """The aggregate's noise multiplier when only ``threshold`` sites survive (the worst case)."""
        return self.noise_multiplier * math.sqrt(self.threshold / self.num_sites)

    def can_afford(self) -> bool:
        """Whether one more aggregation fits the ε budget, counting those still in flight at the
        worst-case noise (same answer on every rank)."""
        if self.accountant is None:
            return True
        with self._lock:
            pending = self._pending
        return self.accountant.fits(self.min_noise_multiplier(), 1.0, pending + 1)

    def reserve(self) -> None:
        """Called by the training thread when it hands an aggregation to a background exchange."""
        with self._lock:
            self._pending += 1

    def _aggregator(self, region: bool) -> SecureAggregator | None:
        """This rank's secure aggregator over every site, or over its region's sites (``region``)."""
        if not region:
            return self.secagg
        if self._region_secagg is None and self.secure and self.carries and len(self.region_sites) > 1:
            # (the config holds privacy.threshold within every region of several sites)
            bound = self.bound + 8 * self.noise_std  # the fixed-point range, as the world's aggregator's
            self._region_secagg = SecureAggregator(self.comm, self.cfg.graph, self.cfg.threshold, bound, self.seed, region=True)
        return self._region_secagg

    @torch.no_grad()
    def average(self, delta: torch.Tensor, round_id: int, weights: list[float] | None = None, region: bool = False) -> int:
        """Replace ``delta`` by the average over surviving sites; returns how many survived.
        A non-finite update is withdrawn (secure aggregation) or left out (plain), never summed.
        ``region``: over the sites of this site's region (multi-tier DiLoCo's region round);
        ``weights`` are still one per site of the run."""
        sites = self.region_sites if region else list(range(self.num_sites))
        if region and len(sites) == 1:  # a region of one site: nothing is summed, nothing released
            if not bool(torch.isfinite(delta).all()):
                raise RoundFailed(f"region round {round_id}: this site's update is not finite")
            return 1
        lane = self.comm.lanes[0].intra  # the site group of whichever thread aggregates (see _secure_sum)
        finite = bool(torch.isfinite(delta).all())
        if self.sharded:  # FSDP: each rank holds a shard of the site's update; the site decides as one
            ok = torch.tensor([float(finite)])
            torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN, group=lane)
            finite = bool(ok.item())
        guard = "own update finite" if finite else "own update non-finite: withdrawn"  # for the audit log
        if not finite:
            delta.zero_()
        norm = float(delta.norm())
        if self.sharded:  # the site's whole-vector norm: the sum of its shards' squares
            squares = torch.tensor([norm * norm], dtype=torch.float64)
            torch.distributed.all_reduce(squares, group=lane)
            norm = math.sqrt(float(squares.item()))
        if norm > self.bound:
            delta.mul_(self.bound / (norm + 1e-12))
        g = self.comm.groups
        # sites weighted by their tokens (sites of different sizes or speeds, sync.weight_by_tokens):
        # each site's update is scaled by its weight over the largest one's before masking (public
        # weights, at most 1, so the fixed-point range holds), the sum divided by the survivors'
        scale = None if weights is None else [w / max(weights[u] for u in sites) for w in weights]
        if scale is not None:
            delta.mul_(scale[self.site])
        sizes = self.comm.site_split(delta.numel())
        # what this rank carries across sites: its part of the site's vector (maybe nothing), or its
        # whole shard under FSDP (local rank i holds the same part at every site)
        shard = delta if self.sharded else delta.split(sizes)[g.me.local_rank]
        if self.noise_std > 0 and shard.numel():
            shard.add_(gaussian_noise(self.gen, shard, self.noise_std))
        inject = self.faults.secagg_fault(round_id)
        if not finite:
            inject = "drop"
        report: RoundReport | None = None
        if self.secure:
            report = self._secure_sum(shard, round_id, inject, guard, self._aggregator(region), sites)
            if not self.sharded:
                self.comm.all_gather_intra(delta, sizes)
            survivors = len(report.survivors)
            divisor = float(survivors) if scale is None else sum(scale[u] for u in report.survivors)
        else:
            survivors = int(sum(self.comm.site_values(1.0 if finite else 0.0, region=region)))
            if survivors == 0:
                self._failed(round_id, RoundFailed(f"round {round_id}: no site had a finite update"), guard, sites)
            self.comm.all_reduce_across_sites(delta, sharded=self.sharded, region=region)
            divisor = float(survivors)
        delta.div_(divisor)
        with self._lock:
            self._pending = max(0, self._pending - 1)
            self.aggregations += 1
            self.dropouts += len(sites) - survivors
            if self.accountant is not None:
                self.accountant.step(self.noise_multiplier * math.sqrt(survivors / self.num_sites), 1.0)
        self._write_audit(round_id, report, None, guard, sites)
        return survivors

    def _site_max(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self.comm.groups.intra)
        return float(t.item())

    def _secure_sum(
        self,
        shard: torch.Tensor,
        round_id: int,
        inject: str | None,
        guard: str,
        secagg: SecureAggregator | None,
        sites: list[int],
    ) -> RoundReport:
        """Securely sum this rank's ``shard`` over ``sites`` (in place) with ``secagg`` (None on a
        rank that carries nothing), on every carrying rank; the site's ranks then agree on one
        outcome: the survivors every carrier saw, or an abort (a carrier that aborted, or carriers
        that saw different survivors, abort the site's round, which the caller rolls back). The
        round's report, the same on every rank of the site, naming sites by their index in the run."""
        n = len(sites)
        report: RoundReport | None = None
        error = ""
        if secagg is not None:
            try:
                summed, report = secagg.aggregate(shard.contiguous(), round_id, inject)
                shard.copy_(summed)
            except SecAggAborted as exc:
                error = str(exc)
        # [aborted, survivor mask (as low and high: the same on every carrier), ...] agreed in the site
        mask = 0 if report is None else sum(1 << u for u in report.survivors)
        aborting = float(bool(error) or (secagg is not None and report is None))
        flags = torch.tensor([aborting, float(mask), -float(mask)], dtype=torch.float64)  # exact masks up to 2^53
        if secagg is None:  # a rank that carries nothing: neutral in the agreement
            flags = torch.tensor([0.0, 0.0, -float((1 << n) - 1)], dtype=torch.float64)
        # on lane 0's site group, as the all-gather that follows: Streaming DiLoCo aggregates in its
        # exchange thread while the training thread uses the main site group
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=self.comm.lanes[0].intra)
        aborted, high, low = bool(flags[0].item()), int(flags[1].item()), -int(flags[2].item())
        if aborted or high != low:
            why = error or ("the site's ranks saw different survivors" if high != low else "another rank of this site aborted")
            self._failed(round_id, SecAggAborted(f"round {round_id}: {why}"), guard, sites)
        if report is None:  # a rank that carries nothing takes the carriers' survivors
            survivors = [u for u in range(n) if high >> u & 1]
            report = RoundReport(
                round_id,
                list(range(n)),
                survivors,
                [u for u in range(n) if u not in survivors],
                [],
                [],
                self.threshold,
                self.cfg.graph,
                0,
                0,
            )
        if n < self.num_sites:  # a region's participants: their indices in the region, named by their sites'
            for name in ("participants", "survivors", "dropped", "malformed", "masks_recovered"):
                setattr(report, name, [sites[u] for u in getattr(report, name)])
        return report

    def _failed(self, round_id: int, exc: RoundFailed, guard: str, sites: list[int]) -> NoReturn:
        """Count and audit a round over ``sites`` that cannot complete, then raise ``exc`` for the caller to roll back."""
        with self._lock:
            self.failed += 1
            self._pending = max(0, self._pending - 1)
        self._write_audit(round_id, None, str(exc), guard, sites)
        raise exc

    def _write_audit(self, round_id: int, report: RoundReport | None, error: str | None, guard: str, sites: list[int]) -> None:
        g = self.comm.groups
        if self.audit is None or g.me.local_rank != 0:
            return
        names = self.site_names
        rec: dict[str, Any] = {
            "kind": "round",
            "round": round_id,
            # multi-tier DiLoCo: a region round (over its region's sites) or a world round, each numbered apart
            **({"tier": "region" if len(sites) < self.num_sites else "world"} if g.topology.tiered else {}),
            "site": names[self.site],
            "secure_aggregation": self.secure,
            "clip_norm": self.bound,
            "dp_unit": self.cfg.dp.unit,
            "noise_multiplier": self.noise_multiplier if self.site_dp else None,
            "epsilon": self.accountant.epsilon() if self.accountant is not None else None,
            "delta": self.cfg.dp.delta if self.accountant is not None else None,
            "guard": guard,
            "attempt": self.audit.attempt,  # the rounds after a checkpoint are done again by a resumed run
        }
        if report is not None:
            rec.update(
                participants=[names[i] for i in report.participants],
                survivors=[names[i] for i in report.survivors],
                dropped=[names[i] for i in report.dropped],
                malformed=[names[i] for i in report.malformed],
                masks_recovered=[names[i] for i in report.masks_recovered],
                threshold=report.threshold,
                graph=report.graph,
                neighbours=report.degree,
                fixed_point_frac_bits=report.frac_bits,
                key_agreement_seconds=round(report.key_agreement_seconds, 6),
                notes=report.notes,
            )
        elif error is None:
            rec.update(participants=[names[i] for i in sites], survivors=[names[i] for i in sites], dropped=[])
        if error is not None:
            rec.update(status="rolled_back", error=error)
        else:
            rec["status"] = "committed"
        with self._lock:
            self.audit.append(rec)

    def close_audit(self, failure: BaseException | None = None) -> None:
        """The audit log's closing line: the run ended here (an audit log without it was cut short),
        ``completed`` or ``failed`` with the error; the first call writes it."""
        if self.audit is not None:
            eps = self.accountant.epsilon() if self.accountant is not None else None
            outcome = (
                {"outcome": "completed"}
                if failure is None
                else {"outcome": "failed", "error": f"{type(failure).__name__}: {failure}"[:500]}
            )
            with self._lock:
                self.audit.close(
                    {
                        "aggregations": self.aggregations,
                        "rolled_back": self.failed,
                        "dropouts": self.dropouts,
                        "epsilon": eps,
                        **outcome,
                    }
                )

    def summary(self) -> dict[str, Any]:
        return {
            "secagg": self.secure,
            "threshold": self.threshold if self.secure else None,
            "graph": self.cfg.graph if self.secure else None,
            "dropouts": self.dropouts,
            "rounds_rolled_back": self.failed,
            "clip_norm": self.bound,
            "noise_multiplier": self.noise_multiplier if self.site_dp else None,
        }
