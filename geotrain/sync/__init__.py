"""Sync algorithms: wrap a model + inner optimizer so the training loop stays plain.

- :mod:`.base`: the optimizer hooks, flat-buffer helpers, interfaces of the parts an algorithm
  can be given (DP-SGD, private aggregation, elastic membership);
- :mod:`.reducer`: the codec-aware cross-site reducer (error feedback, PowerSGD);
- :mod:`.ddp`: data parallel over every rank;
- :mod:`.outer`: what DiLoCo and Streaming DiLoCo share (global parameters, outer step, rollback);
- :mod:`.diloco`: DiLoCo (Douillard et al. 2023);
- :mod:`.streaming`: Streaming DiLoCo (Douillard et al. 2025), its eager variant;
- :mod:`.streaming_elastic`: Streaming DiLoCo whose fragment syncs are elastic rounds;
- :mod:`.streaming_paced`: Streaming DiLoCo whose fragment syncs end the slots of the pace clock;
- :mod:`.streaming_tiers`: Streaming DiLoCo in two tiers (each fragment's syncs in its region, some across regions);
- :mod:`.tiers` and :mod:`.tiers_elastic`: DiLoCo in two tiers (region rounds, rarer world rounds), lock-step or elastic;
- :mod:`.quorum`: asynchronous quorum rounds (a syncer; late updates merged with a staleness discount);
- :mod:`.guard`: non-finite / outlier pseudo-gradients left out, the same way on every rank.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from geotrain.comm.collectives import Collectives
from geotrain.comm.faults import FaultPlan
from geotrain.config import SyncConfig
from geotrain.sync.base import GradientPrivatizer, PrivateAverage, SyncAlgorithm, params_hash
from geotrain.sync.ddp import DDP
from geotrain.sync.diloco import DiLoCo
from geotrain.sync.guard import UpdateGuard
from geotrain.sync.outer import OuterSync
from geotrain.sync.quorum import AsyncDiLoCo, Rejoin
from geotrain.sync.quorum_elastic import ElasticQuorum
from geotrain.sync.quorum_streaming import AsyncStreaming
from geotrain.sync.reducer import SiteReducer
from geotrain.sync.streaming import StreamingDiLoCo, fragment_count
from geotrain.sync.streaming_elastic import ElasticStreaming
from geotrain.sync.streaming_paced import PacedStreaming
from geotrain.sync.streaming_tiers import TieredStreaming
from geotrain.sync.tiers import TieredDiLoCo
from geotrain.sync.tiers_elastic import ElasticTiers

__all__ = [
    "AsyncDiLoCo",
    "DDP",
    "DiLoCo",
    "ElasticQuorum",
    "ElasticTiers",
    "OuterSync",
    "Rejoin",
    "SiteReducer",
    "StreamingDiLoCo",
    "SyncAlgorithm",
    "TieredDiLoCo",
    "UpdateGuard",
    "build_sync",
    "fragment_count",
    "params_hash",
]


def build_sync(
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
    timed: bool = False,
    region: str = "",
) -> SyncAlgorithm:
    """The algorithm ``cfg.algorithm`` with its settings from the ``sync`` config section, hooked
    onto ``optimizer``.

    Args:
        grad_clip: clip the averaged gradient's norm to this (0: off).
        example_dp: DP-SGD on the inner steps (any algorithm).
        private, guard: for the pseudo-gradients of DiLoCo and Streaming DiLoCo: private
            aggregation and the update guard.
        faults: failure injection (:class:`~geotrain.comm.faults.FaultPlan`: NaN updates).
        rejoin: asynchronous quorum rounds, a site that came back (its world is its own ranks).
        elastic: elastic mode (its membership is attached later, when the site joins).
        timed: the run ends on ``train.max_seconds`` (Streaming DiLoCo then agrees on time at each slot's end).
        region: this site's region (elastic rounds in two tiers: what a heal's state is compared with).
    """
    alg: SyncAlgorithm
    if cfg.algorithm == "ddp":
        alg = DDP(model, optimizer, comm, grad_clip, cfg.allreduce, cfg)
    else:
        outer: OuterSync
        if cfg.algorithm == "streaming":
            if elastic:
                outer = ElasticStreaming(model, optimizer, comm, grad_clip, cfg)
            elif cfg.quorum is not None:  # each fragment's sync a quorum delivery
                outer = AsyncStreaming(model, optimizer, comm, grad_clip, cfg, rejoin)
            elif cfg.region_every:
                outer = TieredStreaming(model, optimizer, comm, grad_clip, cfg)
            elif cfg.pace == "adaptive" or timed:  # slots of the clock (budgeted, or timed at lock-step)
                outer = PacedStreaming(model, optimizer, comm, grad_clip, cfg, adaptive=cfg.pace == "adaptive")
            else:
                outer = StreamingDiLoCo(model, optimizer, comm, grad_clip, cfg)
        elif cfg.quorum is not None and elastic:  # quorum rounds as elastic rounds: no syncer
            outer = ElasticQuorum(model, optimizer, comm, grad_clip, cfg)
        elif cfg.quorum is not None:  # (in two tiers too: a syncer per region, world rounds among them)
            outer = AsyncDiLoCo(model, optimizer, comm, grad_clip, cfg, rejoin)
        elif cfg.region_every:  # (elastic: both tiers' rounds are elastic rounds)
            if elastic:
                outer = ElasticTiers(model, optimizer, comm, grad_clip, cfg, region)
            else:
                outer = TieredDiLoCo(model, optimizer, comm, grad_clip, cfg)
        else:
            outer = DiLoCo(model, optimizer, comm, grad_clip, cfg)
        if cfg.quorum is not None and not elastic:  # the guard's outlier test is collective; the syncer leaves non-finite out
            guard = None
        outer.private, outer.guard = private, guard
        if faults is not None:
            outer.faults = faults
        adapter = getattr(outer, "adapter", None)
        if private is not None and adapter is not None:  # sums of masked fixed-point values: H is all it can choose
            adapter.codecs = ["none"]
        if guard is not None:
            guard.sharded = outer.sharded and not outer.resharded  # (resharded: it judges whole vectors)
        alg = outer
    alg.example_dp = example_dp
    return alg
