"""The vocabulary of a round, shared by its parts: what one sync of a fragment gave back, and a
sync still in flight."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

REGION, WORLD = "region", "world"  # a part's tier: a region round of two tiers, or a round of every site


@dataclass
class Outcome:
    """What one fragment's sync gave: the average (to step with at its merge), or steps already
    taken where it was summed (two tiers), or a failure."""

    ok: bool
    reason: str = ""
    average: torch.Tensor | None = None
    stepped: bool = False  # the part's steps were taken where it was summed (two tiers)
    tier: str = WORLD  # the model the local fragment moves to
    contributors: int = 0
    world: tuple[int, int | list[int], int, float] | None = None  # two tiers: a world round's (id, steps, bytes, seconds)
    carry: list[int] | None = None  # two tiers: a failed world round's steps, carried into the next
    answer: Any = None  # a hub's answer (its new global values), taken in at the merge


@dataclass
class InFlight:
    """A fragment's sync whose merge is still to come."""

    merge_at: int
    future: Future[Outcome]
    delta: torch.Tensor  # what was sent (its size: the bytes in flight)


def done(outcome: Outcome) -> Future[Outcome]:
    """A future that already holds ``outcome`` (an exchange that blocked, or one restored from a checkpoint)."""
    fut: Future[Outcome] = Future()
    fut.set_result(outcome)
    return fut
