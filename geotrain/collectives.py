"""Collectives built from point-to-point sends, so every byte is counted on the link it crosses.

Why not ``dist.all_reduce``: a library collective hides which bytes go to which peer, so the
split between intra-site and inter-site traffic could only be estimated from a formula. Here
each collective is a ring of ``isend``/``irecv`` pairs; :class:`Collectives` records the size of
every tensor it sends and classifies it by the destination's site. (Gloo also has no
reduce-scatter, which the hierarchical all-reduce needs.)

Ring algorithms (Patarasuk & Yuan 2009): over n ranks a reduce-scatter and an all-gather each
take n-1 steps and send (n-1)/n of the buffer per rank; an all-reduce is one of each, the
bandwidth-optimal 2(n-1)/n · S per rank.

Hierarchical all-reduce (NeMo multi-DC, see shared/reference/003): reduce-scatter inside each
site, all-reduce each shard across sites among ranks with the same local rank (all shards in
parallel, so every rank's wide-area path is busy), all-gather inside the site. Only S/G bytes
per rank (G = workers per site) cross the slow links, twice (N-1)/N of it for N sites.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from geotrain.codecs import Codec, Residual
from geotrain.groups import ProcessGroups


@dataclass
class CommStats:
    """Payload bytes this rank sent, split by where the receiver lives, and time spent blocked."""

    intra_bytes: int = 0
    inter_bytes: int = 0
    comm_seconds: float = 0.0
    inter_raw_bytes: int = 0  # what the same inter-site sends would have taken in fp32


class Collectives:
    """Ring collectives over the groups of one rank, with exact byte accounting.

    All methods operate in place on a 1-D contiguous tensor that has the same size on every
    participating rank, and must be called by all ranks of the group in the same order.
    """

    def __init__(self, groups: ProcessGroups, stats: CommStats | None = None) -> None:
        self.groups = groups
        self.stats = stats if stats is not None else CommStats()
        self._my_site = groups.me.site_index

    # ------------------------------------------------------------------ primitives

    def _count(self, dst: int, nbytes: int, raw: int | None = None) -> None:
        if self.groups.topology.site_of(dst) == self._my_site:
            self.stats.intra_bytes += nbytes
        else:
            self.stats.inter_bytes += nbytes
            self.stats.inter_raw_bytes += nbytes if raw is None else raw

    def _exchange(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, group: dist.ProcessGroup) -> None:
        """Send ``send`` to ``dst`` while receiving ``recv`` from ``src`` (global ranks)."""
        ops = []
        if send.numel():
            ops.append(dist.P2POp(dist.isend, send, dst, group))
            self._count(dst, send.numel() * send.element_size())
        if recv.numel():
            ops.append(dist.P2POp(dist.irecv, recv, src, group))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    def _ring(self, ranks: list[int]) -> tuple[int, int, int, int]:
        """(ring size, my position, next rank, previous rank) for a ring over ``ranks``."""
        n = len(ranks)
        i = ranks.index(self.groups.me.rank)
        return n, i, ranks[(i + 1) % n], ranks[(i - 1) % n]

    def _ring_reduce_scatter(self, x: torch.Tensor, ranks: list[int], group: dist.ProcessGroup) -> None:
        n, i, nxt, prv = self._ring(ranks)
        if n == 1:
            return
        chunks = x.tensor_split(n)
        scratch = torch.empty_like(chunks[0])
        for s in range(n - 1):
            send = chunks[(i - s - 1) % n]
            into = chunks[(i - s - 2) % n]
            buf = scratch[: into.numel()]
            self._exchange(send, nxt, buf, prv, group)
            into.add_(buf)

    def _ring_all_gather(
        self, x: torch.Tensor, ranks: list[int], group: dist.ProcessGroup, sizes: list[int] | None = None
    ) -> None:
        """Ring all-gather; rank ``ranks[j]`` owns chunk j (``x.tensor_split(n)``, or ``x.split(sizes)``)."""
        n, i, nxt, prv = self._ring(ranks)
        if n == 1:
            return
        chunks = x.split(sizes) if sizes is not None else x.tensor_split(n)
        for s in range(n - 1):
            self._exchange(chunks[(i - s) % n], nxt, chunks[(i - s - 1) % n], prv, group)

    def _timed(self, fn, *args) -> None:  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        fn(*args)
        self.stats.comm_seconds += time.perf_counter() - t0

    @staticmethod
    def _check(x: torch.Tensor) -> None:
        if x.dim() != 1 or not x.is_contiguous():
            raise ValueError("collectives take a 1-D contiguous tensor (flatten first)")

    def _peer_exchange(
        self, sends: dict[int, tuple[torch.Tensor, int]], recvs: dict[int, torch.Tensor], group: dist.ProcessGroup
    ) -> None:
        """Send ``sends[dst] = (buffer, fp32 bytes it stands for)`` and receive ``recvs[src]``, all at once."""
        ops = []
        for dst, (buf, raw) in sends.items():
            ops.append(dist.P2POp(dist.isend, buf, dst, group))
            self._count(dst, buf.numel() * buf.element_size(), raw)
        ops.extend(dist.P2POp(dist.irecv, buf, src, group) for src, buf in recvs.items())
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    def _coded_all_reduce(
        self, x: torch.Tensor, codec: Codec, ranks: list[int], group: dist.ProcessGroup, ef: Residual | None
    ) -> None:
        """Sum ``x`` over ``ranks`` sending only ``codec``-encoded bytes; fp32 accumulation (see geotrain.codecs)."""
        n, i, _, _ = self._ring(ranks)
        if n == 1 or x.numel() == 0:
            return
        if ef is not None:
            ef.add_to(x)
        peers = [r for r in ranks if r != self.groups.me.rank]
        if codec.reduce == "gather":
            enc = codec.encode(x)
            own = codec.decode(enc, x.numel())
            if ef is not None:
                ef.tensor = x - own
            got = {r: torch.empty_like(enc) for r in peers}
            self._peer_exchange({r: (enc, 4 * x.numel()) for r in peers}, got, group)
            tmp = torch.empty_like(x)
            x.zero_()
            for r in ranks:  # same order on every rank: bit-identical sums
                x.add_(own if r == self.groups.me.rank else codec.decode(got[r], x.numel(), tmp))
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
            ef.tensor = res
        senders = peers if mine.numel() else []
        got = {r: torch.empty(codec.encoded_nbytes(mine.numel()), dtype=torch.uint8) for r in senders}
        self._peer_exchange({ranks[j]: (encoded[ranks[j]], 4 * chunks[j].numel()) for j in others}, got, group)
        tmp = torch.empty_like(mine)
        for r in senders:
            mine.add_(codec.decode(got[r], mine.numel(), tmp))
        # all-gather the encoded sums; the owner keeps the decoded one too, so all ranks agree
        sends: dict[int, tuple[torch.Tensor, int]] = {}
        if mine.numel():
            summed = codec.encode(mine)
            codec.decode(summed, mine.numel(), mine)
            sends = {r: (summed, 4 * mine.numel()) for r in peers}
        back = {ranks[j]: torch.empty(codec.encoded_nbytes(chunks[j].numel()), dtype=torch.uint8) for j in others}
        self._peer_exchange(sends, back, group)
        for j in others:
            codec.decode(back[ranks[j]], chunks[j].numel(), chunks[j])

    # ------------------------------------------------------------------ public collectives

    def coded_all_reduce(
        self, x: torch.Tensor, codec: Codec | None, ranks: list[int], group: dist.ProcessGroup, ef: Residual | None = None
    ) -> None:
        """Sum ``x`` over ``ranks`` in place, encoded with ``codec`` (None: the fp32 ring)."""
        self._check(x)
        if codec is None:
            self.ring_all_reduce(x, ranks, group)
        else:
            self._timed(self._coded_all_reduce, x, codec, ranks, group, ef)

    def ring_all_reduce(self, x: torch.Tensor, ranks: list[int], group: dist.ProcessGroup) -> None:
        """Sum ``x`` over ``ranks`` (global ranks, ring order) in place."""
        self._check(x)

        def run() -> None:
            self._ring_reduce_scatter(x, ranks, group)
            self._ring_all_gather(x, ranks, group)

        self._timed(run)

    def all_reduce_intra(self, x: torch.Tensor) -> None:
        """Sum over the ranks of this rank's site."""
        self.ring_all_reduce(x, self.groups.intra_ranks, self.groups.intra)

    def all_reduce_flat(self, x: torch.Tensor, codec: Codec | None = None, ef: Residual | None = None) -> None:
        """Sum over all ranks with one ring in rank order (site-major): the topology-blind baseline."""
        self.coded_all_reduce(x, codec, self.groups.topology.all_ranks(), self.groups.world, ef)

    def _across(self, shard: torch.Tensor, codec: Codec | None, ef: Residual | None) -> None:
        g = self.groups
        if codec is None:
            self._ring_reduce_scatter(shard, g.inter_ranks, g.inter)
            self._ring_all_gather(shard, g.inter_ranks, g.inter)
        else:
            self._coded_all_reduce(shard, codec, g.inter_ranks, g.inter, ef)

    def all_reduce_hierarchical(self, x: torch.Tensor, codec: Codec | None = None, ef: Residual | None = None) -> None:
        """Sum over all ranks: reduce-scatter in site, all-reduce shards across sites, all-gather in site.

        Only the across-sites step is encoded with ``codec``; in-site traffic stays fp32.
        """
        self._check(x)
        g = self.groups

        def run() -> None:
            self._ring_reduce_scatter(x, g.intra_ranks, g.intra)
            shard = x.tensor_split(len(g.intra_ranks))[g.me.local_rank]
            self._across(shard, codec, ef)
            self._ring_all_gather(x, g.intra_ranks, g.intra)

        self._timed(run)

    def all_gather_intra(self, x: torch.Tensor, sizes: list[int]) -> None:
        """In-site all-gather where local rank j owns ``x.split(sizes)[j]``."""
        self._check(x)
        self._timed(self._ring_all_gather, x, self.groups.intra_ranks, self.groups.intra, sizes)

    def all_reduce_across_sites(self, x: torch.Tensor, codec: Codec | None = None, ef: Residual | None = None) -> None:
        """Sum over sites of a tensor that is already identical on every rank of a site.

        Each local rank all-reduces only its 1/G shard across sites, then the site all-gathers:
        the inter-site traffic of a hierarchical all-reduce without the (needless) in-site
        reduce-scatter.
        """
        self._check(x)
        g = self.groups

        def run() -> None:
            shard = x.tensor_split(len(g.intra_ranks))[g.me.local_rank]
            self._across(shard, codec, ef)
            self._ring_all_gather(x, g.intra_ranks, g.intra)

        self._timed(run)

    def all_reduce(self, x: torch.Tensor, how: str, codec: Codec | None = None, ef: Residual | None = None) -> None:
        """Sum over all ranks, ``how`` = 'hierarchical' or 'flat'."""
        if how == "flat":
            self.all_reduce_flat(x, codec, ef)
        else:
            self.all_reduce_hierarchical(x, codec, ef)
