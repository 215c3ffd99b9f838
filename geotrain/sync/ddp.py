"""DDP: data parallel across every rank. Gradients are summed over all ranks every step
(hierarchically by default: reduce-scatter in site, all-reduce across sites, all-gather in site;
see :mod:`geotrain.comm.collectives`) and divided by the world size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from geotrain.comm.collectives import Collectives
from geotrain.config import SyncConfig
from geotrain.sync.base import SyncAlgorithm, flat_grads, write_grads
from geotrain.sync.reducer import SiteReducer


class DDP(SyncAlgorithm):
    """Average gradients over every rank, every step.

    Args:
        allreduce: 'hierarchical' (reduce-scatter in site, all-reduce across, all-gather in site)
            or 'flat' (one ring over all ranks).
        cfg: the sync section; its codec encodes the across-sites step (None: fp32).
    """

    name = "ddp"

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        comm: Collectives,
        grad_clip: float,
        allreduce: str = "hierarchical",
        cfg: SyncConfig | None = None,
    ) -> None:
        super().__init__(model, optimizer, comm, grad_clip)
        self.allreduce = allreduce
        self.world = comm.groups.topology.world_size
        self.num_sites = comm.groups.topology.num_sites
        shapes = [p.shape for p in self.local_params()]
        self.reducer = SiteReducer(cfg, comm, shapes, sharded=self.sharded) if cfg and cfg.codec.name != "none" else None

    def sync_gradients(self) -> None:
        if self.sharded:  # HSDP: FSDP averaged over the site; each rank averages its shard over sites
            self._noise_shards()  # (DP-SGD: each site's noised gradient, as with whole tensors)
            if self.num_sites > 1:
                flat = flat_grads(self.params)
                if self.reducer is None:
                    self.comm.all_reduce_across_sites(flat, sharded=True)
                else:
                    self.reducer(flat)
                flat.div_(self.num_sites)
                write_grads(self.params, flat)
            self._clip_sharded()
            return
        self._average_gradients(self.world, self._sum)

    def _sum(self, flat: torch.Tensor) -> None:
        r = self.reducer
        if r is None:
            self.comm.all_reduce(flat, self.allreduce)
        elif r.powersgd is not None:  # PowerSGD needs whole tensors: sum in site first
            self.comm.all_reduce_intra(flat)
            r(flat)
        else:
            self.comm.all_reduce(flat, self.allreduce, r.codec, r.residual)

    def after_step(self) -> None:
        super().after_step()
        self.rounds = self.local_steps  # every step is a global sync

    def state_dict(self) -> dict[str, Any]:
        return {"reducer": self.reducer_out(self.reducer)}

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        super().load_checkpoint_state(state)
        if self.reducer is not None:
            self.reducer.load_state_dict(self.reducer_in(state["reducer"]))
