"""Pretrained weights in (``model.pretrained``) and the final model out, as safetensors.

- A Hugging Face model directory (``config.json`` + safetensors) is loaded with
  ``from_pretrained(path, local_files_only=True)``: never downloaded. Its own config sets the sizes.
- geotrain's GPT is exported as a Hugging Face GPT-2 (:mod:`.gpt2`, format ``geotrain-gpt/2``):
  ``model.safetensors`` in GPT-2's names, a GPT-2 ``config.json`` with a ``geotrain`` entry, and
  the tokenizer (the data's, or the byte vocabulary's) that ``AutoTokenizer`` loads; transformers
  loads it as any GPT-2. It loads back into geotrain from there, as do earlier exports in
  geotrain's own names (``geotrain-gpt/1``); its sizes must equal the model section's (a mismatch
  is refused naming the field).
- Either way the model's vocabulary must hold the data's: prepare token shards with the model's
  own tokenizer (``geotrain data prepare --tokenizer MODEL_DIR``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch.nn as nn

import geotrain.models.gpt2 as gpt2
from geotrain.config import ModelConfig
from geotrain.models.gpt import GPT, VOCAB_SIZE

GPT_FORMAT = "geotrain-gpt/1"  # geotrain's own names; exports are now gpt2.FORMAT


def _read_config(path: Path) -> dict[str, Any]:
    try:
        c = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"model.pretrained: {path / 'config.json'}: unreadable ({exc})") from None
    if not isinstance(c, dict):
        raise ValueError(f"model.pretrained: {path / 'config.json'}: not a JSON object")
    return c


def _checked_config(cfg: ModelConfig) -> dict[str, Any]:
    """The config of the model at ``cfg.pretrained`` (no weights read), checked against the model section.

    Raises:
        ValueError: one line naming ``model.pretrained``: not a model of ``model.kind``, or its sizes
            differ from the model section's (geotrain GPT).
    """
    path = Path(str(cfg.pretrained))
    c = _read_config(path)
    if cfg.kind == "gpt":
        mark = c.get("geotrain")
        ours: dict[str, Any] = mark if isinstance(mark, dict) else c
        if ours.get("format") not in (GPT_FORMAT, gpt2.FORMAT):
            raise ValueError(
                f"model.pretrained: {path} is not a geotrain GPT export (config.json format {gpt2.FORMAT} or "
                f"{GPT_FORMAT}); for a Hugging Face model set model.kind=hf"
            )
        for k in gpt2.SIZES:
            if ours.get(k) != getattr(cfg, k):
                raise ValueError(f"model.{k}: {getattr(cfg, k)}, but the pretrained GPT at {path} has {ours.get(k)}")
    elif "model_type" not in c or not isinstance(c.get("vocab_size"), int):
        raise ValueError(f"model.pretrained: {path} is not a Hugging Face model directory (config.json without model_type)")
    return c


def pretrained_vocab(cfg: ModelConfig) -> int:
    """The vocabulary of the model at ``cfg.pretrained`` (see :func:`_checked_config` for what is refused)."""
    return int(_checked_config(cfg)["vocab_size"])


def check_pretrained(cfg: ModelConfig, data_vocab: int) -> None:
    """Refuse, before launch, a pretrained model that cannot read the data's tokens."""
    if cfg.pretrained is None:
        return
    c = _checked_config(cfg)
    have = int(c["vocab_size"])
    if data_vocab > have:
        raise ValueError(
            f"model.pretrained: the model's vocabulary ({have:,}) is smaller than the data's ({data_vocab:,}); "
            "prepare the data with the model's tokenizer (geotrain data prepare --tokenizer MODEL_DIR)"
        )
    if cfg.kind == "hf":
        positions = c.get("n_positions", c.get("max_position_embeddings"))
        if isinstance(positions, int) and cfg.block_size > positions:
            raise ValueError(f"model.block_size: {cfg.block_size}, but the pretrained model takes at most {positions} positions")


def load_gpt(cfg: ModelConfig) -> GPT:
    from safetensors.torch import load_file, load_model

    path = Path(str(cfg.pretrained))
    model = GPT(cfg, pretrained_vocab(cfg))
    if _read_config(path).get("format") == GPT_FORMAT:  # an export in geotrain's own names
        load_model(model, str(path / "model.safetensors"), device="cpu")  # strict: every tensor, right shapes
        return model
    try:
        state = gpt2.from_gpt2(load_file(str(path / "model.safetensors"), device="cpu"))
    except ValueError as exc:
        raise ValueError(f"model.pretrained: {path / 'model.safetensors'}: {exc}") from None
    model.load_state_dict(state, strict=True)  # every tensor, right shapes
    return model


def export_model(model: nn.Module, cfg: ModelConfig, out: Path, tokenizer: Path | None = None) -> Path:
    """Write ``model`` (geotrain's interface) to the directory ``out`` as a Hugging Face model:
    geotrain's GPT as a GPT-2 (:mod:`.gpt2`), an HF model by ``save_pretrained``; with its
    tokenizer (``tokenizer``, a ``tokenizer.json``, or the byte vocabulary's for a 256-token
    model) and a ``tokenizer_config.json``, so ``AutoModelForCausalLM`` and ``AutoTokenizer`` load it.

    Atomic: written beside ``out`` and renamed over it, so a crash never leaves half a model; sites
    of an elastic run that export the same global model at once each leave a complete one.
    """
    tmp, old = (out.with_name(f".{out.name}.{what}-{os.getpid()}") for what in ("tmp", "old"))
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        inner: Any = model.inner if cfg.kind == "hf" else None  # HFCausalLM
        vocab = int(inner.config.vocab_size if inner is not None else model.get_parameter("wte.weight").shape[0])
        tok = tokenizer if tokenizer is not None and tokenizer.is_file() else None
        eos = gpt2.write_tokenizer(tmp, tok, cfg.block_size) if tok is not None or vocab == VOCAB_SIZE else None
        if inner is not None:
            inner.save_pretrained(tmp, safe_serialization=True)
        else:  # as a Hugging Face GPT-2
            from safetensors.torch import save_file

            save_file(gpt2.to_gpt2(model.state_dict()), str(tmp / "model.safetensors"), metadata={"format": "pt"})
            (tmp / "config.json").write_text(json.dumps(gpt2.gpt2_config(cfg, vocab, eos), indent=2))
        with contextlib.suppress(OSError):  # an earlier run's export is replaced
            os.rename(out, old)
        with contextlib.suppress(OSError):  # another site of an elastic run just put the same model there
            os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return out
