"""DP-SGD on a model FSDP shards inside a site (``privacy.dp.unit=example`` with
``sync.within_site=fsdp``): per-example gradient norms without per-example gradients.

Per-example gradients (Opacus's ``GradSampleModule``, :class:`geotrain.privacy.dp.ExampleDP`)
hold ``batch`` copies of every parameter's gradient, and FSDP's reduce-scatter averages a
gradient over the site's ranks before any rank could clip one example's. Opacus's own FSDP path
(ghost clipping) refuses tied parameters, and geotrain's GPT ties its head to the token
embedding. So this module computes each example's gradient norm from what a layer sees in
forward and backward ("ghost norms", Li et al. 2022, arXiv:2110.05679; Bu et al. 2023):

* ``nn.Linear`` with input ``a`` ``[T, in]`` and output gradient ``g`` ``[T, out]`` (per example):
  ‖gᵀa‖² = Σ_{t,s} ⟨a_t,a_s⟩⟨g_t,g_s⟩ (or the per-example matrix itself, whichever is smaller);
  bias ‖Σ_t g_t‖²;
* ``nn.Embedding`` with token ids ``x`` and output gradient ``e``: Σ_{t,s: x_t = x_s} ⟨e_t,e_s⟩
  (learned positions, looked up per example, are the same formula with distinct ids);
* ``nn.LayerNorm``: its per-example gradients directly, Σ_t g_t ⊙ x̂_t and Σ_t g_t;
* a head tied to the token embedding (``W`` used by both): the two uses' norms plus twice
  their inner product, 2 Σ_t Σ_s dlogits_s[x_t] ⟨h_s, e_t⟩ (``h``: the head's input).

One step (:meth:`GhostClipping.backward`) is two passes over the same batch with the same random
state (dropout draws alike): the first takes the gradient of the loss down to the embeddings'
outputs only (no parameter gradient, so FSDP reduces nothing) while the hooks sum each example's
squared norm; the second is the usual forward and backward, with the gradient of the logits of
example i scaled by c_i = min(1, C/‖g_i‖), so every parameter's gradient is Σ_i c_i g_i / b and
FSDP's reduce-scatter averages it over the site's G ranks. Each rank then adds Gaussian noise of
standard deviation σC/(G·b) to its own shard (:meth:`noise_shards`): the shards partition every
parameter, so each coordinate carries N(0, σ²C²)/(G·b), as in the replicated path (G shares of
σC/√G, summed and divided by G·b). The cost is a second forward and backward per step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from geotrain.privacy.dp import Accountant, PerExampleDP, gaussian_noise

SUPPORTED = (nn.Linear, nn.Embedding, nn.LayerNorm)


def _per_example(t: torch.Tensor, batch: int) -> torch.Tensor:
    """``t`` as ``[batch, positions, features]`` in fp32."""
    return t.float().reshape(batch, -1, t.shape[-1])


def linear_sq(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Each example's ‖Σ_t g_t a_tᵀ‖² from ``a`` ``[b, T, in]`` and ``g`` ``[b, T, out]``."""
    t, n_in, n_out = a.shape[1], a.shape[2], g.shape[2]
    if 2 * t * t <= n_in * n_out:  # the ghost norm: two T×T Gram matrices
        return ((a @ a.transpose(1, 2)) * (g @ g.transpose(1, 2))).sum((1, 2))
    return (g.transpose(1, 2) @ a).pow(2).sum((1, 2))


def embedding_sq(ids: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """Each example's squared gradient norm of an embedding table: rows add up over equal ids."""
    same = ids.unsqueeze(2) == ids.unsqueeze(1)
    return ((e @ e.transpose(1, 2)) * same).sum((1, 2))


def tied_cross(ids: torch.Tensor, e: torch.Tensor, h: torch.Tensor, dlogits: torch.Tensor) -> torch.Tensor:
    """Each example's ⟨head's gradient, embedding's gradient⟩ of one tied table:
    Σ_t Σ_s dlogits_s[ids_t] ⟨h_s, e_t⟩."""
    b, t = ids.shape
    picked = torch.gather(dlogits, 2, ids.unsqueeze(1).expand(b, dlogits.shape[1], t))  # [b, s, t]
    return (picked * (h @ e.transpose(1, 2))).sum((1, 2))


class GhostClipping(PerExampleDP):
    """DP-SGD for a sharded model: per-example clipping by ghost norms, noise on each shard.

    Raises:
        ValueError: the model holds parameters in a layer whose per-example norm is not known here,
            shares a parameter other than an embedding with a head, or has no embedding to start from.
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
        super().__init__(model, clip_norm, noise_multiplier, workers_per_site, sample_rate, accountant)
        owners: dict[int, list[nn.Module]] = {}
        for m in model.modules():
            own = [p for p in m.parameters(recurse=False) if p.requires_grad]
            if not own:
                continue
            if not isinstance(m, SUPPORTED):
                raise ValueError(
                    f"privacy.dp.unit: example-level DP under sync.within_site=fsdp computes per-example norms of "
                    f"Linear, Embedding and LayerNorm layers, not {type(m).__name__}; use sync.within_site=replicate"
                )
            for p in own:
                owners.setdefault(id(p), []).append(m)
            m.register_forward_hook(self._forward)
        self.tied: tuple[nn.Embedding, nn.Linear] | None = None
        for shared in (o for o in owners.values() if len(o) > 1):
            emb = [m for m in shared if isinstance(m, nn.Embedding)]
            head = [m for m in shared if isinstance(m, nn.Linear)]
            if len(shared) != 2 or len(emb) != 1 or len(head) != 1 or self.tied is not None:
                raise ValueError(
                    "privacy.dp.unit: example-level DP under sync.within_site=fsdp knows one tied pair (a head "
                    "tied to the token embedding); use sync.within_site=replicate"
                )
            self.tied = (emb[0], head[0])
        self._mode = ""  # "norms" (pass 1), "scale" (pass 2) or "" (evaluation: hooks do nothing)
        self._leaves: list[torch.Tensor] = []  # the embeddings' outputs: where pass 1 stops
        self._last: nn.Module | None = None  # the last layer of forward (the logits'): pass 2 scales there
        self._sq = torch.zeros(0)
        self._saved: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}  # the tied pair's (input, grad)
        self._factor = torch.zeros(0)
        self.batch = 0

    def _forward(self, m: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
        if not self._mode or not isinstance(out, torch.Tensor) or not out.requires_grad:
            return None
        if self._mode == "scale":
            if m is self._last:
                factor = self._factor
                out.register_hook(lambda g: g * factor.to(g.dtype).view(-1, *([1] * (g.dim() - 1))))
            return None
        x = args[0]
        if self.batch < 0:  # the first layer of the forward: the batch
            self.batch, self._sq = x.shape[0], torch.zeros(x.shape[0], device=x.device)
        if x.shape[0] != self.batch:
            raise ValueError(
                f"privacy.dp.unit: {type(m).__name__}'s input is not batched per example ({tuple(x.shape)}); "
                "example-level DP under sync.within_site=fsdp needs every layer's input to start with the batch"
            )
        self._last = m
        if isinstance(m, nn.Embedding):
            self._leaves.append(out)
        x = x.detach()
        out.register_hook(lambda g: self._norm(m, x, g))
        return None

    @torch.no_grad()
    def _norm(self, m: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> None:
        b = self.batch
        g = _per_example(grad, b)
        if isinstance(m, nn.Embedding):
            ids = x.reshape(b, -1)
            sq = embedding_sq(ids, g)
        elif isinstance(m, nn.Linear):
            a = _per_example(x, b)
            sq = linear_sq(a, g)
            if m.bias is not None and m.bias.requires_grad:
                sq = sq + g.sum(1).pow(2).sum(1)
        else:  # LayerNorm
            assert isinstance(m, nn.LayerNorm)
            xhat = _per_example(F.layer_norm(x.float(), m.normalized_shape, eps=m.eps), b)
            sq = (g * xhat).sum(1).pow(2).sum(1) if m.weight is not None else torch.zeros(b)
            if m.bias is not None:
                sq = sq + g.sum(1).pow(2).sum(1)
        self._sq += sq
        if self.tied is not None and m in self.tied:
            self._saved[m] = (x.reshape(b, -1) if isinstance(m, nn.Embedding) else _per_example(x, b), g)

    def backward(self, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """One step's forward and backward on the model's batch: ``compute()`` runs the forward and
        returns the mean loss over the batch (its examples weigh alike). Leaves each parameter's
        gradient as Σ_i c_i g_i / b; returns the loss."""
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):  # pass 2 draws the same dropout as pass 1
            self._mode, self._leaves, self._saved, self._last = "norms", [], {}, None
            try:
                self._first(compute)
            finally:
                self._mode = ""
        b = self.batch
        sq = self._sq
        if self.tied is not None and len(self._saved) == 2:
            (ids, e), (h, dlogits) = self._saved[self.tied[0]], self._saved[self.tied[1]]
            sq = sq + 2 * tied_cross(ids, e, h, dlogits)
        self._saved = {}
        norms = sq.clamp(min=0).sqrt() * b  # the loss is a mean over the batch: each example's gradient / b
        self._factor = (self.clip_norm / (norms + 1e-6)).clamp(max=1.0)
        self._mode = "scale"
        try:
            loss = compute()
            loss.backward()
        finally:
            self._mode = ""
        return loss.detach()

    def _first(self, compute: Callable[[], torch.Tensor]) -> None:
        """Pass 1: the forward, then the loss's gradient down to the embeddings' outputs (the hooks
        sum each example's squared norm on the way)."""
        self.batch = -1
        loss = compute()
        if not self._leaves:
            raise ValueError(
                "privacy.dp.unit: example-level DP under sync.within_site=fsdp needs a model that starts with an embedding"
            )
        torch.autograd.grad(loss, self._leaves)

    @torch.no_grad()
    def noise_shards(self, grads: list[torch.Tensor]) -> None:
        """Add this rank's noise to its shards of the site-averaged gradient, once per step."""
        if self.noise_multiplier > 0:
            std = self.noise_multiplier * self.clip_norm / (self.workers * self.batch)
            for g in grads:
                g.add_(gaussian_noise(self.gen, g, std).to(g.dtype))
        self.spend()
