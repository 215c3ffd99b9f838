"""Memory and precision options: activation checkpointing changes nothing but memory, bf16 autocast
keeps fp32 master weights, and gradient accumulation over micro-batches trains a real 2-site run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from geotrain.config import ModelConfig
from geotrain.models import build_model
from tests.helpers import read_summary, train_cli

CFG = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (4, 17), generator=g)
    return x[:, :-1], x[:, 1:]


@pytest.mark.parametrize("kind", ["gpt", "hf"])
def test_activation_checkpointing_gives_the_same_loss_and_gradients(kind: str) -> None:
    x, y = _batch()
    grads = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = build_model(CFG.model_copy(update={"kind": kind, "activation_checkpointing": ckpt}))
        model.train()
        calls: list[int] = []
        block = model.get_submodule("blocks.0.mlp" if kind == "gpt" else "inner.transformer.h.0.mlp")
        block.register_forward_pre_hook(lambda *_, seen=calls: seen.append(1))
        loss = model(x, y)
        loss.backward()
        assert len(calls) == (2 if ckpt else 1)  # recomputed in backward, or kept
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (l0, g0), (l1, g1) = grads
    assert torch.equal(l0, l1)
    assert all(torch.allclose(a, b, rtol=0, atol=1e-7) for a, b in zip(g0, g1, strict=True))


def test_bf16_autocast_keeps_fp32_master_weights_and_gradients() -> None:
    x, y = _batch(1)
    torch.manual_seed(0)
    model = build_model(CFG)
    ref = model(x, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(x, y)
    low.backward()
    assert low.dtype == torch.float32 and abs(low.item() - ref.item()) < 0.02  # bf16 matmuls, fp32 loss
    assert all(p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


@pytest.mark.timeout(300)
def test_grad_accum_bf16_and_checkpointing_in_a_two_site_run(tmp_path: Path) -> None:
    opts = ["train.grad_accum=3", "train.precision=bf16", "model.activation_checkpointing=true"]
    train_cli(tmp_path / "run", [*opts, "train.steps=20", "sync.H=10"])
    s = read_summary(tmp_path / "run")
    # 2 sites x 2 workers (the default topology) x 20 steps x 3 micro-batches x 4 sequences x 16 tokens
    assert s["tokens"] == 4 * 20 * 3 * 4 * 16
    assert s["hashes_agree_within_sites"] and len(set(s["global_param_hash"].values())) == 1
    curve = s["runs"][0]["eval_curve"]
    assert curve[-1]["eval_loss"] < curve[0]["eval_loss"] - 0.3


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.skipif(not any(map(shutil.which, ("cc", "gcc", "clang"))), reason="torch.compile on CPU needs a C compiler")
def test_compiled_training_matches_eager(tmp_path: Path) -> None:
    """train.compile on 1 site x 1 worker: the same losses as eager, to float tolerance."""
    one = "topology:\n  sites: [{name: A, workers: 1}]\n"
    common = ["sync.algorithm=ddp", "train.steps=8", "train.eval_every=4"]
    runs = {}
    for compiled in ("false", "true"):
        out = tmp_path / f"compile-{compiled}"
        train_cli(out, [*common, f"train.compile={compiled}"], topology=one, timeout=360)
        runs[compiled] = read_summary(out)["runs"][0]["eval_curve"]
    assert [p["step"] for p in runs["true"]] == [0, 4, 8]
    for a, b in zip(runs["false"], runs["true"], strict=True):
        assert b["eval_loss"] == pytest.approx(a["eval_loss"], abs=1e-4)
    assert runs["true"][-1]["eval_loss"] < runs["true"][0]["eval_loss"]
