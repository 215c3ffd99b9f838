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

Pipelining: an fp32 all-reduce is cut into chunks of ``chunk_bytes``; chunk k goes to lane
k mod L. Each lane is a thread with its own process groups (:class:`geotrain.comm.groups.Lane`) and
runs the three phases on its chunks in order, so while one lane reduce-scatters inside a site
another has its shard on the wide-area link and a third waits out the link's latency — the
phases overlap and the slow link stays busy.

Every point-to-point exchange goes through :meth:`Collectives._p2p`, where inter-site sends
are paced and delayed by the link emulation (:mod:`geotrain.comm.emulate.inprocess`) when one is configured.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from geotrain.codecs import Codec, Residual
from geotrain.comm.coded import coded_sum
from geotrain.comm.emulate.inprocess import WanEmulator
from geotrain.comm.groups import Lane, ProcessGroups
from geotrain.comm.shapes import hub_sum, tree_sum
from geotrain.comm.threads import DaemonPool

_HEADER_TAG = 1  # arrival-time headers of the link emulation travel on their own tag
TIMELINE_CAP = 200_000


def _isend(t: torch.Tensor, dst: int, group: dist.ProcessGroup, tag: int = 0) -> dist.Work:
    work = dist.isend(t, dst, group=group, tag=tag)
    assert work is not None, "isend to a rank outside the group"
    return work


def _irecv(t: torch.Tensor, src: int, group: dist.ProcessGroup, tag: int = 0) -> dist.Work:
    work = dist.irecv(t, src, group=group, tag=tag)
    assert work is not None, "irecv from a rank outside the group"
    return work


@dataclass
class CommStats:
    """Payload bytes this rank sent, split by where the receiver lives, and time spent.

    ``comm_seconds`` is the time the training (main) thread was blocked on communication, and
    ``wan_wait_seconds`` the part of it spent in collectives that cross sites (what compute
    utilisation counts as lost); ``network_seconds`` is the time any thread spent in an
    exchange that crossed sites.
    """

    intra_bytes: int = 0
    inter_bytes: int = 0
    inter_region_bytes: int = 0  # the part of inter_bytes sent to another region (the slow tier; 0 without regions)
    comm_seconds: float = 0.0
    inter_raw_bytes: int = 0  # what the same inter-site sends would have taken in fp32
    network_seconds: float = 0.0
    wan_wait_seconds: float = 0.0
    link_bytes: dict[int, int] = field(default_factory=dict)  # inter_bytes by the receiving site's index
    # (start, end) monotonic seconds of every exchange that crossed sites, when recording
    intervals: list[tuple[float, float]] | None = field(default=None, repr=False)


class Collectives:
    """Ring collectives over the groups of one rank, with exact byte accounting.

    All methods operate in place on a 1-D contiguous tensor that has the same size on every
    participating rank, and must be called by all ranks of the group in the same order. The
    all-reduces that may cross sites use the lane groups only, so one of them can run in a
    background thread while the training thread averages gradients on ``groups.intra``.

    Args:
        chunk_bytes: fp32 all-reduces are pipelined in chunks of this size over the lanes.
        wan: the link emulation (None: links run at loopback speed).
    """

    def __init__(
        self,
        groups: ProcessGroups,
        stats: CommStats | None = None,
        chunk_bytes: int = 4 << 20,
        wan: WanEmulator | None = None,
    ) -> None:
        self.groups = groups
        self.stats = stats if stats is not None else CommStats()
        self._my_site = groups.me.site_index
        self.lanes: list[Lane] = groups.lanes
        self.chunk_bytes = chunk_bytes
        self.wan = wan
        self._lock = threading.Lock()
        self._pool = DaemonPool(len(self.lanes), "lane") if len(self.lanes) > 1 else None

    def close(self) -> None:
        """Stop the lane threads. Does not wait: after a normal run they are idle, and after a
        failure one may be blocked on a dead or slow peer; they are daemons
        (:mod:`geotrain.comm.threads`), so that cannot hold up the exit either."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    # ------------------------------------------------------------------ primitives

    def _count(self, dst: int, nbytes: int, raw: int | None = None) -> None:
        topo = self.groups.topology
        dst_site = topo.site_of(dst)
        if dst_site == self._my_site:
            with self._lock:
                self.stats.intra_bytes += nbytes
        else:
            self.count_far(nbytes, raw, other_region=not topo.same_region(dst_site, self._my_site), to=dst_site)

    def count_far(self, nbytes: int, raw: int | None = None, other_region: bool = False, to: int | None = None) -> None:
        """Count ``nbytes`` sent to another site (``raw``: the fp32 bytes they stand for; ``to``: its
        index, for bytes per link) across regions or not; also for sends outside this rank's groups
        (a site that came back: the run's store)."""
        with self._lock:
            if to is not None:
                self.stats.link_bytes[to] = self.stats.link_bytes.get(to, 0) + nbytes
            self.stats.inter_bytes += nbytes
            self.stats.inter_raw_bytes += nbytes if raw is None else raw
            if other_region:
                self.stats.inter_region_bytes += nbytes

    def _p2p(
        self, sends: list[tuple[int, torch.Tensor, int | None]], recvs: list[tuple[int, torch.Tensor]], group: dist.ProcessGroup
    ) -> None:
        """Send ``(dst, buffer, fp32 bytes it stands for or None)`` and receive ``(src, buffer)``, all at
        once (global ranks); empty buffers are skipped. Inter-site sends go through the link emulation."""
        sends = [s for s in sends if s[1].numel()]
        recvs = [r for r in recvs if r[1].numel()]
        if not sends and not recvs:
            return
        site = self.groups.topology.site_of
        t0 = time.monotonic()
        recv_works = [_irecv(buf, src, group) for src, buf in recvs]
        works = []
        far_out: list[tuple[int, int]] = []
        for dst, buf, raw in sends:
            nbytes = buf.numel() * buf.element_size()
            self._count(dst, nbytes, raw)
            works.append(_isend(buf, dst, group))
            if site(dst) != self._my_site:
                far_out.append((dst, nbytes))
        far_in = [src for src, _ in recvs if site(src) != self._my_site]
        wan = self.wan
        if wan is None or not (far_out or far_in):
            for w in recv_works + works:
                w.wait()
        elif wan.paces_bandwidth:
            headers_in = {src: torch.zeros(1, dtype=torch.float64) for src in far_in}
            header_works = [_irecv(h, src, group, _HEADER_TAG) for src, h in headers_in.items()]
            arrivals = wan.pace([(site(dst), n) for dst, n in far_out]) if far_out else []
            headers_out = [torch.tensor([a], dtype=torch.float64) for a in arrivals]
            header_works += [_isend(h, dst, group, _HEADER_TAG) for h, (dst, _) in zip(headers_out, far_out, strict=True)]
            for w in recv_works + works + header_works:
                w.wait()
            wan.hold_until(max((float(h.item()) for h in headers_in.values()), default=0.0))
        else:  # kernel mode: tc shapes the bandwidth; hold far data one latency after it arrived
            hold = 0.0
            for (src, _), w in zip(recvs, recv_works, strict=True):
                w.wait()
                if site(src) != self._my_site:
                    hold = max(hold, time.monotonic() + wan.latency(site(src)))
            for w in works:
                w.wait()
            wan.hold_until(hold)
        if far_out or far_in:
            t1 = time.monotonic()
            with self._lock:
                self.stats.network_seconds += t1 - t0
                iv = self.stats.intervals
                if iv is not None and len(iv) < TIMELINE_CAP:
                    iv.append((t0, t1))

    def _exchange(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, group: dist.ProcessGroup) -> None:
        """Send ``send`` to ``dst`` while receiving ``recv`` from ``src`` (global ranks)."""
        self._p2p([(dst, send, None)], [(src, recv)], group)

    def _ring(self, ranks: list[int]) -> tuple[int, int, int, int]:
        """(ring size, my position, next rank, previous rank) for a ring over ``ranks``."""
        n = len(ranks)
        i = ranks.index(self.groups.me.rank)
        return n, i, ranks[(i + 1) % n], ranks[(i - 1) % n]

    def _ring_reduce_scatter(
        self, x: torch.Tensor, ranks: list[int], group: dist.ProcessGroup, sizes: list[int] | None = None
    ) -> None:
        """Ring reduce-scatter; rank ``ranks[j]`` ends with the sum of chunk j (``x.tensor_split(n)``, or ``x.split(sizes)``)."""
        n, i, nxt, prv = self._ring(ranks)
        if n == 1:
            return
        chunks = x.split(sizes) if sizes is not None else x.tensor_split(n)
        scratch = torch.empty(max(c.numel() for c in chunks), dtype=x.dtype, device=x.device)
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

    def _timed(self, fn, *args, wide: bool = True) -> None:  # type: ignore[no-untyped-def]
        """Run ``fn``; time it as blocked communication when the training (main) thread called
        (``wide``: a collective that crosses sites)."""
        t0 = time.perf_counter()
        fn(*args)
        if threading.current_thread() is threading.main_thread():
            self.add_wait(time.perf_counter() - t0, wide)

    def add_wait(self, seconds: float, wide: bool = True) -> None:
        """Account ``seconds`` the training thread spent blocked on communication."""
        self.stats.comm_seconds += seconds
        if wide:
            self.stats.wan_wait_seconds += seconds

    def _laned(self, x: torch.Tensor, per_chunk: Callable[[torch.Tensor, Lane], None]) -> None:
        """Cut ``x`` into chunks of ``chunk_bytes``; chunk k runs ``per_chunk`` on lane k mod L, lanes in parallel."""
        step = max(1, self.chunk_bytes // x.element_size())
        chunks = list(x.split(step)) if x.numel() else [x]
        lanes = min(len(self.lanes), len(chunks))
        if lanes == 1 or self._pool is None:
            for c in chunks:
                per_chunk(c, self.lanes[0])
            return

        def run(i: int) -> None:
            for c in chunks[i::lanes]:
                per_chunk(c, self.lanes[i])

        for f in [self._pool.submit(run, i) for i in range(lanes)]:
            f.result()

    @staticmethod
    def _check(x: torch.Tensor) -> None:
        if x.dim() != 1 or not x.is_contiguous():
            raise ValueError("collectives take a 1-D contiguous tensor (flatten first)")

    def _peer_exchange(
        self, sends: dict[int, tuple[torch.Tensor, int]], recvs: dict[int, torch.Tensor], group: dist.ProcessGroup
    ) -> None:
        """Send ``sends[dst] = (buffer, fp32 bytes it stands for)`` and receive ``recvs[src]``, all at once."""
        self._p2p([(dst, buf, raw) for dst, (buf, raw) in sends.items()], list(recvs.items()), group)

    def _coded_all_reduce(
        self,
        x: torch.Tensor,
        codec: Codec,
        ranks: list[int],
        group: dist.ProcessGroup,
        ef: Residual | None,
        shares: Sequence[float] | None = None,
    ) -> None:
        """Sum ``x`` over ``ranks`` sending only ``codec``-encoded bytes (:func:`geotrain.comm.coded.coded_sum`)."""
        coded_sum(
            x,
            codec,
            ranks,
            self.groups.me.rank,
            lambda sends, recvs: self._peer_exchange(sends, recvs, group),
            ef,
            shares,
            self.groups.topology.site_of,
        )

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

    def _ring_sum(self, x: torch.Tensor, ranks: list[int], group: dist.ProcessGroup) -> None:
        """Ring all-reduce: reduce-scatter then all-gather (untimed building block)."""
        self._ring_reduce_scatter(x, ranks, group)
        self._ring_all_gather(x, ranks, group)

    def _wide_sum(self, x: torch.Tensor, ranks: list[int], group: dist.ProcessGroup, region: bool = False) -> None:
        """fp32 sum over ``ranks`` (one per site) in the exchange's order and shape (``topology.exchange``;
        ``region``: a region's sum of two tiers) (untimed building block)."""
        topo = self.groups.topology
        ranks = topo.ordered(ranks)
        shape = topo.region_shape if region else topo.shape
        if shape == "ring":
            self._ring_sum(x, ranks, group)
        else:
            (tree_sum if shape == "tree" else hub_sum)(x, ranks, self.groups.me.rank, lambda s, r: self._p2p(s, r, group))

    def ring_all_reduce(self, x: torch.Tensor, ranks: list[int], group: dist.ProcessGroup, wide: bool = True) -> None:
        """Sum ``x`` over ``ranks`` (global ranks, ring order) in place (``wide``: the ring crosses sites)."""
        self._check(x)
        self._timed(self._ring_sum, x, ranks, group, wide=wide)

    def all_reduce_intra(self, x: torch.Tensor) -> None:
        """Sum over the ranks of this rank's site (main site group, for the training thread)."""
        self.ring_all_reduce(x, self.groups.intra_ranks, self.groups.intra, wide=False)

    def all_reduce_flat(self, x: torch.Tensor, codec: Codec | None = None, ef: Residual | None = None) -> None:
        """Sum over all ranks with one ring in rank order (site-major): the topology-blind baseline.

        fp32 is pipelined over the lanes like the hierarchical all-reduce, so the two compare fairly.
        """
        self._check(x)
        ranks = self.groups.topology.all_ranks()
        if codec is not None:
            self._timed(self._coded_all_reduce, x, codec, ranks, self.lanes[0].world, ef)
            return

        self._timed(self._laned, x, lambda c, lane: self._ring_sum(c, ranks, lane.world))

    def _across(
        self,
        shard: torch.Tensor,
        lane: Lane,
        codec: Codec | None,
        ef: Residual | None,
        region: bool = False,
        shares: Sequence[float] | None = None,
    ) -> None:
        g = self.groups
        ranks, group = (g.region_inter_ranks, lane.region) if region else (g.inter_ranks, lane.inter)
        assert group is not None, "a rank that carries nothing across sites was given a shard"
        if codec is None:
            self._wide_sum(shard, ranks, group, region)
        else:
            self._coded_all_reduce(shard, codec, ranks, group, ef, shares)

    def _site_pipeline(
        self,
        x: torch.Tensor,
        codec: Codec | None,
        ef: Residual | None,
        reduce_in_site: bool,
        region: bool = False,
        shares: Sequence[float] | None = None,
    ) -> None:
        """[Reduce-scatter in site] -> all-reduce of this rank's shard across sites -> all-gather in
        site; fp32 chunked over the lanes, a codec on the whole tensor (its scales and error
        feedback are per tensor) on lane 0."""
        g = self.groups
        me = g.me.local_rank

        def chunk(c: torch.Tensor, lane: Lane) -> None:
            sizes = self.site_split(c.numel())
            if reduce_in_site:
                self._ring_reduce_scatter(c, g.intra_ranks, lane.intra, sizes)
            if sizes[me]:  # local ranks beyond the smallest site's size carry nothing across sites
                self._across(c.split(sizes)[me], lane, codec, ef, region, shares)
            self._ring_all_gather(c, g.intra_ranks, lane.intra, sizes)

        if codec is None:
            self._laned(x, chunk)
        else:
            chunk(x, self.lanes[0])

    def site_split(self, n: int) -> list[int]:
        """How a vector of ``n`` values is cut over this site's ranks for a cross-site exchange:
        as ``tensor_split(carriers)`` cuts it for the carrying local ranks, nothing for the rest."""
        topo = self.groups.topology
        k, workers = topo.carriers, topo.workers[self._my_site]
        q, r = divmod(n, k)
        return [q + 1] * r + [q] * (k - r) + [0] * (workers - k)

    def all_reduce_hierarchical(self, x: torch.Tensor, codec: Codec | None = None, ef: Residual | None = None) -> None:
        """Sum over all ranks: reduce-scatter in site, all-reduce shards across sites, all-gather in site.

        Only the across-sites step is encoded with ``codec``; in-site traffic stays fp32.
        """
        self._check(x)
        self._timed(self._site_pipeline, x, codec, ef, True)

    def all_gather_intra(self, x: torch.Tensor, sizes: list[int]) -> None:
        """In-site all-gather where local rank j owns ``x.split(sizes)[j]`` (on lane 0's site group)."""
        self._check(x)
        self._timed(self._ring_all_gather, x, self.groups.intra_ranks, self.lanes[0].intra, sizes, wide=False)

    def all_reduce_across_sites(
        self,
        x: torch.Tensor,
        codec: Codec | None = None,
        ef: Residual | None = None,
        *,
        sharded: bool = False,
        region: bool = False,
        shares: Sequence[float] | None = None,
    ) -> None:
        """Sum over sites (``region``: over the sites of this rank's region) of a tensor that is
        already identical on every rank of a site.

        Each local rank all-reduces only its 1/G shard across sites, then the site all-gathers:
        the inter-site traffic of a hierarchical all-reduce without the (needless) in-site
        reduce-scatter.

        ``sharded``: ``x`` is this rank's own shard of the site's tensor (FSDP: local rank i holds
        the same part in every site), so the across-sites step is all there is: the same bytes
        cross sites, and no in-site all-gather follows.
        """
        self._check(x)
        if sharded:
            self._timed(self._shard_across, x, codec, ef, region, shares)
        else:
            self._timed(self._site_pipeline, x, codec, ef, False, region, shares)

    def _shard_across(
        self,
        x: torch.Tensor,
        codec: Codec | None,
        ef: Residual | None,
        region: bool = False,
        shares: Sequence[float] | None = None,
    ) -> None:
        if codec is None:
            self._laned(x, lambda c, lane: self._across(c, lane, None, None, region))
        else:
            self._across(x, self.lanes[0], codec, ef, region, shares)

    def site_values(self, value: float, region: bool = False) -> list[float]:
        """Every site's ``value`` (one float per site, the same on every rank of a site), in site
        order: a sum across sites of a vector holding each site's value in its own slot.
        ``region``: over the sites of this rank's region only (the others' slots stay 0)."""
        slots = torch.zeros(self.groups.topology.num_sites, dtype=torch.float64)
        slots[self._my_site] = value
        self.all_reduce_across_sites(slots, region=region)
        return slots.tolist()

    def gather_sites(self, mine: torch.Tensor) -> torch.Tensor:
        """Every site's ``mine`` (a small control vector, identical on every rank of a site), as rows
        in site order. One hop across sites (each carrying rank sends to its peers directly, not
        round a ring: one latency instead of 2(N-1)); a site's other ranks get it from local rank 0."""
        self._check(mine)
        g, topo = self.groups, self.groups.topology
        out = torch.zeros(topo.num_sites, mine.numel(), dtype=mine.dtype)
        out[self._my_site] = mine
        group = self.lanes[0].inter
        if group is not None and topo.num_sites > 1:
            got = {r: torch.empty_like(mine) for r in g.inter_ranks if r != g.me.rank}
            self._timed(self._peer_exchange, {r: (mine, mine.numel() * mine.element_size()) for r in got}, got, group)
            for r, t in got.items():
                out[topo.site_of(r)] = t
        if topo.workers[self._my_site] > topo.carriers:  # ranks beyond the carriers take local rank 0's copy
            flat = out.reshape(-1)
            if g.me.local_rank:
                flat.zero_()
            self.sum_in_site(flat)
        return out

    def sum_in_site(self, x: torch.Tensor) -> None:
        """Sum a small control value over this rank's site, on lane 0's site group (safe from the
        background exchange thread while the training thread uses the main site group)."""
        self.ring_all_reduce(x, self.groups.intra_ranks, self.lanes[0].intra, wide=False)

    def all_reduce_inter(self, x: torch.Tensor) -> None:
        """Sum over this rank's cross-site group (its local rank in every site), fp32, lane 0."""
        group = self.lanes[0].inter
        assert group is not None, "a rank that carries nothing across sites has no cross-site group"
        self._check(x)
        self._timed(self._wide_sum, x, self.groups.inter_ranks, group)

    def all_reduce(self, x: torch.Tensor, how: str, codec: Codec | None = None, ef: Residual | None = None) -> None:
        """Sum over all ranks, ``how`` = 'hierarchical' or 'flat'."""
        if how == "flat":
            self.all_reduce_flat(x, codec, ef)
        else:
            self.all_reduce_hierarchical(x, codec, ef)
