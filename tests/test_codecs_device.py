"""The codecs' torch-ops path, the one a GPU's tensors take (geotrain/codecs/torchops.py), against
the numba kernels on CPU (``GEOTRAIN_CODEC_KERNELS=0`` sends CPU tensors that way): the same wire
bytes within the codec's own rounding, the same decoded values bit for bit from the same bytes,
the same refusals; then the coded all-reduce over real Gloo groups and a training run through
that path; and, where this machine has a GPU, the same comparison on CUDA tensors."""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from geotrain.codecs import CODEC_NAMES, Codec, SparseLoCo, build_codec
from geotrain.errors import CorruptPayload, NonFiniteError
from tests.helpers import read_summary, train_cli

BYTE_CODECS = [n for n in CODEC_NAMES if n != "powersgd"]
CODECS: dict[str, Callable[[], Codec]] = {
    **{n: (lambda n=n: build_codec(n, fraction=0.05)) for n in BYTE_CODECS},  # type: ignore[misc]
    "sparseloco-chunks": lambda: SparseLoCo(0.01, 4096),
    "fp4-block-6": lambda: build_codec("fp4", block_size=6),
}
TIE = 1.25


def _data(kind: str, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n + len(kind))
    if kind == "gauss":
        return torch.randn(n, generator=g) * 3 + 0.5
    if kind == "heavy":  # pseudo-gradient-like tails
        return torch.randn(n, generator=g) ** 3 * 1e-3
    if kind == "ties":  # equal magnitudes at top-k's threshold
        x = torch.randn(n, generator=g)
        x[: n // 2] = TIE
        x[n // 2 : n // 2 + n // 8] = -TIE
        return x
    if kind == "constant":
        return torch.full((n,), -0.375)
    return torch.zeros(n)


def _paths(codec: Codec, x: torch.Tensor, monkeypatch: pytest.MonkeyPatch, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Bytes and decodings of the kernels ('k') and the torch-ops path ('t', on ``device``); 'kt':
    the kernels' bytes decoded the torch-ops way, 'tk': the torch-ops bytes decoded by the kernels."""
    n = x.numel()
    monkeypatch.delenv("GEOTRAIN_CODEC_KERNELS", raising=False)
    bk = codec.encode(x)
    out = {"bk": bk, "k": codec.decode(bk, n)}
    if device == "cpu":
        monkeypatch.setenv("GEOTRAIN_CODEC_KERNELS", "0")
    bt = codec.encode(x.to(device))
    assert bt.device.type == device
    out |= {"bt": bt.cpu(), "t": codec.decode(bt, n).cpu(), "kt": codec.decode(bk.to(device), n).cpu()}
    monkeypatch.delenv("GEOTRAIN_CODEC_KERNELS", raising=False)
    out["tk"] = codec.decode(bt.cpu(), n)
    return out


def _check_paths(name: str, x: torch.Tensor, p: dict[str, torch.Tensor]) -> None:
    n = x.numel()
    assert p["bt"].numel() == p["bk"].numel(), name
    # the same bytes decode to the same values on either path, bit for bit
    assert torch.equal(p["kt"], p["k"]), name
    assert torch.equal(p["tk"], p["t"]), name
    # the bytes themselves: equal but where a float64 sum in another order moves a value across a
    # bucket's edge (int8's moments and bucket means, SparseLoCo's level scales)
    differ = int((p["bt"] != p["bk"]).sum())
    assert differ <= max(4, p["bk"].numel() // 10_000), (name, differ)
    if n:  # and what the receiver sees differs by less than one quantisation step
        step = {"int8": 12 * float(x.std()) / 256 if n > 1 else 0.0}.get(name, 0.0)
        worst = float((p["t"] - p["k"]).abs().max())
        assert worst <= step + 1e-6 * float(x.abs().max()), (name, worst, step)


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("n", [0, 1, 7, 64, 65, 4095, 4097, 100_003])
def test_the_torch_ops_path_sends_the_kernels_bytes(name: str, n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    for kind in ("gauss", "heavy", "ties", "constant", "zeros"):
        x = _data(kind, n)
        _check_paths(name.split("-")[0], x, _paths(CODECS[name](), x, monkeypatch))


def test_ties_at_the_threshold_keep_the_lowest_indices_on_both_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    x = _data("ties", 10_000)
    p = _paths(SparseLoCo(0.05, 4096), x, monkeypatch)
    assert torch.equal(p["bt"], p["bk"])
    kept = (p["t"] != 0).nonzero().reshape(-1)
    assert kept.numel() == 3 * math.ceil(0.05 * 4096) - math.ceil(0.05 * 4096) + math.ceil(0.05 * (10_000 - 8192))
    assert int(kept[0]) == 0  # the first chunk keeps its first tied values


@pytest.mark.parametrize("name", list(CODECS))
def test_the_torch_ops_path_refuses_what_the_kernels_refuse(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEOTRAIN_CODEC_KERNELS", "0")
    codec = CODECS[name]()
    for bad in (math.nan, math.inf, -math.inf):
        x = torch.randn(5000)
        x[4321] = bad
        with pytest.raises(NonFiniteError, match="non-finite"):
            codec.encode(x)
    good = codec.encode(torch.randn(4099, generator=torch.Generator().manual_seed(1)))
    for short in (good[:-1], torch.cat([good, good[:1]])):
        with pytest.raises(CorruptPayload):
            codec.decode(short, 4099)
    with pytest.raises(ValueError, match="into a tensor on meta"):
        codec.decode(good, 4099, torch.empty(4099, device="meta"))


def test_offsets_past_a_chunk_are_refused_the_torch_ops_way(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEOTRAIN_CODEC_KERNELS", "0")
    for codec, n in ((SparseLoCo(fraction=0.5, chunk=5), 10), (SparseLoCo(), 4097)):
        ones = torch.full((codec.encoded_nbytes(n),), 255, dtype=torch.uint8)
        with pytest.raises(CorruptPayload, match="outside their chunk"):
            codec.decode(ones, n)


@pytest.mark.timeout(180)
def test_coded_all_reduce_through_the_torch_ops_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every byte codec summed across 2 sites × 2 ranks over real Gloo groups, every rank encoding
    and decoding the torch-ops way: every rank ends bit-identical, with exactly the wire bytes the
    formats say, and the sums equal the kernels' (the bytes are the same on CPU)."""
    from tests.helpers import run_ranks
    from tests.test_codecs import _coded_rank

    kernels = run_ranks(4, _coded_rank, 2, 2)
    monkeypatch.setenv("GEOTRAIN_CODEC_KERNELS", "0")
    torch_ops = run_ranks(4, _coded_rank, 2, 2)
    for rank in range(4):
        for key, got in torch_ops[rank].items():
            assert got["x"] == torch_ops[0][key]["x"], (key, rank)
            assert (got["inter"], got["raw"]) == (kernels[rank][key]["inter"], kernels[rank][key]["raw"]), key
            assert got["err"] == pytest.approx(kernels[rank][key]["err"], rel=1e-3, abs=1e-6), key


@pytest.mark.timeout(300)
@pytest.mark.parametrize("codec", ["int8", "sparseloco"])
def test_a_run_with_a_codec_trains_alike_through_the_torch_ops_path(
    codec: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DiLoCo across 2 sites with ``codec``: the kernels and the torch-ops path send the same bytes
    across sites and end on the same model."""
    runs = {}
    for path in ("kernels", "torch"):
        if path == "torch":
            monkeypatch.setenv("GEOTRAIN_CODEC_KERNELS", "0")
        train_cli(tmp_path / path, ["train.steps=40", "sync.algorithm=diloco", "sync.H=10", f"sync.codec={codec}"])
        runs[path] = read_summary(tmp_path / path)
    k, t = runs["kernels"], runs["torch"]
    assert t["inter_site_bytes"] == k["inter_site_bytes"] > 0
    assert t["final_eval_loss"] == pytest.approx(k["final_eval_loss"], rel=1e-3)
    assert t["global_param_hash"] == k["global_param_hash"]  # (on CPU both paths write the same bytes: bit-identical runs)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not any(map(shutil.which, ("cc", "gcc", "clang"))), reason="torch.compile on CPU needs a C compiler")
def test_the_compiled_cores_write_the_eager_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the elementwise cores of int8 and the 4-bit codecs run through torch.compile; here
    they are compiled for the CPU (inductor): the same bytes and the same decoded values as eager,
    for every size (one compilation each: dynamic shapes), and none fell back to eager."""
    from geotrain.codecs import torchops

    monkeypatch.setenv("GEOTRAIN_CODEC_KERNELS", "0")
    want = {}
    for name in ("int8", "int4", "fp4"):
        for n in (1, 7, 64, 4097, 100_003):
            x = _data("heavy", n)
            buf = build_codec(name).encode(x)
            want[(name, n)] = (buf, build_codec(name).decode(buf, n))
    monkeypatch.setattr(torchops, "COMPILE_ON", {"cpu"})
    monkeypatch.setattr(torchops, "_compiled", {})
    for (name, n), (buf, values) in want.items():
        got = build_codec(name).encode(_data("heavy", n))
        assert torch.equal(got, buf), (name, n)
        assert torch.equal(build_codec(name).decode(got, n), values), (name, n)
    assert not torchops._failed and set(torchops._compiled) == {"_int8_codes", "_lookup", "_block4_codes", "_block4_values"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.parametrize("name", list(CODECS))
def test_codecs_on_cuda_send_the_kernels_bytes(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for n in (0, 7, 4097, 1 << 20):
        for kind in ("gauss", "heavy", "ties", "constant"):
            x = _data(kind, n)
            _check_paths(name.split("-")[0], x, _paths(CODECS[name](), x, monkeypatch, "cuda"))
