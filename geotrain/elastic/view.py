"""What a round is about: its members, the site the others heal from, and who heals. Pure
functions, the same on every site given the same members. The Lighthouse's quorum only says who
to meet and where (participants whose member tag verifies, :mod:`geotrain.elastic.auth`); the
members, with what they hold, are the sites authenticated inside the round, with the claims they
made there, bound to that round's fresh nonces: a process without the secret is never a source,
and claims replayed from an earlier round decide nothing.

The *source* is the member with the most committed rounds (ties: the global hash most of those
members hold, then the smallest name) among those that hold a valid state: a *joining* member (a
restarted process that has not loaded any peer's state yet) is never a source, whatever it
advertises. A member stops joining as soon as it has loaded a source's state, even if that round
is then rolled back (its state is then the source's at the round's start, which is where the
rollback leaves every site) — so a site that healed can heal others. *Healers* are the admitted members whose (committed,
hash) differ from the source's, plus any restarted (joining) site: they receive the source's
state and contribute zeros to the round.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from geotrain.comm.topology import REGION
from geotrain.errors import MembershipRefused


@dataclass
class Member:
    """One site in a quorum, as the Lighthouse reported it."""

    site: str
    store: str
    committed: int
    hash: str
    joining: bool = False
    incarnation: int = 0  # the site's process generation (a restarted site counts up)
    session: str = ""  # random per process: tells a live process from a replay of an older one
    step: int = 0  # the inner step it was at when it claimed (inside the round; 0 from a quorum hint)
    part: int = -1  # which part of the model it syncs in this round (a Streaming DiLoCo fragment; -1: the whole, or any)
    rest: int = 0  # rounds it still owes after this one once its steps are run (Streaming DiLoCo's last fragments)
    pace: int = 0  # adaptive pace: its measured compute microseconds per inner step (0: none)
    link: str = ""  # sync.adapt: its measurements of its last committed round ("": none)
    done: bool = False  # it has run its steps: it takes part in the others' rounds without an update


@dataclass
class RoundView:
    """What every rank of a site knows about the round (decided by local rank 0, broadcast)."""

    key: str = ""  # the Lighthouse's name for the round (what the records call it)
    round_id: str = ""  # the round's identity: digest of the admitted sites' nonces and claims
    meeting: str = ""  # the round store the sites meet in
    frame_keys: dict[str, bytes] = field(default_factory=dict)  # per peer site: this round's frame key
    members: list[Member] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)
    source: str = ""
    healers: list[str] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)  # two tiers: a healer's own source (absent: ``source``)
    part: int = -1  # the part of the model this round sums (:func:`round_part`)
    postponed: bool = False
    error: str = ""  # the round fails (rolled back); the site carries on
    fatal: str = ""  # local rank 0 must stop (refused, or a wait passed its bound): every rank raises
    fatal_timeout: bool = False  # fatal is an ElasticTimeout (else MembershipRefused)

    def source_of(self, healer: str) -> str:
        """The site ``healer`` takes its state from."""
        return self.sources.get(healer, self.source)

    def healed_by(self, site: str) -> list[str]:
        """The healers that take their state from ``site``."""
        return [h for h in self.healers if self.source_of(h) == site]


@dataclass
class HealHooks:
    """How the member reads and replaces this rank's training state (provided by the worker)."""

    committed: Callable[[], int]
    global_hash: Callable[[], str]
    step: Callable[[], int]
    state: Callable[[], dict[str, Any]]
    load: Callable[[dict[str, Any]], None]
    load_global: Callable[[dict[str, Any]], None] | None = None  # quorum rounds: a late site takes the global part only
    global_state: Callable[[], dict[str, Any]] | None = None  # quorum rounds: what a source sends sites that are all late


def members_of(quorum: Any, authentic: Callable[[str, dict[str, Any]], bool]) -> tuple[list[Member], list[str]]:
    """The members of a torchft quorum whose claims are ``authentic`` (their member tag verifies,
    and the Lighthouse's own fields agree with the tagged claims), with what each advertised; and
    the names of the participants left out."""
    members, rejected = [], []
    for p in quorum.participants:
        try:  # anyone who reaches the Lighthouse can add a participant: a malformed one is ignored on its own
            data = p.data if isinstance(p.data, dict) else {}
            ok = (
                isinstance(p.replica_id, str)
                and authentic(p.replica_id, data)
                and isinstance(data.get("committed"), int)
                and data.get("committed") == p.step
                and data.get("store") == p.store_address
                and isinstance(data.get("hash", ""), str)
            )
            inc, session = data.get("incarnation", 0), data.get("session", "")
            ok = ok and type(inc) is int and isinstance(session, str)
            member = Member(
                p.replica_id, p.store_address, p.step, str(data.get("hash", "")), data.get("joining") is True, inc, session
            )
            member.done = data.get("done") is True
        except Exception:  # noqa: BLE001 - whatever a forged participant is made of
            ok = False
        if not ok:
            rejected.append(str(getattr(p, "replica_id", "?"))[:64])
            continue
        members.append(member)
    return members, sorted(rejected)


def member_from_claims(site: str, claims: dict[str, Any]) -> Member:
    """A member as it described itself inside the round (claims checked by :func:`parse_claims`)."""
    c = claims
    return Member(
        site, c["store"], c["committed"], c["hash"], c["joining"], c["incarnation"], c["session"], c["step"], c["part"] - 1,
        c["rest"], c["pace"], c["link"], c["done"],
    )  # fmt: skip


def heal_source(members: list[Member]) -> str | None:
    """The site every other heals from (see the module docstring); None if every member is joining."""
    valid = [m for m in members if not m.joining]
    if not valid:
        return None
    top = max(m.committed for m in valid)
    leaders = sorted((m for m in valid if m.committed == top), key=lambda m: m.site)
    held = [m.hash for m in leaders]
    best = max(held, key=lambda h: (held.count(h), -held.index(h)))  # most held, then first by name
    return next(m.site for m in leaders if m.hash == best)


def round_part(members: list[Member], source: str, admitted: list[str]) -> int:
    """The part of the model a round sums: the one the source syncs; if the source syncs none (it
    has run its steps, or it is DiLoCo's whole model), the first part an admitted site syncs."""
    by = {m.site: m for m in members}
    if by[source].part >= 0:
        return by[source].part
    return min((by[s].part for s in admitted if by[s].part >= 0), default=-1)


def healers(members: list[Member], source: str, admitted: list[str]) -> list[str]:
    """The admitted sites that take the source's state this round: those whose (committed, hash)
    differ from the source's, a restarted site, and a site about to sync another part of the
    model than the round's (its schedule is not the source's)."""
    by = {m.site: m for m in members}
    ref = (by[source].committed, by[source].hash)
    part = round_part(members, source, admitted)

    def other_part(s: str) -> bool:
        return part >= 0 and by[s].part >= 0 and by[s].part != part

    return [s for s in admitted if (by[s].committed, by[s].hash) != ref or by[s].joining or other_part(s)]


def whole_regions(members: list[Member], admitted: list[str], region_of: dict[str, str]) -> list[str]:
    """Elastic quorum rounds of two tiers: the admitted sites that take part. A region's model is
    held only by its sites, so a region takes part in a round whole or not at all: a round of k
    of n sites that held some of a region's sites would move their region model and leave the
    others' behind, and a later round of only those others would hold no copy of it. A world
    round needs every region (the world tier is lock-step, as the hubs' is): where a region is
    not whole, only the regions with a site that claims a region round take part (the others, due
    for a world round or done, wait: a round of some of the done sites would move their round
    counts apart from the others' and the run's end would never see them agree)."""
    by = {m.site: m for m in members}
    regions: dict[str, list[str]] = {}
    for s, r in region_of.items():
        regions.setdefault(r, []).append(s)
    whole = {r for r, sites in regions.items() if all(s in admitted for s in sites)}
    if len(whole) < len(regions):  # no world round: a region takes part for a region round of its own only
        whole = {r for r in whole if any(by[s].part >= 0 and by[s].part % 2 == REGION for s in regions[r])}
    return [s for s in admitted if region_of[s] in whole]


def region_healers(
    members: list[Member], source: str, admitted: list[str], region_of: dict[str, str], whole: bool = False
) -> tuple[list[str], dict[str, str]]:
    """Two tiers (elastic mode with ``sync.region_every``): the healers of a round and each one's
    source. A site's state is its region's model as well as the world's, so a region's sites heal
    from the region's own source: :func:`heal_source` among its members that have committed as
    many rounds as the round's ``source``. A region with no such member heals from ``source`` (its
    region model is lost: it restarts from the world model, see
    :class:`geotrain.round.membership.ElasticTiers`). Healers are the region's members whose
    (committed, hash) differ from their source's, and restarted sites. A site that claims another
    tier than the round's does not heal: its state is valid, it sits the round out. With ``whole``
    (:func:`whole_regions`) a region's source is its member with the most committed rounds."""
    by = {m.site: m for m in members}
    top = by[source].committed
    healing: list[str] = []
    sources: dict[str, str] = {}
    for region in sorted({region_of[s] for s in admitted}):
        mine = [by[s] for s in admitted if region_of[s] == region]
        # (regions taking part whole: every site of the region is here, the one with the most rounds holds its model)
        src = heal_source(mine if whole else [m for m in mine if m.committed == top]) or source
        ref = (by[src].committed, by[src].hash)
        for m in mine:
            if m.site != src and ((m.committed, m.hash) != ref or m.joining):
                healing.append(m.site)
                sources[m.site] = src
    return sorted(healing), sources


def late_by(view: RoundView, site: str) -> int:
    """Quorum rounds: the committed rounds ``site`` missed while alive (a healer that is not a
    restarted site, behind its source); its update still counts, discounted. 0: not late."""
    by = {m.site: m for m in view.members}
    if site not in view.healers or by[site].joining:
        return 0
    return max(0, by[view.source_of(site)].committed - by[site].committed)


def all_late(view: RoundView, source: str) -> bool:
    """Quorum rounds: whether every site that heals from ``source`` this round is late (so it
    needs only the global part of the state, :func:`late_by`)."""
    healed = view.healed_by(source)
    return bool(healed) and all(late_by(view, h) > 0 for h in healed)


def nothing_to_do(members: list[Member]) -> bool:
    """Quorum rounds: whether a round of ``members`` would change nothing: every one has run its
    steps (none brings an update) and all hold one model (none heals). Sites that have run their
    steps ask again until a site still training, or one to heal, is among them."""
    return bool(members) and all(m.done and not m.joining for m in members) and len({(m.committed, m.hash) for m in members}) == 1


def tier_ring(view: RoundView, site: str, region_of: dict[str, str] | None, order: list[str]) -> list[str]:
    """The sites a round sums over, in exchange ``order`` (``topology.exchange.order``): in a region
    round of two tiers, ``site``'s region's admitted sites; else every admitted site."""
    mine = region_round(view, region_of)
    ring = [s for s in view.admitted if not mine or region_of[s] == region_of[site]]  # type: ignore[index]
    return sorted(ring, key=order.index)


def region_round(view: RoundView, region_of: dict[str, str] | None) -> bool:
    """Whether ``view`` is a region round of two tiers."""
    return region_of is not None and view.part == REGION


def too_few_to_mask(view: RoundView, region_of: dict[str, str] | None) -> str:
    """Secure aggregation: why the round cannot be masked ("" if it can). A sum over two sites
    shows each the other's update: a round needs three sites, and in a region round of two tiers
    every region's admitted sites are one (its update stays its own) or at least three."""
    if region_of is None or view.part != REGION:
        n = len(view.admitted)
        return f"secure aggregation needs 3 sites in a round; {n} met (each would see the other's update)" if n < 3 else ""
    counts = {r: sum(region_of[s] == r for s in view.admitted) for r in set(region_of.values())}
    two = sorted(r for r, n in counts.items() if n == 2)
    return (
        f"secure aggregation: region {two[0]} has 2 sites in this region round (each would see the other's update)" if two else ""
    )


def same_initial_model(site: str, mine: str, members: list[Member]) -> None:
    """A fresh site (no committed round, not restarted) must start from the model every other
    fresh member claims inside the round (``mine``: its global hash): same seed, model settings
    and code.

    Raises:
        MembershipRefused: naming the sites whose initial model differs.
    """
    differ = sorted(m.site for m in members if not m.committed and not m.joining and m.hash != mine)
    if differ:
        raise MembershipRefused(
            f"the initial model of site(s) {', '.join(differ)} differs from site {site}'s: every "
            "site needs the same train.seed, model settings and geotrain version"
        )


def next_boundary(claimed: list[int], step: int, H: int, total: int) -> int:
    """The step at which the next round ends, the same on every site: the first multiple of ``H``
    past the furthest step a site still training (below ``total``) had ``claimed`` in the last
    round's meeting (or this site's ``step``). A round postponed while the Lighthouse was down
    meets with sites at different steps; from the next one on they are back on the multiples of
    H, so they run the same rounds to the end."""
    return (furthest(claimed, step, total) // H + 1) * H


def furthest(claimed: list[int], step: int, total: int) -> int:
    """The furthest step a site still training (below ``total``) had ``claimed``, or this site's ``step`` if further."""
    return max(step, max([s for s in claimed if s < total], default=step))


class Schedule:
    """What the last round's meeting said about the sites' schedules: the steps the admitted sites
    had reached, the rounds each still owed and (adaptive pace) their rates; and this site's weight.

    With adaptive pace (``paced``) the sites run different steps in a round: a site's weight is
    always its tokens, a round's time budget comes from the fastest admitted site's claimed rate
    (:meth:`fastest_seconds`), and the run ends on rounds, not steps (every site's ``rest`` is the
    rounds it still owes)."""

    def __init__(self, workers: list[int], site_index: int) -> None:
        self.workers, self.site_index = workers, site_index
        self.paced = False
        self.round_steps: list[int] = []
        self.round_rests: list[int] = []
        self.round_paces: list[int] = []
        self.round_links: list[str] = []

    def heard(self, admitted: list[Member]) -> None:
        """What the admitted members of a round claimed about their schedules."""
        self.round_steps = [m.step for m in admitted]
        self.round_rests = [m.rest for m in admitted]
        self.round_paces = [m.pace for m in admitted]
        self.round_links = [m.link for m in admitted]

    def weight(self, steps: int) -> float:
        """This site's tokens in a round of ``steps`` steps where the sites differ in size or pace; else 1 (a plain mean)."""
        return float(self.workers[self.site_index] * steps) if self.paced or len(set(self.workers)) > 1 else 1.0

    def next_boundary(self, step: int, H: int, total: int) -> int:
        """The step at which the next round ends, the same on every site (:func:`next_boundary`)."""
        return next_boundary(self.round_steps, step, H, total)

    def furthest(self, step: int, total: int) -> int:
        """The furthest step a site still training had reached in the last round (:func:`furthest`)."""
        return furthest(self.round_steps, step, total)

    def all_finished(self, total: int) -> bool:
        """Whether every site in the last round had run its ``total`` steps (paced: its rounds) and owed no other round."""
        return (self.paced or all(s >= total for s in self.round_steps)) and not any(self.round_rests)

    def fastest_seconds(self) -> float:
        """The fastest admitted site's seconds per inner step, as claimed in the last round (0: none claimed)."""
        return min((p for p in self.round_paces if p > 0), default=0) / 1e6

    def link_claims(self) -> list[str]:
        """sync.adapt: what each admitted site of the last round claimed to have measured (in admission order)."""
        return list(self.round_links)


def group_key(view: RoundView, rounds_later: int = 0) -> tuple[str, ...]:
    """What a round group is for: each admitted site with its store address (a restarted site has
    a new one, so its group is new too), and the committed rounds the round starts from (the
    source's; ``rounds_later`` added: the key under which the next round may use it again). In
    quorum rounds a site that sat rounds out holds an older group of the same sites, which the
    others have replaced since."""
    stores = {m.site: m.store for m in view.members}
    start = next((m.committed for m in view.members if m.site == view.source), 0) + rounds_later
    return (*(f"{s}@{stores[s]}" for s in view.admitted), f"from {start}")
