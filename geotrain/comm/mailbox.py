"""Messages between sites that do not wait for each other: a header and a payload, one sender,
one receiver, no collective.

The asynchronous quorum rounds (:mod:`geotrain.round.hub`) need a site to hand its update to
the syncer and go on, whatever the other sites are doing; a ring collective would make every
site wait for the slowest. A message is two point-to-point sends on the sites' leaders' group
(:func:`geotrain.comm.groups.leaders_group`): a float64 header (the emulated arrival time, the
payload's length in bytes, then the caller's fields), then the payload: bytes, an fp32 vector's
or a codec's (:mod:`geotrain.codecs`). Like every other send, it is
counted on the link it crosses (:meth:`Collectives._count`) and, with the in-process link
emulation, paced on that link: the sender reserves the link and stamps the arrival time, the
receiver treats the message as delivered only at that time (:meth:`Mailbox.arrived`).

A peer that dies is noticed, not waited for: its connection closes, so a receive from it ends
with a **lost** message (:attr:`Message.lost`) and a send to it is reported by :meth:`flush`.

A site that **comes back** after it died cannot join the torch.distributed world its first
incarnation was part of (a world does not grow). It talks to the syncer through the run's
rendezvous store instead: :class:`StoreChannel` carries the same messages as keys of that store,
one key per message, paced and counted like the mailbox's.

Plain mode runs every site in one torch.distributed world, one trust domain
(docs/SECURITY.md): these messages travel on that world's Gloo connections, like the ring
collectives, so they are exactly as authenticated as the rest of the run.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from geotrain.comm.collectives import Collectives
from geotrain.errors import CorruptPayload

HEADER_TAG = 11
PAYLOAD_TAG = 12


def link_arrival(wan: Any, site: int, nbytes: int) -> float:
    """When ``nbytes`` sent now on the emulated link to ``site`` arrive (CLOCK_MONOTONIC; 0 without
    emulation): the link is reserved for them when it paces bandwidth."""
    if wan is None:
        return 0.0
    if wan.paces_bandwidth:
        return float(wan.pace([(site, nbytes)])[0])
    return time.monotonic() + float(wan.latency(site))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 tensor (a view when it is contiguous)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def frame(
    fields: list[float], payload: torch.Tensor, header_len: int, arrival: Callable[[int], float], raw: int | None
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """One message as it is sent, by the mailbox or a store channel: the float64 header (the
    emulated arrival time of the whole message, the payload's length in bytes, ``fields``), the
    payload's bytes, the bytes sent, and the fp32 bytes they stand for (``raw``: a codec's payload's)."""
    assert len(fields) == header_len - 2
    payload = as_bytes(payload.cpu())  # (a device's payload crosses through the host: Gloo, or the store)
    nbytes = header_len * 8 + payload.numel()
    header = torch.tensor([arrival(nbytes), payload.numel(), *fields], dtype=torch.float64)
    return header, payload, nbytes, nbytes if raw is None else header_len * 8 + raw


@dataclass
class Message:
    """One received message: who sent it, when it arrives (emulated), the sender's header fields, the payload."""

    src: int  # global rank of the sender
    arrival: float  # CLOCK_MONOTONIC seconds (0: at once)
    fields: list[float]
    payload: torch.Tensor  # uint8: the bytes sent (:meth:`floats` for an fp32 vector)
    lost: bool = False  # the sender is gone: its connection closed before a whole message came in

    def floats(self) -> torch.Tensor:
        """The payload as the fp32 vector it was sent as.

        Raises:
            CorruptPayload: its length is not a whole number of fp32 values.
        """
        if self.payload.numel() % 4:
            raise CorruptPayload(f"a payload of {self.payload.numel()} bytes is not an fp32 vector")
        return self.payload.view(torch.float32)


class Sink(Protocol):
    """Where a listener puts the messages it receives (a queue, which may take other items too)."""

    def put(self, item: Message) -> None: ...


class Mailbox:
    """Header-and-payload messages on ``group`` (global ranks), counted and paced like every send.

    Gloo's point-to-point receives cannot be polled (a receive counts as completed only once
    waited on) nor waited on with a timeout (that closes the connection), so every receive blocks
    in a thread of its own and hands the message over through a queue; the caller's waits on that
    queue are what is bounded.

    Args:
        comm: this rank's collectives (byte accounting and the link emulation).
        group: the process group the messages travel on (only this mailbox uses it).
        fields: float64 fields in every header, besides the arrival time and the payload's length.
    """

    def __init__(self, comm: Collectives, group: dist.ProcessGroup, fields: int) -> None:
        self.comm, self.group = comm, group
        self.header_len = 2 + fields
        self._sending: list[tuple[int, dist.Work, torch.Tensor]] = []
        self._failed: set[int] = set()  # destinations a send to failed since the last flush
        # per source: the receive a timed-out receive() left pending (its message is the next one)
        self._pending: dict[int, queue.Queue[Message]] = {}

    def arrival(self, dst: int, nbytes: int) -> float:
        """When ``nbytes`` sent now to global rank ``dst`` arrive (:func:`link_arrival`; 0 inside the site)."""
        site = self.comm.groups.topology.site_of(dst)
        return 0.0 if site == self.comm.groups.me.site_index else link_arrival(self.comm.wan, site, nbytes)

    def send(self, dst: int, fields: list[float], payload: torch.Tensor, raw: int | None = None) -> None:
        """Start sending ``fields`` and ``payload`` (any dtype, sent as its bytes; possibly empty) to
        ``dst``; returns at once (the buffers are kept until :meth:`flush`). ``raw``: the fp32 bytes
        the payload stands for (a codec's), for the compression ratio."""
        header, payload, nbytes, fp32_bytes = frame(fields, payload, self.header_len, lambda n: self.arrival(dst, n), raw)
        self.comm._count(dst, nbytes, fp32_bytes)
        for t, tag in ((header, HEADER_TAG), (payload, PAYLOAD_TAG)):
            if t.numel() and dst not in self._failed:
                try:
                    work = dist.isend(t, dst, group=self.group, tag=tag)
                except RuntimeError:  # the connection to dst is closed: dst is gone
                    self._failed.add(dst)
                    continue
                assert work is not None
                self._sending.append((dst, work, t))

    def flush(self) -> set[int]:
        """Wait until every send has been taken by its receiver (bounded by the group's timeout);
        returns the destinations whose connection closed (they are gone) since the last flush."""
        for dst, work, _ in self._sending:
            try:
                work.wait()
            except RuntimeError:
                self._failed.add(dst)
        failed, self._sending, self._failed = self._failed, [], set()
        return failed

    def poll(self) -> set[int]:
        """:meth:`flush` without the wait: sends that are done are released (a failed one names its
        destination), the others stay pending. A receiver that hangs (stopped, its sockets open)
        may never take its message, and a sender that must go on cannot wait for it."""
        pending = []
        for dst, work, t in self._sending:
            if not work.is_completed():
                pending.append((dst, work, t))
                continue
            try:
                work.wait()
            except RuntimeError:
                self._failed.add(dst)
        failed, self._sending, self._failed = self._failed, pending, set()
        return failed

    def _receive(self, src: int) -> Message:
        """Block until ``src``'s next message is in (not held to its arrival time)."""
        header = torch.zeros(self.header_len, dtype=torch.float64)
        work = dist.irecv(header, src, group=self.group, tag=HEADER_TAG)
        assert work is not None
        work.wait()
        h = header.tolist()
        payload = torch.empty(int(h[1]), dtype=torch.uint8)
        if payload.numel():
            work = dist.irecv(payload, src, group=self.group, tag=PAYLOAD_TAG)
            assert work is not None
            work.wait()  # sent right after its header
        return Message(src, h[0], h[2:], payload)

    def _receive_or_lost(self, src: int) -> Message:
        """:meth:`_receive`, or a lost message once ``src``'s connection closes (Gloo: "Connection closed by peer")."""
        try:
            return self._receive(src)
        except RuntimeError:
            return Message(src, 0.0, [], torch.empty(0, dtype=torch.uint8), lost=True)

    def listen(self, src: int, into: Sink, last: Callable[[Message], bool]) -> threading.Thread:
        """Put every message from ``src`` into ``into`` (as it comes in, not at its arrival time),
        from a thread that stops after the message ``last`` says is the last, or after a lost
        message if ``src`` dies first."""

        def run() -> None:
            while True:
                msg = self._receive_or_lost(src)
                into.put(msg)
                if msg.lost or last(msg):
                    return

        thread = threading.Thread(target=run, name=f"mailbox-{src}", daemon=True)
        thread.start()
        return thread

    def receive(self, src: int, timeout_s: float) -> Message | None:
        """The next message from ``src``, held until its emulated arrival (a lost one at once, if
        ``src`` dies first); None after ``timeout_s``. A receive that timed out stays pending in
        its thread, and the next call for ``src`` waits for that same receive: a message is never
        taken by a receive nobody waits for any more."""
        got = self._pending.pop(src, None)
        if got is None:
            got = queue.Queue()
            box = got
            threading.Thread(target=lambda: box.put(self._receive_or_lost(src)), name=f"mailbox-{src}", daemon=True).start()
        try:
            msg = got.get(timeout=timeout_s)
        except queue.Empty:
            self._pending[src] = got
            return None
        self.arrived(msg)
        return msg

    @staticmethod
    def arrived(msg: Message) -> None:
        """Sleep until ``msg``'s emulated arrival time (returns at once without emulation)."""
        delay = msg.arrival - time.monotonic()
        if delay > 0:
            time.sleep(delay)


def join_key(site: int) -> str:
    """The run store's counter a lost site's leader adds 1 to when it comes back (its incarnation)."""
    return f"geotrain/quorum/join/{site}"


def down_key(site: int) -> str:
    """The run store's counter the launcher sets to a site's incarnation when that incarnation's
    processes exit (the store, unlike the mailbox's connections, does not tell)."""
    return f"geotrain/quorum/down/{site}"


def silent_key(site: int) -> str:
    """The run store's key the syncer sets to a site's incarnation when it loses that incarnation
    for silence (stopped or hung: its processes still exist, so only the launcher can end them)."""
    return f"geotrain/quorum/silent/{site}"


def channel_keys(site: int, incarnation: int) -> tuple[str, str]:
    """The store key prefixes (site → syncer, syncer → site) of a site's incarnation that came back."""
    base = f"geotrain/quorum/{site}.{incarnation}"
    return f"{base}/up", f"{base}/down"


class StoreChannel:
    """Messages to and from one peer through keys of the run's rendezvous store (a site that came
    back talks to the syncer this way; see the module docstring).

    Message ``i`` sent by this end is the key ``<send>/<i>``: the float64 header (arrival time,
    payload length in bytes, the caller's fields), then the payload's bytes. The receiver waits for
    ``<recv>/<i>`` (bounded), reads it and deletes it, so the store holds only messages in flight.

    Args:
        connect: makes a client of the store (each thread of this channel has its own, so a blocked
            wait never holds up a send).
        send, recv: the key prefixes this end writes and reads.
        fields: float64 fields in every header, besides the arrival time and the payload's length.
        src: the peer's global rank (:attr:`Message.src` of what is received).
        arrival: the emulated arrival time of ``nbytes`` sent now (0: at once).
        count: counts ``nbytes`` sent on the link to the peer (standing for ``raw`` fp32 bytes).
    """

    def __init__(
        self,
        connect: Callable[[], Any],
        send: str,
        recv: str,
        fields: int,
        src: int,
        arrival: Callable[[int], float] = lambda nbytes: 0.0,
        count: Callable[[int, int], None] = lambda nbytes, raw: None,
    ) -> None:
        self.connect, self.send_prefix, self.recv_prefix = connect, send, recv
        self.header_len, self.src = 2 + fields, src
        self.arrival, self.count = arrival, count
        self._sent = self._received = 0
        self._store: Any = None
        self._stop = threading.Event()
        self._failing = False  # the store failed (not a timeout) on the last try: logged once per outage

    def _client(self) -> Any:
        """This end's client of the store (made at its first use; the listener thread has its own)."""
        if self._store is None:
            self._store = self.connect()
        return self._store

    def send(self, fields: list[float], payload: torch.Tensor, raw: int | None = None) -> None:
        """Write ``fields`` and ``payload`` (any dtype, as its bytes; possibly empty) as the next
        message (``raw``: as for :meth:`Mailbox.send`)."""
        header, payload, nbytes, fp32_bytes = frame(fields, payload, self.header_len, self.arrival, raw)
        self.count(nbytes, fp32_bytes)
        data = header.numpy().tobytes() + payload.numpy().tobytes()
        self._client().set(f"{self.send_prefix}/{self._sent}", data)
        self._sent += 1

    def _next(self, store: Any, timeout_s: float) -> Message | None:
        """The next message once it is in the store (not held to its arrival); None after
        ``timeout_s``. A store that fails (rather than times out) is waited out for the rest of
        ``timeout_s``, never retried at once: a store that is gone must not make a loop spin."""
        key = f"{self.recv_prefix}/{self._received}"
        t0 = time.monotonic()
        try:
            store.wait([key], timedelta(seconds=timeout_s))
        except dist.DistStoreError:  # the wait ran out
            return None
        except Exception as exc:  # noqa: BLE001 - the store is unreachable or closed its connection
            if not self._failing:
                self._failing = True
                print(f"geotrain: the run's store failed while waiting for {key} ({exc}); retrying", file=sys.stderr, flush=True)
            self._stop.wait(max(0.0, timeout_s - (time.monotonic() - t0)))
            return None
        self._failing = False
        data = store.get(key)
        store.delete_key(key)
        self._received += 1
        h = torch.frombuffer(bytearray(data[: self.header_len * 8]), dtype=torch.float64).tolist()
        body = data[self.header_len * 8 :]
        payload = torch.frombuffer(bytearray(body), dtype=torch.uint8) if body else torch.empty(0, dtype=torch.uint8)
        if payload.numel() != int(h[1]):
            raise RuntimeError(f"store message {key}: {payload.numel()} payload bytes, its header says {int(h[1])}")
        return Message(self.src, h[0], h[2:], payload)

    def receive(self, timeout_s: float) -> Message | None:
        """The next message, held until its emulated arrival; None after ``timeout_s``."""
        msg = self._next(self._client(), timeout_s)
        if msg is not None:
            Mailbox.arrived(msg)
        elif self._failing:
            self._store = None  # a new client next time: a store's client does not reconnect
        return msg

    def listen(self, into: Sink, last: Callable[[Message], bool]) -> threading.Thread:
        """Put every message into ``into`` as it comes in, from a thread of its own (with its own
        client) that stops after the message ``last`` says is the last, or at :meth:`close`."""

        def run() -> None:
            store = None
            while not self._stop.is_set():
                if store is None:
                    try:
                        store = self.connect()
                    except Exception:  # noqa: BLE001 - the store is down: try again shortly
                        self._stop.wait(0.5)
                        continue
                msg = self._next(store, 0.5)
                if msg is None and self._failing:
                    store = None  # a new client next time: a store's client does not reconnect
                if msg is not None:
                    into.put(msg)
                    if last(msg):
                        return

        thread = threading.Thread(target=run, name=f"store-channel-{self.src}", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        """Stop listening: within half a second, or while the store is down within a reconnection's
        timeout (the client that ``connect`` makes)."""
        self._stop.set()


class Rejoins:
    """Lost sites that came back, read from the run's store (:func:`join_key`), the channel to
    each (``channel(site, incarnation)``), and which of them the launcher saw go down again
    (:func:`down_key`: the store does not close a connection when a site dies)."""

    def __init__(self, connect: Callable[[], Any], channel: Callable[[int, int], StoreChannel]) -> None:
        self.connect, self.channel = connect, channel
        self.seen: dict[int, int] = {}  # the last incarnation of each site taken back
        self._store: Any = None

    def _connected(self) -> Any:
        if self._store is None:
            self._store = self.connect()
        return self._store

    def _read(self, key: str) -> int:
        return int(self._connected().add(key, 0))  # a read that never blocks on a missing key

    def report_silent(self, site: int) -> None:
        """Tell the launcher that ``site``'s current incarnation was lost for silence
        (:func:`silent_key`): it ends that incarnation's processes and may start the site again."""
        self._connected().set(silent_key(site), str(self.seen.get(site, 0)))

    def poll(self, lost: Iterable[int]) -> list[tuple[int, int]]:
        """(site, incarnation) of each of the ``lost`` sites whose new incarnation asked to rejoin."""
        back = []
        for s in sorted(lost):
            k = self._read(join_key(s))
            if k > self.seen.get(s, 0):
                self.seen[s] = k
                back.append((s, k))
        return back

    def down(self, sites: Iterable[int]) -> list[int]:
        """Of ``sites`` (that came back), those whose current incarnation the launcher saw exit."""
        return [s for s in sorted(sites) if self._read(down_key(s)) >= self.seen.get(s, 0)]
