"""Background threads that never hold up a process's exit: the pool behind the collectives' lanes
and Streaming DiLoCo's exchange.

Why not :class:`concurrent.futures.ThreadPoolExecutor`: since Python 3.9 the interpreter joins
every executor thread at shutdown, whatever ``shutdown(wait=False)`` said. A lane thread that is
sending a chunk over a slow link, or waiting on a peer that hung, then keeps a rank that already
failed alive for the rest of the transfer or the whole collective timeout (300 s by default),
and its launcher cannot tell a failed rank from a slow one meanwhile. These threads are daemons:
a process that is leaving does not wait for them. A normal run waits for its exchanges itself
(every caller takes the result of what it submitted) and :meth:`DaemonPool.shutdown` joins idle
threads, so nothing is cut short on success.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

_Item = tuple["Future[Any]", Callable[..., Any], tuple[Any, ...]]


class DaemonPool:
    """``workers`` daemon threads taking calls from one FIFO queue; started on first use.

    :meth:`submit` returns a standard :class:`~concurrent.futures.Future`. With one worker the
    calls run one after another in submission order.
    """

    def __init__(self, workers: int, name: str) -> None:
        if workers < 1:
            raise ValueError(f"workers: at least 1 (got {workers})")
        self.workers, self.name = workers, name
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Queue ``fn(*args)``; its future holds the result or the exception it raised.

        Raises:
            RuntimeError: the pool was shut down.
        """
        fut: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: submit after shutdown")
            if not self._threads:
                self._threads = [
                    threading.Thread(target=self._run, name=f"{self.name}_{i}", daemon=True) for i in range(self.workers)
                ]
                for t in self._threads:
                    t.start()
            self._queue.put((fut, fn, args))
        return fut

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever takes the result
                fut.set_exception(exc)

    def shutdown(self, wait: bool = True, timeout_s: float | None = None) -> None:
        """Stop taking calls; the threads end after the calls already queued. ``wait``: join
        them (for at most ``timeout_s`` each). Calling it again does nothing more."""
        with self._lock:
            first = not self._closed
            self._closed = True
            threads = self._threads
        if first:
            for _ in threads:
                self._queue.put(None)
        if wait:
            for t in threads:
                if t is not threading.current_thread():
                    t.join(timeout_s)
