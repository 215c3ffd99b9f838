"""The model factory: geotrain's GPT or a Hugging Face causal LM, from the model section.

Every model geotrain trains has the interface ``forward(idx, targets) -> mean loss``.
"""

from __future__ import annotations

import torch.nn as nn

from geotrain.config import ModelConfig
from geotrain.models.gpt import GPT


def build_model(cfg: ModelConfig) -> nn.Module:
    """The model for ``cfg``: geotrain's GPT, or a Hugging Face causal LM built from a config."""
    if cfg.kind == "hf":
        from geotrain.models.hf import build_hf_model

        return build_hf_model(cfg)
    return GPT(cfg)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
