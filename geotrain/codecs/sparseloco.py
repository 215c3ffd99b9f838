"""SparseLoCo as published (arXiv 2508.15706): top-k in 64×64 tiles of each weight matrix, values
in 2-bit bins over each tensor's spread, each coordinate averaged over the sites that sent it.

A payload is a pure function of the input, as for every codec; what makes it "as published" is
where its chunks fall and how the receivers combine it:

* **Tiles.** A matrix of r × c values (a tensor of more dimensions is read as r × the rest) is cut
  into tiles of h × w, h the largest divisor of r up to ``tile`` and w the same for c, and each
  tile is one chunk, read row by row. A vector (or a matrix's stand-in: any tensor of one
  dimension) is cut into runs of ``tile²`` values, the last run shorter. In every chunk of m
  values the ``k = max(1, ceil(fraction · m))`` largest in magnitude are kept, each sent as its
  offset in the chunk (``ceil(log2 m)`` bits) and a 2-bit code.
* **2-bit values.** Per tensor, the kept values are centred on their mean and put into 4 uniform
  bins of width ``spread · σ / 4`` (σ their unbiased standard deviation) around code 2; each
  code decodes to its bin's mean (a table of 4 fp32 values and the shift, 20 bytes per tensor).
* **Per-sender mean** (:class:`geotrain.comm.coded.GatherSum`): each coordinate of the aggregate is the mean over the
  sites whose payload names it, not the sum divided by every site: a coordinate one site sent
  moves by that site's value, as its error feedback dropped all of it.

The codec needs the shapes of the tensors it is given flattened and concatenated (the reducer's
``shapes``); an input of another length (a shard of a site's vector, cut across tensors) is read
as one vector. Everything here is torch ops, so it runs wherever the tensor lives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch

from geotrain.codecs.base import Codec, _refuse_non_finite, kept
from geotrain.codecs.torchops import bits_of, bytes_of
from geotrain.errors import CorruptPayload

BINS = 4  # 2-bit codes
TABLE = 4 * (1 + BINS)  # per tensor: the shift and the bins' means, fp32


def largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of ``n`` that is at most ``at_most`` (1 for a prime above it)."""
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


@dataclass(frozen=True)
class Group:
    """``rows`` consecutive chunks of ``size`` values of one tensor, from ``start`` in tile order."""

    start: int
    rows: int
    size: int
    k: int
    tensor: int

    @property
    def bits(self) -> int:
        """Bits per kept entry: its offset in the chunk and its 2-bit code."""
        return max(1, (self.size - 1).bit_length()) + 2


@dataclass
class Layout:
    """Where every chunk of a flat vector of tensors lies: ``perm`` reorders the flat vector into
    tile order (each chunk contiguous), ``groups`` cut that order into chunks."""

    n: int
    tensors: int
    perm: torch.Tensor | None  # None: tile order is the flat order
    groups: list[Group]
    nbits: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbits = sum(g.rows * g.k * g.bits for g in self.groups)

    def nbytes(self) -> int:
        return TABLE * self.tensors + (self.nbits + 7) // 8


def tile_layout(shapes: list[tuple[int, ...]], fraction: float, tile: int = 64) -> Layout:
    """The chunks of tensors of ``shapes``, flattened and concatenated (see the module's rule)."""
    perms: list[torch.Tensor] = []
    groups: list[Group] = []
    offset = start = 0
    run = tile * tile
    tiled = False

    def add(rows: int, size: int, t: int) -> None:
        nonlocal start
        if rows and size:
            groups.append(Group(start, rows, size, kept(fraction, size), t))
            start += rows * size

    for t, shape in enumerate(shapes):
        numel = math.prod(shape)
        if len(shape) >= 2 and numel:
            r, c = shape[0], numel // shape[0]
            h, w = largest_divisor(r, tile), largest_divisor(c, tile)
            idx = torch.arange(numel).view(r // h, h, c // w, w).permute(0, 2, 1, 3).reshape(-1)
            perms.append(idx + offset)
            tiled = tiled or (w != c)
            add((r // h) * (c // w), h * w, t)
        else:
            perms.append(torch.arange(offset, offset + numel))
            add(numel // run, run, t)
            add(1 if numel % run else 0, numel % run, t)
        offset += numel
    perm = torch.cat(perms) if tiled else None
    return Layout(offset, len(shapes), perm, groups)


def _pack(values: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """Concatenate each value's low ``width`` bits (least significant first) into bytes."""
    top = int(widths.max()) if widths.numel() else 0
    shifts = torch.arange(top, device=values.device)
    bits = ((values.unsqueeze(1) >> shifts) & 1).to(torch.uint8)
    bits = bits[shifts.unsqueeze(0) < widths.unsqueeze(1)]  # row by row: each value's own width
    return bytes_of(torch.nn.functional.pad(bits, (0, (-bits.numel()) % 8)))


def quantize(vals: torch.Tensor, spread: float) -> tuple[torch.Tensor, torch.Tensor]:
    """2-bit codes of ``vals`` and the table [shift, 4 bin means of the centred values]."""
    shift = vals.mean() if vals.numel() else vals.new_zeros(())
    centred = vals - shift
    std = centred.norm() / math.sqrt(centred.numel() - 1) if centred.numel() > 1 else vals.new_zeros(())
    scale = spread * std / BINS
    if not bool(torch.isfinite(scale)) or float(scale) == 0.0:
        scale = vals.new_ones(())
    codes = (centred / scale + BINS // 2).round().clamp(0, BINS - 1).to(torch.int64)
    sums = vals.new_zeros(BINS).scatter_add_(0, codes, centred)
    counts = vals.new_zeros(BINS).scatter_add_(0, codes, torch.ones_like(centred))
    means = torch.where(counts > 0, sums / counts.clamp_min(1), torch.zeros_like(sums))
    return codes, torch.cat([shift.reshape(1), means])


@dataclass(repr=True)
class TiledSparseLoCo(Codec):
    """SparseLoCo as published (see the module): 64×64 tiles, 2-bit bins per tensor, per-sender
    mean. ``shapes``: the tensors its input concatenates (without them, one vector)."""

    fraction: float = 0.01
    tile: int = 64
    spread: float = 6.0
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    name: ClassVar[str] = "sparseloco"
    reduce: ClassVar[Literal["scatter", "gather"]] = "gather"
    sender_mean: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1 or self.tile < 1 or self.spread <= 0:
            raise ValueError(f"sparseloco needs 0 < fraction <= 1, tile >= 1, spread > 0 (got {self})")
        self.shapes = [tuple(int(d) for d in s) for s in self.shapes]
        self._layouts: dict[int, Layout] = {}

    def layout(self, n: int) -> Layout:
        if n not in self._layouts:
            fits = sum(math.prod(s) for s in self.shapes) == n and self.shapes
            self._layouts[n] = tile_layout(self.shapes if fits else [(n,)], self.fraction, self.tile)
        return self._layouts[n]

    @property
    def bits(self) -> float:  # type: ignore[override]
        """Wire bits per value of a 4,096-value tile."""
        run = self.tile * self.tile
        return math.ceil(self.fraction * run) * (max(1, (run - 1).bit_length()) + 2) / run

    def encoded_nbytes(self, n: int) -> int:
        return self.layout(n).nbytes()

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x)
        lay = self.layout(x.numel())
        if not bool(torch.isfinite(x).all()):
            _refuse_non_finite(self.name, x)
        xt = x if lay.perm is None else x[lay.perm.to(x.device)]
        tables = torch.zeros(lay.tensors, 1 + BINS, dtype=torch.float32, device=x.device)
        fields: list[torch.Tensor] = []
        widths: list[torch.Tensor] = []
        by_tensor: dict[int, list[tuple[Group, torch.Tensor, torch.Tensor]]] = {}
        for g in lay.groups:
            rows = xt[g.start : g.start + g.rows * g.size].view(g.rows, g.size)
            idx = torch.topk(rows.abs(), g.k, dim=1, sorted=False).indices
            by_tensor.setdefault(g.tensor, []).append((g, idx, rows.gather(1, idx)))
        for t, parts in by_tensor.items():
            codes, tables[t] = quantize(torch.cat([v.reshape(-1) for _, _, v in parts]), self.spread)
            at = 0
            for g, idx, v in parts:
                c = codes[at : at + v.numel()].view_as(idx)
                at += v.numel()
                fields.append((idx << 2 | c).reshape(-1))
                widths.append(torch.full((idx.numel(),), g.bits, dtype=torch.int64, device=x.device))
        stream = _pack(torch.cat(fields), torch.cat(widths)) if fields else x.new_zeros(0, dtype=torch.uint8)
        return torch.cat([tables.reshape(-1).view(torch.uint8), stream])

    def decode(
        self, buf: torch.Tensor, n: int, out: torch.Tensor | None = None, sent: torch.Tensor | None = None
    ) -> torch.Tensor:
        """As :meth:`Codec.decode`; ``sent`` (bool, ``n``) is also set True where the payload names a value."""
        return self._decode_into(buf, n, self._validate(buf, n, out), sent)

    def _decode(self, buf: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
        return self._decode_into(buf, n, out, None)

    def _decode_into(self, buf: torch.Tensor, n: int, out: torch.Tensor, sent: torch.Tensor | None) -> torch.Tensor:
        lay = self.layout(n)
        tables = buf[: TABLE * lay.tensors].view(torch.float32).view(lay.tensors, 1 + BINS)
        if not bool(torch.isfinite(tables).all()):  # another site's table: a NaN would reach every coordinate it names
            raise CorruptPayload(f"{self.name} codec: a payload's value table is not finite")
        bits = bits_of(buf[TABLE * lay.tensors :])
        dev = bits.device
        dense = torch.zeros(n, dtype=torch.float32, device=out.device)
        mask = torch.zeros(n, dtype=torch.bool, device=out.device) if sent is not None else None
        at = 0
        for g in lay.groups:
            m = g.rows * g.k
            fields = (bits[at : at + m * g.bits].view(m, g.bits).to(torch.int64) << torch.arange(g.bits, device=dev)).sum(1)
            at += m * g.bits
            offsets, codes = (fields >> 2).view(g.rows, g.k), fields & 3
            if m and int(offsets.max()) >= g.size:
                raise CorruptPayload(f"{self.name} codec: a payload names an offset past its {g.size}-value chunk")
            pos = (offsets + g.start + torch.arange(g.rows, device=dev).unsqueeze(1) * g.size).reshape(-1)
            dense[pos] = tables[g.tensor, 1 + codes] + tables[g.tensor, 0]
            if mask is not None:
                mask[pos] = True
        if lay.perm is None:
            out.copy_(dense)
        else:
            out[lay.perm.to(out.device)] = dense
            if mask is not None:
                mask[lay.perm.to(out.device)] = mask.clone()
        if mask is not None and sent is not None:
            sent.copy_(mask)
        return out
