"""Differential privacy: Opacus accountants, noise calibration, and DP-SGD on the inner steps.

Two units (``privacy.dp.unit``):

* ``site`` — each site clips its pseudo-gradient to ``clip_norm`` and adds Gaussian noise of
  std ``σ·C/√N`` (N sites), so the sum of the N shares carries N(0, σ²C²): *distributed noise*
  (applied by :mod:`geotrain.privacy.aggregation`). Combined with secure aggregation no one sees
  a site's update un-noised; on its own, the noise each site adds is only 1/√N of what protects
  it. It protects the participation of a whole site (organisation) in the global model; with few
  sites σ must be large and the model suffers — it is meaningful with many sites.
* ``example`` — DP-SGD inside each site (:class:`ExampleDP`): per-example gradients (Opacus
  ``GradSampleModule``), each clipped to ``clip_norm``, summed, plus N(0, σ²C²) split over the
  site's workers. It protects each record of a site's data, also with few sites; it says nothing
  about what the site's aggregate reveals beyond that.

ε is tracked with Opacus's RDP or PRV accountant for the configured δ (site unit: one step per
aggregation with sampling rate 1 and the noise actually present, which shrinks when sites drop
out; example unit: one step per inner step with the rank's sampling rate). Training stops
before a step would exceed ``epsilon``.

Noise is drawn from torch's generator seeded from ``os.urandom`` — not a cryptographically
secure generator (Opacus's secure mode needs torchcsprng, which is not packaged here).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn


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

    def state_dict(self) -> dict[str, Any]:
        """The accountant's history (what a checkpoint carries)."""
        return {"history": [list(h) for h in self._acc.history], "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._acc.history = [tuple(h) for h in state["history"]]
        self.steps = state["steps"]

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


def gaussian_noise(gen: torch.Generator, like: torch.Tensor, std: float) -> torch.Tensor:
    return torch.randn(like.shape, generator=gen, dtype=torch.float32) * std


def secure_generator() -> torch.Generator:
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))


class PerExampleDP:
    """What both DP-SGD paths share: the bound, the noise, the site's workers, the sampling rate,
    the generator and the accountant (one step per privatized gradient), and a model that looks
    its positions up per example. :class:`ExampleDP` noises whole tensors, :class:`GhostClipping`
    (:mod:`geotrain.privacy.ghost`) FSDP shards."""

    def __init__(
        self,
        model: nn.Module,
        clip_norm: float,
        noise_multiplier: float,
        workers_per_site: int,
        sample_rate: float = 1.0,
        accountant: Accountant | None = None,
    ) -> None:
        if hasattr(model, "batched_positions"):
            model.batched_positions = True  # type: ignore[assignment]  # per-example gradients need a batch dimension everywhere
        self.clip_norm, self.noise_multiplier, self.workers = clip_norm, noise_multiplier, workers_per_site
        self.sample_rate, self.accountant = sample_rate, accountant
        self.gen = secure_generator()

    def spend(self) -> None:
        """One privatized gradient: one step of the accountant."""
        if self.accountant is not None:
            self.accountant.step(self.noise_multiplier, self.sample_rate)

    def backward(self, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """One forward and backward; the loss."""
        loss = compute()
        loss.backward()
        return loss.detach()

    def privatize(self) -> torch.Tensor:
        raise TypeError(f"{type(self).__name__} keeps no per-example gradients of whole tensors (see noise_shards)")

    def noise_shards(self, grads: list[torch.Tensor]) -> None:
        raise TypeError(f"{type(self).__name__} noises whole tensors' gradients, not FSDP shards (see privatize)")


class ExampleDP(PerExampleDP):
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

        super().__init__(model, clip_norm, noise_multiplier, workers_per_site, sample_rate, accountant)
        # Opacus's hooks fire on the first layer, whose input (token ids) needs no gradient: harmless
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.module = GradSampleModule(model, loss_reduction="mean")
        self.params = [p for p in model.parameters() if p.requires_grad]

    @torch.no_grad()
    def privatize(self) -> torch.Tensor:
        samples = [p.grad_sample for p in self.params]  # type: ignore[attr-defined]
        batch = samples[0].shape[0]
        flat = torch.cat([s.reshape(batch, -1) for s in samples], dim=1)
        norms = flat.norm(dim=1)
        factor = (self.clip_norm / (norms + 1e-6)).clamp(max=1.0)
        total = factor @ flat
        if self.noise_multiplier > 0:
            total.add_(gaussian_noise(self.gen, total, self.noise_multiplier * self.clip_norm / math.sqrt(self.workers)))
        for p in self.params:
            p.grad_sample = None  # type: ignore[attr-defined]
        self.spend()
        return total.div_(batch)


class RoundNoise:
    """Site-level DP inside elastic rounds (``privacy.dp.unit=site`` with ``elastic.enabled``):
    each site clips its whole update to ``clip`` and adds Gaussian noise of standard deviation
    z · clip / √m, where m is the fewest sites a round may hold (``elastic.min_sites``, 3 with
    secure aggregation): a round of k ≥ m sites then carries at least z · clip in its sum, as the
    lock-step mode's k sites do. Each round this site sends a noised update is one step of the
    accountant (rolled-back rounds included: their sum may have been formed). A restarted site has
    lost its own count; it counts at least the run's committed rounds it healed into
    (:meth:`at_least`), each of which held at most one update of its.
    """

    def __init__(self, clip: float, noise_multiplier: float, min_sites: int, accountant: Accountant) -> None:
        self.clip, self.noise_multiplier = clip, noise_multiplier
        self.std = noise_multiplier * clip / math.sqrt(max(1, min_sites))
        self.accountant = accountant
        self.gen = secure_generator()

    def clip_scale(self, norm: float) -> float:
        """The factor that clips an update of L2 norm ``norm`` to the bound."""
        return min(1.0, self.clip / norm) if norm > 0 else 1.0

    def privatize_(self, part: torch.Tensor, scale: float) -> None:
        """This rank's ``part`` of the site's update, clipped by ``scale`` and noised (each part once)."""
        part.mul_(scale).add_(gaussian_noise(self.gen, part, self.std))

    def spend(self) -> None:
        """This site sent a noised update in a round."""
        self.accountant.step(self.noise_multiplier, 1.0)

    def at_least(self, rounds: int) -> None:
        """After a heal: count at least ``rounds`` rounds (the run's committed ones)."""
        while self.accountant.steps < rounds:
            self.spend()

    def affords(self) -> bool:
        """Whether one more noised update fits the ε budget (always, without one)."""
        return self.accountant.fits(self.noise_multiplier, 1.0)
