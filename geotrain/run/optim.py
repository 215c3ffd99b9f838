"""The inner optimizer and its learning-rate schedule, from the optim section.

AdamW (DiLoCo paper: lr 4e-4, weight decay 0.1, betas 0.9/0.95), SGD, or Muon for the hidden
weight matrices with AdamW for the rest (MuLoCo, arXiv 2505.23725: embeddings, the output head,
norms and biases stay on AdamW, as Muon's authors advise). Muon's step is scaled to AdamW's update
RMS (``adjust_lr_fn="match_rms_adamw"``), so one learning rate and schedule serve both. Linear
warm-up, then constant or cosine decay to 10% at the last step. Weight decay applies to matrices
(weights of linear layers, embedding tables) only, never to norms' gains or biases (as nanoGPT
and torchtitan do): decaying a LayerNorm's gain toward 0 only fights the normalisation.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.optim._muon as _muon

from geotrain.config import OptimConfig


def build_optimizer(
    cfg: OptimConfig, model: nn.Module, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The inner optimizer over ``model``'s trainable parameters and its schedule over ``total_steps``."""
    groups = decay_groups([p for p in model.parameters() if p.requires_grad], cfg.weight_decay)
    opt: torch.optim.Optimizer
    if cfg.name == "adamw":
        opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]))
    elif cfg.name == "muon":
        opt = MuonAdamW(model, cfg)
    else:
        opt = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)

    def factor(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def decay_groups(params: list[nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """Param groups: the matrices (2-D and up) with ``weight_decay``, the rest (norm gains,
    biases) without; an empty group is left out."""
    matrices = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def muon_split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's, AdamW's) trainable parameters: Muon takes every 2-D weight except embedding tables
    and the output head (``*head.weight``, or tied to an embedding); AdamW takes the rest."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    muon, adamw = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.dim() == 2 and id(p) not in embeddings and not name.endswith("head.weight"):
            muon.append(p)
        else:
            adamw.append(p)
    return muon, adamw


class MuonAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` over :func:`muon_split`'s matrices and AdamW over the rest, as one
    optimizer: the two share their param groups with this one, so a scheduler reaches both, and
    one state dict holds both."""

    def __init__(self, model: nn.Module, cfg: OptimConfig) -> None:
        muon, adamw = muon_split(model)
        if not muon:
            raise ValueError("optim.name=muon: the model has no hidden weight matrix for Muon")
        self.muon = torch.optim.Muon(
            muon, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum, adjust_lr_fn="match_rms_adamw"
        )
        self.adamw = torch.optim.AdamW(decay_groups(adamw, cfg.weight_decay), lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]))
        super().__init__([{"params": muon}, {"params": adamw}], {"lr": cfg.lr})
        self.param_groups = [*self.muon.param_groups, *self.adamw.param_groups]

    @torch.no_grad()
    def step(self, closure: object = None) -> None:  # type: ignore[override]
        on_cpu = self.muon.param_groups[0]["params"][0].device.type == "cpu"
        with _fp32_newton_schulz() if on_cpu else contextlib.nullcontext():
            self.muon.step()
        self.adamw.step()

    def state_dict(self) -> dict[str, object]:  # type: ignore[override]
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict[str, object]) -> None:  # type: ignore[override]
        self.muon.load_state_dict(state_dict["muon"])  # type: ignore[arg-type]
        self.adamw.load_state_dict(state_dict["adamw"])  # type: ignore[arg-type]


def _newton_schulz_fp32(
    grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> torch.Tensor:
    """Muon's quintic Newton-Schulz orthogonalisation with the same coefficients and steps as
    torch's, in fp32: torch's runs it in bf16, which CPUs without bf16 matrix units execute about
    20x slower than fp32 (2 s per step of the default model here, against 0.1 s)."""
    a, b, c = ns_coefficients
    x = grad.float()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


@contextlib.contextmanager
def _fp32_newton_schulz() -> Iterator[None]:
    """Run torch.optim.Muon's orthogonalisation in fp32 for the duration of one step (CPU only)."""
    original = _muon._zeropower_via_newtonschulz
    _muon._zeropower_via_newtonschulz = _newton_schulz_fp32
    try:
        yield
    finally:
        _muon._zeropower_via_newtonschulz = original
