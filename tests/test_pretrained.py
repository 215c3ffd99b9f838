"""Pretrained weights in and the final model out: a run exports safetensors, a second run started
from the export evaluates it to the first run's final loss; a tiny Hugging Face model saved here is
trained and round-tripped the same way; bad pretrained directories are refused before launch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import read_summary, train_cli

pytestmark = pytest.mark.timeout(300)

STEPS = ["train.steps=10", "sync.H=5", "train.eval_every=5"]


def _tiny_hf(path: Path, vocab: int = 300, positions: int = 32) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=positions, vocab_size=vocab)
    GPT2LMHeadModel(cfg).save_pretrained(path, safe_serialization=True)
    return path


def _round_trip(tmp_path: Path, first: list[str]) -> tuple[dict, dict]:  # type: ignore[type-arg]
    a, b = tmp_path / "a", tmp_path / "b"
    train_cli(a, [*first, *STEPS])
    export = a / "final_model"
    assert (export / "model.safetensors").is_file() and (export / "config.json").is_file()
    kind = [o for o in first if o.startswith("model.kind=")]
    train_cli(b, [*kind, f"model.pretrained={export}", *STEPS])
    return read_summary(a)["runs"][0], read_summary(b)["runs"][0]


def test_gpt_export_reloads_with_the_same_eval_loss(tmp_path: Path) -> None:
    sa, sb = _round_trip(tmp_path, [])
    config = json.loads((tmp_path / "a" / "final_model" / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["geotrain"]["format"] == "geotrain-gpt/2"
    assert sb["eval_curve"][0]["step"] == 0
    assert sb["eval_curve"][0]["eval_loss"] == pytest.approx(sa["final_eval_loss"], abs=1e-6)
    assert sb["eval_curve"][0]["eval_loss"] < sa["eval_curve"][0]["eval_loss"] - 0.1  # it did start from the trained model
    export = tmp_path / "a" / "final_model"
    p = train_cli(tmp_path / "c", [f"model.pretrained={export}", "model.n_layer=2"], expect_rc=2, timeout=60)
    assert p.stderr.strip().splitlines() == [
        f"geotrain: config error: model.n_layer: 2, but the pretrained GPT at {export} has 1"
    ]


@pytest.mark.slow
def test_hf_model_saved_here_trains_exports_and_reloads(tmp_path: Path) -> None:
    m0 = _tiny_hf(tmp_path / "m0")
    sa, sb = _round_trip(tmp_path, ["model.kind=hf", f"model.pretrained={m0}"])
    assert sa["params"] == sb["params"]  # sizes came from the saved model's config (vocab 300, not 256)
    assert sb["eval_curve"][0]["eval_loss"] == pytest.approx(sa["final_eval_loss"], abs=1e-6)
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "final_model", local_files_only=True)
    assert reloaded.config.vocab_size == 300


@pytest.mark.parametrize(
    "make, overrides, needle",
    [
        (lambda d: _tiny_hf(d / "hf"), ["model.kind=gpt"], "is not a geotrain GPT export"),
        (lambda d: _tiny_hf(d / "hf", vocab=200), ["model.kind=hf"], "vocabulary (200) is smaller than the data's (256)"),
        (
            lambda d: _tiny_hf(d / "hf", positions=8),
            ["model.kind=hf"],
            "model.block_size: 16, but the pretrained model takes at most 8",
        ),
        (lambda d: d / "nowhere", [], "model.pretrained"),
    ],
)
def test_a_pretrained_model_that_cannot_fit_is_refused_before_launch(tmp_path: Path, make, overrides, needle) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "run"
    p = train_cli(out, [*overrides, f"model.pretrained={make(tmp_path)}"], expect_rc=2, timeout=60)
    assert needle in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    assert not (out / "logs").exists()  # nothing launched


def _gpt(vocab: int = 256):  # type: ignore[no-untyped-def]
    """A geotrain GPT with every weight, bias and norm moved off its initial value."""
    import torch

    from geotrain.config import ModelConfig
    from geotrain.models import GPT

    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)
    torch.manual_seed(0)
    model = GPT(cfg, vocab)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return cfg, model.eval()


def test_gpt_export_is_a_gpt2_that_transformers_loads_with_equal_logits(tmp_path: Path) -> None:
    """The export loads with AutoModelForCausalLM and AutoTokenizer (byte vocabulary: id b is byte
    b), the logits equal geotrain's within fp32 rounding, and it loads back into geotrain."""
    import torch
    from tokenizers import pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from geotrain.models import export_model
    from geotrain.models.gpt2 import bytes_to_unicode
    from geotrain.models.pretrained import load_gpt

    assert set(bytes_to_unicode().values()) == set(pre_tokenizers.ByteLevel.alphabet())  # GPT-2's byte alphabet
    cfg, model = _gpt()
    out = export_model(model, cfg, tmp_path / "m")
    hf = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    text = "héllo, wörld\n\t\x01 ✓"
    ids = tok(text)["input_ids"]
    assert ids == list(text.encode()) and tok.decode(ids) == text
    x = torch.tensor([ids[:16], list(range(200, 216))])
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model.logits(x), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(hf(x).logits, model.logits(x.flip(1)))  # (the comparison can fail)
    back = load_gpt(cfg.model_copy(update={"pretrained": str(out)}))
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), model.state_dict().values(), strict=True))


def test_an_export_with_a_trained_tokenizer_and_an_earlier_export_format(tmp_path: Path) -> None:
    """A BPE tokenizer of token shards ships with the model (its end-of-text token as eos); an
    export in geotrain's own names (geotrain-gpt/1, before the GPT-2 layout) still loads."""
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from geotrain.data.prepare import Inputs, load_tokenizer
    from geotrain.models import export_model
    from geotrain.models.pretrained import load_gpt

    (tmp_path / "c.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    bpe = load_tokenizer("bpe", Inputs([tmp_path / "c.txt"]), 300)
    bpe.hf.save(str(tmp_path / "tokenizer.json"))
    cfg, model = _gpt(bpe.vocab_size)
    out = export_model(model, cfg, tmp_path / "m", tmp_path / "tokenizer.json")
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert tok("the lazy fox")["input_ids"] == bpe.hf.encode("the lazy fox").ids and tok.eos_token == "<|endoftext|>"
    hf = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert hf.config.eos_token_id == bpe.eot_id and hf.config.vocab_size == bpe.vocab_size
    old = tmp_path / "old"
    old.mkdir()
    save_model(model, str(old / "model.safetensors"))
    sizes = {k: getattr(cfg, k) for k in ("n_layer", "n_head", "n_embd", "block_size")}
    (old / "config.json").write_text(json.dumps({"format": "geotrain-gpt/1", **sizes, "vocab_size": bpe.vocab_size}))
    back = load_gpt(cfg.model_copy(update={"pretrained": str(old)}))
    x = torch.arange(16).reshape(1, 16)
    with torch.no_grad():
        assert torch.equal(back.logits(x), model.logits(x))
