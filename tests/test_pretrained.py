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
    assert json.loads((tmp_path / "a" / "final_model" / "config.json").read_text())["format"] == "geotrain-gpt/1"
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
