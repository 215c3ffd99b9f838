"""Quorum rounds in elastic mode (``sync.quorum``, :mod:`geotrain.round.membership`): a site's
member, and how far each site is, for the end of the run.

In quorum rounds a round holds only the sites that asked in time, so a site that has run its
steps cannot learn from its rounds whether a slower site is still training: the Lighthouse names
only the sites that asked. Each site therefore writes its progress (whether it has run its
steps, its committed rounds and global hash) into its own round store, sealed with the run's key,
each time it claims a round and after each round, with the stores of the other sites it knows.
A finished site reads the others' progress from their stores (at the last address their quorum
entries gave, or another site's progress named, for a site it has not met: a restarted site meets
few): it may leave once every site whose store still answers has run its steps and holds its
model. A site that died took its store with it; a site that came back has a new store, which its
quorum entries name.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from geotrain.elastic.auth import RunKeys, SealedStore
from geotrain.elastic.member import SiteMember, _fatal
from geotrain.elastic.roundstore import Stores
from geotrain.elastic.view import Member, RoundView, nothing_to_do, same_initial_model
from geotrain.errors import ROUND_FAILURES, ElasticTimeout


class Progress:
    """This site's progress in its own store, and the others' as their stores tell it.

    Args:
        stores: this site's round-store clients; ``own``: the address of the store it hosts.
        wait_timeout_s: the longest a finished site waits while no other site's progress changes.
    """

    def __init__(
        self, keys: RunKeys, stores: Stores, site: str, names: list[str], own: str, wait_timeout_s: float,
        log: Callable[[str], None],
    ) -> None:  # fmt: skip
        self.keys, self.stores, self.site, self.own, self.wait_timeout_s, self.log = keys, stores, site, own, wait_timeout_s, log
        self.others = [s for s in names if s != site]
        self.addresses: dict[str, str] = {}  # each other site's store, as its latest quorum entry named it
        self.gone: set[str] = set()  # stores that did not answer: their sites died (a restarted site has a new one)
        self._last: tuple[Any, ...] = ()
        self._since = time.monotonic()

    def _scope(self, address: str) -> SealedStore:
        return SealedStore(self.stores.get(address), self.keys, "progress", self.log)

    def publish(self, done: bool, committed: int, global_hash: str) -> None:
        """Write this site's progress into its own store."""
        got = {"done": done, "committed": committed, "hash": global_hash, "stores": self.addresses}
        self._scope(self.own).set(self.site, json.dumps(got))

    def saw(self, members: list[Member]) -> None:
        """Where the sites of a quorum keep their stores now (a restarted site has a new one)."""
        for m in members:
            if m.site != self.site:
                self.addresses[m.site] = m.store

    def read(self, site: str) -> dict[str, Any] | None:
        """``site``'s progress; None if its store does not answer (the site is gone) or holds none yet
        (``{}``: it answered without progress)."""
        address = self.addresses.get(site)
        if address is None:
            return {}
        if address in self.gone:
            return None
        try:
            raw = self._scope(address).peek(site)
        except ROUND_FAILURES:
            self.stores.forget(address)
            self.gone.add(address)
            return None
        try:
            got = json.loads(raw) if raw is not None else {}
        except ValueError:
            return {}
        if not isinstance(got, dict):
            return {}
        stores = got.pop("stores", {})
        for s, a in stores.items() if isinstance(stores, dict) else ():  # the stores it knows of sites this one has not met
            if s in self.others and isinstance(a, str) and (s not in self.addresses or self.addresses[s] in self.gone):
                self.addresses[s] = a
        return got

    def initial(self, site: str) -> str | None:
        """``site``'s initial model's hash, as its store tells it (None: it has committed rounds,
        or its store does not answer or holds nothing yet)."""
        got = self.read(site)
        return got.get("hash") if got and got.get("committed") == 0 else None

    def all_done(self, committed: int, global_hash: str) -> bool:
        """Whether every other live site has run its steps and holds this site's model (this site
        has run its steps).

        Raises:
            ElasticTimeout: no other site's progress changed for ``wait_timeout_s``.
        """
        seen = tuple((s, json.dumps(self.read(s), sort_keys=True)) for s in self.others)
        if seen != self._last:
            self._last, self._since = seen, time.monotonic()
        elif time.monotonic() - self._since > self.wait_timeout_s:
            raise ElasticTimeout(
                f"this site has run its steps and no other site progressed for {self.wait_timeout_s:g}s "
                f"(liveness.wait_timeout_s): {', '.join(f'{s} {p}' for s, p in seen)}"
            )
        mine = {"done": True, "committed": committed, "hash": global_hash}
        return all(p == "null" or json.loads(p) == mine for _, p in seen)


class QuorumMember(SiteMember):
    """A site's member in quorum rounds: a late site's update counts in its next round, times
    (1 + rounds missed)^-``staleness_power`` (:meth:`SiteMember._exchange_and_vote`), and a
    round's weighted sum is divided by ``world_weight``, every site's weight in a round (as the
    syncer divides by a whole world round's tokens: a round of some of the sites, or of one late
    update, moves the model by their share only); a round of sites that have all run their steps
    and hold one model is not held; a site that has run its steps stays until
    :meth:`all_finished` (their stores say)."""

    def __init__(self, *args: Any, staleness_power: float, world_weight: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stale_power, self.world_weight = staleness_power, world_weight
        self.progress: Progress | None = None  # local rank 0
        if self.local == 0:
            assert self.coordinator is not None
            own = self.coordinator.store_address
            self.progress = Progress(self.keys, self._stores, self.site, self.names, own, self.live.wait_timeout_s, self.log)

    def _present(self, sites: int, timeout: float) -> list[str]:
        """Before the first step: ask for quorums until every one of the ``sites`` sites has been in
        one (a quorum holds only the first sites to ask, so rarely all), or ``timeout`` passes. Each
        site's initial model is read from its own store (its first claims, sealed with the run's
        key): another one is refused before any step, as :func:`same_initial_model` refuses it. A
        site that has committed rounds already is not compared (this site heals from it)."""
        assert self.progress is not None
        deadline, seen = time.monotonic() + timeout, {self.site}
        while len(seen) < sites and time.monotonic() < deadline:
            hints = self.hints.usable(self._quorum(can_postpone=False))
            self.progress.saw(hints)
            seen |= {m.site for m in hints}
            initial = {s: self.progress.initial(s) for s in sorted(seen - {self.site})}
            same_initial_model(self.site, self._hash, [Member(s, "", 0, h) for s, h in initial.items() if h is not None])
            time.sleep(self.live.heartbeat_s)
        self.log(f"rendezvous: {len(seen)} of {sites} sites present ({', '.join(sorted(seen))})")
        return sorted(seen)

    def _quorum(self, can_postpone: bool, once: bool = False) -> Any:
        """A finished site's request gives up when it finds too few sites; the site then asks again
        at once unless every live site is done (a request given up stays at the Lighthouse until
        the next one replaces it, and a quorum formed with it would wait for a site that is not
        coming)."""
        while True:
            q = super()._quorum(can_postpone, once=self.done)
            if q is not None or not self.done or self.progress is None or self.coordinator is None or self.coordinator.down:
                return q
            if self.progress.all_done(self.hooks.committed(), self._hash):
                return None  # (postponed: the caller sees that every site is done)

    def _claims(self) -> dict[str, Any]:  # (local rank 0) what it claims, it publishes
        claims = super()._claims()
        assert self.progress is not None
        self.progress.publish(self.done, claims["committed"], claims["hash"])
        return claims

    def _idle(self, hints: list[Member]) -> bool:
        assert self.progress is not None
        self.progress.saw(hints)
        return nothing_to_do(hints)

    def note(self, outcome: str, reason: str, global_hash: str, committed: int, step: int) -> None:
        super().note(outcome, reason, global_hash, committed, step)
        if self.progress is not None:
            self.progress.publish(self.done, committed, global_hash)

    def all_finished(self, total: int) -> bool:
        """Every live site has run its steps and holds this site's model (their stores say; every
        rank of the site gets local rank 0's answer). Raises ElasticTimeout as :meth:`Progress.all_done`."""
        global_hash = self.hooks.global_hash() if self.collective or self.local == 0 else ""  # (sharded: a collective)
        view = RoundView(postponed=True)  # postponed: not yet
        if self.local == 0:
            assert self.progress is not None
            try:
                view.postponed = not self.progress.all_done(self.hooks.committed(), global_hash)
            except ElasticTimeout as exc:
                view = _fatal(exc)
        return not self._broadcast(view).postponed
