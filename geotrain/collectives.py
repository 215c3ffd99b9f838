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

from geotrain.groups import ProcessGroups


@dataclass
class CommStats:
    """Payload bytes this rank sent, split by where the receiver lives, and time spent blocked."""

    intra_bytes: int = 0
    inter_bytes: int = 0
    comm_seconds: float = 0.0


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

    def _count(self, dst: int, nbytes: int) -> None:
        if self.groups.topology.site_of(dst) == self._my_site:
            self.stats.intra_bytes += nbytes
        else:
            self.stats.inter_bytes += nbytes

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

    def _ring_all_gather(self, x: torch.Tensor, ranks: list[int], group: dist.ProcessGroup) -> None:
        n, i, nxt, prv = self._ring(ranks)
        if n == 1:
            return
        chunks = x.tensor_split(n)
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

    # ------------------------------------------------------------------ public collectives

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

    def all_reduce_flat(self, x: torch.Tensor) -> None:
        """Sum over all ranks with one ring in rank order (site-major): the topology-blind baseline."""
        self.ring_all_reduce(x, self.groups.topology.all_ranks(), self.groups.world)

    def all_reduce_hierarchical(self, x: torch.Tensor) -> None:
        """Sum over all ranks: reduce-scatter in site, all-reduce shards across sites, all-gather in site."""
        self._check(x)
        g = self.groups

        def run() -> None:
            self._ring_reduce_scatter(x, g.intra_ranks, g.intra)
            shard = x.tensor_split(len(g.intra_ranks))[g.me.local_rank]
            self._ring_reduce_scatter(shard, g.inter_ranks, g.inter)
            self._ring_all_gather(shard, g.inter_ranks, g.inter)
            self._ring_all_gather(x, g.intra_ranks, g.intra)

        self._timed(run)

    def all_reduce_across_sites(self, x: torch.Tensor) -> None:
        """Sum over sites of a tensor that is already identical on every rank of a site.

        Each local rank all-reduces only its 1/G shard across sites, then the site all-gathers:
        the inter-site traffic of a hierarchical all-reduce without the (needless) in-site
        reduce-scatter.
        """
        self._check(x)
        g = self.groups

        def run() -> None:
            shard = x.tensor_split(len(g.intra_ranks))[g.me.local_rank]
            self._ring_reduce_scatter(shard, g.inter_ranks, g.inter)
            self._ring_all_gather(shard, g.inter_ranks, g.inter)
            self._ring_all_gather(x, g.intra_ranks, g.intra)

        self._timed(run)

    def all_reduce(self, x: torch.Tensor, how: str) -> None:
        """Sum over all ranks, ``how`` = 'hierarchical' or 'flat'."""
        if how == "flat":
            self.all_reduce_flat(x)
        else:
            self.all_reduce_hierarchical(x)
