"""What every round and DDP share, below the round engine (:mod:`geotrain.round`).

- :mod:`.base`: the optimizer hooks, flat-buffer and layout helpers, and the interfaces of the
  parts a round can be given (DP-SGD, private aggregation, elastic membership);
- :mod:`.reducer`: the codec-aware cross-site reducer (error feedback, PowerSGD);
- :mod:`.ddp`: data parallel over every rank;
- :mod:`.guard`: non-finite / outlier pseudo-gradients left out, the same way on every rank.
"""

from __future__ import annotations

from geotrain.sync.base import GradientPrivatizer, PrivateAverage, SyncAlgorithm, params_hash
from geotrain.sync.ddp import DDP
from geotrain.sync.guard import UpdateGuard
from geotrain.sync.reducer import SiteReducer

__all__ = ["DDP", "GradientPrivatizer", "PrivateAverage", "SiteReducer", "SyncAlgorithm", "UpdateGuard", "params_hash"]
