"""One round's cross-site exchange, run in a thread of its own while the training thread watches
the peers' heartbeats.

Gloo waits cannot be interrupted, so a hung peer would block the caller; the exchange therefore
runs in a thread, and the training (main) thread abandons it when a peer goes silent.

**Ownership.** The thread owns only this :class:`Exchange`: the process group it creates, the
shard buffer it was handed, the healing bytes it receives, its error. It never touches the model,
the optimizer, the member's group or its counters except through a lock. The main thread
serialises the source's state before the thread starts, and reads the results after the thread
ended — or, if it abandoned it, takes only what the thread had completed (a healing blob is set
once fully received). A thread that ends after being abandoned aborts the group it created
itself. Every wait has a backstop timeout sized from its bytes and the slowest link, so an
abandoned thread ends within that bound (a Gloo wait that times out closes its pair and raises).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from geotrain.comm.coded import GatherSum
from geotrain.comm.emulate.inprocess import WanEmulator
from geotrain.comm.groups import round_group
from geotrain.config import LivenessConfig
from geotrain.elastic.auth import FrameCipher, SealedStore, sealed_size
from geotrain.elastic.commit import TRAILER, Encoder
from geotrain.elastic.roundstore import Monitor
from geotrain.elastic.view import RoundView
from geotrain.errors import RoundFailed

HEAL_TAG = 2  # and 3: the healing state's size, then the state
PIECE_TAG = 16  # a frame's piece j travels with tag PIECE_TAG + 2j, its arrival time with PIECE_TAG + 2j + 1
PIECE = 4 << 20  # bytes of a frame sealed and sent at once


def backstop(slowest_link: tuple[float, float], cfg: LivenessConfig, nbytes: int, sites: int) -> float:
    """Seconds one wait of ``nbytes`` among ``sites`` may take before it fails on its own, over the
    slowest link (bandwidth, latency). Heartbeats detect a dead or hung peer sooner; this bounds
    how long an abandoned exchange thread can live."""
    bps, latency = slowest_link
    transfer = nbytes * 8 / bps + latency
    return min(cfg.collective_timeout_s, 5 * cfg.heartbeat_timeout_s + 4 * sites * transfer)


class Exchange:
    """One round's exchange for one local rank: [create the round group], [send or receive the
    healing state], sum ``shard`` with the same local rank of every admitted site: an fp32 ring,
    or, with a ``codec``, encoded (:meth:`_coded_sum`).

    Args:
        view: the round (admitted sites in group-rank order, source, healers).
        site, local: this site and local rank.
        names: every site of the run (link emulation indices).
        group: the round group to reuse (same membership as last round), or None to create one in ``store``.
        shard: this rank's part of the vector to sum (the thread sums into it); its last
            :data:`TRAILER` elements are this site's weight in the round and 1 if it contributes
            (both 0 if not), summed exactly.
        outgoing: the source's serialised state for the healers (the source only).
        heals: this rank takes part in healing (local rank 0: the state crosses once per site).
        add: how the ring adds a received chunk (secure aggregation: int32 mod 2^32; default fp32).
        ping: first time a round trip to the next site of the ring (``sync.adapt``'s; :attr:`ping_s`).
        codec: encode what crosses sites (None: fp32); with ``error_feedback``, ``residual`` (this
            rank's, or None) is added before encoding and the new one is left in
            :attr:`residual` for the main thread to keep if the round commits.
        backstop: the timeout of one wait of ``nbytes`` among ``n`` sites.
        count: adds bytes sent across sites to the member's counter (under its lock), with the
            site they went to.
        ring: the sites whose shards are summed, in exchange order (``topology.exchange.order``; two tiers: a region
            round sums over the region's admitted sites; default: every admitted site). Healing
            state crosses between any two admitted sites.
        on_mid_round: called between the reduce-scatter and the all-gather (failure injection).
        Every frame (ring chunk, healing state) is encrypted and authenticated under the key of its
        pair of sites in this round (``view.frame_keys``, :class:`FrameCipher`), bound to the
        round, sender, receiver, local rank and position; a frame that fails to open fails the
        round (:class:`RoundFailed` naming the sender) before it is used.
        tamper: failure injection: alter this rank's outgoing frames after they were sealed (an
            attacker on the path).
    """

    def __init__(
        self,
        view: RoundView,
        site: str,
        local: int,
        names: list[str],
        wan: WanEmulator | None,
        monitor: Monitor,
        store: SealedStore,
        group: Any,
        shard: torch.Tensor,
        outgoing: bytes | None,
        backstop: Callable[[int], float],
        timeout_s: float,
        count: Callable[[int, str], None],
        on_mid_round: Callable[[], None] | None,
        tamper: bool = False,
        heals: bool = True,
        codec: Encoder | None = None,
        error_feedback: bool = False,
        residual: torch.Tensor | None = None,
        add: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
        ping: bool = False,
        ring: list[str] | None = None,
    ) -> None:
        self.view, self.site, self.local, self.names, self.wan = view, site, local, names, wan
        self.ring = ring if ring is not None else view.admitted
        self.monitor, self.store, self.shard, self.outgoing = monitor, store, shard, outgoing
        self.backstop, self.timeout_s, self.count, self.on_mid_round = backstop, timeout_s, count, on_mid_round
        self.ciphers = {peer: FrameCipher(k) for peer, k in view.frame_keys.items()}
        self.tamper, self.heals, self.codec = tamper, heals, codec
        self.error_feedback, self.residual = error_feedback, residual
        self.add = add or torch.Tensor.add_  # the ring's sum (secure aggregation: mod 2^32)
        self.raw_bytes = 0  # what an fp32 ring would have sent for the same sum (the codec's reference)
        self._seq = 0
        self.forged: str | None = None  # the first frame that failed to open
        self.seal_seconds = 0.0  # time spent encrypting outgoing frames (before they leave: on the critical path)
        self.open_seconds = 0.0  # time spent decrypting and checking received frames (also on the critical path)
        self.reused = group is not None
        self.group = group
        self.ping, self.ping_s = ping, 0.0  # sync.adapt: a round trip around the ring, timed, before the sum
        self.heal_blob: bytes | None = None  # set once the whole healing state has arrived
        self.seconds = 0.0
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._done = self._abandoned = False
        self._ended = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="cross-site-exchange")

    # ------------------------------------------------------------------ main thread

    def start(self) -> None:
        self._thread.start()

    def wait(self) -> bool:
        """Wait until the exchange ends or a peer goes silent; False: the exchange is abandoned
        (the thread may still run; it will abort its own group)."""
        self.monitor.woken.append(self._ended)  # woken by the thread's end or by a peer's silence
        while not self._ended.is_set() and self.monitor.failed is None:
            self._ended.wait(1.0)
        with self._lock:
            if not self._done:
                self._abandoned = True
            return not self._abandoned

    # ------------------------------------------------------------------ the exchange thread

    def _run(self) -> None:
        t0 = time.monotonic()
        try:
            if self.group is None:
                self.group = round_group(
                    self.store.gloo_prefix(f"pg/{self.local}"),
                    self.view.admitted.index(self.site),
                    len(self.view.admitted),
                    self.timeout_s,
                    os.environ.get("GEOTRAIN_BIND_ADDR"),  # the cross-site address (geotrain site --bind)
                )
            if self.ping:
                self._ping()
            if self.heals:
                self._heal()
            if self.codec is None:
                self._ring_sum()
            else:
                self._coded_sum(self.codec)
            if self.forged is not None:
                raise RoundFailed(self.forged)
        except BaseException as exc:  # reported to the main thread
            self.error = exc
        finally:
            self.seconds = time.monotonic() - t0  # the exchange alone (it may have run beside compute)
            with self._lock:
                self._done = True
                abandoned = self._abandoned
            self._ended.set()
            if abandoned and not self.reused and self.group is not None:
                with contextlib.suppress(Exception):
                    self.group.abort()

    def _wait(self, works: list[Any], nbytes: int) -> None:
        limit = timedelta(seconds=self.backstop(nbytes))
        for w in works:
            w.wait(limit)
        self.monitor.check()

    def _context(self, sender: int, receiver: int, what: str) -> bytes:
        admitted = self.view.admitted
        return f"geotrain-frame|{self.view.round_id}|{admitted[sender]}|{admitted[receiver]}|{self.local}|{what}".encode()

    def _seal(self, data: torch.Tensor, dst: int, what: str) -> torch.Tensor:
        """``data`` encrypted for group rank ``dst`` (timed); altered afterwards under failure injection."""
        t0 = time.perf_counter()
        cipher = self.ciphers[self.view.admitted[dst]]
        sealed = cipher.seal(self._context(self.view.admitted.index(self.site), dst, what), data)
        self.seal_seconds += time.perf_counter() - t0
        if self.tamper:
            sealed[0] ^= 1
        return sealed

    def _open(self, sealed: torch.Tensor, into: torch.Tensor, src: int, what: str) -> bool:
        """Decrypt what site ``src`` sent into ``into``; False if it is not what ``src`` sealed. The
        first such frame is remembered (it fails the round once the ring has ended: the ring goes
        on so no peer is left waiting)."""
        t0 = time.perf_counter()
        cipher = self.ciphers[self.view.admitted[src]]
        ok = cipher.open(self._context(src, self.view.admitted.index(self.site), what), sealed, into)
        self.open_seconds += time.perf_counter() - t0
        if not ok and self.forged is None:
            self.forged = f"a frame from site {self.view.admitted[src]} failed authentication (AES-GCM tag)"
        return ok

    def _send_recv(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> None:
        """One paced, encrypted exchange over the round group (group ranks = positions in
        ``view.admitted``); ``recv`` is filled only from pieces that opened.

        The frame travels in pieces of :data:`PIECE` bytes, each sealed on its own, so the cipher
        overlaps the wire: a piece is sealed while the one before it is in flight, and a received
        piece is opened once it has (emulated) arrived, while later ones are still on the way.
        What the cipher adds to the critical path is then about one piece's sealing and one
        piece's opening, unless the cipher is slower than the link."""
        pg = self.group
        self._seq += 1
        what = f"ring{self._seq}"
        out_u8, in_u8 = send.view(torch.uint8), recv.view(torch.uint8)
        outs = list(range(0, max(1, out_u8.numel()), PIECE))
        ins = list(range(0, max(1, in_u8.numel()), PIECE))
        incoming: list[tuple[torch.Tensor, Any, torch.Tensor | None, Any]] = []
        for j, k in enumerate(ins):  # every receive posted first
            buf = torch.empty(sealed_size(min(PIECE, in_u8.numel() - k)), dtype=torch.uint8)
            header = torch.zeros(1, dtype=torch.float64) if self.wan is not None else None
            incoming.append(
                (
                    buf,
                    pg.recv([buf], src, PIECE_TAG + 2 * j),
                    header,
                    pg.recv([header], src, PIECE_TAG + 2 * j + 1) if header is not None else None,
                )
            )
        sent: list[Any] = []  # (works and the tensors they send, kept alive until done)
        opened = 0  # the received pieces opened so far, in order

        def open_ready(block: bool) -> None:
            """Open the received pieces, in order, that have arrived (all of them if ``block``)."""
            nonlocal opened
            while opened < len(incoming):
                buf, work, header, hwork = incoming[opened]
                ready = work.is_completed() and (hwork is None or hwork.is_completed())
                if not block and (not ready or (header is not None and time.monotonic() < float(header.item()))):
                    break
                self._wait([work] if hwork is None else [work, hwork], buf.numel())
                if header is not None and self.wan is not None:
                    self.wan.hold_until(float(header.item()))
                k = ins[opened]
                self._open(buf, in_u8[k : k + PIECE], src, f"{what}|{opened}")
                opened += 1

        for i, k in enumerate(outs):
            piece = self._seal(out_u8[k : k + PIECE], dst, f"{what}|{i}")
            nbytes = piece.numel()
            self.count(nbytes, self.view.admitted[dst])
            works = [pg.send([piece], dst, PIECE_TAG + 2 * i)]
            if self.wan is not None:
                arrival = self.wan.pace([(self.names.index(self.view.admitted[dst]), nbytes)])[0]
                stamp = torch.tensor([arrival], dtype=torch.float64)
                works.append(pg.send([stamp], dst, PIECE_TAG + 2 * i + 1))
                sent.append(stamp)
            sent.append((works, piece))
            open_ready(block=False)
        open_ready(block=True)
        for item in sent:
            if isinstance(item, tuple):
                self._wait(item[0], item[1].numel())

    def _rank(self, j: int) -> int:
        """The group rank of the ``j``-th site of the ring (modulo its length)."""
        return self.view.admitted.index(self.ring[j % len(self.ring)])

    def _ring_sum(self) -> None:
        x = self.shard
        n = len(self.ring)
        i = self.ring.index(self.site)
        nxt, prv = self._rank(i + 1), self._rank(i - 1)
        chunks = x.tensor_split(n)
        scratch = torch.empty_like(chunks[0])
        # an fp32 ring sends every chunk but its own, then every chunk but the next one's
        self.raw_bytes += 4 * (2 * x.numel() - chunks[i].numel() - chunks[(i + 1) % n].numel())
        for s in range(n - 1):
            into = chunks[(i - s - 2) % n]
            buf = scratch[: into.numel()]
            self._send_recv(chunks[(i - s - 1) % n], nxt, buf, prv)
            self.add(into, buf)
        if self.on_mid_round is not None:
            self.on_mid_round()
        for s in range(n - 1):
            self._send_recv(chunks[(i - s) % n], nxt, chunks[(i - s - 1) % n], prv)

    def _ping(self) -> None:
        """sync.adapt: a round trip to the next site of the ring, timed. A one-float ping goes to
        the next site, then each site echoes the ping it got back to the site it came from; the echo
        leaves only once the ping has arrived, so every site's time holds at least one round trip
        on its link to the next site (plus, for a site that started early, its wait for the others).
        Two hops the same way round did not: with three sites or more, the second message from the
        site before could leave before the one that started last had sent anything."""
        i = self.ring.index(self.site)
        one, got, echo = torch.zeros(1), torch.zeros(1), torch.zeros(1)
        t = time.perf_counter()
        self._send_recv(one, self._rank(i + 1), got, self._rank(i - 1))  # ping forward
        self._send_recv(got, self._rank(i - 1), echo, self._rank(i + 1))  # echo back
        self.ping_s = time.perf_counter() - t

    def _heal(self) -> None:
        """A source sends its serialised state to each of its healers (same local rank), encrypted;
        a healer keeps the bytes for the main thread to load."""
        view, pg = self.view, self.group
        if view.healed_by(self.site) and self.outgoing is not None:
            state = torch.frombuffer(bytearray(self.outgoing), dtype=torch.uint8)
            size = torch.tensor([state.numel()], dtype=torch.int64)
            for h in view.healed_by(self.site):
                dst = view.admitted.index(h)
                blob = self._seal(state, dst, f"heal{state.numel()}")  # the size is bound into the context
                self._wait([pg.send([size], dst, HEAL_TAG), pg.send([blob], dst, HEAL_TAG + 1)], blob.numel())
                self.count(blob.numel() + 8, h)
                self.raw_bytes += blob.numel() + 8  # the same with or without a codec
        elif self.site in view.healers:
            source = view.source_of(self.site)
            src = view.admitted.index(source)
            size = torch.zeros(1, dtype=torch.int64)
            self._wait([pg.recv([size], src, HEAL_TAG)], 8)
            n = int(size.item())
            if not 0 < n <= 1 << 36:
                raise RoundFailed(f"site {source} announced healing state of {n} bytes")
            blob = torch.empty(sealed_size(n), dtype=torch.uint8)
            self._wait([pg.recv([blob], src, HEAL_TAG + 1)], blob.numel())
            state = torch.empty(n, dtype=torch.uint8)
            if self._open(blob, state, src, f"heal{n}"):
                self.heal_blob = state.numpy().tobytes()

    def _coded_sum(self, codec: Encoder) -> None:
        """Sum the shard over the admitted sites sending only ``codec``-encoded values, as the
        lock-step reducer does (:meth:`geotrain.comm.collectives.Collectives._coded_all_reduce`):

        * ``scatter`` codecs: site j owns chunk j; every site sends its encoding of chunk j to j
          (error feedback keeps what the encoding lost), the owner adds them to its own fp32 chunk,
          encodes the sum once and sends it to every site; all decode the same bytes, so every
          site ends with the same values;
        * ``gather`` codecs (top-k, SparseLoCo): every site sends its encoding of the whole shard
          to every other, and each decodes and adds them in the order of ``view.admitted``.

        The shard's :data:`TRAILER` (weight, count) travels beside the codes as fp32: the number
        that divides the sum is exact. Pairs are visited as offsets d = 1..n-1 (send to
        i+d, receive from i-d), one encrypted frame each way, like the ring's steps.
        """
        ext = self.shard
        n = len(self.ring)
        i = self.ring.index(self.site)
        if n == 1:  # alone in the round: nothing crosses, nothing is encoded (the residual waits, as in lock-step)
            return
        x, weight = ext[:-TRAILER], ext[-TRAILER:]
        contributes = bool(float(weight[-1].item()))
        if self.residual is not None and contributes:
            x.add_(self.residual)
        meant = x.clone() if self.error_feedback and contributes else None

        tail = 4 * TRAILER

        def frame(codes: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return torch.cat([codes, w.to(torch.float32).view(torch.uint8)])

        def received(numel: int) -> torch.Tensor:
            return torch.empty(codec.encoded_nbytes(numel) + tail, dtype=torch.uint8)

        def unpack(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return buf[:-tail], buf[-tail:].clone().view(torch.float32)

        sent = torch.zeros_like(x)  # what the peers will decode from this site (for error feedback)
        if codec.reduce == "gather":
            codes = codec.encode(x)
            codec.decode(codes, x.numel(), sent)
            got: dict[int, torch.Tensor] = {i: frame(codes, weight)}
            for d in range(1, n):
                buf = received(x.numel())
                self._send_recv(got[i], self._rank(i + d), buf, self._rank(i - d))
                got[(i - d) % n] = buf
                self.raw_bytes += 4 * x.numel()
                if d == 1 and self.on_mid_round is not None:  # some peers have this site's update, others not
                    self.on_mid_round()
            total = torch.zeros(TRAILER)
            # a sender-mean codec (SparseLoCo): each coordinate over the weights of the sites that sent
            # it, times the round's total weight, which divides it later
            acc = GatherSum(codec, x, mean=True)
            for j in range(n):  # the same order on every site: bit-identical sums
                codes_j, w = unpack(got[j])
                acc.add(codes_j, share=float(w[0]))
                total += w
            acc.finish(scale=float(total[0]))
        else:
            chunks, spent = x.tensor_split(n), sent.tensor_split(n)
            mine, total = chunks[i], weight.clone()
            tmp = torch.empty_like(mine)
            parts: list[tuple[torch.Tensor, torch.Tensor]] = []
            for d in range(1, n):  # reduce-scatter, encoded
                dst, src = (i + d) % n, (i - d) % n
                codes = codec.encode(chunks[dst])
                codec.decode(codes, chunks[dst].numel(), spent[dst])
                buf = received(mine.numel())
                self._send_recv(frame(codes, weight), self._rank(dst), buf, self._rank(src))
                self.raw_bytes += 4 * chunks[dst].numel()
                parts.append(unpack(buf))
            for codes_j, w in parts:
                mine.add_(codec.decode(codes_j, mine.numel(), tmp))
                total += w
            if self.on_mid_round is not None:
                self.on_mid_round()
            summed = codec.encode(mine)  # the owner keeps the decoded sum too: every site holds the same
            codec.decode(summed, mine.numel(), mine)
            ours = frame(summed, total)
            for d in range(1, n):  # all-gather of the encoded sums
                dst, src = (i + d) % n, (i - d) % n
                buf = received(chunks[src].numel())
                self._send_recv(ours, self._rank(dst), buf, self._rank(src))
                self.raw_bytes += 4 * mine.numel()
                codes_j, _ = unpack(buf)
                codec.decode(codes_j, chunks[src].numel(), chunks[src])
            if meant is not None:  # the chunk this site owns never crossed encoded: no error on it
                spent[i].copy_(meant.tensor_split(n)[i])
        # error feedback: what this site meant to send minus what its peers decoded (a site that
        # sent nothing keeps none, as in lock-step rounds)
        self.residual = meant.sub_(sent) if meant is not None else None
        weight.copy_(total)
