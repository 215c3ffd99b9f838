"""SparseLoCo as published, against a plain-PyTorch reference of the algorithm written from the paper
(arXiv 2508.15706) and its published code: per tensor, error feedback e ← β·e + Δ; top-k in each
64×64 tile (h × w: the largest divisors of the dimensions up to 64) of e; the kept values in 4
bins of 1.5 σ around their mean, decoded to the bins' means; e ← e − what was sent; each coordinate
averaged over the workers that sent it (``scatter_reduce(mean, include_self=False)``); the outer
step θ ← θ − 1·mean (SGD, lr 1, no momentum). Vectors follow geotrain's documented rule: runs of
4,096 values, the last shorter.

geotrain's rounds run for real: 3 sites on Gloo over 127.0.0.1, DiLoCo with ``sync.codec=sparseloco``
through the reducer, the collectives and the outer optimizer, inner SGD steps of given gradients.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import run_ranks, uniform_topology

SITES, H, ROUNDS, FRACTION, BETA, TILE = 3, 2, 4, 1 / 32, 0.95, 64
SHAPES = [(128, 128), (96, 40), (300,), (5000,), (64, 8, 8)]


class Tensors(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(*s, generator=g) * 0.02) for s in SHAPES])


def _grads(site: int, rnd: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * site + 100 * rnd + step)
    # heavy tails, as pseudo-gradients have: a few coordinates much larger than the rest
    return [torch.randn(*s, generator=g) * torch.rand(*s, generator=g).pow(4) * 0.01 for s in SHAPES]


def _geotrain_rank(rank: int) -> list[list[float]]:
    from geotrain.comm.session import rank_comm
    from geotrain.config import SyncConfig
    from geotrain.round import build_round

    model = Tensors()
    with rank_comm(uniform_topology(SITES, 1), "off") as (_groups, comm):
        inner = torch.optim.SGD(model.parameters(), lr=1.0)
        cfg = SyncConfig(algorithm="diloco", H=H, codec={"name": "sparseloco", "fraction": FRACTION})
        with build_round(cfg, model, inner, comm, grad_clip=0.0) as sync:
            for rnd in range(ROUNDS):
                for step in range(H):
                    for p, g in zip(model.ps, _grads(rank, rnd, step), strict=True):
                        p.grad = g
                    inner.step()
            sync.finish()
    return [p.detach().reshape(-1).tolist() for p in model.ps]


# ---------------------------------------------------------------- the reference, plain PyTorch


def _divisor(n: int, most: int) -> int:
    return max(d for d in range(1, min(n, most) + 1) if n % d == 0)


def _chunks(t: torch.Tensor) -> list[torch.Tensor]:
    """Views of ``t`` as [chunks, values per chunk] blocks: a matrix's tiles, or a vector's runs."""
    if t.dim() >= 2:
        r, c = t.shape[0], t.numel() // t.shape[0]
        h, w = _divisor(r, TILE), _divisor(c, TILE)
        return [t.reshape(r // h, h, c // w, w).permute(0, 2, 1, 3).reshape(-1, h * w)]
    run, v = TILE * TILE, t.reshape(-1)
    full = v.numel() // run * run
    return [b for b in (v[:full].reshape(-1, run), v[full:].reshape(1, -1)) if b.numel()]


def _unchunk(blocks: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    if like.dim() >= 2:
        r, c = like.shape[0], like.numel() // like.shape[0]
        h, w = _divisor(r, TILE), _divisor(c, TILE)
        return blocks[0].reshape(r // h, c // w, h, w).permute(0, 2, 1, 3).reshape(like.shape)
    return torch.cat([b.reshape(-1) for b in blocks]).reshape(like.shape)


def _compress(e: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per block: the kept positions and their 2-bit-decoded values (the tensor's 4 bins)."""
    idx, val = [], []
    for b in _chunks(e):
        k = max(1, math.ceil(FRACTION * b.shape[1]))
        i = torch.topk(b.abs(), k, dim=1, sorted=False).indices
        idx.append(i)
        val.append(b.gather(1, i))
    flat = torch.cat([v.reshape(-1) for v in val])
    shift = flat.mean()
    centred = flat - shift
    std = centred.norm() / math.sqrt(centred.numel() - 1) if centred.numel() > 1 else torch.tensor(0.0)
    scale = 6.0 * std / 4
    if scale == 0 or not torch.isfinite(scale):
        scale = torch.tensor(1.0)
    q = (centred / scale + 2).round().clamp(0, 3).long()
    sums = torch.zeros(4).scatter_add_(0, q, centred)
    counts = torch.zeros(4).scatter_add_(0, q, torch.ones_like(centred))
    lookup = torch.where(counts > 0, sums / counts, 0.0)
    decoded = lookup[q] + shift
    out, at = [], 0
    for v in val:
        out.append(decoded[at : at + v.numel()].view_as(v))
        at += v.numel()
    return idx, out


def _dense(idx: list[torch.Tensor], val: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    blocks = [torch.zeros_like(b).scatter(1, i, v) for b, i, v in zip(_chunks(torch.zeros_like(like)), idx, val, strict=True)]
    return _unchunk(blocks, like)


def _reference() -> list[torch.Tensor]:
    theta = [p.detach().clone() for p in Tensors().ps]
    errors = [[torch.zeros_like(t) for t in theta] for _ in range(SITES)]
    for rnd in range(ROUNDS):
        sent: list[list[tuple[list[torch.Tensor], list[torch.Tensor]]]] = []
        for s in range(SITES):
            local = [t.clone() for t in theta]
            for step in range(H):
                for p, g in zip(local, _grads(s, rnd, step), strict=True):
                    p.add_(g, alpha=-1.0)
            mine = []
            for j, (t, p) in enumerate(zip(theta, local, strict=True)):
                e = errors[s][j].mul_(BETA).add_(t - p)
                idx, val = _compress(e)
                e.sub_(_dense(idx, val, e))
                mine.append((idx, val))
            sent.append(mine)
        for j, t in enumerate(theta):
            blocks = []
            for bi, b in enumerate(_chunks(torch.zeros_like(t))):
                i = torch.cat([sent[s][j][0][bi] for s in range(SITES)], dim=1)
                v = torch.cat([sent[s][j][1][bi] for s in range(SITES)], dim=1)
                blocks.append(torch.zeros_like(b).scatter_reduce_(1, i, v, reduce="mean", include_self=False))
            t.sub_(_unchunk(blocks, t))  # outer SGD, lr 1, no momentum
    return theta


@pytest.mark.timeout(180)
def test_sparseloco_rounds_equal_a_plain_pytorch_reference_of_the_published_algorithm() -> None:
    got = run_ranks(SITES, _geotrain_rank, timeout=150)
    want = _reference()
    for site in got:
        for g, w in zip(site, want, strict=True):
            g = torch.tensor(g)
            w = w.reshape(-1)
            assert torch.allclose(g, w, rtol=1e-6, atol=1e-9), float((g - w).abs().max())
    # every site ends on the same model, and the rounds moved it (the comparison is not of two starts)
    assert all(s == got[0] for s in got)
    start = torch.cat([p.detach().reshape(-1) for p in Tensors().ps])
    assert float((torch.cat([torch.tensor(x) for x in got[0]]) - start).abs().max()) > 1e-3


# ---------------------------------------------------------------- the codec and its parts, one process


def test_tiles_follow_the_published_rule_and_vectors_run_in_4096s() -> None:
    from geotrain.codecs.sparseloco import tile_layout

    lay = tile_layout([(128, 128), (96, 40), (5000,), (64, 8, 8)], 0.01)
    got = [(g.rows, g.size, g.k, g.tensor) for g in lay.groups]
    # 4 tiles of 64 x 64; 96 x 40 in 2 tiles of 48 x 40; 5,000 values in 4,096 + 904; 64 x 64 (8 x 8 read as 64) in 1
    assert got == [(4, 4096, 41, 0), (2, 1920, 20, 1), (1, 4096, 41, 2), (1, 904, 10, 2), (1, 4096, 41, 3)]
    assert lay.perm is not None and sorted(lay.perm.tolist()) == list(range(lay.n))  # a reordering, nothing lost


def test_the_codec_keeps_each_tiles_top_k_at_four_levels_per_tensor_and_refuses_a_bad_offset() -> None:
    from geotrain.codecs.sparseloco import TiledSparseLoCo
    from geotrain.errors import CorruptPayload

    codec = TiledSparseLoCo(FRACTION, shapes=[(128, 128), (300,)])
    x = torch.randn(128 * 128 + 300, generator=torch.Generator().manual_seed(0))
    buf = codec.encode(x)
    assert buf.numel() == codec.encoded_nbytes(x.numel()) == 2 * 20 + (4 * 128 * 14 + 10 * 11 + 7) // 8
    sent = torch.zeros(x.numel(), dtype=torch.bool)
    y = codec.decode(buf, x.numel(), sent=sent)
    w, d = x[: 128 * 128].view(128, 128), sent[: 128 * 128].view(128, 128)
    for r in (0, 64):
        for c in (0, 64):
            tile, kept = w[r : r + 64, c : c + 64].abs(), d[r : r + 64, c : c + 64]
            assert int(kept.sum()) == 128 and bool(tile[kept].min() >= tile[~kept].max())
    assert bool((y[~sent] == 0).all()) and len(set(y[: 128 * 128][sent[: 128 * 128]].tolist())) <= 4
    assert int(sent[128 * 128 :].sum()) == 10  # the vector: ceil(300 / 32)
    bad = buf.clone()
    bad[40:] = 255  # every offset field all ones: 4,095 fits a tile, 511 does not fit the 300-value run
    with pytest.raises(CorruptPayload, match="offset"):
        codec.decode(bad, x.numel())
    with pytest.raises(CorruptPayload):
        codec.decode(buf[:-1], x.numel())
    nan = buf.clone()
    nan[:4].view(torch.float32).fill_(float("nan"))  # the first tensor's shift
    with pytest.raises(CorruptPayload, match="not finite"):
        codec.decode(nan, x.numel())


def test_the_per_sender_mean_counts_only_the_sites_that_sent_a_coordinate() -> None:
    from geotrain.codecs.sparseloco import TiledSparseLoCo
    from geotrain.comm.coded import GatherSum

    codec = TiledSparseLoCo(1 / 64, shapes=[(64,)])
    a, b = torch.zeros(64), torch.zeros(64)
    a[3], b[3], b[9] = 2.0, 4.0, -8.0  # one entry each (k = 1): a sends 3, b sends 9
    x = torch.empty(64)
    acc = GatherSum(codec, x, mean=True)
    for v in (a, b):
        acc.add(codec.encode(v))
    acc.finish()
    assert x[3] == pytest.approx(2.0) and x[9] == pytest.approx(-8.0) and int((x != 0).sum()) == 2
    # weighted: shares 1 and 3, values pre-weighted: (1*2) / 1 where only a sent; b alone at 9
    acc = GatherSum(codec, x, mean=True)
    acc.add(codec.encode(a), share=0.25, weight=0.25)
    acc.add(codec.encode(b), share=0.75, weight=0.75)
    acc.finish()
    assert x[3] == pytest.approx(2.0) and x[9] == pytest.approx(-8.0)
    # a plain sum (DDP's gradients, the chunks variant)
    acc = GatherSum(codec, x, mean=False)
    acc.add(codec.encode(b))
    acc.add(codec.encode(b))
    assert acc.finish()[9] == pytest.approx(-16.0)


def test_error_feedback_decays_the_residual_it_keeps() -> None:
    from geotrain.codecs import Residual

    r = Residual(decay=0.95)
    r.keep(torch.full((4,), 2.0))
    assert r.tensor is not None and torch.equal(r.tensor, torch.full((4,), 1.9))
    r.keep(None)
    assert r.tensor is None


def test_sparseloco_defaults_and_the_outer_step_a_user_sets() -> None:
    from geotrain.config import load_config

    def sync(*o: str):  # type: ignore[no-untyped-def]
        return load_config(None, list(o)).sync

    assert (sync().outer_sgd, sync().codec.error_decay) == ((0.7, 0.9, True), 1.0)
    s = sync("sync.codec=sparseloco")
    assert (s.outer_sgd, s.codec.error_decay, s.codec.variant) == ((1.0, 0.0, False), 0.95, "published")
    assert sync("sync.codec=sparseloco", "sync.outer_lr=0.5").outer_sgd == (0.5, 0.0, False)
    assert sync("sync.codec=sparseloco", "sync.codec.variant=chunks").outer_sgd == (0.7, 0.9, True)
    assert sync("sync.codec=sparseloco", "sync.codec.ef_decay=1.0").codec.error_decay == 1.0
    assert sync("sync.outer_momentum=0").outer_sgd == (0.7, 0.0, False)


def test_the_many_round_regime_and_its_coverage_column() -> None:
    from geotrain.bench.quality import _coverage, many_rounds, quality_runs
    from geotrain.config import load_config

    runs = dict(quality_runs(regime="many"))
    assert list(runs) == [
        "ddp",
        "diloco",
        "sparseloco k=0.03125",
        "sparseloco k=0.01",
        "sparseloco(chunks) k=0.03125",
        "muloco k=0.03125",
    ]
    cfg = load_config(None, [*many_rounds(100), *runs["sparseloco k=0.03125"]])
    assert len(cfg.topology.sites) == 8 and cfg.train.steps == 1500 and cfg.sync.H == 15
    assert _coverage(cfg) == {"rounds": 100, "density": 0.03125, "workers": 8, "rounds_x_density_x_workers": 25.0}
    ddp = load_config(None, [*many_rounds(100), *runs["ddp"]])
    assert _coverage(ddp)["rounds_x_density_x_workers"] == 1500 * 8
