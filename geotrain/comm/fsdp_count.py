"""FSDP2's own collectives, counted: the all-gathers and reduce-scatters ``fully_shard`` runs
inside a site go through these (``FSDPModule.set_custom_all_gather`` and
``set_custom_reduce_scatter``, FSDP2's public hooks for its communication), which add the bytes
this rank sends to ``CommStats.intra_bytes`` and then run the collective FSDP2 would run.

Bytes are counted as geotrain counts its own ring collectives: in an all-gather of ``n`` ranks a
rank sends its shard to each of the ``n − 1`` others' outputs, ``(n − 1) · shard``; in a
reduce-scatter it sends the ``n − 1`` chunks other ranks own, ``(n − 1) · output``. (The
classes have the shape of FSDP2's ``AllGather`` and ``ReduceScatter``, ``allocate`` and a call,
without subclassing them: torch exports those from a private module only.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from geotrain.comm.collectives import CommStats


class _Alloc:
    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class CountedAllGather(_Alloc):
    def __init__(self, stats: CommStats) -> None:
        self.stats = stats

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> Any:
        self.stats.intra_bytes += (group.size() - 1) * input_tensor.numel() * input_tensor.element_size()
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class CountedReduceScatter(_Alloc):
    def __init__(self, stats: CommStats) -> None:
        self.stats = stats

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, op: Any, async_op: bool = False
    ) -> Any:
        self.stats.intra_bytes += (group.size() - 1) * output_tensor.numel() * output_tensor.element_size()
        return dist.reduce_scatter_single(output=output_tensor, input=input_tensor, group=group, op=op, async_op=async_op)


def count_fsdp(module: Any, stats: CommStats) -> None:
    """Route ``module``'s (a ``fully_shard``-ed module's) all-gathers and reduce-scatters through the counters."""
    module.set_custom_all_gather(CountedAllGather(stats))
    module.set_custom_reduce_scatter(CountedReduceScatter(stats))
