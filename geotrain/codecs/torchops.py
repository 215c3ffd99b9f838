"""The quantising codecs in torch ops: the wire formats of :mod:`geotrain.codecs.kernels`, run
wherever the tensor lives (a GPU's, or a CPU's where ``GEOTRAIN_CODEC_KERNELS=0``).

Why torch ops on a device: the numba kernels are one-thread CPU loops, and a GPU tensor would
cross to the host and back for every encoding. Every function here is a few full passes over
memory, each one a fused elementwise or reduction kernel on a GPU, so it runs at the device's
memory bandwidth without a compiler at run time (docs/CODECS.md gives the choice and the numbers).

The formats and the arithmetic are the kernels' (the tests compare them on CPU):

* **decoding is the same arithmetic, bit for bit** (each value is a table lookup, or a per-block
  table computed in float64 and rounded once, as the kernels do), so sites on CPUs and GPUs that
  receive the same bytes hold the same values;
* **encoding** may differ from the kernels only where a float64 sum is added in another order
  (int8's moments and bucket means, SparseLoCo's level scales): a value within a rounding of a
  bucket's edge may land in the next bucket, which is the codec's own rounding.

Each encoder returns ``(buffer, finite)``; ``finite`` is False when the input holds a NaN or an
infinity, which the codec refuses to send.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from geotrain.codecs.base import kept

FP4_MIDPOINTS = (2.0**-7, *(0.75 * 2.0 ** (k - 7) for k in range(2, 8)))  # relative to the block's max |x|
INT8_TABLE = 256 * 4


# device types whose tensors run the elementwise cores below compiled (torch.compile: one fused
# pass each, where eager torch ops make three or four); a CPU's tensors normally take the numba kernels
COMPILE_ON = {"cuda"}
_compiled: dict[str, Callable[..., Any]] = {}
_failed: set[str] = set()
_lock = threading.Lock()


def _run(fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """``fn(*args)``, compiled where the first tensor's device is in :data:`COMPILE_ON`. Compiled
    and eager give the same bits: the cores are elementwise, no sum whose order could change. A
    core that fails to compile runs eagerly from then on (said once on stderr). One lock: the
    exchange's lanes are threads, and a compilation must not race another."""
    if args[0].device.type not in COMPILE_ON or fn.__name__ in _failed:
        return fn(*args)
    with _lock:
        try:
            if fn.__name__ not in _compiled:
                _compiled[fn.__name__] = torch.compile(fn, dynamic=True)
            return _compiled[fn.__name__](*args)
        except Exception as exc:  # noqa: BLE001 - any compiler failure: the eager core gives the same bytes
            _failed.add(fn.__name__)
            print(f"geotrain codecs: {fn.__name__} runs eagerly, torch.compile failed: {exc!r:.200}", file=sys.stderr)
            return fn(*args)


def int8_range(mean: float, var: float, sigma_range: float) -> tuple[float, float]:
    """(lo, half) of int8's 256 buckets, lo + 2·half wide, from the mean and the variance."""
    std = math.sqrt(max(var, 0.0))
    half = sigma_range * std
    if half <= 1e-30 * max(1.0, abs(mean)):  # constant tensor: one bucket holds it exactly
        half = max(abs(mean), 1e-30)
    return mean - half, half


def _int8_codes(x: torch.Tensor, lo: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    return ((x - lo) * inv).clamp(0, 255).to(torch.uint8)  # (fp32, truncated: the kernel's arithmetic)


def _lookup(codes: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return table[codes.long()]


def int8_encode(x: torch.Tensor, sigma_range: float) -> tuple[torch.Tensor, bool]:
    """A 1 KiB table of bucket means, then one bucket index per value."""
    n = x.numel()
    buf = torch.empty(INT8_TABLE + n, dtype=torch.uint8, device=x.device)
    if n == 0:
        buf.zero_()
        return buf, True
    xd = x.double()  # (the kernel's float64 accumulators; a constant tensor's moments come out exact)
    var, mean = (float(v) for v in torch.var_mean(xd, correction=0))
    if not (math.isfinite(mean) and math.isfinite(var)):
        return buf, False
    lo, half = int8_range(mean, var, sigma_range)
    inv_step = 256.0 / (2 * half)
    lo32, inv32 = torch.tensor([lo, inv_step], dtype=torch.float32, device=x.device).unbind()
    codes = buf[INT8_TABLE:]
    codes.copy_(_run(_int8_codes, x, lo32, inv32))
    sums = torch.bincount(codes, weights=xd, minlength=256)
    counts = torch.bincount(codes, minlength=256)
    centres = lo + (torch.arange(256, dtype=torch.float64, device=x.device) + 0.5) * (1.0 / inv_step)
    buf[:INT8_TABLE].view(torch.float32).copy_(torch.where(counts > 0, sums / counts.clamp_min(1), centres))
    return buf, True


def int8_decode(buf: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    out.copy_(_run(_lookup, buf[INT8_TABLE:], buf[:INT8_TABLE].view(torch.float32)))
    return out


def _block4_codes(b: torch.Tensor, m: torch.Tensor, n: int, fp4: bool) -> torch.Tensor:
    """The packed codes of blocks ``b`` (``[blocks, block]``, zero-padded past ``n`` values) with
    scales ``m`` (``[blocks, 1]``, max |x|)."""
    a = b.abs()
    if fp4:  # e = how many midpoints (scaled to the block's max) |x| reaches
        e = sum((a >= m * t).to(torch.uint8) for t in FP4_MIDPOINTS)
        codes = e | ((b < 0) & (e > 0)).to(torch.uint8) << 3
    else:
        codes = (torch.floor(b * (7.0 / m) + 0.5) + 8).nan_to_num(8).to(torch.uint8)
    codes = torch.where(m > 0, codes, 0 if fp4 else 8)
    inside = torch.arange(b.numel(), device=b.device).view(b.shape) < n
    codes = torch.where(inside, codes, 0)  # (an odd count's last byte: its high nibble is 0, as the kernel writes)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).reshape(-1)


def _block4_values(packed: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    codes = torch.stack([packed & 15, packed >> 4], dim=1).view(lut.shape[0], -1)
    return lut.gather(1, codes.long()).reshape(-1)


def block4_encode(x: torch.Tensor, block: int, fp4: bool) -> tuple[torch.Tensor, bool]:
    """One fp32 scale per block (its max |x|), then two 4-bit codes per byte, low nibble first."""
    n = x.numel()
    nb = -(-n // block)
    b = F.pad(x, (0, nb * block - n)).view(nb, block)
    m = b.abs().amax(dim=1, keepdim=True) if nb else b.new_zeros(0, 1)
    finite = bool(torch.isfinite(m).all())  # amax carries a NaN or an infinity through
    packed = _run(_block4_codes, b, m, n, fp4)[: (n + 1) // 2] if nb else b.new_zeros(0, dtype=torch.uint8)
    return torch.cat([m.reshape(-1).view(torch.uint8), packed]), finite


def block4_decode(buf: torch.Tensor, n: int, block: int, fp4: bool, out: torch.Tensor) -> torch.Tensor:
    nb = -(-n // block)
    if not nb:
        return out
    s = buf[: 4 * nb].view(torch.float32).double().unsqueeze(1)
    c = torch.arange(16, device=buf.device)
    if fp4:  # each block's 16 values in float64, rounded to fp32 once, as the kernel's table
        e = c & 7
        mag = torch.where(e > 0, s * torch.pow(2.0, (e - 7).double()), torch.zeros_like(s))
        lut = torch.where(c & 8 > 0, -mag, mag).float()
    else:
        lut = ((c - 8).double() * (s / 7.0)).float()
    packed = F.pad(buf[4 * nb :], (0, nb * block // 2 - (buf.numel() - 4 * nb)))  # (whole blocks: the last one padded)
    out.copy_(_run(_block4_values, packed, lut)[:n])
    return out


def bits_of(payload: torch.Tensor) -> torch.Tensor:
    """The bits of each byte along the last dimension, least significant first (8 per byte)."""
    return ((payload.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8, device=payload.device)) & 1).flatten(-2)


def bytes_of(bits: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`bits_of`: every 8 bits along the last dimension (a multiple of 8) as a byte."""
    b = bits.to(torch.uint8).unflatten(-1, (-1, 8))
    return (b << torch.arange(8, dtype=torch.uint8, device=bits.device)).sum(-1, dtype=torch.uint8)


def _rows(n: int, chunk: int) -> list[tuple[int, int, int]]:
    """(first value, rows, values per row) of the full chunks, then of the shorter last chunk."""
    full = n // chunk
    return [g for g in ((0, full, chunk), (full * chunk, 1, n - full * chunk)) if g[1] and g[2]]


def sparse2_encode(x: torch.Tensor, chunk: int, fraction: float, offset_bits: int) -> tuple[torch.Tensor, bool]:
    """SparseLoCo's chunked format (:func:`geotrain.codecs.kernels.sparse2_encode`): two fp32 level
    scales per chunk, then per chunk its kept entries bit-packed, each chunk from a new byte."""
    if not bool(torch.isfinite(x).all()):
        return x.new_empty(0, dtype=torch.uint8), False
    width = offset_bits + 2
    scales, streams = [], []
    for first, rows, m in _rows(x.numel(), chunk):
        k = kept(fraction, m)
        b = x[first : first + rows * m].view(rows, m)
        a = b.abs()
        idx = torch.sort(-a, dim=1, stable=True).indices[:, :k].sort(dim=1).values  # ties: lowest index
        mag = a.gather(1, idx).double()
        mean = (mag.sum(1, keepdim=True) / k).float().double()
        hi = mag >= mean
        n_hi = hi.sum(1, keepdim=True)
        n_lo = k - n_hi
        s_hi = torch.where(n_hi > 0, (mag * hi).sum(1, keepdim=True) / n_hi.clamp_min(1), mean)
        s_lo = torch.where(n_lo > 0, (mag * ~hi).sum(1, keepdim=True) / n_lo.clamp_min(1), mean)
        scales.append(torch.cat([s_lo, s_hi], dim=1).float())
        codes = idx << 2 | (b.gather(1, idx) < 0).long() << 1 | hi.long()
        bits = ((codes.unsqueeze(2) >> torch.arange(width, device=x.device)) & 1).view(rows, k * width)
        streams.append(bytes_of(F.pad(bits, (0, (-k * width) % 8))).reshape(-1))
    table = torch.cat(scales).reshape(-1) if scales else x.new_empty(0)
    return torch.cat([table.view(torch.uint8), *streams]), True


def sparse2_decode(buf: torch.Tensor, n: int, chunk: int, fraction: float, offset_bits: int, out: torch.Tensor) -> int:
    """Inverse of :func:`sparse2_encode` into ``out``; returns how many offsets fall outside their
    chunk (a payload no encoder makes; ``out`` is then left unwritten)."""
    width = offset_bits + 2
    groups = _rows(n, chunk)
    scales = buf[: 8 * -(-n // chunk)].view(torch.float32).view(-1, 2)
    at, row = 8 * scales.shape[0], 0
    found: list[tuple[torch.Tensor, torch.Tensor]] = []
    for first, rows, m in groups:
        k = kept(fraction, m)
        nbytes = (k * width + 7) // 8
        stream = buf[at : at + rows * nbytes].view(rows, nbytes)
        at += rows * nbytes
        bits = bits_of(stream)
        fields = (bits[:, : k * width].reshape(rows, k, width).long() << torch.arange(width, device=buf.device)).sum(2)
        offsets = fields >> 2
        if bool((offsets >= m).any()):
            return int((offsets >= m).sum())
        mag = scales[row : row + rows].gather(1, fields & 1)
        pos = offsets + first + torch.arange(rows, device=buf.device).unsqueeze(1) * m
        found.append((pos.reshape(-1), torch.where(fields & 2 > 0, -mag, mag).reshape(-1)))
        row += rows
    out.zero_()
    for pos, val in found:
        out[pos] = val
    return 0
