"""One supervisor for every launcher: the loop that starts a run's sites, restarts, migrates and
stops them, and always takes every process down at the end. A policy, called once per poll, says
what an exit, a fault request or a lost site means and when the run is over:

* lock-step and hub runs (:mod:`geotrain.launch.local`): any failure stops the run, except that
  with asynchronous quorum rounds a site is lost (and, with ``fault.restart_after``, started again
  as a world of its own);
* elastic runs (:mod:`geotrain.launch.sites`): every site is its own job; kills, hangs, crashes,
  migrations and restarts are handled per site, and the Lighthouse is supervised beside them;
* one site on this machine (:mod:`geotrain.launch.site`): its ranks, until they finish, drain or
  fail.

A site's incarnation k > 0 logs to ``<name>.<k>.log`` beside its first one's, so a restarted site
keeps its earlier logs; ``OUT/pids.json`` names every live process (the tests and the chaos
bench signal them by PID).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from geotrain.launch.spawn import GRACE_SECONDS, Rank, spawn_rank, stop_all, worker_args, zygote_pid


@dataclass
class Site:
    """One site's processes under the supervisor, in its current incarnation."""

    index: int
    name: str
    procs: list[Rank] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    incarnation: int = -1
    state: str = "down"  # running | finished | stopped (SIGSTOP) | down (dead, lost or drained)
    restart_at: float | None = None  # when it starts again (fault.restart_after)
    store: Any = None  # the rendezvous store of its current incarnation, where the launcher hosts it

    def signal(self, sig: signal.Signals) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL every rank of the site still running."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()

    def codes(self) -> list[int | None]:
        return [p.poll() for p in self.procs]


# how a site's local rank starts: its environment, its log file and its network namespace (or None)
RankStart = Callable[[Site, int], tuple[dict[str, str], Path, "str | None"]]


class Supervisor:
    """Starts, restarts and stops the sites of one run (see the module docstring).

    Args:
        names, workers: the sites this supervisor runs, and each one's ranks.
        start_rank: a local rank's environment, log and namespace, per incarnation.
        pids: where the live PIDs are written (None: nowhere); ``extra_pids`` adds entries.
    """

    def __init__(
        self,
        names: Sequence[str],
        workers: Sequence[int],
        cfg_path: Path,
        out: Path,
        start_rank: RankStart,
        console_print: Callable[[str], None] | None,
        fork: bool,
        pids: Path | None = None,
        extra_pids: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.sites = [Site(i, n) for i, n in enumerate(names)]
        self.workers, self.cfg_path, self.out, self.start_rank = workers, cfg_path, out, start_rank
        self.console_print, self.fork, self.pids, self.extra_pids = console_print, fork, pids, extra_pids
        self.pumps: list[threading.Thread] = []

    def say(self, line: str) -> None:
        if self.console_print is not None:
            self.console_print(line)

    def start(self, site: Site) -> None:
        """Start ``site``'s next incarnation (its first, or again after it was lost or drained)."""
        site.incarnation += 1
        site.procs, site.logs = [], []
        for local in range(self.workers[site.index]):
            env, log, netns = self.start_rank(site, local)
            forward = self.console_print if local == 0 else None
            p, t = spawn_rank(worker_args(self.cfg_path, self.out), env, log, forward, netns, self.fork)
            site.procs.append(p)
            site.logs.append(log)
            self.pumps.append(t)
        site.state, site.restart_at = "running", None
        self.write_pids()

    def procs(self) -> list[Rank]:
        return [p for s in self.sites for p in s.procs]

    def write_pids(self) -> None:
        if self.pids is None:
            return
        pids = {"launcher": os.getpid(), "zygote": zygote_pid(), "ranks": [p.pid for p in self.procs()]}
        self.pids.write_text(json.dumps({**pids, **(self.extra_pids() if self.extra_pids is not None else {})}))

    def run(self, policy: Callable[[float], bool], on_poll: Callable[[], None] | None, period_s: float) -> None:
        """Call ``policy`` every ``period_s`` until it says the run is over; then stop every
        process (a stopped one is continued first, so that it can take its SIGTERM)."""
        try:
            while not policy(time.monotonic()):
                if on_poll is not None:
                    on_poll()
                time.sleep(period_s)
        finally:
            for s in self.sites:
                s.signal(signal.SIGCONT)
            stop_all(self.procs())
            for t in self.pumps:
                t.join(timeout=GRACE_SECONDS)
