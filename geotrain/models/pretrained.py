"""Pretrained weights in (``model.pretrained``) and the final model out, as safetensors.

- A Hugging Face model directory (``config.json`` + safetensors) is loaded with
  ``from_pretrained(path, local_files_only=True)``: never downloaded. Its own config sets the sizes.
- geotrain's GPT is exported as ``model.safetensors`` plus a ``config.json`` holding its sizes and
  vocabulary (format ``geotrain-gpt/1``), and loaded back from there; its sizes must equal the
  model section's (a mismatch is refused naming the field).
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

from geotrain.config import ModelConfig
from geotrain.models.gpt import GPT

GPT_FORMAT = "geotrain-gpt/1"
GPT_SIZES = ("n_layer", "n_head", "n_embd", "block_size")


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
        if c.get("format") != GPT_FORMAT:
            raise ValueError(
                f"model.pretrained: {path} is not a geotrain GPT export (config.json format {GPT_FORMAT}); "
                "for a Hugging Face model set model.kind=hf"
            )
        for k in GPT_SIZES:
            if c[k] != getattr(cfg, k):
                raise ValueError(f"model.{k}: {getattr(cfg, k)}, but the pretrained GPT at {path} has {c[k]}")
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
    from safetensors.torch import load_model

    path = Path(str(cfg.pretrained))
    model = GPT(cfg, pretrained_vocab(cfg))
    load_model(model, str(path / "model.safetensors"), device="cpu")  # strict: every tensor, right shapes
    return model


def export_model(model: nn.Module, cfg: ModelConfig, out: Path, tokenizer: Path | None = None) -> Path:
    """Write ``model`` (geotrain's interface) to the directory ``out`` as safetensors with its config;
    with ``tokenizer`` (a ``tokenizer.json``) a copy of it. An HF model is written by ``save_pretrained``.

    Atomic: written beside ``out`` and renamed over it, so a crash never leaves half a model; sites
    of an elastic run that export the same global model at once each leave a complete one.
    """
    tmp, old = (out.with_name(f".{out.name}.{what}-{os.getpid()}") for what in ("tmp", "old"))
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if cfg.kind == "hf":
            inner: Any = model.inner  # HFCausalLM
            inner.save_pretrained(tmp, safe_serialization=True)
        else:
            from safetensors.torch import save_model

            save_model(model, str(tmp / "model.safetensors"))  # the tied head is stored once
            sizes = {k: getattr(cfg, k) for k in GPT_SIZES}
            vocab = model.get_submodule("wte").num_embeddings
            (tmp / "config.json").write_text(json.dumps({"format": GPT_FORMAT, **sizes, "vocab_size": vocab}, indent=2))
        if tokenizer is not None and tokenizer.is_file():
            shutil.copyfile(tokenizer, tmp / "tokenizer.json")
        with contextlib.suppress(OSError):  # an earlier run's export is replaced
            os.rename(out, old)
        with contextlib.suppress(OSError):  # another site of an elastic run just put the same model there
            os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return out
