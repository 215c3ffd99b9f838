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
import hmac
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from geotrain.comm.emulate.inprocess import WanEmulator
from geotrain.comm.groups import round_group
from geotrain.elastic.auth import TAG_BYTES, SealedStore, frame_tag
from geotrain.elastic.roundstore import Monitor
from geotrain.elastic.view import RoundView
from geotrain.errors import RoundFailed

DATA_TAG, HEADER_TAG, HEAL_TAG, MAC_TAG, HEAL_MAC_TAG = 0, 1, 2, 4, 5


class Exchange:
    """One round's exchange for one local rank: [create the round group], [send or receive the
    healing state], ring-sum ``shard`` with the same local rank of every admitted site.

    Args:
        view: the round (admitted sites in group-rank order, source, healers).
        site, local: this site and local rank.
        names: every site of the run (link emulation indices).
        group: the round group to reuse (same membership as last round), or None to create one in ``store``.
        shard: this rank's part of the vector to sum (the thread sums into it).
        outgoing: the source's serialised state for the healers (the source only).
        backstop: the timeout of one wait of ``nbytes`` among ``n`` sites.
        count: adds bytes sent across sites to the member's counter (under its lock).
        on_mid_round: called between the reduce-scatter and the all-gather (failure injection).
        payload_key: every frame (ring chunk, healing state) carries an HMAC-SHA256 under this key,
            bound to the round, sender, receiver, local rank and position; a frame that fails it
            fails the round (:class:`RoundFailed` naming the sender) before it is used.
        tamper: failure injection: alter this rank's outgoing frames after their MAC (an attacker
            on the path).
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
        count: Callable[[int], None],
        on_mid_round: Callable[[], None] | None,
        payload_key: bytes,
        tamper: bool = False,
    ) -> None:
        self.view, self.site, self.local, self.names, self.wan = view, site, local, names, wan
        self.monitor, self.store, self.shard, self.outgoing = monitor, store, shard, outgoing
        self.backstop, self.timeout_s, self.count, self.on_mid_round = backstop, timeout_s, count, on_mid_round
        self.payload_key, self.tamper = payload_key, tamper
        self._seq = 0
        self.forged: str | None = None  # the first frame that failed its MAC
        self.mac_seconds = 0.0  # time spent computing and checking MACs (the cost of authentication)
        self.verify_seconds = 0.0  # of which checking received frames (after arrival: on the critical path)
        self.reused = group is not None
        self.group = group
        self.heal_blob: bytes | None = None  # set once the whole healing state has arrived
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._done = self._abandoned = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="cross-site-exchange")

    # ------------------------------------------------------------------ main thread

    def start(self) -> None:
        self._thread.start()

    def wait(self) -> bool:
        """Wait until the exchange ends or a peer goes silent; False: the exchange is abandoned
        (the thread may still run; it will abort its own group)."""
        while self._thread.is_alive() and self.monitor.failed is None:
            self._thread.join(timeout=0.01)
        with self._lock:
            if not self._done:
                self._abandoned = True
            return not self._abandoned

    # ------------------------------------------------------------------ the exchange thread

    def _run(self) -> None:
        try:
            if self.group is None:
                self.group = round_group(
                    self.store.gloo_prefix(f"pg/{self.local}"),
                    self.view.admitted.index(self.site),
                    len(self.view.admitted),
                    self.timeout_s,
                    os.environ.get("GEOTRAIN_BIND_ADDR"),  # the cross-site address (geotrain site --bind)
                )
            self._heal()
            self._ring_sum()
            if self.forged is not None:
                raise RoundFailed(self.forged)
        except BaseException as exc:  # reported to the main thread
            self.error = exc
        finally:
            with self._lock:
                self._done = True
                abandoned = self._abandoned
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
        return f"geotrain-frame|{self.view.key}|{admitted[sender]}|{admitted[receiver]}|{self.local}|{what}".encode()

    def _mac(self, sender: int, receiver: int, what: str, data: torch.Tensor) -> bytes:
        """The frame MAC of ``data`` from ``sender`` to ``receiver`` (group ranks), timed."""
        t0 = time.perf_counter()
        tag = frame_tag(self.payload_key, self._context(sender, receiver, what), data)
        self.mac_seconds += time.perf_counter() - t0
        return tag

    def _tag(self, data: torch.Tensor, dst: int, what: str) -> torch.Tensor:
        """The MAC this rank sends after ``data`` to ``dst``."""
        tag = self._mac(self.view.admitted.index(self.site), dst, what, data)
        return torch.frombuffer(bytearray(tag), dtype=torch.uint8)

    def _altered(self, data: torch.Tensor) -> torch.Tensor:
        """Failure injection: ``data`` with one bit flipped (after its MAC was computed)."""
        data = data.clone()
        data.view(torch.uint8)[0] ^= 1
        return data

    def _verify(self, data: torch.Tensor, tag: torch.Tensor, src: int, what: str) -> bool:
        """Whether ``data`` is what site ``src`` sent. A frame that is not is remembered (the first
        one fails the round once the ring has ended: the ring goes on so no peer is left waiting)."""
        t0 = time.perf_counter()
        want = self._mac(src, self.view.admitted.index(self.site), what, data)
        self.verify_seconds += time.perf_counter() - t0
        if hmac.compare_digest(want, tag.numpy().tobytes()):
            return True
        if self.forged is None:
            self.forged = f"a frame from site {self.view.admitted[src]} failed authentication (payload MAC)"
        return False

    def _send_recv(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> None:
        """One paced, authenticated exchange over the round group (group ranks = positions in
        ``view.admitted``); ``recv`` is verified before the caller uses it. The outgoing MAC is
        computed while the frame is in flight and follows it; the incoming one is checked once the
        frame has (emulated) arrived, so its cost is on the round's critical path as on a real link."""
        pg = self.group
        nbytes = send.numel() * send.element_size()
        self.count(nbytes + TAG_BYTES)
        self._seq += 1
        what = f"ring{self._seq}"
        works = [pg.recv([recv], src, DATA_TAG), pg.send([self._altered(send) if self.tamper else send], dst, DATA_TAG)]
        arrival = self.wan.pace([(self.names.index(self.view.admitted[dst]), nbytes)])[0] if self.wan is not None else 0.0
        tag_out = self._tag(send, dst, what)  # of the unaltered frame, while it is in flight
        tag_in = torch.empty(TAG_BYTES, dtype=torch.uint8)
        works += [pg.recv([tag_in], src, MAC_TAG), pg.send([tag_out], dst, MAC_TAG)]
        if self.wan is None:
            self._wait(works, nbytes)
            self._verify(recv, tag_in, src, what)
            return
        header_in = torch.zeros(1, dtype=torch.float64)
        works += [
            pg.recv([header_in], src, HEADER_TAG),
            pg.send([torch.tensor([arrival], dtype=torch.float64)], dst, HEADER_TAG),
        ]
        self._wait(works, nbytes)
        self.wan.hold_until(float(header_in.item()))
        self._verify(recv, tag_in, src, what)

    def _ring_sum(self) -> None:
        view, x = self.view, self.shard
        n = len(view.admitted)
        i = view.admitted.index(self.site)
        nxt, prv = (i + 1) % n, (i - 1) % n
        chunks = x.tensor_split(n)
        scratch = torch.empty_like(chunks[0])
        for s in range(n - 1):
            into = chunks[(i - s - 2) % n]
            buf = scratch[: into.numel()]
            self._send_recv(chunks[(i - s - 1) % n], nxt, buf, prv)
            into.add_(buf)
        if self.on_mid_round is not None:
            self.on_mid_round()
        for s in range(n - 1):
            self._send_recv(chunks[(i - s) % n], nxt, chunks[(i - s - 1) % n], prv)

    def _heal(self) -> None:
        """The source sends its serialised state to every healer (same local rank); a healer keeps
        the bytes for the main thread to load."""
        view, pg = self.view, self.group
        src = view.admitted.index(view.source)
        if self.site == view.source and self.outgoing is not None:
            state = torch.frombuffer(bytearray(self.outgoing), dtype=torch.uint8)
            size = torch.tensor([state.numel()], dtype=torch.int64)
            for h in view.healers:
                dst = view.admitted.index(h)
                tag = self._tag(state, dst, f"heal{state.numel()}")
                blob = self._altered(state) if self.tamper else state
                works = [pg.send([size], dst, HEAL_TAG), pg.send([blob], dst, HEAL_TAG + 1), pg.send([tag], dst, HEAL_MAC_TAG)]
                self._wait(works, blob.numel())
                self.count(blob.numel() + 8 + TAG_BYTES)
        elif self.site in view.healers:
            size = torch.zeros(1, dtype=torch.int64)
            self._wait([pg.recv([size], src, HEAL_TAG)], 8)
            blob = torch.empty(int(size.item()), dtype=torch.uint8)
            tag = torch.empty(TAG_BYTES, dtype=torch.uint8)
            self._wait([pg.recv([blob], src, HEAL_TAG + 1), pg.recv([tag], src, HEAL_MAC_TAG)], blob.numel())
            if self._verify(blob, tag, src, f"heal{blob.numel()}"):  # the size is bound into the MAC
                self.heal_blob = blob.numpy().tobytes()
