"""Sync algorithms: wrap a model + inner optimizer so the training loop stays plain.

- :mod:`.base`: the optimizer hooks, flat-buffer helpers, interfaces of the parts an algorithm
  can be given (DP-SGD, private aggregation, elastic membership);
- :mod:`.reducer`: the codec-aware cross-site reducer (error feedback, PowerSGD);
- :mod:`.ddp`: data parallel over every rank;
- :mod:`.outer`: what DiLoCo and Streaming DiLoCo share (global parameters, outer step, rollback);
- :mod:`.diloco`: DiLoCo (Douillard et al. 2023);
- :mod:`.streaming`: Streaming DiLoCo (Douillard et al. 2025), its eager variant;
- :mod:`.guard`: non-finite / outlier pseudo-gradients left out, the same way on every rank.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from geotrain.comm.collectives import Collectives
from geotrain.config import SyncConfig
from geotrain.sync.base import SyncAlgorithm, params_hash
from geotrain.sync.ddp import DDP
from geotrain.sync.diloco import DiLoCo
from geotrain.sync.outer import OuterSync
from geotrain.sync.reducer import SiteReducer
from geotrain.sync.streaming import StreamingDiLoCo

__all__ = ["DDP", "DiLoCo", "OuterSync", "SiteReducer", "StreamingDiLoCo", "SyncAlgorithm", "build_sync", "params_hash"]


def build_sync(
    cfg: SyncConfig,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    comm: Collectives,
    *,
    grad_clip: float,
    tokens_per_step: int,
) -> SyncAlgorithm:
    """The algorithm ``cfg.algorithm`` with its settings from the ``sync`` config section."""
    if cfg.algorithm == "ddp":
        return DDP(model, optimizer, comm, grad_clip, cfg.allreduce, cfg)
    cls = StreamingDiLoCo if cfg.algorithm == "streaming" else DiLoCo
    return cls(model, optimizer, comm, grad_clip, cfg, tokens_per_step)
