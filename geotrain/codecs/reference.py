"""Straightforward torch-ops versions of the quantising codecs: the yardstick for the kernels.

Same formats and the same arithmetic as :mod:`geotrain.codecs` (the tests check the codes agree),
written the way one would with tensor ops: every step is a full pass with a temporary. The
benchmark measures the fused kernels against these. (PyTorch's own PowerSGD hook, the yardstick
of :mod:`geotrain.codecs.powersgd`, needs a process group, so it runs in tests/test_codecs.py.)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

FP4_MIDPOINTS = torch.tensor([2.0**-7] + [0.75 * 2.0 ** (k - 7) for k in range(2, 8)], dtype=torch.float32)


def int8_encode(x: torch.Tensor, sigma_range: float = 6.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8, table fp32[256])."""
    mean = x.double().mean()
    std = (x.double().pow(2).mean() - mean * mean).clamp_min(0).sqrt()
    half = float(sigma_range * std)
    if half <= 1e-30 * max(1.0, abs(float(mean))):  # constant tensor, as in the fast codec
        half = max(abs(float(mean)), 1e-30)
    lo = float(mean) - half
    lo32 = torch.tensor(lo, dtype=torch.float32)
    inv32 = torch.tensor(256.0 / (2 * half), dtype=torch.float32)
    t = ((x - lo32) * inv32).clamp(0, 255)
    codes = t.floor().to(torch.uint8)
    idx = codes.long()
    sums = torch.bincount(idx, weights=x.double(), minlength=256)
    counts = torch.bincount(idx, minlength=256)
    centres = lo + (torch.arange(256, dtype=torch.float64) + 0.5) * (2 * half / 256)
    table = torch.where(counts > 0, sums / counts.clamp_min(1), centres).float()
    return codes, table


def int8_decode(codes: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return table[codes.long()]


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    pad = (-x.numel()) % block
    return F.pad(x, (0, pad)).view(-1, block)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    flat = codes.reshape(-1)
    if flat.numel() % 2:
        flat = F.pad(flat, (0, 1))
    return flat[0::2] | (flat[1::2] << 4)


def _unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1)[:n]


def block4_encode(x: torch.Tensor, block: int = 64, fp4: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes uint8, scales fp32 per block) for int4 or fp4 (E3M0)."""
    n = x.numel()
    b = _blocks(x, block)
    scale = b.abs().amax(dim=1, keepdim=True)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    if fp4:  # e = how many midpoints (scaled to the block) |x| reaches
        e = (b.abs().unsqueeze(-1) >= safe.unsqueeze(-1) * FP4_MIDPOINTS).sum(-1)
        codes = e | ((b < 0) & (e > 0)).long() << 3
    else:
        codes = torch.floor(b * (7.0 / safe) + 0.5).long() + 8
    codes = torch.where(scale > 0, codes, torch.full_like(codes, 0 if fp4 else 8))
    packed = _pack(codes.reshape(-1)[:n].to(torch.uint8))
    return packed[: (n + 1) // 2], scale.reshape(-1).float()


def block4_decode(packed: torch.Tensor, scales: torch.Tensor, n: int, block: int = 64, fp4: bool = False) -> torch.Tensor:
    codes = _unpack(packed, n).long()
    s = scales.repeat_interleave(block)[:n]
    if fp4:
        e = codes & 7
        mag = torch.where(e > 0, s * torch.pow(2.0, (e - 7).float()), torch.zeros_like(s))
        return torch.where(codes & 8 > 0, -mag, mag)
    return (codes - 8).float() * (s / 7.0)


def sparse2_encode(x: torch.Tensor, fraction: float, chunk: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """SparseLoCo's format with tensor ops: per chunk, (kept offsets, 2-bit codes) and the two
    level scales. Returns ([offsets, codes] per chunk row block, scales fp32 [chunks, 2])."""
    n = x.numel()
    full = n // chunk * chunk
    blocks = [x[:full].view(-1, chunk)] if full else []
    if n > full:
        blocks.append(x[full:].view(1, -1))
    entries, scales = [], []
    for b in blocks:
        m = b.shape[1]
        k = min(m, max(1, math.ceil(fraction * m)))
        a = b.abs()
        idx = torch.sort(-a, dim=1, stable=True).indices[:, :k].sort(dim=1).values  # ties: lowest index
        mag = a.gather(1, idx)
        mean = (mag.double().sum(1) / k).float().unsqueeze(1)
        hi = mag >= mean
        n_hi = hi.sum(1, keepdim=True)
        n_lo = k - n_hi
        s_hi = torch.where(n_hi > 0, (mag.double() * hi).sum(1, keepdim=True) / n_hi.clamp_min(1), mean.double())
        s_lo = torch.where(n_lo > 0, (mag.double() * ~hi).sum(1, keepdim=True) / n_lo.clamp_min(1), mean.double())
        codes = (b.gather(1, idx) < 0).long() * 2 + hi.long()
        entries.append((idx, codes))
        scales.append(torch.cat([s_lo, s_hi], dim=1).float())
    return [torch.stack([i.reshape(-1), c.reshape(-1)]) for i, c in entries], (torch.cat(scales) if scales else torch.empty(0, 2))


def sparse2_decode(entries: list[torch.Tensor], scales: torch.Tensor, n: int, chunk: int) -> torch.Tensor:
    """Dense fp32 from :func:`sparse2_encode`'s output: zeros except ± each kept entry's level scale."""
    full = n // chunk * chunk
    shapes = ([(full // chunk, chunk, 0)] if full else []) + ([(1, n - full, full)] if n > full else [])
    out = torch.zeros(n)
    row = 0
    for (rows, _, base), e in zip(shapes, entries, strict=True):
        idx, codes = e[0].view(rows, -1), e[1].view(rows, -1)
        mag = scales[row : row + rows].gather(1, codes & 1)
        pos = idx + base + (torch.arange(rows) * chunk).unsqueeze(1)
        out[pos.reshape(-1)] = torch.where(codes & 2 > 0, -mag, mag).reshape(-1)
        row += rows
    return out
