"""The round: one engine (:mod:`.engine`) driving parts chosen independently from the config.

- :mod:`.schedule`: which fragment a slot of the cycle syncs (DiLoCo: one, the whole model);
- :mod:`.outer`: the global models, the outer step and the merge back into the local model;
- :mod:`.fixed`: the fixed world's rounds (every site in every round, no heal, no vote);
- :mod:`.engine`: the optimizer hooks that run the rounds, the end of the run, checkpoints.

:func:`build_round` is the one function that composes a run's round from its config.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from geotrain.comm.collectives import Collectives
from geotrain.comm.faults import FaultPlan
from geotrain.config import LivenessConfig, SyncConfig
from geotrain.round.engine import RoundEngine
from geotrain.round.fixed import FixedWorld
from geotrain.round.hub import Rejoin
from geotrain.sync import DDP, SyncAlgorithm
from geotrain.sync.base import GradientPrivatizer, PrivateAverage
from geotrain.sync.guard import UpdateGuard

__all__ = ["RoundEngine", "build_round"]


def build_round(
    cfg: SyncConfig,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    comm: Collectives,
    *,
    grad_clip: float,
    example_dp: GradientPrivatizer | None = None,
    private: PrivateAverage | None = None,
    guard: UpdateGuard | None = None,
    faults: FaultPlan | None = None,
    rejoin: Rejoin | None = None,
    elastic: bool = False,
    region: str = "",
    site_sizes: tuple[int, ...] = (),
    liveness: LivenessConfig | None = None,
) -> SyncAlgorithm:
    """The run's round, hooked onto ``optimizer``, from the ``sync`` section and the parts the
    composition root made (privacy, guard, failure injection, membership).

    Args:
        grad_clip: clip the averaged gradient's norm to this (0: off).
        example_dp: DP-SGD on the inner steps (any algorithm).
        private, guard: private aggregation and the update guard of the pseudo-gradients.
        faults: failure injection (:class:`~geotrain.comm.faults.FaultPlan`).
        rejoin: asynchronous quorum rounds, a site that came back (its world is its own ranks).
        elastic: elastic membership (attached when the site joins).
        region: this site's region (elastic rounds in two tiers).
        site_sizes: every site's workers, where this process's world is not the whole run (elastic mode).
        liveness: a hub's failure detection and wait bounds (default: liveness's defaults).
    """
    alg: SyncAlgorithm
    if cfg.algorithm == "ddp":
        alg = DDP(model, optimizer, comm, grad_clip, cfg.allreduce, cfg)
    else:
        faults = faults or FaultPlan()
        members = FixedWorld(comm, cfg, private, guard, faults)
        quorum = cfg.quorum is not None
        hub = quorum and not elastic  # a hub merges: it leaves non-finite updates out (the guard's test is collective)
        engine = RoundEngine(
            model, optimizer, comm, grad_clip, cfg, members, private=private,
            guard=None if hub else guard, delayed=quorum and elastic, region=region, hub=hub, rejoin=rejoin,
            site_sizes=site_sizes, heals=elastic, liveness=liveness,
        )  # fmt: skip
        guard = engine.guard
        engine.faults = faults
        if private is not None and engine.adapter is not None:  # sums of masked fixed-point values: H is all it can choose
            engine.adapter.codecs = ["none"]
        if guard is not None:
            guard.sharded = engine.sharded and not engine.resharded  # (resharded: it judges whole vectors)
        alg = engine
    alg.example_dp = example_dp
    return alg
