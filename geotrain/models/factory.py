"""The model factory: geotrain's GPT or a Hugging Face causal LM, from the model section.

Every model geotrain trains has the interface ``forward(idx, targets) -> mean loss``.
"""

from __future__ import annotations

import torch.nn as nn

from geotrain.config import ModelConfig
from geotrain.models.gpt import GPT, VOCAB_SIZE


def build_model(cfg: ModelConfig, vocab_size: int = VOCAB_SIZE) -> nn.Module:
    """The model for ``cfg``: geotrain's GPT, or a Hugging Face causal LM built from a config;
    ``vocab_size`` follows the data (256 byte tokens, or the prepared shards' tokenizer). With
    ``cfg.pretrained`` the weights (and vocabulary) are the saved model's."""
    if cfg.kind == "hf":
        from geotrain.models.hf import build_hf_model

        return build_hf_model(cfg, vocab_size)
    if cfg.pretrained is not None:
        from geotrain.models.pretrained import load_gpt

        return load_gpt(cfg)
    return GPT(cfg, vocab_size)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
