"""Codecs for what crosses sites: pure encode/decode functions over tensors.

A codec turns a 1-D fp32 tensor into one ``uint8`` buffer — exactly the bytes that go on the
wire, scales, tables and indices included — and back. Nothing here touches a process group, so
every codec is testable on its own; :mod:`geotrain.comm.collectives` moves the buffers and
:mod:`geotrain.codecs.powersgd` holds the one codec that is not a byte format (its factors are
all-reduced directly because PowerSGD is linear in them).

``reduce`` says how encoded values may be aggregated (never by summing codes):

* ``"scatter"``: reduce-scatter then all-gather, both encoded. Each rank encodes the chunks
  other ranks own, the owner decodes and sums in fp32 (its own chunk exact), re-encodes the sum
  and sends it back; every rank decodes the same bytes, so sites stay bit-identical. Wire bytes
  per rank: 2 (n-1) · enc(S/n), the ring all-reduce's volume in encoded form.
* ``"gather"``: all-gather of each rank's encoded tensor, decoded and summed in rank order on
  every rank (top-k: re-selecting the top-k of a sum would drop most of it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from geotrain.codecs import torchops as T
from geotrain.codecs.base import CODEC_NAMES as CODEC_NAMES
from geotrain.codecs.base import FP16_MAX as FP16_MAX
from geotrain.codecs.base import Codec as Codec
from geotrain.codecs.base import _kernels, _np, _refuse_non_finite, kept, on_kernels
from geotrain.codecs.sparseloco import TiledSparseLoCo as TiledSparseLoCo
from geotrain.errors import CorruptPayload, NonFiniteError


class NoneCodec(Codec):
    """fp32 as is (the reference for byte counts)."""

    name = "none"

    def encoded_nbytes(self, n: int) -> int:
        return 4 * n

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x)
        if not bool(torch.isfinite(x).all()):
            _refuse_non_finite(self.name, x)
        return x.clone().view(torch.uint8)

    def _decode(self, buf: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
        out.copy_(buf.view(torch.float32))
        return out


class _HalfCodec(Codec):
    dtype: ClassVar[torch.dtype]
    bits = 16.0

    def encoded_nbytes(self, n: int) -> int:
        return 2 * n

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x)
        h = x.to(self.dtype)  # round to nearest even, one pass
        if not bool(torch.isfinite(h).all()):  # catches NaN/inf inputs and fp16 overflow alike
            if bool(torch.isfinite(x).all()):
                raise NonFiniteError(
                    f"{self.name} codec: a value of magnitude {float(x.abs().max()):.3g} exceeds {self.name}'s range"
                )
            _refuse_non_finite(self.name, x)
        return h.view(torch.uint8)

    def _decode(self, buf: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
        out.copy_(buf.view(self.dtype))
        return out


class BF16(_HalfCodec):
    name = "bf16"
    dtype = torch.bfloat16


class FP16(_HalfCodec):
    name = "fp16"
    dtype = torch.float16


@dataclass(repr=True)
class Int8(Codec):
    """256 uniform buckets over mean ± k·σ; the wire carries each bucket's mean (a 1 KiB table).

    Decoding to the bucket mean (not the centre) makes the codec unbiased per bucket and puts
    outliers beyond ±kσ at the mean of what was clipped. Bound on Gaussian data with k = 6: the
    bucket width is 12σ/256 and a uniform error within it has rms width/√12 = 1.35% of σ.
    """

    sigma_range: float = 6.0
    name: ClassVar[str] = "int8"
    bits: ClassVar[float] = 8.0
    TABLE: ClassVar[int] = 256 * 4

    def encoded_nbytes(self, n: int) -> int:
        return self.TABLE + n

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x)
        n = x.numel()
        if not on_kernels(x):
            return self._finite(x, T.int8_encode(x, self.sigma_range))
        buf = torch.empty(self.encoded_nbytes(n), dtype=torch.uint8)
        table = buf[: self.TABLE].view(torch.float32)
        if n == 0:
            table.zero_()
            return buf
        xs = _np(x)
        s, ss, probe = _kernels().moments(xs)
        if not math.isfinite(probe):
            _refuse_non_finite(self.name, x)
        mean = s / n
        lo, half = T.int8_range(mean, ss / n - mean * mean, self.sigma_range)
        _kernels().int8_encode(xs, lo, 256.0 / (2 * half), _np(buf[self.TABLE :]), _np(table))
        return buf

    def _decode(self, buf: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
        if not on_kernels(buf):
            return T.int8_decode(buf, out)
        _kernels().lookup_decode(_np(buf[self.TABLE :]), _np(buf[: self.TABLE].view(torch.float32)), _np(out))
        return out


@dataclass(repr=True)
class _Block4(Codec):
    """Two 4-bit codes per byte plus one fp32 scale per block of ``block_size`` values."""

    block_size: int = 64
    bits: ClassVar[float] = 4.0
    is_fp4: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.block_size < 2 or self.block_size % 2:  # (each block's codes start on a byte)
            raise ValueError(f"{self.name} needs an even block_size of at least 2 (got {self.block_size})")

    def _blocks(self, n: int) -> int:
        return -(-n // self.block_size)

    def encoded_nbytes(self, n: int) -> int:
        return 4 * self._blocks(n) + (n + 1) // 2

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x)
        n = x.numel()
        if not on_kernels(x):
            return self._finite(x, T.block4_encode(x, self.block_size, self.is_fp4))
        buf = torch.empty(self.encoded_nbytes(n), dtype=torch.uint8)
        nb = self._blocks(n)
        scales = buf[: 4 * nb].view(torch.float32)
        probe = _kernels().block4_encode(_np(x), self.block_size, self.is_fp4, _np(scales), _np(buf[4 * nb :]))
        if not math.isfinite(probe):
            _refuse_non_finite(self.name, x)
        return buf

    def _decode(self, buf: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
        if not on_kernels(buf):
            return T.block4_decode(buf, n, self.block_size, self.is_fp4, out)
        nb = self._blocks(n)
        _kernels().block4_decode(
            _np(buf[4 * nb :]), _np(buf[: 4 * nb].view(torch.float32)), self.block_size, self.is_fp4, _np(out)
        )
        return out


@dataclass(repr=True)
class Int4(_Block4):
    """Uniform symmetric 4-bit: round(x / (max|x|/7)) per block, 15 levels."""

    name: ClassVar[str] = "int4"


@dataclass(repr=True)
class FP4(_Block4):
    """E3M0: a sign and a 3-bit exponent per value (0 and ±2^-6..2^0 of the block's max|x|)."""

    name: ClassVar[str] = "fp4"
    is_fp4: ClassVar[bool] = True


@dataclass(repr=True)
class TopK(Codec):
    """The ``fraction`` of entries largest in magnitude: int32 indices then fp32 values."""

    fraction: float = 0.01
    name: ClassVar[str] = "topk"
    reduce: ClassVar[Literal["scatter", "gather"]] = "gather"

    def k(self, n: int) -> int:
        return kept(self.fraction, n) if n else 0

    @property
    def bits(self) -> float:  # type: ignore[override]
        return 64.0 * self.fraction

    def encoded_nbytes(self, n: int) -> int:
        return 8 * self.k(n)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x)
        n = x.numel()
        k = self.k(n)
        buf = torch.empty(8 * k, dtype=torch.uint8, device=x.device)
        if k == 0:
            return buf
        if not bool(torch.isfinite(x).all()):
            _refuse_non_finite(self.name, x)
        idx = torch.topk(x.abs(), k, sorted=False).indices
        idx = idx.sort().values  # sorted indices: deterministic layout, friendlier scatter
        buf[: 4 * k].view(torch.int32).copy_(idx)
        buf[4 * k :].view(torch.float32).copy_(x[idx])
        return buf

    def _decode(self, buf: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
        out.zero_()
        k = buf.numel() // 8
        if k:
            idx = buf[: 4 * k].view(torch.int32).long()
            if int(idx.min()) < 0 or int(idx.max()) >= n:  # (a negative index would count from the end)
                raise CorruptPayload(f"{self.name} codec: a payload names positions outside 0..{n - 1}")
            out[idx] = buf[4 * k :].view(torch.float32)
        return out


@dataclass(repr=True)
class SparseLoCo(Codec):
    """Top-k per chunk with 2-bit values (SparseLoCo, arXiv 2508.15706): in every chunk of
    ``chunk`` values, the ``ceil(fraction * len)`` largest in magnitude, each sent as its
    chunk-local offset (``ceil(log2 chunk)`` bits) and a 2-bit code (sign, low or high level),
    with two fp32 level scales per chunk (each the mean magnitude of the values at that level).
    Everything else is dropped, so it is meant for error feedback (on by default).

    Wire bytes per chunk: ``8 + ceil(k (log2 chunk + 2) / 8)``: at 1% of 4,096 values, 80 bytes
    for 16 KiB of fp32 (205x). Aggregated by gather like :class:`TopK`: re-selecting a sum's top
    entries would drop most of it.
    """

    fraction: float = 0.01
    chunk: int = 4096
    name: ClassVar[str] = "sparseloco"
    reduce: ClassVar[Literal["scatter", "gather"]] = "gather"

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1 or self.chunk < 2:
            raise ValueError(f"sparseloco needs 0 < fraction <= 1 and chunk >= 2 (got {self.fraction}, {self.chunk})")
        self.offset_bits = max(1, (self.chunk - 1).bit_length())

    def _ks(self, n: int) -> list[int]:
        return [kept(self.fraction, min(self.chunk, n - b)) for b in range(0, n, self.chunk)]

    @property
    def bits(self) -> float:  # type: ignore[override]
        return self.fraction * (self.offset_bits + 2) + 64.0 / self.chunk

    def encoded_nbytes(self, n: int) -> int:
        ks = self._ks(n)
        return 8 * len(ks) + sum((k * (self.offset_bits + 2) + 7) // 8 for k in ks)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x)
        n = x.numel()
        if not on_kernels(x):
            return self._finite(x, T.sparse2_encode(x, self.chunk, self.fraction, self.offset_bits))
        buf = torch.empty(self.encoded_nbytes(n), dtype=torch.uint8)
        nc = -(-n // self.chunk)
        scales = buf[: 8 * nc].view(torch.float32)
        if n:
            probe = _kernels().sparse2_encode(
                _np(x), self.chunk, self.fraction, self.offset_bits, _np(scales), _np(buf[8 * nc :])
            )
            if not math.isfinite(probe):
                _refuse_non_finite(self.name, x)
        return buf

    def _decode(self, buf: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
        if n:
            nc = -(-n // self.chunk)
            bad = (
                _kernels().sparse2_decode(
                    _np(buf[8 * nc :]),
                    _np(buf[: 8 * nc].view(torch.float32)),
                    self.chunk,
                    self.fraction,
                    self.offset_bits,
                    _np(out),
                )
                if on_kernels(buf)
                else T.sparse2_decode(buf, n, self.chunk, self.fraction, self.offset_bits, out)
            )
            if bad:
                raise CorruptPayload(f"{self.name} codec: {bad} offset(s) of a payload fall outside their chunk")
        return out


@dataclass
class Residual:
    """Error-feedback state: what this rank's encoding left out last time, added to its next input,
    kept times ``decay`` (SparseLoCo's β: e ← β·e + Δ, then e ← e − what was sent)."""

    tensor: torch.Tensor | None = None
    decay: float = 1.0

    def keep(self, left_out: torch.Tensor | None) -> None:
        """Keep what an encoding left out (decayed) for the next round's input (None: nothing)."""
        self.tensor = left_out.mul_(self.decay) if left_out is not None and self.decay != 1.0 else left_out

    def add_to(self, x: torch.Tensor) -> None:
        if self.tensor is not None:
            if self.tensor.shape != x.shape:
                raise ValueError(f"error-feedback residual has shape {tuple(self.tensor.shape)}, input {tuple(x.shape)}")
            x.add_(self.tensor)


def build_codec(
    name: str,
    *,
    sigma_range: float = 6.0,
    block_size: int = 64,
    fraction: float = 0.01,
    chunk: int = 4096,
    variant: str = "published",
    tile: int = 64,
    spread: float = 6.0,
    shapes: list[tuple[int, ...]] | None = None,
) -> Codec:
    """The byte codec called ``name`` (``powersgd`` is not a byte codec: see :mod:`.powersgd`);
    ``shapes``: the tensors its input concatenates (SparseLoCo's tiles)."""
    if name == "none":
        return NoneCodec()
    if name == "bf16":
        return BF16()
    if name == "fp16":
        return FP16()
    if name == "int8":
        return Int8(sigma_range)
    if name == "int4":
        return Int4(block_size)
    if name == "fp4":
        return FP4(block_size)
    if name == "topk":
        return TopK(fraction)
    if name == "sparseloco" and variant == "published":
        return TiledSparseLoCo(fraction, tile, spread, list(shapes or []))
    if name == "sparseloco":
        return SparseLoCo(fraction, chunk)
    raise ValueError(f"unknown byte codec {name!r} (one of {', '.join(n for n in CODEC_NAMES if n != 'powersgd')})")


def roundtrip(codec: Codec, x: torch.Tensor) -> torch.Tensor:
    """decode(encode(x)): what the receiver sees."""
    return codec.decode(codec.encode(x), x.numel())


def relative_error(x: torch.Tensor, y: torch.Tensor) -> float:
    """‖x − y‖ / ‖x‖ in float64."""
    x64 = x.double()
    return float((x64 - y.double()).norm() / x64.norm().clamp_min(1e-300))
