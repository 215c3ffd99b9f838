"""Sync algorithms: wrap a model + inner optimizer so the training loop stays plain.

Each algorithm registers hooks on the inner optimizer (as torchft's DiLoCo does), so the loop
is only ``zero_grad -> backward -> step``:

* a *step pre-hook* averages gradients before the inner update;
* a *step post-hook* runs the outer synchronisation when one is due.

``DDP`` — data parallel across every rank: gradients are summed over all ranks every step
(hierarchically by default, see :mod:`geotrain.collectives`) and divided by the world size.

``DiLoCo`` — Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
Models", arXiv:2311.08105, Algorithm 1:

1. inner step: gradients are averaged inside the site only (fast links), then AdamW;
2. every H inner steps: pseudo-gradient Δ = θ_global − θ_local (fp32);
3. Δ is averaged across sites (optionally weighted by tokens processed);
4. the outer optimizer (SGD with Nesterov momentum, fp32 state) steps θ_global with Δ as its
   gradient;
5. θ_local ← θ_global, and the next round starts (the inner optimizer state is kept).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from types import TracebackType

import torch
import torch.nn as nn

from geotrain.collectives import Collectives
from geotrain.config import SyncConfig


def flat_grads(params: list[nn.Parameter]) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def views_like(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views into ``flat`` shaped like each tensor of ``like``, in order (the inverse of a cat)."""
    return [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in like]), like, strict=True)]


def write_grads(params: list[nn.Parameter], flat: torch.Tensor) -> None:
    for p, v in zip(params, views_like(flat, params), strict=True):
        if p.grad is None:
            p.grad = torch.empty_like(p)
        p.grad.copy_(v)


def clip_flat_(flat: torch.Tensor, max_norm: float) -> None:
    """Scale ``flat`` in place so its 2-norm is at most ``max_norm`` (0 disables), like clip_grad_norm_."""
    if max_norm > 0:
        norm = flat.norm()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        flat.mul_(coef)


def params_hash(tensors: list[torch.Tensor]) -> str:
    """sha256 of the fp32 bytes of ``tensors`` in order: equal hashes mean bit-identical models."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


class SyncAlgorithm:
    """Base class: owns the optimizer hooks. Use as a context manager or call :meth:`close`."""

    name = "base"

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm: Collectives, grad_clip: float) -> None:
        self.model = model
        self.optimizer = optimizer
        self.comm = comm
        self.grad_clip = grad_clip
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.local_steps = 0
        self.rounds = 0
        self._handles = [
            optimizer.register_step_pre_hook(lambda *_: self.sync_gradients()),
            optimizer.register_step_post_hook(lambda *_: self.after_step()),
        ]

    def sync_gradients(self) -> None:
        """Average gradients as the algorithm requires. Called by the optimizer before each step."""
        raise NotImplementedError

    def _average_gradients(self, members: int, reduce_sum: Callable[[torch.Tensor], None]) -> None:
        """Sum gradients with ``reduce_sum`` over ``members`` ranks, divide, clip the average."""
        if members == 1:  # nothing to exchange; keep the single-worker path as cheap as plain PyTorch
            if self.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
            return
        flat = flat_grads(self.params)
        reduce_sum(flat)
        flat.div_(members)
        clip_flat_(flat, self.grad_clip)
        write_grads(self.params, flat)

    def after_step(self) -> None:
        """Called by the optimizer after each inner step."""
        self.local_steps += 1

    def finish(self) -> None:
        """Bring the run to a consistent end (e.g. a last outer sync). Call once after the loop."""

    def global_parameters(self) -> list[torch.Tensor]:
        """The parameters every site agrees on (the model to evaluate and save)."""
        return [p.detach() for p in self.params]

    def global_hash(self) -> str:
        return params_hash(self.global_parameters())

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> SyncAlgorithm:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class DDP(SyncAlgorithm):
    """Average gradients over every rank, every step.

    Args:
        allreduce: 'hierarchical' (reduce-scatter in site, all-reduce across, all-gather in site)
            or 'flat' (one ring over all ranks).
    """

    name = "ddp"

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        comm: Collectives,
        grad_clip: float,
        allreduce: str = "hierarchical",
    ) -> None:
        super().__init__(model, optimizer, comm, grad_clip)
        self.allreduce = allreduce
        self.world = comm.groups.topology.world_size

    def sync_gradients(self) -> None:
        self._average_gradients(self.world, lambda flat: self.comm.all_reduce(flat, self.allreduce))

    def after_step(self) -> None:
        super().after_step()
        self.rounds = self.local_steps  # every step is a global sync


class DiLoCo(SyncAlgorithm):
    """DiLoCo across sites, synchronous data parallel inside a site.

    Args:
        H: inner steps per outer round.
        outer_lr, outer_momentum, nesterov: outer SGD (paper: 0.7, 0.9, Nesterov).
        tokens_per_step: tokens this site processes per inner step (for token weighting).
        weight_by_tokens: weight each site's pseudo-gradient by its tokens in the round.
    """

    name = "diloco"

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        comm: Collectives,
        grad_clip: float,
        H: int,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        weight_by_tokens: bool = False,
        tokens_per_step: int = 1,
    ) -> None:
        super().__init__(model, optimizer, comm, grad_clip)
        self.H = H
        self.weight_by_tokens = weight_by_tokens
        self.tokens_per_step = tokens_per_step
        topo = comm.groups.topology
        self.num_sites = topo.num_sites
        self.workers_per_site = topo.workers_per_site
        # fp32 outer state, whatever the model's dtype
        self.global_params = [p.detach().clone().to(torch.float32) for p in self.params]
        self.outer_optimizer = torch.optim.SGD(self.global_params, lr=outer_lr, momentum=outer_momentum, nesterov=nesterov)
        self._steps_in_round = 0

    def sync_gradients(self) -> None:
        self._average_gradients(self.workers_per_site, self.comm.all_reduce_intra)

    def after_step(self) -> None:
        super().after_step()
        self._steps_in_round += 1
        if self._steps_in_round == self.H:
            self.outer_step()

    def finish(self) -> None:
        if self._steps_in_round:  # a last, shorter round so every site ends on the global model
            self.outer_step()

    @torch.no_grad()
    def outer_step(self) -> None:
        """Steps 2-5 of DiLoCo: average pseudo-gradients across sites and apply the outer optimizer."""
        # 2. pseudo-gradient, fp32
        delta = torch.cat([(g - p.to(torch.float32)).reshape(-1) for g, p in zip(self.global_params, self.params, strict=True)])
        # 3. average across sites (every local rank carries 1/G of it over the WAN)
        if self.num_sites > 1:
            if self.weight_by_tokens:
                mine = float(self._steps_in_round * self.tokens_per_step)
                total = torch.tensor([mine], dtype=torch.float64)
                self.comm.all_reduce_across_sites(total)
                delta.mul_(mine / float(total.item()))
                self.comm.all_reduce_across_sites(delta)
            else:
                self.comm.all_reduce_across_sites(delta)
                delta.div_(self.num_sites)
        # 4. outer optimizer step with Δ as the gradient
        for g, v in zip(self.global_params, views_like(delta, self.global_params), strict=True):
            g.grad = v
        self.outer_optimizer.step()
        self.outer_optimizer.zero_grad(set_to_none=True)
        # 5. local ← global
        for g, p in zip(self.global_params, self.params, strict=True):
            p.copy_(g)
        self._steps_in_round = 0
        self.rounds += 1

    def global_parameters(self) -> list[torch.Tensor]:
        return self.global_params


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
        return DDP(model, optimizer, comm, grad_clip, cfg.allreduce)
    return DiLoCo(
        model,
        optimizer,
        comm,
        grad_clip,
        cfg.H,
        cfg.outer_lr,
        cfg.outer_momentum,
        cfg.nesterov,
        cfg.weight_by_tokens,
        tokens_per_step,
    )
