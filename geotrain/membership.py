"""Elastic cross-site membership: sites that die, hang or come back without stopping the others.

In elastic mode (``elastic.enabled``) every site is its own torch.distributed job (its ranks
average gradients inside the site as usual); sites meet once per DiLoCo outer round:

1. **Quorum** (torchft's Lighthouse, :class:`torchft.coordination.LighthouseClient`): each
   site's local rank 0 heartbeats to the Lighthouse and asks it for the round's quorum,
   advertising its committed-round count, global-model hash, inner step and its round store
   (a ``TCPStore`` it hosts). The Lighthouse answers once every heartbeating site has asked (or
   drops a silent one after ``heartbeat_timeout_s``); fewer than ``min_sites`` → the site logs
   that training is paused and asks again. If the Lighthouse is down, the round is postponed:
   the site keeps doing inner steps and asks again every step until it is back.
2. **Authentication**: in the round store every site proves knowledge of the shared secret by
   HMAC-SHA256 over the other sites' fresh nonces (the secret never crosses the wire). A
   site that cannot prove it is refused (told so through the store) and left out of the
   round's process group.
3. **Healing**: the *source* is the member with the most committed rounds (ties: the global
   hash most members hold, then the smallest name). Members whose (committed, hash) differ —
   a restarted site, or one that rolled back a round its peers committed — receive the
   source's state (global parameters, outer optimizer, counters, step, inner model/optimizer)
   over the round's process group and contribute zeros to this round; after it, they are
   bit-identical to the others.
4. **All-reduce**: each local rank sums its 1/G shard of the pseudo-gradient with the same
   local rank of every admitted site (a ring over a fresh Gloo group per membership), the
   site all-gathers; the last element counts the contributing sites. Every wait polls a
   heartbeat monitor (a counter per rank in the round store): a SIGSTOPped or dead peer aborts
   the round within ``heartbeat_timeout_s``, not a collective timeout.
5. **Commit**: the site's ranks agree the exchange succeeded, then every site writes its vote
   to the round store and waits for all votes; any missing or negative vote rolls the round
   back (the caller restores global parameters; nothing is half-applied). A site that saw all
   votes commits; if a peer was cut off while reading them it rolled back, and step 3 heals
   it at the next round, so survivors are always bit-identical again one round later.

The Lighthouse is not a silent single point of failure: sites keep training while it is down
and carry on when it is restarted (the launcher supervises it; :class:`LighthouseProcess`).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import hmac
import io
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from geotrain.comm.collectives import CommStats
from geotrain.comm.emulate.inprocess import WanEmulator
from geotrain.config import Config, ElasticConfig
from geotrain.errors import CoordinatorDown, MembershipRefused, RoundFailed

_DATA_TAG, _HEADER_TAG, _HEAL_TAG = 0, 1, 2


def load_secret(cfg: ElasticConfig) -> bytes:
    """The shared secret from ``secret_file`` or the ``secret_env`` variable.

    Raises:
        MembershipRefused: neither holds a secret.
    """
    if cfg.secret_file:
        try:
            data = Path(cfg.secret_file).expanduser().read_bytes().strip()
        except OSError as exc:
            raise MembershipRefused(f"elastic.secret_file: cannot read {cfg.secret_file} ({exc.strerror})") from None
    else:
        data = os.environ.get(cfg.secret_env, "").encode()
    if len(data) < 16:
        where = f"elastic.secret_file ({cfg.secret_file})" if cfg.secret_file else f"environment variable {cfg.secret_env}"
        raise MembershipRefused(f"no membership secret of at least 16 bytes in {where}")
    return data


def join_proof(secret: bytes, round_key: str, verifier_nonce: str, prover: str) -> str:
    """HMAC-SHA256 proof that ``prover`` holds ``secret``, bound to the round and the verifier's fresh nonce."""
    msg = f"geotrain-join|{round_key}|{verifier_nonce}|{prover}".encode()
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


# --------------------------------------------------------------------------- the coordinator


def lighthouse_main(argv: list[str] | None = None) -> int:
    """``python -m geotrain.membership --bind 127.0.0.1:PORT ...``: run a Lighthouse until SIGTERM."""
    from torchft.coordination import LighthouseServer

    ap = argparse.ArgumentParser(prog="geotrain lighthouse", description="geotrain's membership coordinator (torchft Lighthouse)")
    ap.add_argument("--bind", required=True, help="HOST:PORT (use a loopback or private address)")
    ap.add_argument("--min-sites", type=int, default=1)
    ap.add_argument("--heartbeat-timeout", type=float, default=2.0, help="seconds")
    ap.add_argument("--join-timeout", type=float, default=60.0, help="seconds")
    args = ap.parse_args(argv)
    from geotrain.comm.procs import die_with_parent

    die_with_parent()  # under geotrain's launcher: never outlive it
    server = LighthouseServer(
        bind=args.bind,
        min_replicas=args.min_sites,
        join_timeout_ms=int(args.join_timeout * 1000),
        quorum_tick_ms=50,
        heartbeat_timeout_ms=int(args.heartbeat_timeout * 1000),
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(f"geotrain lighthouse on {args.bind} (min sites {args.min_sites})", flush=True)
    stop.wait()
    server.shutdown()
    return 0


class LighthouseProcess:
    """A Lighthouse in its own process on ``127.0.0.1:port``, restarted by :meth:`supervise` if it dies."""

    def __init__(self, port: int, cfg: ElasticConfig, log: Path) -> None:
        self.port, self.cfg, self.log = port, cfg, log
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [sys.executable, "-m", "geotrain.membership", "--bind", self.address, "--min-sites", str(self.cfg.min_sites)]
        cmd += ["--heartbeat-timeout", str(self.cfg.heartbeat_timeout_s)]
        env = {**os.environ, "GEOTRAIN_PARENT_PID": str(os.getpid())}
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env)

    def kill(self) -> None:
        """SIGKILL it (failure injection); :meth:`supervise` brings it back."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def supervise(self) -> bool:
        """Restart it if it died; True if it had to."""
        if self.proc is not None and self.proc.poll() is not None:
            self.restarts += 1
            self.start()
            return True
        return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# --------------------------------------------------------------------------- one site's member


@dataclass
class Member:
    """One site in a quorum, as the Lighthouse reported it."""

    site: str
    store: str
    committed: int
    hash: str
    joining: bool = False


@dataclass
class RoundView:
    """What every rank of a site knows about the round (decided by local rank 0, broadcast)."""

    key: str = ""
    members: list[Member] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)
    source: str = ""
    healers: list[str] = field(default_factory=list)
    postponed: bool = False
    error: str = ""


@dataclass
class HealHooks:
    """How the member reads and replaces this rank's training state (provided by the worker)."""

    committed: Callable[[], int]
    global_hash: Callable[[], str]
    step: Callable[[], int]
    state: Callable[[], dict[str, Any]]
    load: Callable[[dict[str, Any]], None]


class _Monitor:
    """Heartbeats of this rank and its ring peers through the round store, in a thread: a peer
    whose counter stops for ``timeout`` seconds (or an unreachable store) fails the round."""

    def __init__(self, store: dist.Store, me: str, peers: list[str], interval: float, timeout: float) -> None:
        self.store, self.me, self.peers = store, me, peers
        self.interval, self.timeout = interval, timeout
        self.failed: str | None = None
        self.culprit: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="heartbeat-monitor")
        self._thread.start()

    def _run(self) -> None:
        seen = {p: (-1, time.monotonic()) for p in self.peers}
        last_ok = time.monotonic()
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            try:
                self.store.add(f"hb/{self.me}", 1)
                for p in self.peers:
                    v = self.store.add(f"hb/{p}", 0)
                    if v != seen[p][0]:
                        seen[p] = (v, now)
                    elif now - seen[p][1] > self.timeout:
                        self._fail(f"no heartbeat from {p.split('/')[0]} for {now - seen[p][1]:.1f}s", p)
                        return
                last_ok = now
            except Exception as exc:  # the store's host is gone or stopped
                if now - last_ok > self.timeout:
                    self._fail(f"round store unreachable ({type(exc).__name__})", None)
                    return

    def _fail(self, why: str, who: str | None) -> None:
        self.culprit = who.split("/")[0] if who else None
        self.failed = why

    def check(self) -> None:
        if self.failed is not None:
            raise RoundFailed(self.failed)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _connect(address: str, timeout: float) -> dist.TCPStore:
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout), wait_for_workers=False)


class SiteMember:
    """This rank's part in the elastic rounds (see the module docstring).

    Args:
        cfg: the run's config (``elastic`` section).
        site: this site's name; ``local_rank``/``workers``: this rank within the site.
        intra: the site's process group (the site's own torch.distributed world).
        wan: the link emulation (None: loopback speed); ``site_index`` names our end of a link.
        hooks: reads and replaces the training state for healing.
        log: writes one line to this rank's log.
        on_mid_round: called between the reduce-scatter and all-gather of the exchange
            (failure injection "in the middle of an all-reduce").
    """

    def __init__(
        self,
        cfg: Config,
        site: str,
        site_index: int,
        local_rank: int,
        workers: int,
        intra: dist.ProcessGroup,
        wan: WanEmulator | None,
        hooks: HealHooks,
        log: Callable[[str], None],
        on_mid_round: Callable[[], None] | None = None,
        stats: CommStats | None = None,
    ) -> None:
        self.cfg = cfg.elastic
        self.stats = stats if stats is not None else CommStats()
        self.site, self.site_index, self.local, self.G = site, site_index, local_rank, workers
        self.names = [s.name for s in cfg.topology.sites]
        self.intra, self.wan, self.hooks, self.log = intra, wan, hooks, log
        self.on_mid_round = on_mid_round
        self.secret = load_secret(self.cfg)
        self.inter_bytes = 0  # bytes this rank sent to other sites (pseudo-gradients, healing state)
        self.events: list[dict[str, Any]] = []  # failures this site detected
        self.healed_at_step: int | None = None
        self.joining = False  # a restarted site: it heals in its first round and contributes from the next
        self.record_file: Path | None = None  # local rank 0: one JSON line per round
        self._current: dict[str, Any] = {}
        self._pg: tuple[tuple[str, ...], Any] | None = None
        self._last_members: list[str] = []
        self._stores: dict[str, dist.TCPStore] = {}
        self._host_store: dist.TCPStore | None = None
        self._hb_stop = threading.Event()
        self._client: Any = None
        self._down = False
        self._state_lock = threading.Lock()
        self._back_at = -1e9
        self._hb_gen = 0
        self._hb_started = self._hb_last_ok = time.monotonic()
        addr = self.cfg.lighthouse or os.environ.get("GEOTRAIN_LIGHTHOUSE", "")
        if not addr:
            raise MembershipRefused("no Lighthouse address: set elastic.lighthouse (HOST:PORT)")
        self.lighthouse = addr if addr.startswith("http") else f"http://{addr}"
        if local_rank == 0:
            bind = os.environ.get("GEOTRAIN_BIND_ADDR", "127.0.0.1")
            self._host_store = dist.TCPStore(
                bind, 0, is_master=True, timeout=timedelta(seconds=self.cfg.collective_timeout_s), wait_for_workers=False
            )
            self.store_address = f"{bind}:{self._host_store.port}"
            self._start_heartbeat()

    @property
    def retry_seconds(self) -> float:
        """How long a postponed round waits before it is retried (one heartbeat interval)."""
        return self.cfg.heartbeat_s

    # ------------------------------------------------------------------ coordinator (local rank 0)

    def _connect_lighthouse(self) -> Any:
        from torchft.coordination import LighthouseClient

        try:
            return LighthouseClient(self.lighthouse, connect_timeout=timedelta(seconds=self.cfg.heartbeat_timeout_s))
        except Exception as exc:
            raise CoordinatorDown(str(exc).splitlines()[0]) from None

    def _lighthouse(self) -> Any:
        """The main thread's client (the heartbeat thread has its own: one client per thread)."""
        if self._client is None:
            self._client = self._connect_lighthouse()
        return self._client

    def _start_heartbeat(self) -> None:
        self._hb_gen += 1
        self._hb_started = time.monotonic()
        gen = self._hb_gen
        threading.Thread(target=self._heartbeat, args=(gen,), daemon=True, name=f"lighthouse-heartbeat-{gen}").start()

    def _heartbeat(self, gen: int) -> None:
        """Heartbeat every ``heartbeat_s`` with this thread's own client, until replaced (``gen``)."""
        client = None
        while gen == self._hb_gen and not self._hb_stop.wait(self.cfg.heartbeat_s):
            try:
                client = client or self._connect_lighthouse()
                client.heartbeat(self.site, timeout=timedelta(seconds=self.cfg.heartbeat_timeout_s))
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

    def _coordinator_down(self) -> bool:
        """Down, or its heartbeats are stale. A heartbeat call can hang when the Lighthouse dies in
        the middle of it, so a stale heartbeat thread is replaced by a fresh one."""
        now = time.monotonic()
        stale = now - self._hb_last_ok > self.cfg.heartbeat_timeout_s
        if stale and now - self._hb_started > 2 * self.cfg.heartbeat_timeout_s:
            self._start_heartbeat()
        if stale:
            self._set_down(True)
        return self._down

    def _quorum(self, can_postpone: bool) -> Any:
        """The round's quorum (None: the Lighthouse is down and the round may be postponed)."""
        waited = 0.0
        give_up = time.monotonic() + self.cfg.start_timeout_s
        while True:
            if self.joining and time.monotonic() > give_up:
                raise MembershipRefused(f"no live site to heal from within elastic.start_timeout_s={self.cfg.start_timeout_s:g}s")
            try:
                down = self._coordinator_down()
                settling = time.monotonic() - self._back_at < 4 * self.cfg.heartbeat_s
                if (down or settling) and can_postpone:
                    return None
                q = self._lighthouse().quorum(
                    replica_id=self.site,
                    timeout=timedelta(seconds=self.cfg.quorum_timeout_s),
                    address=self.store_address,
                    store_address=self.store_address,
                    step=self.hooks.committed(),
                    world_size=self.G,
                    shrink_only=False,
                    data={"hash": self.hooks.global_hash(), "step": self.hooks.step(), "joining": self.joining},
                )
                if waited:
                    self.log(f"quorum reached after {waited:.1f}s: training resumes")
                return q
            except TimeoutError:
                waited += self.cfg.quorum_timeout_s
                self.log(
                    f"training paused: fewer than elastic.min_sites={self.cfg.min_sites} live sites answer "
                    f"(waited {waited:.0f}s); retrying"
                )
            except Exception as exc:
                self._client = None
                self._set_down(True)
                if can_postpone:
                    return None
                self.log(f"Lighthouse unreachable ({str(exc).splitlines()[0][:80]}); retrying")
                time.sleep(self.cfg.heartbeat_s * 4)

    def rendezvous(self, sites: int, timeout: float) -> list[str]:
        """Before the first step of a fresh run: wait until all ``sites`` sites are in one quorum (or
        ``timeout`` passes, then go on with those present), so no site trains rounds alone while
        the others are still starting. Every rank returns the sites present."""
        present: list[str] = []
        if self.local == 0:
            deadline = time.monotonic() + timeout
            while True:
                q = self._quorum(can_postpone=False)
                present = sorted(p.replica_id for p in q.participants)
                if len(present) >= sites or time.monotonic() > deadline:
                    break
                time.sleep(self.cfg.heartbeat_s)
            self._last_members = present
            self.log(f"rendezvous: {len(present)} of {sites} sites present ({', '.join(present)})")
        box: list[Any] = [present]
        dist.broadcast_object_list(box, src=0, group=self.intra)
        return list(box[0])

    def _store(self, address: str) -> dist.TCPStore:
        if address not in self._stores:
            self._stores[address] = _connect(address, self.cfg.heartbeat_timeout_s)
        return self._stores[address]

    def _wait_keys(
        self,
        store: dist.Store,
        keys: list[str],
        deadline: float,
        monitor: _Monitor | None = None,
        stop_if: Callable[[str], bool] | None = None,
    ) -> list[str]:
        """The keys present by ``deadline`` (polling, so a heartbeat failure ends it early), or as
        soon as a present key satisfies ``stop_if``."""
        pending = list(keys)
        while pending and time.monotonic() < deadline:
            present = [k for k in pending if store.check([k])]
            pending = [k for k in pending if k not in present]
            if stop_if is not None and any(stop_if(k) for k in present):
                break
            if monitor is not None:
                monitor.check()
            if pending:
                time.sleep(0.005)
        return [k for k in keys if k not in pending]

    def _authenticate(self, store: dist.Store, key: str, members: list[str]) -> list[str]:
        """HMAC challenge among ``members``; the ones that proved the secret to this site (and back)."""
        nonce = secrets.token_hex(16)
        store.set(f"nonce/{self.site}", nonce)
        others = [m for m in members if m != self.site]
        deadline = time.monotonic() + self.cfg.heartbeat_timeout_s * 2
        present = self._wait_keys(store, [f"nonce/{m}" for m in others], deadline)
        for k in present:
            peer = k.split("/", 1)[1]
            store.set(f"proof/{peer}/{self.site}", join_proof(self.secret, key, store.get(k).decode(), self.site))
        got = self._wait_keys(store, [f"proof/{self.site}/{m}" for m in others], deadline)
        ok = []
        for k in got:
            peer = k.rsplit("/", 1)[1]
            if hmac.compare_digest(store.get(k).decode(), join_proof(self.secret, key, nonce, peer)):
                ok.append(peer)
            else:
                store.set(f"refused/{peer}", f"refused by {self.site}")
                self.log(f"site {peer!r} failed authentication (wrong secret): refused")
        # refused: no peer's proof verified here and a peer said ours did not verify there (one of
        # the two alone may be a slow peer, or an impostor writing to the store)
        refusal = [f"refused/{self.site}"]
        if others and not ok and self._wait_keys(store, refusal, time.monotonic() + self.cfg.heartbeat_timeout_s):
            raise MembershipRefused(
                f"site {self.site!r} was refused by its peers and could not authenticate any of them: the "
                f"membership secret differs (elastic.secret_env / elastic.secret_file)"
            )
        return sorted([self.site, *ok])

    def _decide(self, can_postpone: bool) -> RoundView:
        """Local rank 0: quorum, authentication, healing plan."""
        q = self._quorum(can_postpone)
        if q is None:
            return RoundView(postponed=True)
        members = [
            Member(
                p.replica_id,
                p.store_address,
                p.step,
                str((p.data or {}).get("hash", "")),
                bool((p.data or {}).get("joining", False)),
            )
            for p in q.participants
        ]
        names = sorted(m.site for m in members)
        if self.joining and all(m.joining for m in members):  # nobody to heal from (yet)
            return RoundView(postponed=True)
        gone = [s for s in self._last_members if s not in names]
        for s in gone:
            self._event(s, "left quorum")
        self._last_members = names
        key = f"{q.quorum_id}-{q.created.seconds}-{q.created.nanos}"
        by = {m.site: m for m in members}
        top = max(m.committed for m in members)
        leaders = sorted((m for m in members if m.committed == top), key=lambda m: m.site)
        held = [m.hash for m in leaders]
        best = max(held, key=lambda h: (held.count(h), -held.index(h)))  # most held, then first by name
        source = next(m.site for m in leaders if m.hash == best)
        view = RoundView(key=key, members=members, source=source)
        try:
            auth = dist.PrefixStore(f"auth/{key}", self._store(by[source].store))
            admitted = self._authenticate(auth, key, names)
            # a slow site may be admitted by some and timed out by others: the round goes ahead
            # only if every admitted site admitted the same set (else all of them roll back)
            mine = ",".join(admitted)
            auth.set(f"view/{self.site}", mine)
            keys = [f"view/{s}" for s in admitted]
            got = self._wait_keys(auth, keys, time.monotonic() + self.cfg.heartbeat_timeout_s * 2)
            if len(got) != len(keys) or any(auth.get(k).decode() != mine for k in keys):
                view.error = f"round {key}: sites disagree on who was authenticated"
                return view
        except MembershipRefused:
            raise
        except Exception as exc:
            view.error = f"round {key}: membership set-up failed ({type(exc).__name__}: {str(exc)[:120]})"
            return view
        if source not in admitted:
            view.error = f"round {key}: the source site {source} was not authenticated"
            return view
        view.admitted = admitted
        view.healers = [s for s in admitted if (by[s].committed, by[s].hash) != (top, best) or by[s].joining]
        return view

    def _event(self, site: str, how: str) -> None:
        self.events.append({"site": site, "how": how, "time": time.time(), "by": self.site})

    def _broadcast(self, view: RoundView) -> RoundView:
        box: list[Any] = [view]
        dist.broadcast_object_list(box, src=0, group=self.intra)
        return box[0]

    # ------------------------------------------------------------------ the round (every rank)

    def _group(self, view: RoundView, store: dist.Store) -> Any:
        """The round's Gloo group, reused while the admitted sites are the same processes (a
        restarted site has a new store address, so its old connections are never reused)."""
        by = {m.site: m.store for m in view.members}
        names = tuple(f"{s}@{by[s]}" for s in view.admitted)
        if self._pg is not None and self._pg[0] == names:
            return self._pg[1]
        self._drop_group()
        pg = dist.ProcessGroupGloo(
            dist.PrefixStore(f"pg/{view.key}/{self.local}", store),
            view.admitted.index(self.site),
            len(names),
            timedelta(seconds=self.cfg.collective_timeout_s),
        )
        self._pg = (names, pg)
        return pg

    def _drop_group(self) -> None:
        if self._pg is not None:
            with contextlib.suppress(Exception):
                self._pg[1].abort()
            self._pg = None

    @staticmethod
    def _wait(works: list[Any], monitor: _Monitor) -> None:
        """Wait for Gloo works (in the exchange thread; the main thread watches the heartbeats)."""
        for w in works:
            w.wait()
        monitor.check()

    def _send_recv(
        self,
        pg: dist.ProcessGroup,
        view: RoundView,
        send: torch.Tensor,
        dst: int,
        recv: torch.Tensor,
        src: int,
        monitor: _Monitor,
        tag: int = _DATA_TAG,
    ) -> None:
        """One paced exchange over the round group (group ranks = positions in ``view.admitted``)."""
        nbytes = send.numel() * send.element_size()
        self.inter_bytes += nbytes
        works = [pg.recv([recv], src, tag), pg.send([send], dst, tag)]
        if self.wan is not None:
            dst_site = self.names.index(view.admitted[dst])
            arrival = self.wan.pace([(dst_site, nbytes)])[0]
            header_in = torch.zeros(1, dtype=torch.float64)
            works += [
                pg.recv([header_in], src, _HEADER_TAG),
                pg.send([torch.tensor([arrival], dtype=torch.float64)], dst, _HEADER_TAG),
            ]
            self._wait(works, monitor)
            self.wan.hold_until(float(header_in.item()))
        else:
            self._wait(works, monitor)

    def _ring_sum(self, pg: dist.ProcessGroup, view: RoundView, x: torch.Tensor, monitor: _Monitor) -> None:
        n = len(view.admitted)
        i = view.admitted.index(self.site)
        nxt, prv = (i + 1) % n, (i - 1) % n
        chunks = x.tensor_split(n)
        scratch = torch.empty_like(chunks[0])
        for s in range(n - 1):
            into = chunks[(i - s - 2) % n]
            buf = scratch[: into.numel()]
            self._send_recv(pg, view, chunks[(i - s - 1) % n], nxt, buf, prv, monitor)
            into.add_(buf)
        if self.on_mid_round is not None:
            self.on_mid_round()
        for s in range(n - 1):
            self._send_recv(pg, view, chunks[(i - s) % n], nxt, chunks[(i - s - 1) % n], prv, monitor)

    def _heal(self, pg: dist.ProcessGroup, view: RoundView, monitor: _Monitor) -> None:
        """The source sends its state to every healer (same local rank), who loads it."""
        src = view.admitted.index(view.source)
        if self.site == view.source:
            buf = io.BytesIO()
            torch.save(self.hooks.state(), buf)
            blob = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
            size = torch.tensor([blob.numel()], dtype=torch.int64)
            for h in view.healers:
                dst = view.admitted.index(h)
                self._wait([pg.send([size], dst, _HEAL_TAG), pg.send([blob], dst, _HEAL_TAG + 1)], monitor)
                self.inter_bytes += blob.numel() + 8
        elif self.site in view.healers:
            size = torch.zeros(1, dtype=torch.int64)
            self._wait([pg.recv([size], src, _HEAL_TAG)], monitor)
            blob = torch.empty(int(size.item()), dtype=torch.uint8)
            self._wait([pg.recv([blob], src, _HEAL_TAG + 1)], monitor)
            state = torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=True, map_location="cpu")
            self.hooks.load(state)
            self.healed_at_step = int(state["step"])
            if self.local == 0:
                self.log(f"healed from {view.source}: {state['committed']} committed rounds, step {state['step']}")

    def round(self, delta: torch.Tensor, can_postpone: bool = True) -> int | None:
        """Average ``delta`` (this site's pseudo-gradient, identical on its ranks) over the admitted
        sites in place; the number of sites that contributed. None: postponed (Lighthouse down).

        Raises:
            RoundFailed: the round cannot commit on every participant; roll it back.
            MembershipRefused: this site failed authentication.
        """
        t0, sent0 = time.time(), self.inter_bytes
        try:
            return self._round(delta, can_postpone, t0)
        finally:  # the training thread was blocked on the wide area all along
            seconds, sent = time.time() - t0, self.inter_bytes - sent0
            st = self.stats
            st.inter_bytes += sent
            st.inter_raw_bytes += sent
            st.comm_seconds += seconds
            st.wan_wait_seconds += seconds
            st.network_seconds += seconds

    def _round(self, delta: torch.Tensor, can_postpone: bool, t0: float) -> int | None:
        view = self._decide(can_postpone and not self.joining) if self.local == 0 else RoundView()
        view = self._broadcast(view)
        if view.postponed:
            return None
        self._current = {
            "key": view.key,
            "start": t0,
            "quorum_s": time.time() - t0,
            "members": sorted(m.site for m in view.members),
            "admitted": view.admitted,
            "healers": view.healers,
        }
        if view.error:
            raise RoundFailed(view.error)
        by = {m.site: m for m in view.members}
        store = self._store(by[view.source].store)
        peers = [f"{s}/{self.local}" for s in view.admitted if s != self.site]
        hb_store = dist.PrefixStore(f"round/{view.key}", _connect(by[view.source].store, self.cfg.heartbeat_timeout_s))
        monitor = _Monitor(hb_store, f"{self.site}/{self.local}", peers, self.cfg.heartbeat_s, self.cfg.heartbeat_timeout_s)
        ext = torch.cat([delta.detach().to("cpu", torch.float32), torch.zeros(1)])  # Gloo: CPU, also under NCCL
        ok = torch.ones(1)
        why = ""
        errors: list[BaseException] = []

        def exchange() -> None:
            try:
                pg = self._group(view, store)
                self._heal(pg, view, monitor)
                finite = bool(torch.isfinite(delta).all())
                if not finite:
                    self.log("pseudo-gradient is not finite: withdrawn from this round")
                if self.site not in view.healers and finite:
                    ext[:-1].copy_(delta.cpu())
                    ext[-1] = 1.0
                else:
                    ext.zero_()
                self._ring_sum(pg, view, self._shard(ext), monitor)
            except BaseException as exc:  # reported to the main thread
                errors.append(exc)

        # Gloo waits cannot be interrupted, so the exchange runs in a thread and the main thread
        # watches the heartbeats; a hung peer abandons the thread (it ends at the group's timeout)
        worker = threading.Thread(target=exchange, daemon=True, name="cross-site-exchange")
        worker.start()
        while worker.is_alive() and monitor.failed is None:
            worker.join(timeout=0.01)
        if worker.is_alive():
            ok.zero_()
            why = monitor.failed or "aborted"
            self._drop_group()
        elif errors:
            ok.zero_()
            exc = errors[0]
            if isinstance(exc, MembershipRefused):
                raise exc
            first = str(exc).splitlines()[0][:100] if str(exc) else type(exc).__name__
            why = str(exc) if isinstance(exc, RoundFailed) else f"collective failed ({first})"
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.intra)
        if ok.item() and self.G > 1:  # Gloo's all-gather wants equal parts: pad the last shard
            c = -(-ext.numel() // self.G)
            mine = torch.zeros(c)
            shard = self._shard(ext)
            mine[: shard.numel()] = shard
            gathered = [torch.empty(c) for _ in range(self.G)]
            dist.all_gather(gathered, mine, group=self.intra)
            ext.copy_(torch.cat(gathered)[: ext.numel()])
        committed = self._vote(dist.PrefixStore(f"round/{view.key}", store), view, monitor, bool(ok.item()))
        monitor.stop()
        if monitor.culprit:
            self._event(monitor.culprit, "heartbeat timeout")
        if not committed:
            self._drop_group()
            self._stores.pop(by[view.source].store, None)  # reconnect next time: its host may be gone
            reason = why or monitor.failed or "a participant did not confirm the round"
            if self.local == 0:
                self.log(f"round {view.key} rolled back: {reason}")
            raise RoundFailed(reason)
        self.joining = False
        count = int(round(float(ext[-1].item())))
        if count == 0:
            raise RoundFailed("no site contributed to the round")
        delta.copy_(ext[:-1].to(delta.device)).div_(count)
        self._current["contributors"] = count
        return count

    def _shard(self, x: torch.Tensor) -> torch.Tensor:
        """This local rank's contiguous 1/G of ``x`` (ceil-sized parts; the last may be shorter)."""
        c = -(-x.numel() // self.G)
        return x[self.local * c : min(x.numel(), (self.local + 1) * c)]

    def _vote(self, prefix: dist.Store, view: RoundView, monitor: _Monitor, ok: bool) -> bool:
        """Local rank 0 writes this site's vote and reads everyone's; the round commits only if every
        admitted site voted yes. The site's ranks agree on the result."""
        decision = torch.zeros(1)
        if self.local == 0:
            with contextlib.suppress(Exception):  # an unreachable store: no commit
                prefix.set(f"vote/{self.site}", "1" if ok else "0")
                if ok:  # a no (ours, or any seen) settles it at once; a yes needs every vote
                    keys = [f"vote/{s}" for s in view.admitted]
                    votes: dict[str, bytes] = {}

                    def said_no(k: str) -> bool:
                        votes[k] = prefix.get(k)
                        return votes[k] != b"1"

                    deadline = time.monotonic() + self.cfg.collective_timeout_s
                    self._wait_keys(prefix, keys, deadline, monitor, stop_if=said_no)
                    decision.fill_(float(all(votes.get(k) == b"1" for k in keys)))
        dist.broadcast(decision, src=0, group=self.intra)
        return bool(decision.item())

    def note(self, outcome: str, reason: str, global_hash: str, committed: int, step: int) -> None:
        """Record the round's outcome (after the caller applied or rolled it back): one JSON line."""
        rec = {**self._current, "end": time.time(), "outcome": outcome, "reason": reason}
        rec.update(site=self.site, hash=global_hash, committed=committed, step=step)
        self._current = {}
        if self.record_file is not None:
            with open(self.record_file, "a") as f:
                f.write(json.dumps(rec) + "\n")

    def close(self) -> None:
        self._hb_stop.set()
        self._drop_group()


def main(argv: list[str] | None = None) -> int:
    return lighthouse_main(argv)


if __name__ == "__main__":
    sys.exit(main())
