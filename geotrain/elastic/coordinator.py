"""A site's link to the Lighthouse (local rank 0 only): heartbeats, outage tracking, quorums.

* A heartbeat thread (with its own client: one torchft client per thread) heartbeats every
  ``heartbeat_s``. A heartbeat call can hang when the Lighthouse dies in the middle of it, so
  once heartbeats are stale the Lighthouse counts as down and a fresh thread replaces the old.
* While it is down, a round may be postponed: the site keeps doing inner steps and asks again.
  When it is back, the site waits four heartbeat intervals before asking, so that a restarted
  Lighthouse knows every live site before it forms a quorum.
* Below ``min_sites`` a quorum request times out; the site logs that training is paused and asks
  again.
* Every wait is bounded: a site that has waited ``wait_timeout_s`` for a quorum (the Lighthouse
  unreachable, a wrong address, or too few sites), counted from its first request that got none,
  raises :class:`ElasticTimeout`, whether it postpones rounds meanwhile or not (the inner steps
  of a normal round do not count); a joining site gives up after ``start_timeout_s``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from geotrain.comm.procs import oversubscribed
from geotrain.config import ElasticConfig, LivenessConfig
from geotrain.errors import CoordinatorDown, ElasticTimeout, MembershipRefused


class Coordinator:
    """The Lighthouse as seen by one site.

    Args:
        cfg: the elastic section.
        lighthouse: ``HOST:PORT`` (or an http URL) of the Lighthouse.
        site: this site's name (its replica id); ``workers``: its ranks.
        store_address: ``HOST:PORT`` of the round store this site hosts (advertised in quorums).
        log: writes one line to this rank's log.
    """

    def __init__(
        self,
        cfg: ElasticConfig,
        lighthouse: str,
        site: str,
        workers: int,
        store_address: str,
        log: Callable[[str], None],
        live: LivenessConfig | None = None,
    ) -> None:
        self.live = live or LivenessConfig()
        self.cfg, self.site, self.workers, self.store_address, self.log = cfg, site, workers, store_address, log
        self.lighthouse = lighthouse if lighthouse.startswith("http") else f"http://{lighthouse}"
        self._client: Any = None
        self._down = False
        self._state_lock = threading.Lock()
        self._back_at = -1e9
        self._hb_stop = threading.Event()
        self._hb_gen = 0
        self._hb_threads: list[threading.Thread] = []
        self._hb_started = self._hb_last_ok = time.monotonic()
        self._waiting_since: float | None = None  # when the current wait for a quorum began (None: not waiting)
        self._why_waiting = ""
        self._start_heartbeat()

    def _connect(self) -> Any:
        from geotrain.elastic.lighthouse import torchft_native

        try:
            return torchft_native().LighthouseClient(
                self.lighthouse, connect_timeout=timedelta(seconds=self.live.heartbeat_timeout_s)
            )
        except Exception as exc:
            raise CoordinatorDown(str(exc).splitlines()[0]) from None

    def _main_client(self) -> Any:
        """The main thread's client (the heartbeat thread has its own: one client per thread)."""
        if self._client is None:
            self._client = self._connect()
        return self._client

    def _start_heartbeat(self) -> None:
        self._hb_gen += 1
        self._hb_started = time.monotonic()
        gen = self._hb_gen
        t = threading.Thread(target=self._heartbeat, args=(gen,), daemon=True, name=f"lighthouse-heartbeat-{gen}")
        t.start()
        self._hb_threads = [x for x in self._hb_threads if x.is_alive()] + [t]

    def _heartbeat(self, gen: int) -> None:
        """Heartbeat every ``heartbeat_s`` with this thread's own client, until replaced (``gen``)."""
        client = None
        while gen == self._hb_gen and not self._hb_stop.wait(self.live.heartbeat_s):
            try:
                client = client or self._connect()
                client.heartbeat(self.site, timeout=timedelta(seconds=self.live.heartbeat_timeout_s))
                if gen == self._hb_gen:
                    self._hb_last_ok = time.monotonic()
                    self._set_down(False)
            except Exception:
                self._set_down(True)
                client = None

    def _set_down(self, down: bool) -> None:
        """Track (and log once) the Lighthouse going away and coming back."""
        with self._state_lock:
            if down == self._down:
                return
            self._down = down
        if down:
            self.log(f"Lighthouse {self.lighthouse} unreachable: inner steps go on, rounds wait for it")
        else:
            # let every live site's heartbeat reach a restarted Lighthouse before asking for a
            # quorum, so it does not form one without them
            self._back_at = time.monotonic()
            self.log("Lighthouse reachable again")

    @property
    def down(self) -> bool:
        """Whether the Lighthouse counts as unreachable now."""
        return self._down

    def _is_down(self) -> bool:
        """Down, or its heartbeats are stale (then a fresh heartbeat thread replaces a hung one)."""
        now = time.monotonic()
        stale = now - self._hb_last_ok > self.live.heartbeat_timeout_s
        if stale and now - self._hb_started > 2 * self.live.heartbeat_timeout_s:
            self._start_heartbeat()
        if stale:
            self._set_down(True)
        return self._down

    def quorum(self, can_postpone: bool, *, committed: int, joining: bool, data: dict[str, Any], once: bool = False) -> Any:
        """The round's quorum, advertising this site's committed-round count, round store and
        ``data`` (its global hash, step, member tag...) (None: the Lighthouse is down and the
        round may be postponed; ``once``: also when one request found too few sites, so the
        caller can look again whether it still needs a round).

        Raises:
            MembershipRefused: ``joining`` and no quorum within ``start_timeout_s``.
        """
        waited = 0.0
        give_up = time.monotonic() + self.live.start_timeout_s
        if self._waiting_since is None:  # a postponed round's retries continue the same wait
            self._waiting_since = time.monotonic()
        while True:
            if joining and time.monotonic() > give_up:
                raise MembershipRefused(
                    f"no live site to heal from within liveness.start_timeout_s={self.live.start_timeout_s:g}s"
                )
            self._check_bound()
            try:
                down = self._is_down()
                settling = time.monotonic() - self._back_at < 4 * self.live.heartbeat_s
                if down:
                    self._why_waiting = f"the Lighthouse at {self.lighthouse} is unreachable"
                if (down or settling) and can_postpone:
                    return None
                q = self._main_client().quorum(
                    replica_id=self.site,
                    timeout=timedelta(seconds=self.live.quorum_timeout_s),
                    address=self.store_address,
                    store_address=self.store_address,
                    step=committed,
                    world_size=self.workers,
                    shrink_only=False,
                    data=data,
                )
                if waited:
                    self.log(f"quorum reached after {waited:.1f}s: training resumes")
                self._waiting_since, self._why_waiting = None, ""
                return q
            except TimeoutError:
                if once:
                    return None
                waited += self.live.quorum_timeout_s
                self._why_waiting = f"fewer than elastic.min_sites={self.cfg.min_sites} live sites answer"
                hint = oversubscribed()
                self.log(
                    f"training paused: fewer than elastic.min_sites={self.cfg.min_sites} live sites answer "
                    f"(waited {waited:.0f}s); retrying" + (f"; {hint}" if hint else "")
                )
            except Exception as exc:
                self._client = None
                self._set_down(True)
                first = str(exc).splitlines()[0][:80] if str(exc) else type(exc).__name__
                self._why_waiting = f"the Lighthouse at {self.lighthouse} is unreachable ({first})"
                if can_postpone:
                    return None
                self.log(f"Lighthouse unreachable ({first}); retrying")
                time.sleep(self.live.heartbeat_s * 4)

    def _check_bound(self) -> None:
        """Raise :class:`ElasticTimeout` once this site has waited ``wait_timeout_s`` for a quorum
        (from its first request that got none; training between rounds does not count)."""
        waited = time.monotonic() - (self._waiting_since or time.monotonic())
        if waited > self.live.wait_timeout_s:
            why = self._why_waiting or "no quorum"
            raise ElasticTimeout(f"no round for {waited:.0f}s (liveness.wait_timeout_s={self.live.wait_timeout_s:g}): {why}")

    def close(self) -> None:
        """Stop heartbeating and wait (bounded) for the heartbeat threads to leave torchft's client:
        a thread still inside its native code when the interpreter shuts down aborts the process."""
        self._hb_stop.set()
        self._hb_gen += 1
        deadline = time.monotonic() + self.live.heartbeat_timeout_s
        for t in self._hb_threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        self._client = None
