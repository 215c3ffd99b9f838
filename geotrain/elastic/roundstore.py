"""The round store: an authenticated store (:mod:`geotrain.comm.authstore`) hosted by a site,
where the sites of a round meet to authenticate, watch each other's heartbeats and vote.

Gloo waits cannot be interrupted, so every wait here is a series of bounded requests: :func:`wait_keys`
ends at its deadline, as soon as a present key settles it, or when the :class:`Monitor` has failed
the round.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from geotrain.comm.alive import Silence
from geotrain.comm.authstore import MAX_WAIT_S, AuthStore, StoreRefused
from geotrain.errors import RoundFailed


def connect(address: str, key: bytes, timeout: float) -> AuthStore:
    """A client of the round store at ``HOST:PORT``, authenticated with the run's store ``key``
    (every operation times out after ``timeout`` s).

    Raises:
        RoundFailed: the store cannot be reached, or does not prove the key.
    """
    try:
        return AuthStore(address, key, timeout)
    except (StoreRefused, TimeoutError, OSError) as exc:
        raise RoundFailed(f"round store {address}: {exc}") from None


class Stores:
    """This site's clients of the round stores it met in, one per address, kept from round to round."""

    def __init__(self, key: bytes, timeout: float) -> None:
        self.key, self.timeout = key, timeout
        self._clients: dict[str, AuthStore] = {}

    def get(self, address: str) -> AuthStore:
        """The client of the store at ``address`` (connected on first use; raises RoundFailed as :func:`connect`)."""
        if address not in self._clients:
            self._clients[address] = connect(address, self.key, self.timeout)
        return self._clients[address]

    def forget(self, address: str) -> None:
        """Reconnect next time (the store's host may be gone)."""
        client = self._clients.pop(address, None)
        if client is not None:
            client.close()

    def close(self) -> None:
        for address in list(self._clients):
            self.forget(address)


class Monitor:
    """Heartbeats of this rank and its ring peers through the round store, in a thread: a peer
    whose counter stops for ``timeout`` seconds (:class:`~geotrain.comm.alive.Silence`, the
    detector the hub reads too) or an unreachable store fails the round.

    ``store`` is a sealed store (:class:`geotrain.elastic.auth.SealedStore`): each rank sets its
    own counter as an authenticated value, so a counter that does not verify (forged, or replayed
    from another round or rank) counts as no heartbeat, and a replayed older value as no progress.
    """

    def __init__(self, store: Any, me: str, peers: list[str], interval: float, timeout: float) -> None:
        self.store, self.me, self.peers = store, me, peers
        self.interval, self.timeout = interval, timeout
        self.failed: str | None = None
        self.culprit: str | None = None
        self.woken: list[threading.Event] = []  # set when the round fails (a waiter sleeps on one of them)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="heartbeat-monitor")
        self._thread.start()

    def _run(self) -> None:
        beats = Silence(self.peers, self.timeout)
        last_ok = time.monotonic()
        beat = 0
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            try:
                beat += 1
                self.store.set(f"hb/{self.me}", str(beat))
                raw = {p: self.store.peek(f"hb/{p}") for p in self.peers}
                beats.saw({p: int(v) for p, v in raw.items() if v is not None}, now)
                for p, quiet in beats.silent(now).items():
                    self._fail(f"no heartbeat from {p.split('/')[0]} for {quiet:.1f}s", p)
                    return
                last_ok = now
            except Exception as exc:  # the store's host is gone or stopped
                if now - last_ok > self.timeout:
                    self._fail(f"round store unreachable ({type(exc).__name__})", None)
                    return

    def _fail(self, why: str, who: str | None) -> None:
        self.culprit = who.split("/")[0] if who else None
        self.failed = why
        for event in self.woken:
            event.set()

    def check(self) -> None:
        """Raise :class:`RoundFailed` if a peer went silent."""
        if self.failed is not None:
            raise RoundFailed(self.failed)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def wait_keys(
    store: Any,
    keys: list[str],
    deadline: float,
    monitor: Monitor | None = None,
    stop_if: Callable[[str], bool] | None = None,
) -> list[str]:
    """The keys present by ``deadline``, or as soon as a present key satisfies ``stop_if``. One
    request asks for every pending key; the store answers as soon as one of them is written, or
    after :data:`~geotrain.comm.authstore.MAX_WAIT_S` (so a heartbeat failure ends the wait within
    that), never by a sleep and a request per key."""
    pending = list(keys)
    while pending and time.monotonic() < deadline:
        flags = store.present(pending, min(MAX_WAIT_S, max(0.0, deadline - time.monotonic())))
        present = [k for k, here in zip(pending, flags, strict=True) if here]
        pending = [k for k in pending if k not in present]
        if stop_if is not None and any(stop_if(k) for k in present):
            break
        if monitor is not None:
            monitor.check()
    return [k for k in keys if k not in pending]
