"""The encoded sum over a group of ranks: only a codec's bytes cross, fp32 accumulation
(:mod:`geotrain.codecs` explains the two ways, ``scatter`` and ``gather``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from geotrain.codecs import Codec, Residual
from geotrain.codecs.sparseloco import TiledSparseLoCo

Exchange = Callable[[dict[int, tuple[torch.Tensor, int]], dict[int, torch.Tensor]], None]


def coded_sum(
    x: torch.Tensor,
    codec: Codec,
    ranks: list[int],
    me: int,
    exchange: Exchange,
    ef: Residual | None,
    shares: Sequence[float] | None,
    site_of: Callable[[int], int],
) -> None:
    """Sum ``x`` over ``ranks`` (``me`` among them) in place; ``exchange(sends, recvs)`` sends
    ``sends[dst] = (buffer, fp32 bytes it stands for)`` and fills ``recvs[src]``, all at once.

    ``ef``: error feedback (what the encoding left out is kept for the next call). ``shares`` (one
    per site, ``site_of`` a rank's) with a sender-mean codec: the share-weighted mean over the
    sites whose payload names each coordinate (equal shares: the plain mean over them, as the
    published SparseLoCo's ``scatter_reduce(mean)``); a site of share 0 counts nowhere.
    """
    n, i = len(ranks), ranks.index(me)
    if n == 1 or x.numel() == 0:
        return
    if ef is not None:
        ef.add_to(x)
    peers = [r for r in ranks if r != me]
    if codec.reduce == "gather":
        enc = codec.encode(x)
        own = codec.decode(enc, x.numel())
        if ef is not None:
            ef.keep(x - own)
        got = {r: torch.empty_like(enc) for r in peers}
        exchange({r: (enc, 4 * x.numel()) for r in peers}, got)
        got[me] = enc
        acc = GatherSum(codec, x, mean=shares is not None)
        equal = shares is not None and len({s for s in shares if s}) <= 1
        for r in ranks:  # same order on every rank: bit-identical sums
            share = 1.0 if shares is None else shares[site_of(r)]
            if equal:  # unweighted: sum then divide by the count, bit for bit the reference's mean
                share = 1.0 if share else 0.0
            acc.add(got[r], share, weight=share if shares is not None else 1.0, decoded=own if r == me else None)
        acc.finish()
        return
    chunks = x.tensor_split(n)
    mine = chunks[i]
    # reduce-scatter: encode the chunks others own, receive everyone's encoding of mine
    # empty chunks (fewer values than ranks) are not sent at all
    others = [j for j in range(n) if j != i and chunks[j].numel()]
    encoded = {ranks[j]: codec.encode(chunks[j]) for j in others}
    if ef is not None:
        res = torch.zeros_like(x)
        for j in others:
            torch.sub(chunks[j], codec.decode(encoded[ranks[j]], chunks[j].numel()), out=res.tensor_split(n)[j])
        ef.keep(res)
    senders = peers if mine.numel() else []
    got = {r: torch.empty(codec.encoded_nbytes(mine.numel()), dtype=torch.uint8, device=x.device) for r in senders}
    exchange({ranks[j]: (encoded[ranks[j]], 4 * chunks[j].numel()) for j in others}, got)
    tmp = torch.empty_like(mine)
    for r in senders:
        mine.add_(codec.decode(got[r], mine.numel(), tmp))
    # all-gather the encoded sums; the owner keeps the decoded one too, so all ranks agree
    sends: dict[int, tuple[torch.Tensor, int]] = {}
    if mine.numel():
        summed = codec.encode(mine)
        codec.decode(summed, mine.numel(), mine)
        sends = {r: (summed, 4 * mine.numel()) for r in peers}
    back = {ranks[j]: torch.empty(codec.encoded_nbytes(chunks[j].numel()), dtype=torch.uint8, device=x.device) for j in others}
    exchange(sends, back)
    for j in others:
        codec.decode(back[ranks[j]], chunks[j].numel(), chunks[j])


class Decoder(Protocol):
    """What :class:`GatherSum` asks of a codec (a :class:`~geotrain.codecs.Codec`)."""

    @property
    def sender_mean(self) -> bool: ...

    def decode(self, buf: torch.Tensor, n: int, out: torch.Tensor | None = None) -> torch.Tensor: ...


class GatherSum:
    """Adds the decoded payloads of a gather codec in a fixed order into ``x`` (fp32, zeroed
    first). ``mean``: the codec's per-sender mean, where each coordinate is divided by the total
    share of the senders that named it (:class:`TiledSparseLoCo`); else a plain sum.
    """

    def __init__(self, codec: Decoder, x: torch.Tensor, mean: bool) -> None:
        self.codec, self.x = codec, x.zero_()
        self.mean = mean and codec.sender_mean
        self.tmp = torch.empty_like(x)
        self.den = torch.zeros_like(x) if self.mean else None
        self.sent = torch.empty(x.numel(), dtype=torch.bool, device=x.device) if self.mean else None

    def add(self, buf: torch.Tensor, share: float = 1.0, weight: float = 1.0, decoded: torch.Tensor | None = None) -> None:
        """Add ``weight`` × one sender's decoded payload; its ``share`` counts where it sent.
        ``decoded``: the payload's decoding where the caller has it (a plain sum then decodes nothing)."""
        n = self.x.numel()
        if self.mean:
            assert isinstance(self.codec, TiledSparseLoCo) and self.den is not None and self.sent is not None
            decoded = self.codec.decode(buf, n, self.tmp, sent=self.sent)
            self.den.add_(self.sent.to(self.den.dtype), alpha=share)
        elif decoded is None:
            decoded = self.codec.decode(buf, n, self.tmp)
        self.x.add_(decoded, alpha=weight)

    def finish(self, scale: float = 1.0) -> torch.Tensor:
        """The sum, or (``mean``) the per-coordinate mean times ``scale``; 0 where nobody sent."""
        if self.den is not None:
            torch.where(self.den > 0, self.x / self.den, torch.zeros_like(self.x), out=self.x)
            if scale != 1.0:
                self.x.mul_(scale)
        return self.x
