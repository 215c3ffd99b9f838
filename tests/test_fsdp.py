"""``sync.within_site=fsdp``: FSDP2 inside a site, DiLoCo / DDP across sites (HSDP), end to end
through the real launcher (4 processes, Gloo on 127.0.0.1), against the replicated layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from geotrain.config import ModelConfig, load_config
from geotrain.errors import ConfigError
from geotrain.launch.local import launch_local
from geotrain.models import build_model
from geotrain.run.fsdp import block_list, copy_on
from tests.helpers import PLAIN_SGD, TINY

H1 = ["sync.algorithm=diloco", "sync.H=1", "sync.outer_lr=1.0", "sync.outer_momentum=0.0", "sync.nesterov=false"]
FSDP = ["sync.within_site=fsdp"]
TWO_BLOCKS = ["model.n_layer=2"]  # the default topology: 2 sites x 2 workers


def _run(tmp: Path, name: str, overrides: list[str]) -> tuple[dict, dict[str, torch.Tensor]]:
    cfg = load_config(None, TINY + TWO_BLOCKS + overrides)
    summary = launch_local(cfg, tmp / name, console_print=None)
    return summary, torch.load(tmp / name / "final_model.pt")


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float, atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=rtol, atol=atol, msg=k)


def _one_model(s: dict) -> None:
    assert len(set(s["global_param_hash"].values())) == 1 and s["hashes_agree_within_sites"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp_diloco_h1_plain_sgd_equals_ddp(tmp_path: Path) -> None:
    steps = ["train.steps=6"]
    ddp, ddp_w = _run(tmp_path, "ddp", steps + PLAIN_SGD + ["sync.algorithm=ddp"])
    fs, fs_w = _run(tmp_path, "fsdp", steps + PLAIN_SGD + H1 + FSDP)
    _same(ddp_w, fs_w, rtol=1e-5, atol=1e-6)
    assert ddp["final_eval_loss"] < ddp["eval_curve"][0]["eval_loss"]  # the model moved
    _one_model(fs)
    # HSDP (DDP across sites over FSDP shards) is the same DDP too
    hs, hs_w = _run(tmp_path, "hsdp", steps + PLAIN_SGD + ["sync.algorithm=ddp"] + FSDP)
    _same(ddp_w, hs_w, rtol=1e-5, atol=1e-6)
    assert hs["inter_site_bytes"] == ddp["inter_site_bytes"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp_diloco_equals_replicated_over_rounds_with_the_same_wan_bytes(tmp_path: Path) -> None:
    # AdamW, Nesterov outer momentum, grad clipping and the guard: everything at its default
    common = ["train.steps=9", "sync.H=3"]
    rep, rep_w = _run(tmp_path, "rep", common)
    fs, fs_w = _run(tmp_path, "fsdp", common + FSDP)
    assert fs["rounds"] == rep["rounds"] == 3
    _same(rep_w, fs_w, rtol=1e-4, atol=1e-5)
    for a, b in zip(rep["eval_curve"], fs["eval_curve"], strict=True):
        assert b["eval_loss"] == pytest.approx(a["eval_loss"], abs=1e-4)
    # each rank carries its own shard across sites: the same bytes as the replicated 1/G shards
    assert fs["inter_site_bytes"] == rep["inter_site_bytes"] > 0
    _one_model(fs)
    # the export holds the whole gathered model: it reloads and equals final_model.pt
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "fsdp" / "final_model" / "model.safetensors"))
    for k, v in exported.items():
        torch.testing.assert_close(v, fs_w[k])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_streaming_with_a_codec_and_bf16_under_fsdp(tmp_path: Path) -> None:
    stream = ["train.steps=8", "sync.algorithm=streaming", "sync.H=4", "sync.fragments=2", "sync.tau=1", "sync.codec=int8"]
    rep, _ = _run(tmp_path, "rep", stream)
    fs, _ = _run(tmp_path, "fsdp", stream + FSDP)
    _one_model(fs)
    assert fs["final_eval_loss"] < fs["eval_curve"][0]["eval_loss"]
    assert fs["final_eval_loss"] == pytest.approx(rep["final_eval_loss"], abs=0.02)
    assert fs["inter_site_bytes"] == pytest.approx(rep["inter_site_bytes"], rel=0.05)  # int8: about a quarter of fp32
    # FSDP's mixed precision (bf16 compute, fp32 shards and reductions), accumulation, checkpointing
    bf, bf_w = _run(
        tmp_path,
        "bf16",
        ["train.steps=8", "sync.H=4", "train.precision=bf16", "train.grad_accum=2", "model.activation_checkpointing=true"] + FSDP,
    )
    _one_model(bf)
    assert all(v.dtype == torch.float32 for v in bf_w.values())
    assert bf["final_eval_loss"] < bf["eval_curve"][0]["eval_loss"]


@pytest.mark.parametrize(
    "setting",
    [
        "elastic.enabled=true",
        "privacy.secure_aggregation=true",
        "sync.allreduce=flat",
        "train.compile=true",
        "checkpoint.every=5",
    ],
)
def test_unsupported_combinations_are_refused_in_one_line(setting: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(None, [*FSDP, setting])
    msg = str(exc.value)
    assert "\n" not in msg and "sync.within_site=fsdp" in msg and setting.split("=")[0].split(".")[0] in msg


def test_blocks_are_found_and_a_structural_copy_keeps_ties() -> None:
    model = build_model(ModelConfig(n_layer=3, n_embd=16, n_head=2, block_size=8), 64)
    assert block_list(model) is model.get_submodule("blocks")
    meta = copy_on(model, "meta")
    assert meta.get_parameter("wte.weight").device.type == "meta"
    whole = copy_on(meta, "cpu")
    assert whole.get_parameter("head.weight") is whole.get_parameter("wte.weight")
    assert len(list(whole.parameters())) == len(list(model.parameters()))


def test_held_bytes_counts_each_storage_once() -> None:
    from geotrain.bench.shard import held_bytes

    a = torch.zeros(100)
    assert held_bytes([a, a[:10], a.view(10, 10), torch.zeros(5)]) == 4 * 105


def test_bench_scale_refuses_an_unknown_part_in_one_line() -> None:
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-m", "geotrain", "bench", "scale", "--parts", "memory,nope"], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines() == [
        "geotrain: --parts: unknown part nope (allowed: loader, memory, overhead, gpt2_small)"
    ]
