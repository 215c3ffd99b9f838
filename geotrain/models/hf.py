"""Hugging Face causal LMs built from a config, or loaded from a local directory (never downloaded).

Optional: needs the ``hf`` extra (``pip install 'geotrain[hf]'``). The model is created with
``AutoModelForCausalLM.from_config`` so it starts from random weights and nothing is fetched
from a hub. It is wrapped to geotrain's model interface ``forward(idx, targets) -> loss`` with
a 256-entry byte vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from geotrain.config import ModelConfig
from geotrain.models.gpt import VOCAB_SIZE

# How each config family names the common sizes.
_SIZE_KEYS: dict[str, dict[str, str]] = {
    "gpt2": {"n_layer": "n_layer", "n_head": "n_head", "n_embd": "n_embd", "block_size": "n_positions"},
    "llama": {
        "n_layer": "num_hidden_layers",
        "n_head": "num_attention_heads",
        "n_embd": "hidden_size",
        "block_size": "max_position_embeddings",
    },
}


class HFCausalLM(nn.Module):
    """Adapter: ``forward(idx, targets)`` returns the mean next-token loss."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.inner(input_ids=idx).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


_SIZE_KEYS["mistral"] = _SIZE_KEYS["qwen2"] = _SIZE_KEYS["llama"]  # same names, same sizes


def hf_config_kwargs(cfg: ModelConfig, vocab_size: int = VOCAB_SIZE) -> dict[str, Any]:
    """AutoConfig keyword arguments for ``cfg`` (the family's own names for geotrain's sizes).

    Raises:
        ValueError: a family geotrain does not know how to size (config validation refuses it first).
    """
    kwargs = dict(cfg.hf)
    model_type = kwargs.pop("model_type", "gpt2")
    if model_type not in _SIZE_KEYS:
        raise ValueError(f"hf.model_type: must be one of {', '.join(_SIZE_KEYS)} (got {model_type!r})")
    for ours, theirs in _SIZE_KEYS[model_type].items():
        kwargs.setdefault(theirs, getattr(cfg, ours))
    if model_type != "gpt2":
        kwargs.setdefault("intermediate_size", 4 * cfg.n_embd)
        kwargs.setdefault("num_key_value_heads", cfg.n_head)
    kwargs["vocab_size"] = vocab_size
    kwargs["model_type"] = model_type
    return kwargs


def build_hf_model(cfg: ModelConfig, vocab_size: int = VOCAB_SIZE) -> nn.Module:
    model = _hf_model(cfg, vocab_size)
    if cfg.activation_checkpointing:
        inner: Any = model.inner
        if hasattr(inner, "activation_checkpointing_enable"):  # transformers >= 5 (the old name is deprecated)
            inner.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _hf_model(cfg: ModelConfig, vocab_size: int) -> HFCausalLM:
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("model.kind=hf needs transformers: pip install 'geotrain[hf]'") from exc
    if cfg.pretrained is not None:  # its own config sets the sizes; local files only
        return HFCausalLM(AutoModelForCausalLM.from_pretrained(cfg.pretrained, local_files_only=True, dtype=torch.float32))
    kwargs = hf_config_kwargs(cfg, vocab_size)
    hf_cfg = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    return HFCausalLM(AutoModelForCausalLM.from_config(hf_cfg))
