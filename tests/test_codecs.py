"""Codecs: round trips, bad input, coded collectives
over real Gloo groups (bit-identical results, exact wire bytes), PowerSGD against PyTorch's."""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from geotrain.codecs import CODEC_NAMES, FP4, Int8, Residual, SparseLoCo, build_codec, relative_error, roundtrip
from geotrain.codecs.powersgd import PowerSGD
from geotrain.comm.mailbox import Message
from geotrain.errors import CorruptPayload, NonFiniteError
from tests.helpers import run_ranks, uniform_topology

BYTE_CODECS = [n for n in CODEC_NAMES if n != "powersgd"]
SIZES = [0, 1, 7, 64, 65, 4099, 100_003]
# bound on ‖x − x̂‖/‖x‖ for Gaussian data (int8: the ±6σ / 256-bucket bound is 1.35%)
GAUSS_BOUND = {"none": 0.0, "bf16": 0.004, "fp16": 0.0005, "int8": 0.015, "int4": 0.15, "fp4": 0.25}


@pytest.mark.parametrize("name", BYTE_CODECS)
@pytest.mark.parametrize("n", SIZES)
def test_roundtrip_sizes_and_wire_bytes(name: str, n: int) -> None:
    codec = build_codec(name)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    buf = codec.encode(x)
    assert buf.dtype == torch.uint8 and buf.numel() == codec.encoded_nbytes(n)
    y = codec.decode(buf, n)
    assert y.shape == x.shape and y.dtype == torch.float32
    if n >= 4099 and name in GAUSS_BOUND:
        assert relative_error(x, y) <= GAUSS_BOUND[name]


def test_int8_error_bound_and_unbiased_table() -> None:
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))
    codec = Int8()
    y = roundtrip(codec, x)
    err = relative_error(x, y)
    assert 0.010 < err <= 0.015  # close to the analytic 1.35%, not suspiciously exact
    # decoding to bucket means preserves the sum (per bucket, hence overall)
    assert abs(float(y.double().sum() - x.double().sum())) < 1e-3 * float(x.abs().sum()) / math.sqrt(x.numel())
    assert codec.ratio(x.numel()) == pytest.approx(4.0, rel=1e-3)


def test_topk_keeps_the_largest_exactly() -> None:
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(1))
    codec = build_codec("topk", fraction=0.05)
    y = roundtrip(codec, x)
    kept = y != 0
    assert int(kept.sum()) == 500
    assert torch.equal(y[kept], x[kept])
    assert float(x[~kept].abs().max()) <= float(x[kept].abs().min())
    assert codec.encoded_nbytes(10_000) == 500 * 8


def test_sparseloco_keeps_the_top_k_of_every_chunk_at_two_levels() -> None:
    n, chunk = 10_000, 1024
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    codec = SparseLoCo(0.02, chunk)
    y = roundtrip(codec, x)
    # chunks of 1024, 1024, ..., 784: k = ceil(0.02 m) = 21 per full chunk, 16 for the last
    ks = [21] * 9 + [16]
    assert codec.encoded_nbytes(n) == 10 * 8 + sum((k * (10 + 2) + 7) // 8 for k in ks)
    for c, k in enumerate(ks):
        xs, ys = x[c * chunk : (c + 1) * chunk], y[c * chunk : (c + 1) * chunk]
        kept = ys != 0
        assert int(kept.sum()) == k
        assert float(xs[~kept].abs().max()) <= float(xs[kept].abs().min())  # the largest, exactly
        assert torch.equal(ys[kept].sign(), xs[kept].sign())
        assert len(set(ys[kept].abs().tolist())) <= 2  # two magnitudes per chunk
    assert codec.ratio(n) > 100


def test_sparseloco_error_feedback_keeps_residual_plus_sent_equal_to_the_input() -> None:
    codec = SparseLoCo(0.01, 4096)
    gen = torch.Generator().manual_seed(5)
    ef = Residual()
    total_in = torch.zeros(50_000, dtype=torch.float64)
    total_sent = torch.zeros(50_000, dtype=torch.float64)
    for _ in range(5):  # what the rounds sent plus what is still held back is everything put in
        x = torch.randn(50_000, generator=gen)
        total_in += x.double()
        ef.add_to(x)
        sent = roundtrip(codec, x)
        ef.tensor = x - sent
        dropped = sent == 0
        assert torch.equal(ef.tensor[dropped], x[dropped])  # nothing of a dropped value is lost
        total_sent += sent.double()
    torch.testing.assert_close(total_sent + ef.tensor.double(), total_in, rtol=0, atol=1e-5)


def test_fp4_levels_are_powers_of_two_of_the_block_max() -> None:
    x = torch.tensor([1.0, -0.5, 0.25, 0.3, 0.0, 0.001, -0.74, 0.76])
    y = roundtrip(FP4(8), x)
    assert y.tolist() == [1.0, -0.5, 0.25, 0.25, 0.0, 0.0, -0.5, 1.0]


@pytest.mark.parametrize("name", BYTE_CODECS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_refused_at_sender(name: str, bad: float) -> None:
    x = torch.randn(1000)
    x[137] = bad
    with pytest.raises(NonFiniteError, match="non-finite"):
        build_codec(name).encode(x)


def test_fp16_overflow_refused() -> None:
    with pytest.raises(NonFiniteError, match="exceeds fp16"):
        build_codec("fp16").encode(torch.tensor([1.0, 1e6]))


@pytest.mark.parametrize("name", ["int8", "int4", "fp4"])
def test_constant_and_zero_tensors(name: str) -> None:
    codec = build_codec(name)
    z = torch.zeros(100)
    assert torch.equal(roundtrip(codec, z), z)
    c = torch.full((100,), 0.125)
    torch.testing.assert_close(roundtrip(codec, c), c)


def test_powersgd_exact_on_low_rank_and_error_feedback_conserves() -> None:
    gen = torch.Generator().manual_seed(2)
    low = torch.randn(50, 2, generator=gen) @ torch.randn(2, 40, generator=gen)
    ps = PowerSGD(rank=4, error_feedback=False)
    out = [low.clone()]
    ps.all_reduce(out, lambda t: None)
    torch.testing.assert_close(out[0], low, rtol=1e-4, atol=1e-4)
    # error feedback: what was sent over rounds plus what is still owed equals what was input
    ps = PowerSGD(rank=1, error_feedback=True)
    inputs = [torch.randn(30, 20, generator=gen) for _ in range(5)]
    sent = torch.zeros(30, 20)
    for m in inputs:
        buf = [m.clone()]
        ps.all_reduce(buf, lambda t: None)
        sent += buf[0]
    err = ps.errors[0]
    assert err is not None
    torch.testing.assert_close(sent + err, sum(inputs), rtol=1e-4, atol=1e-4)
    assert ps.wire_floats([(30, 20), (7,)]) == 1 * (30 + 20) + 7


def test_residual_shape_checked() -> None:
    r = Residual(torch.zeros(3))
    with pytest.raises(ValueError, match="residual"):
        r.add_to(torch.zeros(4))


@pytest.mark.parametrize("name", BYTE_CODECS)
def test_a_payload_of_the_wrong_length_is_refused_before_a_kernel_reads_it(name: str) -> None:
    """Another site's bytes are checked before the compiled kernels (which do not check bounds)
    read them: one byte short or long is CorruptPayload, and so is another dtype."""
    codec = build_codec(name)
    good = codec.encode(torch.randn(4099, generator=torch.Generator().manual_seed(1)))
    for bad in (good[:-1], torch.cat([good, good[:1]]), good[: good.numel() // 4 * 4].view(torch.float32)):
        with pytest.raises(CorruptPayload, match=f"{name} codec"):
            codec.decode(bad, 4099)
    torch.testing.assert_close(codec.decode(good, 4099), codec.decode(good.clone(), 4099))  # the good one still decodes


def test_positions_outside_the_tensor_are_refused() -> None:
    """top-k's indices and SparseLoCo's chunk offsets come from the sender: an index past the end
    (or negative, which would count from the end) and an offset past its chunk's end (a chunk that
    is not a power of two, or the last, shorter chunk) are CorruptPayload."""
    topk = build_codec("topk")
    buf = topk.encode(torch.randn(1000))
    for index in (1000, -1):
        tampered = buf.clone()
        tampered[:4].view(torch.int32)[0] = index
        with pytest.raises(CorruptPayload, match="outside"):
            topk.decode(tampered, 1000)
    for codec, n in ((SparseLoCo(fraction=0.5, chunk=5), 10), (SparseLoCo(), 4097)):
        ones = torch.full((codec.encoded_nbytes(n),), 255, dtype=torch.uint8)  # every offset all ones: 7 of 5, 4095 of 1
        with pytest.raises(CorruptPayload, match="outside their chunk"):
            codec.decode(ones, n)


def test_a_message_that_is_not_whole_fp32_values_is_refused() -> None:
    msg = Message(src=1, arrival=0.0, fields=[], payload=torch.zeros(10, dtype=torch.uint8))
    with pytest.raises(CorruptPayload, match="10 bytes"):
        msg.floats()
    assert Message(src=1, arrival=0.0, fields=[], payload=torch.zeros(8, dtype=torch.uint8)).floats().numel() == 2


# --------------------------------------------------------------------------- over real groups


def _coded_rank(rank: int, sites: int, workers: int) -> dict:
    from geotrain.comm.collectives import Collectives
    from geotrain.comm.groups import ProcessGroups

    topo = uniform_topology(sites, workers)
    groups = ProcessGroups.build(topo, "gloo", timeout_s=60)
    out: dict = {}
    try:
        for name in BYTE_CODECS:
            codec = build_codec(name, fraction=0.1)
            for n in (1, 7, 4099, 65_537):
                comm = Collectives(groups)
                site = topo.site_of(rank)
                x = torch.randn(n, generator=torch.Generator().manual_seed(n + 17 * site))  # same within a site
                parts = [torch.randn(n, generator=torch.Generator().manual_seed(n + 17 * s)) for s in range(sites)]
                truth = torch.stack(parts).sum(0)
                comm.all_reduce_across_sites(x, codec, Residual() if codec.reduce == "gather" else None)
                out[(name, n)] = {
                    "x": hashlib.sha256(x.numpy().tobytes()).hexdigest(),
                    "err": relative_error(truth, x),
                    "inter": comm.stats.inter_bytes,
                    "raw": comm.stats.inter_raw_bytes,
                }
    finally:
        groups.destroy()
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sites,workers", [(2, 2), pytest.param(3, 1, marks=pytest.mark.slow)])
def test_coded_all_reduce_identical_everywhere_with_exact_bytes(sites: int, workers: int) -> None:
    results = run_ranks(sites * workers, _coded_rank, sites, workers)
    topo = uniform_topology(sites, workers)
    for key, first in results[0].items():
        name, n = key
        for rank, res in enumerate(results):
            assert res[key]["x"] == first["x"], f"{key}: rank {rank} differs from rank 0"
            # exact wire bytes: encoded chunks to the other sites' owners, then the encoded sum back
            codec = build_codec(name, fraction=0.1)
            local, site_index = rank % workers, topo.site_of(rank)
            shard = torch.empty(n).tensor_split(workers)[local].numel()
            if shard == 0:
                assert res[key]["inter"] == 0
                continue
            if codec.reduce == "gather":
                expected = (sites - 1) * codec.encoded_nbytes(shard)
                raw = (sites - 1) * 4 * shard
            else:
                chunks = [c.numel() for c in torch.empty(shard).tensor_split(sites)]
                own = chunks[site_index]
                others = [c for j, c in enumerate(chunks) if j != site_index and c]  # empty chunks are not sent
                expected = sum(codec.encoded_nbytes(c) for c in others) + (sites - 1) * (codec.encoded_nbytes(own) if own else 0)
                raw = 4 * sum(others) + (sites - 1) * 4 * own
            assert res[key]["inter"] == expected, key
            assert res[key]["raw"] == raw, key
        bound = {"topk": 1.0, "sparseloco": 1.0, "none": 1e-6}.get(name, 4 * GAUSS_BOUND.get(name, 1.0))
        if n >= 4099:
            assert first["err"] <= bound, (key, first["err"])


class _Linear(torch.nn.Module):
    """loss = Σ ⟨p_i, t_i⟩, so the gradient of p_i is exactly t_i."""

    def __init__(self, like: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.params = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros_like(t)) for t in like])

    def forward(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.stack([(p * t).sum() for p, t in zip(self.params, tensors, strict=True)]).sum()


def torch_powersgd(tensors: Sequence[torch.Tensor], rank: int, rounds: int = 1, seed: int = 0) -> list[torch.Tensor]:
    """PyTorch's PowerSGD hook applied ``rounds`` times (warm start, no error feedback) to ``tensors``.

    Call on every rank of an initialised process group, each with the same ``tensors``. The hook
    only runs inside DistributedDataParallel (which skips it on a single process), so this wraps
    a module whose gradients are exactly ``tensors`` and reads the gradients back after each
    backward: the hook averages over ranks, so what comes back is its rank-``rank`` approximation.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(_Linear(tensors), bucket_cap_mb=1 << 14)  # one bucket
    state = psgd.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=rank,
        start_powerSGD_iter=2,
        min_compression_rate=2,
        use_error_feedback=False,
        warm_start=True,
        random_seed=seed,
    )
    ddp.register_comm_hook(state, psgd.powerSGD_hook)
    out: list[torch.Tensor] = []
    for _ in range(2 + rounds):  # iterations below start_powerSGD_iter (2) are sent uncompressed
        ddp.zero_grad()
        ddp(tensors).backward()  # the forward must go through DDP to arm its reducer
        out = [p.grad.detach().clone() for p in ddp.module.params]  # type: ignore[union-attr]
    return out


def _torch_powersgd_rank(rank: int) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        gen = torch.Generator().manual_seed(0)
        decay = torch.diag(torch.linspace(1, 0.01, 128))
        ts = [torch.randn(64, 128, generator=gen) @ decay, torch.randn(200, 50, generator=gen), torch.randn(30, generator=gen)]
        flat = torch.cat([t.reshape(-1) for t in ts])

        def err(approx: list[torch.Tensor]) -> float:
            return relative_error(flat, torch.cat([a.reshape(-1) for a in approx]))

        res = {}
        for rounds in (1, 3):
            theirs = torch_powersgd(ts, 4, rounds)
            ps = PowerSGD(4, error_feedback=False)
            for _ in range(rounds):
                ours = [t.clone() for t in ts]
                ps.all_reduce(ours, lambda t: None)
            res[rounds] = (err(ours), err(theirs))
        return res
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_powersgd_matches_pytorch_powersgd_quality() -> None:
    res = run_ranks(2, _torch_powersgd_rank)[0]
    for rounds, (ours, theirs) in res.items():
        assert 0 < theirs < 1 and 0 < ours < 1
        assert abs(ours - theirs) <= 0.05 * theirs + 0.01, (rounds, ours, theirs)
    assert res[3][0] < res[1][0]  # warm start: the power iteration keeps improving


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "override,message",
    [
        ("sync.codec=int9", "sync.codec.name: Input should be"),
        ("sync.codec.bits=3", "sync.codec.bits: the int8 codec sends 8 bits per value (allowed: 8; got 3)"),
        ("sync.codec.fraction=0", "sync.codec.fraction: Input should be greater than 0"),
        (
            "sync.codec={name: sparseloco, fraction: 0.2}",
            "sync.codec.fraction: sparseloco sends 0.5-5% of each chunk's entries (0.005..0.05; got 0.2)",
        ),
        (
            "sync.codec={name: sparseloco, fraction: 0.001}",
            "sync.codec.fraction: sparseloco sends 0.5-5% of each chunk's entries (0.005..0.05; got 0.001)",
        ),
        ("sync.codec.rank=0", "sync.codec.rank: Input should be greater than or equal to 1"),
        ("sync.codec.block_size=63", "sync.codec.block_size: must be even"),
        ("run.backend=nccl", "run.backend: nccl runs one rank per GPU"),  # (a codec is no reason: this machine has no GPU)
    ],
)
def test_bad_codec_config_is_one_line(override: str, message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "geotrain", "train", "--set", "sync.codec=int8", "--set", override],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_codec_section_is_set_by_name_or_key_by_key(tmp_path: Path) -> None:
    """sync.codec is one section: its name alone keeps the other keys (in either order, from a
    file or an override), and every key that was flat in sync is refused naming its new one."""
    from geotrain.config import ConfigError, load_config
    from geotrain.config.sync import MOVED_CODEC_KEYS

    for over in (["sync.codec=topk", "sync.codec.fraction=0.05"], ["sync.codec.fraction=0.05", "sync.codec=topk"]):
        c = load_config(None, over).sync.codec
        assert (c.name, c.fraction, c.uses_error_feedback) == ("topk", 0.05, True), over
    f = tmp_path / "c.yaml"
    f.write_text("sync:\n  codec: sparseloco\n")
    c = load_config(f, ["sync.codec.variant=chunks"]).sync.codec
    assert (c.name, c.variant, c.error_decay) == ("sparseloco", "chunks", 1.0)
    assert load_config(f).sync.codec.published_sparseloco
    assert len(MOVED_CODEC_KEYS) == 12
    for old, new in MOVED_CODEC_KEYS.items():
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"{old}=1"])
        assert str(err.value) == f"{old}: moved to {new}"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_codecs_cli_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "codecs.json"
    proc = subprocess.run(
        [sys.executable, "-m", "geotrain", "bench", "codecs", "--size-mib", "0.25", "--reps", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    entries = {e["codec"]: e for e in result["entries"]}
    assert set(entries) == set(CODEC_NAMES)
    for e in entries.values():
        assert {"codec", "ratio", "rel_error", "encode_gbps", "decode_gbps", "reference_encode_gbps"} <= e.keys()
        assert e["ratio"] >= 1.0
    n = result["size_bytes"] // 4
    assert n == 65_536
    assert entries["int8"]["rel_error"] <= 0.015 and entries["int8"]["ratio"] == pytest.approx(4 * n / (n + 1024))
    assert entries["fp4"]["ratio"] == pytest.approx(4 * n / (n // 2 + 4 * n // 64))
    assert 0 < entries["int8"]["rel_error_pseudo_gradient"] < 0.05
    assert "int8" in proc.stdout and "speed-up" in proc.stdout


def test_codec_quality_summary_and_reuse_of_finished_runs(tmp_path: Path) -> None:
    import yaml

    from geotrain.bench.quality import _finished, summarise

    pts = [
        {"label": lab, "seed": s, "final_eval_loss": loss, "inter_site_bytes": b, "hashes_agree": True}
        for lab, s, loss, b in [("ddp", 1, 2.0, 1000), ("ddp", 2, 2.2, 1000), ("x", 1, 2.02, 10), ("x", 2, 2.2, 10)]
    ]
    ddp, x = summarise(pts)
    assert ddp["mean_gap_to_ddp"] == 0 and ddp["bytes_ratio_vs_ddp"] == 1
    # gaps at the same seed: +1% and 0%
    assert x["mean_gap_to_ddp"] == pytest.approx(0.005) and x["std_gap_to_ddp"] == pytest.approx(math.sqrt(2) * 0.005)
    assert x["mean_eval_loss"] == pytest.approx(2.11) and x["bytes_ratio_vs_ddp"] == 100
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"a": 1}))
    assert _finished(run, {"a": 1}) is None  # no summary: not finished
    (run / "summary.json").write_text('{"final_eval_loss": 1.5}')
    assert _finished(run, {"a": 1}) == {"final_eval_loss": 1.5}
    assert _finished(run, {"a": 2}) is None  # another configuration: trained again


def test_a_reducers_codec_has_its_kernels_loaded_before_any_exchange() -> None:
    """``make_codec`` warms the codec: its compiled kernels are loaded when the reducer is made
    (0.4-0.6 s from numba's cache on first use), not in the first round, where an adapted run
    would time the load as network. Checked in a fresh interpreter, by the kernels' compiled
    signatures, never by a clock."""
    probe = (
        "from geotrain.codecs import kernels as k\n"
        "from geotrain.config import SyncConfig\n"
        "from geotrain.sync.reducer import make_codec\n"
        "names = ('int8_encode', 'lookup_decode', 'block4_encode', 'block4_decode', 'sparse2_encode', 'sparse2_decode')\n"
        "before = [len(getattr(k, n).signatures) for n in names]\n"
        "for c in ('int8', 'fp4', 'sparseloco'):\n"
        "    make_codec(SyncConfig(codec={'name': c, 'variant': 'chunks'}))\n"
        "print(json.dumps([before, [len(getattr(k, n).signatures) for n in names]]))\n"
    )
    out = subprocess.run([sys.executable, "-c", "import json\n" + probe], capture_output=True, text=True, timeout=120, check=True)
    before, after = json.loads(out.stdout)
    assert before == [0] * 6 and all(n >= 1 for n in after), out.stdout
