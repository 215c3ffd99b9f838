"""Liveness through the run's rendezvous store: each rank beats a counter; a watcher notices one
that stopped.

A site that dies closes its connections, and the mailbox sees that at once. A site that hangs (a
``SIGSTOP``, a machine that vanishes without closing anything) keeps its connections open and
just goes quiet. Its messages alone cannot tell it from a slow site: a round of a slow site may
be long. So every rank runs a thread that adds 1 to its own key in the store every
``heartbeat_s``. A stopped process stops beating, whatever it was doing; a slow one goes on.

The store is the one torch.distributed rendezvoused on (``MASTER_ADDR``/``MASTER_PORT``, under
geotrain's launchers or torchrun; a site that came back rendezvouses its own ranks elsewhere and
finds the run's store at ``GEOTRAIN_RUN_PORT``). Each beat is one small request to it; the watcher reads every
rank's counter once per ``heartbeat_s``. Keys are ``geotrain/alive/<rank>``. The watcher measures
silence on its own clock, so clocks of different machines never need to agree.

:class:`Silence` is the one failure detector every round reads: counters that must advance,
measured on this process's clock. The hub's :class:`SilenceWatch` feeds it from the run's store;
an elastic round's peers (:class:`geotrain.elastic.roundstore.Monitor`) feed it from their round's
sealed store, whose counters a forger or a replay cannot advance.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any


def _key(rank: int) -> str:
    return f"geotrain/alive/{rank}"


def run_store(timeout_s: float) -> Any:
    """A client of the run's rendezvous store (``MASTER_ADDR``, and ``GEOTRAIN_RUN_PORT`` or else
    ``MASTER_PORT``) whose requests give up after ``timeout_s``."""
    import torch.distributed as dist

    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ.get("GEOTRAIN_RUN_PORT") or os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def _client(period_s: float) -> Any:
    """A client of the run's store, whose requests give up after a few beats (at least 10 s)."""
    return run_store(max(10.0, 5 * period_s))


class Heartbeat:
    """Beats ``rank``'s counter every ``period_s`` in a daemon thread until :meth:`stop`."""

    def __init__(self, rank: int, period_s: float) -> None:
        self.rank, self.period_s = rank, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            store = _client(self.period_s)
            while not self._stop.is_set():
                store.add(_key(self.rank), 1)
                self._stop.wait(self.period_s)
        except Exception as exc:  # noqa: BLE001 - a thread's last word; the run goes on without it
            if not self._stop.is_set():  # after stop() the store may be gone with the run: nothing to tell
                print(
                    f"geotrain: rank {self.rank}'s heartbeat to the rendezvous store stopped ({exc}); "
                    "its site will be lost after liveness.hub_lost_after_s",
                    file=sys.stderr,
                    flush=True,
                )

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.period_s + 1.0)


class Silence:
    """Who has stopped beating: each watched name's counter and when it last advanced, on this
    process's clock. A counter that does not grow (a repeat, or a replayed older value) is no
    beat; a name not seen yet has ``limit_s`` from the start (or its :meth:`restart`)."""

    def __init__(self, names: Iterable[Any], limit_s: float) -> None:
        self.limit_s = limit_s
        now = time.monotonic()
        self._count: dict[Any, int] = {n: -1 for n in names}
        self._since: dict[Any, float] = {n: now for n in self._count}

    def saw(self, counts: Mapping[Any, int], now: float) -> None:
        """The counters read at ``now``."""
        for n, count in counts.items():
            if count > self._count[n]:
                self._count[n], self._since[n] = count, now

    def silent(self, now: float, names: Iterable[Any] | None = None) -> dict[Any, float]:
        """Of ``names`` (default: all, in the order watched), each silent for at least ``limit_s``:
        its silence in seconds."""
        names = self._since if names is None else names
        return {n: now - self._since[n] for n in names if now - self._since[n] >= self.limit_s}

    def excuse(self, gap_s: float) -> None:
        """``gap_s`` seconds in which nobody's counter could be read: nobody's silence."""
        for n in self._since:
            self._since[n] += gap_s

    def restart(self, names: Iterable[Any]) -> None:
        """``names`` started again: each has ``limit_s`` from now to beat."""
        now = time.monotonic()
        for n in names:
            self._since[n] = now


class StoreLost(RuntimeError):
    """The run's rendezvous store has not answered for longer than the watch's bound."""


class SilenceWatch:
    """Which ranks have not beaten for ``limit_s``, on this process's clock. Call :meth:`silent`
    often; it reads the store at most once per ``period_s``.

    While the store cannot be read nobody's silence can be measured: the outage is logged when it
    starts and ends, does not count as anyone's silence, and ends in :class:`StoreLost` once it
    lasts ``10 * limit_s`` (at least 60 s). Before, an unreachable store made every rank count as
    alive forever, without a word."""

    def __init__(self, ranks: Sequence[int], period_s: float, limit_s: float) -> None:
        self.period_s, self.limit_s = period_s, limit_s
        self.outage_limit_s = max(60.0, 10 * limit_s)
        self.beats = Silence(ranks, limit_s)
        self._read_at = 0.0
        self._store: Any = None
        self._down_since: float | None = None  # when the store stopped answering

    def _read(self, ranks: Sequence[int], now: float) -> dict[int, int] | None:
        """Every rank's counter, or None while the store cannot be read (logged)."""
        try:
            if self._store is None:
                self._store = _client(self.period_s)
            counts = {r: int(self._store.add(_key(r), 0)) for r in ranks}  # reads that never block on a missing key
        except Exception as exc:  # noqa: BLE001 - the store is unreachable or closed its connection
            self._store = None  # a new client at the next read: a store's client does not reconnect
            if self._down_since is None:
                self._down_since = now
                print(
                    f"geotrain: the run's rendezvous store cannot be read ({str(exc).splitlines()[0][:120]}): ranks' "
                    f"silence is not measured until it answers (at most {self.outage_limit_s:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
            elif now - self._down_since > self.outage_limit_s:
                raise StoreLost(
                    f"the run's rendezvous store has not answered for {now - self._down_since:.0f} s: liveness cannot be measured"
                ) from None
            return None
        if self._down_since is not None:  # the outage is nobody's silence
            gap = now - self._down_since
            self.beats.excuse(gap)
            print(f"geotrain: the run's rendezvous store answers again after {gap:.1f} s", file=sys.stderr, flush=True)
            self._down_since = None
        return counts

    def silent(self, ranks: Sequence[int]) -> dict[int, float]:
        """Of ``ranks``, each one silent for at least ``limit_s``: its silence in seconds.

        Raises:
            StoreLost: the store has not answered for ``outage_limit_s``.
        """
        now = time.monotonic()
        if now - self._read_at >= self.period_s:
            self._read_at = now
            counts = self._read(ranks, now)
            if counts is None:
                return {}
            self.beats.saw(counts, now)
        if self._down_since is not None:
            return {}
        return self.beats.silent(now, ranks)

    def restart(self, ranks: Sequence[int]) -> None:
        """``ranks`` started again (a site that came back): each has ``limit_s`` from now to beat."""
        self.beats.restart(ranks)
