"""Which participants of a Lighthouse quorum a site takes as hints of who to meet, and where.

The Lighthouse hands every request to anyone, so an entry is kept only if its member tag verifies
(a process without the secret is ignored), its site has a pinned key where sites have keys
(``elastic.site_keys``: a removed entry is a revoked site), and it is not older than what its
site last proved inside a round (an earlier process or incarnation: a replay). Malformed entries
are ignored one by one, never an error; each refused name is logged once (at most
:data:`REJECTED_LOGGED`, since a forger may make up many).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any

from geotrain.comm.identity import Identity
from geotrain.elastic.auth import RunKeys
from geotrain.elastic.view import Member, RoundView, members_of
from geotrain.errors import MembershipRefused

REJECTED_LOGGED = 64


class QuorumHints:
    """One site's reading of the quorums (state: what each site last proved, what was logged).

    Args:
        site: this site; ``names``: every site of the run's topology.
        identity: this site's identity where sites have keys; ``identity_error``: why it could
            not be made (raised as :class:`MembershipRefused` at the first quorum).
    """

    def __init__(
        self,
        site: str,
        names: list[str],
        keys: RunKeys,
        identity: Identity | None,
        identity_error: str,
        log: Callable[[str], None],
    ) -> None:
        self.site, self.names, self.keys, self.identity, self.log = site, names, keys, identity, log
        self.identity_error = identity_error
        self.session = secrets.token_hex(8)  # tells this process's claims from replays of an older one's
        self.known: dict[str, tuple[int, str]] = {}  # (incarnation, session) each site last proved in a round
        self.authenticated_peer = False  # this site has proved the secret with a peer in this run
        self._logged: set[object] = set()

    def proved(self, members: list[Member]) -> None:
        """What each site proved as of a round: older quorum entries are replays from then on."""
        for m in members:
            self.known[m.site] = (m.incarnation, m.session)

    def stale(self, m: Member) -> bool:
        """Whether a quorum entry is older than what its site last proved inside a round (or, for
        this site, not this process's own): a replay, or a request displaced by one."""
        if m.site == self.site:
            return m.session != self.session
        known = self.known.get(m.site)
        if known is None:
            return False
        incarnation, session = known
        return m.incarnation < incarnation or (m.incarnation == incarnation and m.session != session)

    def _once(self, what: object, line: str) -> None:
        if what not in self._logged and len(self._logged) < REJECTED_LOGGED:
            self._logged.add(what)
            self.log(line)

    def usable(self, q: Any) -> list[Member]:
        """The quorum's participants taken as hints (see the module docstring). A site that has
        never authenticated a peer in this run, finds no other participant it can verify, and sees
        participants named like sites of this run's topology stops: its secret differs from theirs
        (it cannot tell that from impostors using those names; docs/SECURITY.md).

        Raises:
            MembershipRefused: as above; or this site's own key is not (or no longer) pinned.
        """
        members, rejected = members_of(q, self.keys.member_ok)
        if self.identity_error:
            raise MembershipRefused(self.identity_error)
        if self.identity is not None:
            try:
                self.identity.refresh()  # a site whose entry was removed is revoked from this round on
            except (ValueError, OSError) as exc:
                raise MembershipRefused(f"elastic.site_keys: {exc}: leaving the run") from None
            for m in [m for m in members if m.site not in self.identity.pinned]:
                members.remove(m)
                self._once(
                    ("unpinned", m.site),
                    f"quorum participant {m.site!r} has no key in elastic.site_keys (revoked, or unknown): ignored",
                )
        for m in [m for m in members if self.stale(m)]:
            members.remove(m)
            self._once(
                (m.site, m.session),
                f"quorum participant {m.site!r} made claims older than it proved in a round (a replay?): ignored",
            )
        for name in rejected:
            self._once(name, f"quorum participant {name!r} failed authentication (no valid member tag): ignored")
        known = [r for r in rejected if r in self.names and r != self.site]
        if known and len(members) == 1 and not self.authenticated_peer:
            raise MembershipRefused(
                f"site {self.site!r} could not authenticate any other site in the quorum ({', '.join(known)}): the "
                f"membership secret differs (elastic.secret_env / elastic.secret_file)"
            )
        if len(members) > 1:
            self.authenticated_peer = True
        return members

    def rendezvous(
        self, ask: Callable[[], Any], meet_once: Callable[[], RoundView], sites: int, timeout: float, heartbeat_s: float
    ) -> list[str]:
        """Local rank 0 of a fresh run (:meth:`geotrain.elastic.member.SiteMember.rendezvous`): ask
        for quorums (``ask``) until ``sites`` sites are in one (or ``timeout`` passes), then meet
        them (or ``sites`` sites) once (``meet_once``, which raises MembershipRefused on another
        initial model); the sites present."""
        deadline = time.monotonic() + timeout
        while True:
            present = sorted(m.site for m in self.usable(ask()))
            if len(present) >= sites or time.monotonic() > deadline:
                break
            time.sleep(heartbeat_s)
        while len(present) > 1 and not (set(met := meet_once().admitted) >= set(present) or len(met) >= sites):
            if time.monotonic() > deadline:
                self.log("rendezvous: no meeting with every site before the first step; the first round checks")
                break
        self.log(f"rendezvous: {len(present)} of {sites} sites present ({', '.join(present)})")
        return present
