"""Messages between sites that do not wait for each other: a header and a payload, one sender,
one receiver, no collective.

The asynchronous quorum rounds (:mod:`geotrain.sync.quorum`) need a site to hand its update to
the syncer and go on, whatever the other sites are doing; a ring collective would make every
site wait for the slowest. A message is two point-to-point sends on the sites' leaders' group
(:func:`geotrain.comm.groups.leaders_group`): a float64 header (the emulated arrival time, the
payload's length, then the caller's fields), then the fp32 payload. Like every other send, it is
counted on the link it crosses (:meth:`Collectives._count`) and, with the in-process link
emulation, paced on that link: the sender reserves the link and stamps the arrival time, the
receiver treats the message as delivered only at that time (:meth:`Mailbox.arrived`).

A peer that dies is noticed, not waited for: its connection closes, so a receive from it ends
with a **lost** message (:attr:`Message.lost`) and a send to it is reported by :meth:`flush`.

Plain mode runs every site in one torch.distributed world, one trust domain
(docs/SECURITY.md): these messages travel on that world's Gloo connections, like the ring
collectives, so they are exactly as authenticated as the rest of the run.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from geotrain.comm.collectives import Collectives

HEADER_TAG = 11
PAYLOAD_TAG = 12


@dataclass
class Message:
    """One received message: who sent it, when it arrives (emulated), the sender's header fields, the payload."""

    src: int  # global rank of the sender
    arrival: float  # CLOCK_MONOTONIC seconds (0: at once)
    fields: list[float]
    payload: torch.Tensor
    lost: bool = False  # the sender is gone: its connection closed before a whole message came in


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

    def _arrival(self, dst: int, nbytes: int) -> float:
        wan, site = self.comm.wan, self.comm.groups.topology.site_of(dst)
        if wan is None or site == self.comm.groups.me.site_index:
            return 0.0
        if wan.paces_bandwidth:
            return wan.pace([(site, nbytes)])[0]
        return time.monotonic() + wan.latency(site)

    def send(self, dst: int, fields: list[float], payload: torch.Tensor) -> None:
        """Start sending ``fields`` and ``payload`` (flat fp32, possibly empty) to ``dst``; returns at
        once (the buffers are kept until :meth:`flush`)."""
        assert len(fields) == self.header_len - 2
        payload = payload.to(torch.float32).contiguous()
        nbytes = self.header_len * 8 + payload.numel() * 4
        header = torch.tensor([self._arrival(dst, nbytes), payload.numel(), *fields], dtype=torch.float64)
        self.comm._count(dst, nbytes, nbytes)
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
        payload = torch.empty(int(h[1]), dtype=torch.float32)
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
            return Message(src, 0.0, [], torch.empty(0), lost=True)

    def listen(self, src: int, into: queue.Queue[Message], last: Callable[[Message], bool]) -> threading.Thread:
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
        ``src`` dies first); None after ``timeout_s`` (the receive then stays pending in its
        thread: the caller is expected to stop)."""
        got: queue.Queue[Message] = queue.Queue()
        threading.Thread(target=lambda: got.put(self._receive_or_lost(src)), name=f"mailbox-{src}", daemon=True).start()
        try:
            msg = got.get(timeout=timeout_s)
        except queue.Empty:
            return None
        self.arrived(msg)
        return msg

    @staticmethod
    def arrived(msg: Message) -> None:
        """Sleep until ``msg``'s emulated arrival time (returns at once without emulation)."""
        delay = msg.arrival - time.monotonic()
        if delay > 0:
            time.sleep(delay)
