"""A rank's privacy machinery for one run, built from the privacy section: what the training
loop (the ε budget stop), the sync algorithm (private aggregation, DP-SGD) and the summary need.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from geotrain.comm.collectives import Collectives
from geotrain.comm.faults import FaultPlan
from geotrain.comm.groups import is_dtensor
from geotrain.config import PrivacyConfig
from geotrain.privacy.aggregation import PrivateAggregation
from geotrain.privacy.audit import AuditChain, site_key
from geotrain.privacy.dp import Accountant, ExampleDP, PerExampleDP, RoundNoise, calibrate_noise
from geotrain.privacy.ghost import GhostClipping


def global_max(value: float, group: dist.ProcessGroup) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


class Privacy:
    """A rank's privacy machinery for one run: what the training loop and the summary need."""

    def __init__(
        self,
        cfg: PrivacyConfig,
        aggregation: PrivateAggregation | None,
        example: PerExampleDP | None,
        max_steps: int,
        round_noise: RoundNoise | None = None,
    ) -> None:
        self.cfg = cfg
        self.aggregation = aggregation
        self.round_noise = round_noise  # site-level DP inside elastic rounds (the member adds it)
        self.example = example
        self.max_steps = max_steps  # the ε budget allows this many inner steps (example unit)
        self.stopped_at: int | None = None
        self.stop_reason = ""

    def backward(self, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """One micro-batch's forward (``compute``: its loss) and backward; the loss, detached.
        Under DP-SGD of a sharded model: two passes, the gradients clipped per example."""
        if self.example is not None:
            return self.example.backward(compute)
        loss = compute()
        loss.backward()
        return loss.detach()

    @property
    def active(self) -> bool:
        return self.aggregation is not None or self.example is not None or self.round_noise is not None

    def accountant(self) -> Accountant | None:
        if self.example is not None:
            return self.example.accountant
        if self.round_noise is not None:
            return self.round_noise.accountant
        return self.aggregation.accountant if self.aggregation is not None else None

    def epsilon(self) -> float | None:
        acc = self.accountant()
        return acc.epsilon() if acc is not None else None

    def accountant_state(self) -> dict[str, Any] | None:
        acc = self.accountant()
        return None if acc is None else acc.state_dict()

    def load_accountant_state(self, state: dict[str, Any] | None) -> None:
        acc = self.accountant()
        if acc is not None and state is not None:
            acc.load_state_dict(state)

    def begin(self, resumed_at: int) -> str:
        """Start the audit log: fresh, or carried on after a resume from step ``resumed_at``; what
        was done, for the run's log ('' without one)."""
        audit = self.aggregation.audit if self.aggregation is not None else None
        if audit is None:
            return ""
        audit.begin(resumed_at)
        return audit.note

    def close(self, failure: BaseException | None = None) -> None:
        """Close the audit log: the run ended, normally or with ``failure`` (its closing line says
        which). Only the first call writes."""
        if self.aggregation is not None:
            self.aggregation.close_audit(failure)

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
        if self.round_noise is not None:
            out.update(noise_multiplier=self.round_noise.noise_multiplier, clip_norm=self.round_noise.clip)
        if self.example is not None:
            out.update(
                noise_multiplier=self.example.noise_multiplier,
                clip_norm=self.example.clip_norm,
                sample_rate=self.example.sample_rate,
            )
        return out


def keys_dir(cfg: PrivacyConfig) -> Path:
    """Where the sites' audit signing keys live: ``privacy.keys_dir``, ``$GEOTRAIN_KEYS_DIR``, or
    ``~/.geotrain/keys`` (outside any run's output folder)."""
    return Path(cfg.keys_dir or os.environ.get("GEOTRAIN_KEYS_DIR") or Path.home() / ".geotrain" / "keys").expanduser()


def build_privacy(
    cfg: PrivacyConfig,
    comm: Collectives,
    model: nn.Module,
    out: Path,
    *,
    seed: int,
    steps: int,
    rounds_planned: int,
    sample_rate: float,
    run_id: str | None = None,
    elastic: bool = False,
    faults: FaultPlan | None = None,
    min_sites: int = 1,
) -> Privacy:
    """The privacy machinery ``cfg`` asks for on this rank (nothing when privacy is off).

    Args:
        comm: this rank's collectives (secure aggregation runs over them).
        model: wrapped for per-example gradients when ``cfg.dp.unit == 'example'``.
        out: the run directory (the audit logs go there; the sites' signing keys in :func:`keys_dir`).
        seed: the run's public seed (the SecAgg+ graph of each round derives from it).
        steps: inner steps planned; ``rounds_planned``: cross-site aggregations planned.
        sample_rate: this rank's sampling rate (batch ÷ windows of its shard); the largest over
            all ranks is used, so every rank stops at the same step.
        run_id: the run's public id (from its secret), named in the audit logs.
        elastic: elastic mode, whose rounds mask their own parts (:class:`geotrain.privacy.masking.PairMasks`,
            given to the member) and add site-level DP noise (:class:`RoundNoise`): no aggregation
            over the fixed world here.
        min_sites: elastic mode, the fewest sites a round may hold (site-level DP's noise is split among them).
        faults: failure injection (a site that drops out of a secure-aggregation round, ``privacy.inject``).
    """
    groups = comm.groups
    aggregation = None
    if (cfg.secure_aggregation or cfg.dp.unit == "site") and not elastic:
        me = groups.me
        audit = None
        nonce = torch.tensor(list(os.urandom(16)) if me.rank == 0 else [0] * 16, dtype=torch.uint8)
        dist.broadcast(nonce, src=0, group=groups.world)  # the run's nonce, in every site's genesis line
        if me.local_rank == 0:  # each site signs its own log with its own key; begun once resume is known
            path = out / ("audit.jsonl" if me.rank == 0 else f"audit-{me.site}.jsonl")
            key = site_key(keys_dir(cfg) / f"{me.site}.key")
            audit = AuditChain(path, key, me.site, run_id, bytes(nonce.tolist()).hex(), start=False)
        aggregation = PrivateAggregation(cfg, comm, seed, rounds_planned, audit, faults)
    round_noise = None
    if elastic and cfg.dp.unit == "site":
        d = cfg.dp
        nm = d.noise_multiplier
        if nm is None:  # the run's planned rounds, each one step of the accountant
            nm = calibrate_noise(d.epsilon or 0.0, d.delta, 1.0, rounds_planned, d.accountant)
        round_noise = RoundNoise(d.clip_norm, nm, min_sites, Accountant(d.accountant, d.delta, d.epsilon))
    example = None
    max_steps = steps
    if cfg.dp.unit == "example":
        d = cfg.dp
        q = global_max(min(1.0, sample_rate), groups.world)
        nm = d.noise_multiplier
        if nm is None:
            nm = calibrate_noise(d.epsilon or 0.0, d.delta, q, steps, d.accountant)
        accountant = Accountant(d.accountant, d.delta, d.epsilon)
        workers = groups.topology.workers[groups.me.site_index]
        sharded = any(is_dtensor(p) for p in model.parameters())  # sync.within_site=fsdp: ghost norms
        example = (GhostClipping if sharded else ExampleDP)(model, d.clip_norm, nm, workers, q, accountant)
        max_steps = accountant.max_steps(nm, q, steps) if nm > 0 else (0 if d.epsilon else steps)
    return Privacy(cfg, aggregation, example, max_steps, round_noise)
