"""geotrain's GPT as a Hugging Face GPT-2, both ways, and the byte vocabulary as a tokenizer.

geotrain's GPT *is* the GPT-2 architecture (Radford et al. 2019): learned positions, pre-LN
blocks, a fused q/k/v projection with biases, a 4x MLP, a final LayerNorm (eps 1e-5) and an LM
head tied to the token embeddings. Two differences of form, none of function:

- GPT-2 keeps its linear layers as ``Conv1D`` (weight ``[in, out]``): ours are ``nn.Linear``
  (``[out, in]``), so those weights are transposed;
- our MLP uses the exact GELU (``nn.GELU()``): the config says ``activation_function: gelu``
  (transformers' exact GELU), not GPT-2's default tanh approximation ``gelu_new``.

So ``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` loads an export and computes the
same logits (a test checks it, within fp32 rounding). The export also loads back into geotrain
(``model.kind=gpt``, ``model.pretrained=DIR``): its ``config.json`` carries a ``geotrain`` entry
with the format and sizes.

The byte vocabulary (ids 0-255 are the bytes themselves) becomes a ``tokenizers`` byte-level BPE
with no merges, whose token for byte b is GPT-2's printable stand-in for b and has id b, so
``AutoTokenizer.from_pretrained(DIR)`` gives the ids geotrain trained on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from geotrain.config import ModelConfig

FORMAT = "geotrain-gpt/2"  # an export in GPT-2's layout (geotrain-gpt/1: geotrain's own names)
SIZES = ("n_layer", "n_head", "n_embd", "block_size")
LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, GPT-2's too
EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")  # as data prepare looks for them

# geotrain name (in a block) -> GPT-2 name (in transformer.h.{i}), and whether the weight is transposed
_BLOCK = {
    "ln1.weight": ("ln_1.weight", False),
    "ln1.bias": ("ln_1.bias", False),
    "attn.qkv.weight": ("attn.c_attn.weight", True),
    "attn.qkv.bias": ("attn.c_attn.bias", False),
    "attn.proj.weight": ("attn.c_proj.weight", True),
    "attn.proj.bias": ("attn.c_proj.bias", False),
    "ln2.weight": ("ln_2.weight", False),
    "ln2.bias": ("ln_2.bias", False),
    "mlp.0.weight": ("mlp.c_fc.weight", True),
    "mlp.0.bias": ("mlp.c_fc.bias", False),
    "mlp.2.weight": ("mlp.c_proj.weight", True),
    "mlp.2.bias": ("mlp.c_proj.bias", False),
}
_TOP = {"wte.weight": "transformer.wte.weight", "wpe.weight": "transformer.wpe.weight"}
_TOP.update({"ln_f.weight": "transformer.ln_f.weight", "ln_f.bias": "transformer.ln_f.bias"})


def to_gpt2(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """geotrain GPT's state dict in GPT-2's names and layout (the tied head stored once, as wte)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name == "head.weight":
            continue  # tied to wte
        if name in _TOP:
            out[_TOP[name]] = t.contiguous()
            continue
        _, i, rest = name.split(".", 2)  # blocks.{i}.{rest}
        theirs, transpose = _BLOCK[rest]
        out[f"transformer.h.{i}.{theirs}"] = (t.t() if transpose else t).contiguous()
    return out


def from_gpt2(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_gpt2` (the head takes wte's weight).

    Raises:
        ValueError: a tensor geotrain's GPT does not have (a GPT-2 of another shape or kind).
    """
    top = {v: k for k, v in _TOP.items()}
    block = {theirs: (ours, transpose) for ours, (theirs, transpose) in _BLOCK.items()}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name in top:
            out[top[name]] = t
        elif name.startswith("transformer.h.") and name.split(".", 3)[3] in block:
            i, rest = name.split(".", 3)[2:]
            ours, transpose = block[rest]
            out[f"blocks.{i}.{ours}"] = t.t() if transpose else t
        elif name != "lm_head.weight":
            raise ValueError(f"{name}: not a tensor of geotrain's GPT")
    out["head.weight"] = out["wte.weight"]
    return out


def gpt2_config(cfg: ModelConfig, vocab_size: int, eos_id: int | None) -> dict[str, Any]:
    """The ``config.json`` of an export: GPT-2's fields for transformers, and geotrain's own entry."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab_size,
        "n_positions": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": None,  # 4 x n_embd
        "activation_function": "gelu",  # exact, as nn.GELU()
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "layer_norm_epsilon": LAYER_NORM_EPS,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
        "geotrain": {"format": FORMAT, **{k: getattr(cfg, k) for k in SIZES}},
    }


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (the byte-level pre-tokenizer's alphabet): printable
    Latin-1 bytes stand for themselves, the others for code points from 256 up, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def byte_tokenizer_json() -> str:
    """geotrain's byte vocabulary as a ``tokenizer.json``: id b is byte b."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return str(tok.to_str())


def write_tokenizer(out: Path, tokenizer: Path | None, max_length: int) -> int | None:
    """Write ``tokenizer.json`` (``tokenizer``'s, or the byte vocabulary's when None) and the
    ``tokenizer_config.json`` that lets ``AutoTokenizer`` load it; the end-of-text id, if any."""
    text = tokenizer.read_text() if tokenizer is not None else byte_tokenizer_json()
    (out / "tokenizer.json").write_text(text)
    added = {t["content"]: int(t["id"]) for t in json.loads(text).get("added_tokens", [])}
    eos = next((t for t in EOS_TOKENS if t in added), None)
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length}
    if eos is not None:
        config.update(eos_token=eos, bos_token=eos)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return None if eos is None else added[eos]
