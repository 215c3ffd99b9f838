"""The inner optimizer and its learning-rate schedule, from the optim section.

AdamW (DiLoCo paper: lr 4e-4, weight decay 0.1, betas 0.9/0.95) or SGD; linear warm-up, then
constant or cosine decay to 10% at the last step.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from geotrain.config import OptimConfig


def build_optimizer(
    cfg: OptimConfig, model: nn.Module, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The inner optimizer over ``model``'s trainable parameters and its schedule over ``total_steps``."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt: torch.optim.Optimizer
    if cfg.name == "adamw":
        opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(cfg.betas[0], cfg.betas[1]))
    else:
        opt = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)

    def factor(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)
