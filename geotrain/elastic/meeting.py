"""The meeting of one round, in a site's round store: the sites the quorum named prove the run's
key to each other, say what they hold as of this round, agree on one view, and derive the
round's identity and the keys of its frames.

The Lighthouse's quorum only says who to meet and in whose store (:mod:`geotrain.elastic.auth`);
everything a round decides comes from here: who is admitted, who is the heal source and who
heals (from the claims made in the meeting, bound to its fresh nonces), the round's identity (the
digest of the admitted sites, their nonces and claims), and the key of each pair of sites (from
the ephemeral X25519 keys in those claims). With site identities (``elastic.site_keys``) every
claim, proof and vote is also signed by its site's own key.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from geotrain.comm.identity import Identity
from geotrain.elastic.auth import (
    RunKeys,
    SealedStore,
    authenticate,
    ephemeral,
    ephemeral_shared,
    pair_key,
    round_digest,
)
from geotrain.elastic.roundstore import wait_keys
from geotrain.elastic.view import (
    Member,
    RoundView,
    heal_source,
    healers,
    member_from_claims,
    region_healers,
    round_part,
    whole_regions,
)
from geotrain.errors import ROUND_FAILURES, MembershipRefused


def meet(
    store: dist.Store,
    keys: RunKeys,
    view: RoundView,
    site: str,
    names: list[str],
    claims: dict[str, Any],
    identity: Identity | None,
    timeout: float,
    min_sites: int,
    log: Callable[[str], None],
    region_of: dict[str, str] | None = None,
    whole: bool = False,
) -> tuple[RoundView, list[Member]]:
    """Meet in ``store`` for the round ``view.key`` with the sites ``names``; ``claims``: what this
    site holds now; ``region_of``: each site's region in two tiers (healers heal from their own
    region's source, :func:`~geotrain.elastic.view.region_healers`, and the round is a region
    round if any site claims one; ``whole``: quorum rounds, where a region takes part whole or
    not at all, :func:`~geotrain.elastic.view.whole_regions`). Returns the round's view
    (``error`` set if it cannot go ahead: every site that met rolls back) and every member that
    proved itself, as it described itself in the meeting (also those left out of the round).

    Raises:
        MembershipRefused: this site failed authentication (from :func:`authenticate`).
    """
    eph, eph_public = ephemeral()
    try:
        auth = SealedStore(store, keys, f"auth/{view.key}", log)
        proved = authenticate(auth, view.key, site, names, keys.join, {**claims, "eph": eph_public}, timeout, log, identity)
        # a slow site may be admitted by some and timed out by others: the round goes ahead only if
        # every admitted site admitted the same sites, with the same nonces and claims (else all of
        # them roll back); that digest is the round's identity from here on
        digest = round_digest(view.key, proved)
        auth.set(f"view/{site}", digest)
        views = [f"view/{s}" for s in proved]
        got = wait_keys(auth, views, time.monotonic() + timeout * 2)
        if len(got) != len(views) or any(auth.get(k) != digest.encode() for k in views):
            view.error = (
                f"round {view.key}: sites disagree on who was authenticated or what they hold (round store {view.meeting})"
            )
            return view, []
    except MembershipRefused:
        raise
    except ROUND_FAILURES as exc:  # a peer, the network or the store; a bug is not caught here
        view.error = f"round {view.key}: membership set-up failed ({type(exc).__name__}: {str(exc)[:160]})"
        return view, []
    members = [member_from_claims(s, c) for s, (c, _) in proved.items()]
    admitted = sorted(proved)
    if len(admitted) < min_sites:  # the quorum had enough sites, but not all of them answered
        view.error = f"round {view.key}: {len(admitted)} site(s) authenticated, fewer than elastic.min_sites={min_sites}"
        return view, members
    taking = members  # the members the round is about (every one that proved, but see whole_regions)
    if region_of is not None and whole:  # elastic quorum rounds of two tiers: regions take part whole
        admitted = whole_regions(members, admitted, region_of)
        if site not in admitted:
            return RoundView(postponed=True), members
        taking = [m for m in members if m.site in admitted]
    source = heal_source(taking)
    if source is None:  # every member is a restarted site without a state: nobody to heal from (yet)
        return RoundView(postponed=True), members
    frame_keys = {}
    for s, (c, _) in proved.items():
        if s != site:
            shared = ephemeral_shared(eph, c["eph"])
            if shared is None:
                view.error = f"round {view.key}: site {s} sent an invalid X25519 key"
                return view, members
            frame_keys[s] = pair_key(keys.payload, shared, digest[:32], site, s)
    sources: dict[str, str] = {}
    if region_of is None:
        healing, part = healers(taking, source, admitted), round_part(taking, source, admitted)
    else:  # two tiers: a region round if any site has steps to bring to its region (the part is the tier)
        healing, sources = region_healers(taking, source, admitted, region_of, whole)
        part = min((m.part for m in taking if m.part >= 0), default=-1)
    done = RoundView(
        key=view.key,
        round_id=digest[:32],
        meeting=view.meeting,
        members=taking,
        admitted=admitted,
        source=source,
        healers=healing,
        sources=sources,
        part=part,
        frame_keys=frame_keys,
    )
    return done, members


def ballot(identity: Identity | None, round_id: str, site: str, yes: bool, kind: str = "vote") -> str:
    """A site's vote (or, ``kind`` "decided", its decision) as written: "1" or "0", signed with
    its own key where sites have keys."""
    v = "1" if yes else "0"
    if identity is None:
        return v
    return f"{v}|{identity.sign(f'geotrain-{kind}|{round_id}|{site}|{v}'.encode())}"


def said_yes(identity: Identity | None, round_id: str, site: str, raw: bytes | None, kind: str = "vote") -> bool:
    """Whether ``raw`` is ``site``'s yes to the round, or (``kind`` "decided") its commit
    (signed by its pinned key where sites have keys)."""
    if raw is None or identity is None:
        return raw == b"1"
    v, _, sig = raw.decode(errors="replace").partition("|")
    return v == "1" and identity.verify(site, f"geotrain-{kind}|{round_id}|{site}|1".encode(), sig)
