"""Failure injection: what a test or a soak makes go wrong in a run, in one place.

One :class:`FaultPlan` per rank is built from the config (``fault.nan``, ``fault.tamper``,
``privacy.inject``; ``fault.kill`` and ``fault.hang`` are carried out by the launcher, which
signals the site's processes) and handed to the parts that have a seam where a fault can enter:
the cross-site average of a pseudo-gradient (a NaN update), an elastic round's outgoing frames
(altered after they were sealed, as by an attacker on the path), and a secure-aggregation round
(a site that drops out at a given step of the protocol). The algorithms hold no schedule of
their own: they ask the plan at their seam, and a plan with nothing in it answers no.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class FaultPlan:
    """The faults to inject into one site (its name ``site``).

    Args:
        nan: rounds whose pseudo-gradient from this site is replaced by NaN (``fault.nan``).
        tamper: inner steps at which this site's outgoing frames of an elastic round are altered
            after sealing (``fault.tamper``).
        secagg: round -> how this site fails in that secure-aggregation round (``privacy.inject``).
    """

    site: str = ""
    nan: frozenset[int] = field(default_factory=frozenset)
    tamper: frozenset[int] = field(default_factory=frozenset)
    secagg: dict[int, str] = field(default_factory=dict)

    @classmethod
    def for_site(
        cls,
        site: str,
        nan: Iterable[tuple[str, int]] = (),
        tamper: Iterable[tuple[str, int]] = (),
        secagg: dict[tuple[str, int], str] | None = None,
    ) -> FaultPlan:
        """This site's part of a run's plan, given as (site, round or step) pairs for every site."""
        mine = {r: k for (s, r), k in (secagg or {}).items() if s == site}
        return cls(site, frozenset(r for s, r in nan if s == site), frozenset(t for s, t in tamper if s == site), mine)

    def corrupt_update(self, delta: torch.Tensor, round_id: int) -> None:
        """The pseudo-gradient this site sends in round ``round_id``: NaN if the plan says so."""
        if round_id in self.nan:
            delta.fill_(float("nan"))

    def tampers(self, step: int) -> bool:
        """Whether this site's frames of the round at inner step ``step`` are altered after sealing."""
        return step in self.tamper

    def secagg_fault(self, round_id: int) -> str | None:
        """How this site fails in secure-aggregation round ``round_id`` (None: it does not)."""
        return self.secagg.get(round_id)
