"""Cross-organisation mode: what leaves a site is clipped, optionally noised, and securely summed.

Two units of differential privacy (``privacy.dp.unit``):

* ``site`` — each site clips its pseudo-gradient to ``clip_norm`` and adds Gaussian noise of
  std ``σ·C/√N`` (N sites), so the sum of the N shares carries N(0, σ²C²): *distributed noise*.
  Combined with secure aggregation no one sees a site's update un-noised; on its own, the noise
  each site adds is only 1/√N of what protects it. It protects the participation of a whole
  site (organisation) in the global model; with few sites σ must be large and the model
  suffers — it is meaningful with many sites.
* ``example`` — DP-SGD inside each site: per-example gradients (Opacus ``GradSampleModule``),
  each clipped to ``clip_norm``, summed, plus N(0, σ²C²) split over the site's workers. It
  protects each record of a site's data, also with few sites; it says nothing about what the
  site's aggregate reveals beyond that.

ε is tracked with Opacus's RDP or PRV accountant for the configured δ (site unit: one step per
aggregation with sampling rate 1 and the noise actually present, which shrinks when sites drop
out; example unit: one step per inner step with the rank's sampling rate). Training stops
before a step would exceed ``epsilon``.

Noise is drawn from torch's generator seeded from ``os.urandom`` — not a cryptographically
secure generator (Opacus's secure mode needs torchcsprng, which is not packaged here).
"""

from __future__ import annotations

import json
import math
import os
import threading
import warnings
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.nn as nn

from geotrain.comm.collectives import Collectives
from geotrain.config import PrivacyConfig
from geotrain.errors import RoundFailed, SecAggAborted
from geotrain.secagg import RoundReport, SecureAggregator


def _accountant(kind: str) -> Any:
    from opacus.accountants import PRVAccountant, RDPAccountant

    return PRVAccountant() if kind == "prv" else RDPAccountant()


def calibrate_noise(epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str) -> float:
    """The noise multiplier that spends ``epsilon`` in ``steps`` steps (Opacus's search)."""
    from opacus.accountants.utils import get_noise_multiplier

    return float(
        get_noise_multiplier(
            target_epsilon=epsilon, target_delta=delta, sample_rate=sample_rate, steps=max(1, steps), accountant=accountant
        )
    )


class Accountant:
    """ε spent so far, and whether one more step fits the budget."""

    def __init__(self, kind: str, delta: float, budget: float | None) -> None:
        self.kind, self.delta, self.budget = kind, delta, budget
        self._acc = _accountant(kind)
        self.steps = 0

    def epsilon(self) -> float:
        if not self.steps:
            return 0.0
        return float(self._acc.get_epsilon(delta=self.delta))

    def step(self, noise_multiplier: float, sample_rate: float) -> None:
        self._acc.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)
        self.steps += 1

    def fits(self, noise_multiplier: float, sample_rate: float, steps: int = 1) -> bool:
        """Whether ``steps`` more steps with these settings stay within the budget."""
        if self.budget is None:
            return True
        if noise_multiplier <= 0:
            return False
        trial = _accountant(self.kind)
        trial.history = list(self._acc.history)
        for _ in range(steps):
            trial.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)
        return float(trial.get_epsilon(delta=self.delta)) <= self.budget

    def max_steps(self, noise_multiplier: float, sample_rate: float, limit: int) -> int:
        """The most steps (≤ ``limit``) the budget allows from now (binary search)."""
        if self.budget is None:
            return limit
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.fits(noise_multiplier, sample_rate, mid):
                lo = mid
            else:
                hi = mid - 1
        return lo


def _noise(gen: torch.Generator, like: torch.Tensor, std: float) -> torch.Tensor:
    return torch.randn(like.shape, generator=gen, dtype=torch.float32) * std


def _secure_generator() -> torch.Generator:
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))


class PrivateAggregation:
    """Clip, noise (site DP) and sum pseudo-gradients across sites, securely or in the clear.

    Every rank of every site calls :meth:`average` with the same round number and its site's
    pseudo-gradient (identical on the ranks of a site); it becomes the average over the sites
    that survived. Raises :class:`SecAggAborted` when the round cannot complete: the caller
    must roll it back.
    """

    def __init__(self, cfg: PrivacyConfig, comm: Collectives, seed: int, rounds_planned: int, audit: Path | None) -> None:
        self.cfg = cfg
        self.comm = comm
        g = comm.groups
        self.num_sites = g.topology.num_sites
        self.site_names = list(g.topology.site_names)
        self.site = g.me.site_index
        self.site_dp = cfg.dp.unit == "site"
        self.bound = cfg.dp.clip_norm if self.site_dp else cfg.update_bound
        self.secagg = (
            SecureAggregator(comm, cfg.graph, cfg.threshold, self.bound, seed)
            if cfg.secure_aggregation and self.num_sites > 1
            else None
        )
        self.threshold = self.secagg.t if self.secagg is not None else self.num_sites
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
        self.gen = _secure_generator()
        self.injections = {(s, r): k for (s, r), k in cfg.injections().items() if s == self.site_names[self.site]}
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

    @torch.no_grad()
    def average(self, delta: torch.Tensor, round_id: int) -> int:
        """Replace ``delta`` by the average over surviving sites; returns how many survived.
        A non-finite update is withdrawn (secure aggregation) or left out (plain), never summed."""
        finite = bool(torch.isfinite(delta).all())
        if not finite:
            delta.zero_()
        norm = float(delta.norm())
        if norm > self.bound:
            delta.mul_(self.bound / (norm + 1e-12))
        g = self.comm.groups
        G, me = len(g.intra_ranks), g.me.local_rank
        shard = delta.tensor_split(G)[me]  # what this rank carries across sites
        if self.noise_std > 0:
            shard.add_(_noise(self.gen, shard, self.noise_std))
        inject = self.injections.get((self.site_names[self.site], round_id))
        if not finite:
            inject = "drop"
        report: RoundReport | None = None
        if self.secagg is not None:
            try:
                summed, report = self.secagg.aggregate(shard.contiguous(), round_id, inject)
            except SecAggAborted as exc:
                self._failed(round_id, exc)
            shard.copy_(summed)
            self.comm.all_gather_intra(delta, [s.numel() for s in delta.tensor_split(G)])
            survivors = len(report.survivors)
        else:
            survivors = int(sum(self.comm.site_values(1.0 if finite else 0.0)))
            if survivors == 0:
                self._failed(round_id, RoundFailed(f"round {round_id}: no site had a finite update"))
            self.comm.all_reduce_across_sites(delta)
        delta.div_(survivors)
        with self._lock:
            self._pending = max(0, self._pending - 1)
            self.aggregations += 1
            self.dropouts += self.num_sites - survivors
            if self.accountant is not None:
                self.accountant.step(self.noise_multiplier * math.sqrt(survivors / self.num_sites), 1.0)
        self._write_audit(round_id, report, None)
        return survivors

    def _failed(self, round_id: int, exc: RoundFailed) -> NoReturn:
        """Count and audit a round that cannot complete, then raise ``exc`` for the caller to roll back."""
        with self._lock:
            self.failed += 1
            self._pending = max(0, self._pending - 1)
        self._write_audit(round_id, None, str(exc))
        raise exc

    def _write_audit(self, round_id: int, report: RoundReport | None, error: str | None) -> None:
        g = self.comm.groups
        if self.audit is None or g.me.local_rank != 0:
            return
        names = self.site_names
        rec: dict[str, Any] = {
            "round": round_id,
            "site": names[self.site],
            "secure_aggregation": self.secagg is not None,
            "clip_norm": self.bound,
            "dp_unit": self.cfg.dp.unit,
            "noise_multiplier": self.noise_multiplier if self.site_dp else None,
            "epsilon": self.accountant.epsilon() if self.accountant is not None else None,
            "delta": self.cfg.dp.delta if self.accountant is not None else None,
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
            rec.update(participants=names, survivors=names, dropped=[])
        if error is not None:
            rec.update(status="rolled_back", error=error)
        else:
            rec["status"] = "committed"
        with self._lock, self.audit.open("a") as f:
            f.write(json.dumps(rec) + "\n")

    def summary(self) -> dict[str, Any]:
        return {
            "secagg": self.secagg is not None,
            "threshold": self.threshold if self.secagg is not None else None,
            "graph": self.cfg.graph if self.secagg is not None else None,
            "dropouts": self.dropouts,
            "rounds_rolled_back": self.failed,
            "clip_norm": self.bound,
            "noise_multiplier": self.noise_multiplier if self.site_dp else None,
        }


class ExampleDP:
    """DP-SGD on the inner steps of one rank: per-example gradients (Opacus), clipped, summed, noised.

    :meth:`privatize` turns the per-example gradients of the last backward pass into
    (Σ_i clip(g_i) + this rank's noise share) / batch, a flat vector: summed over the site's G
    workers and divided by G it is the DP-SGD gradient of the site's batch.
    """

    def __init__(
        self,
        model: nn.Module,
        clip_norm: float,
        noise_multiplier: float,
        workers_per_site: int,
        sample_rate: float = 1.0,
        accountant: Accountant | None = None,
    ) -> None:
        from opacus import GradSampleModule

        if hasattr(model, "batched_positions"):
            model.batched_positions = True  # type: ignore[assignment]  # per-example gradients need a batch dimension everywhere
        # Opacus's hooks fire on the first layer, whose input (token ids) needs no gradient: harmless
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.module = GradSampleModule(model, loss_reduction="mean")
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.clip_norm = clip_norm
        self.noise_multiplier = noise_multiplier
        self.workers = workers_per_site
        self.gen = _secure_generator()
        self.sample_rate = sample_rate
        self.accountant = accountant  # steps once per privatized gradient

    @torch.no_grad()
    def privatize(self) -> torch.Tensor:
        samples = [p.grad_sample for p in self.params]  # type: ignore[attr-defined]
        batch = samples[0].shape[0]
        flat = torch.cat([s.reshape(batch, -1) for s in samples], dim=1)
        norms = flat.norm(dim=1)
        factor = (self.clip_norm / (norms + 1e-6)).clamp(max=1.0)
        total = factor @ flat
        if self.noise_multiplier > 0:
            total.add_(_noise(self.gen, total, self.noise_multiplier * self.clip_norm / math.sqrt(self.workers)))
        for p in self.params:
            p.grad_sample = None  # type: ignore[attr-defined]
        if self.accountant is not None:
            self.accountant.step(self.noise_multiplier, self.sample_rate)
        return total.div_(batch)


def global_max(value: float, group: dist.ProcessGroup) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


class Privacy:
    """A rank's privacy machinery for one run: what the training loop and the summary need."""

    def __init__(
        self, cfg: PrivacyConfig, aggregation: PrivateAggregation | None, example: ExampleDP | None, max_steps: int
    ) -> None:
        self.cfg = cfg
        self.aggregation = aggregation
        self.example = example
        self.max_steps = max_steps  # the ε budget allows this many inner steps (example unit)
        self.stopped_at: int | None = None
        self.stop_reason = ""

    @property
    def active(self) -> bool:
        return self.aggregation is not None or self.example is not None

    def accountant(self) -> Accountant | None:
        if self.example is not None:
            return self.example.accountant
        return self.aggregation.accountant if self.aggregation is not None else None

    def epsilon(self) -> float | None:
        acc = self.accountant()
        return acc.epsilon() if acc is not None else None

    def accountant_state(self) -> dict[str, Any] | None:
        acc = self.accountant()
        return None if acc is None else {"history": [list(h) for h in acc._acc.history], "steps": acc.steps}

    def load_accountant_state(self, state: dict[str, Any] | None) -> None:
        acc = self.accountant()
        if acc is not None and state is not None:
            acc._acc.history = [tuple(h) for h in state["history"]]
            acc.steps = state["steps"]

    def summary(self) -> dict[str, Any]:
        d = self.cfg.dp
        out: dict[str, Any] = {
            "secagg": False,
            "dp_unit": d.unit,
            "epsilon": self.epsilon(),
            "epsilon_budget": d.epsilon,
            "delta": d.delta if d.unit != "none" else None,
            "accountant": d.accountant if d.unit != "none" else None,
            "noise_multiplier": None,
            "clip_norm": None,
            "dropouts": 0,
            "privacy_stopped_at_step": self.stopped_at,
        }
        if self.aggregation is not None:
            out.update(self.aggregation.summary())
        if self.example is not None:
            out.update(
                noise_multiplier=self.example.noise_multiplier,
                clip_norm=self.example.clip_norm,
                sample_rate=self.example.sample_rate,
            )
        return out


def setup_privacy(cfg: Any, model: nn.Module, sync: Any, comm: Collectives, groups: Any, data: Any, out: Path) -> Privacy:
    """Attach the configured privacy machinery to ``sync`` (and the model, for DP-SGD)."""
    p = cfg.privacy
    topo = groups.topology
    aggregation = None
    if p.secure_aggregation or p.dp.unit == "site":
        H = cfg.sync.H
        per_round = getattr(sync, "F", 1)
        planned = per_round * math.ceil(cfg.train.steps / H)
        me = groups.me
        audit = None
        if me.local_rank == 0:
            audit = out / ("audit.jsonl" if me.rank == 0 else f"audit-{me.site}.jsonl")
            audit.unlink(missing_ok=True)
        aggregation = PrivateAggregation(p, comm, cfg.train.seed, planned, audit)
        sync.private = aggregation
    example = None
    max_steps = cfg.train.steps
    if p.dp.unit == "example":
        d = p.dp
        windows = data.train.tokens.numel() - cfg.model.block_size - 1
        # the largest sampling rate of any rank, so every rank stops at the same step
        q = global_max(min(1.0, cfg.train.batch_size / windows), groups.world)
        nm = d.noise_multiplier
        if nm is None:
            nm = calibrate_noise(d.epsilon or 0.0, d.delta, q, cfg.train.steps, d.accountant)
        accountant = Accountant(d.accountant, d.delta, d.epsilon)
        example = ExampleDP(model, d.clip_norm, nm, topo.workers_per_site, q, accountant)
        max_steps = accountant.max_steps(nm, q, cfg.train.steps) if nm > 0 else (0 if d.epsilon else cfg.train.steps)
        sync.example_dp = example
    return Privacy(p, aggregation, example, max_steps)
