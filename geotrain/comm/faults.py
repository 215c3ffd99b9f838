"""Failure injection: what a test or a soak makes go wrong in a run, in one place.

One :class:`FaultPlan` per rank is built from the config (``fault.nan``, ``fault.tamper``,
``fault.split``, ``privacy.inject``; ``fault.kill`` and ``fault.hang`` are carried out by the
launcher, which signals the site's processes) and handed to the parts that have a seam where a
fault can enter: the cross-site average of a pseudo-gradient (a NaN update), an elastic round's
outgoing frames (altered after they were sealed, as by an attacker on the path), its vote (a
site that misses the others' votes), and a secure-aggregation round (a site that drops out at a
given step of the protocol). The algorithms hold no schedule of
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
        split: inner steps at which this site, in an elastic round, misses the others' votes after
            voting yes (``fault.split``).
    """

    site: str = ""
    nan: frozenset[int] = field(default_factory=frozenset)
    tamper: frozenset[int] = field(default_factory=frozenset)
    secagg: dict[int, str] = field(default_factory=dict)
    split: frozenset[int] = field(default_factory=frozenset)
    _split_done: set[int] = field(default_factory=set, compare=False)  # (each fault.split fires in one round only)

    @classmethod
    def for_site(
        cls,
        site: str,
        nan: Iterable[tuple[str, int]] = (),
        tamper: Iterable[tuple[str, int]] = (),
        secagg: dict[tuple[str, int], str] | None = None,
        split: Iterable[tuple[str, int]] = (),
    ) -> FaultPlan:
        """This site's part of a run's plan, given as (site, round or step) pairs for every site."""
        mine = {r: k for (s, r), k in (secagg or {}).items() if s == site}

        def own(pairs: Iterable[tuple[str, int]]) -> frozenset[int]:
            return frozenset(r for s, r in pairs if s == site)

        return cls(site, own(nan), own(tamper), mine, own(split))

    def corrupt_update(self, delta: torch.Tensor, round_id: int) -> None:
        """The pseudo-gradient this site sends in round ``round_id``: NaN if the plan says so."""
        if round_id in self.nan:
            delta.fill_(float("nan"))

    def tampers(self, step: int) -> bool:
        """Whether this site's frames of the round at inner step ``step`` are altered after sealing."""
        return step in self.tamper

    def splits(self, step: int) -> bool:
        """Whether this site misses the others' votes in the elastic round at inner step ``step``
        (the first round at that step: a site that has run its steps stays in rounds at its last)."""
        if step not in self.split or step in self._split_done:
            return False
        self._split_done.add(step)
        return True

    def secagg_fault(self, round_id: int) -> str | None:
        """How this site fails in secure-aggregation round ``round_id`` (None: it does not)."""
        return self.secagg.get(round_id)
