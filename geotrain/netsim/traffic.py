"""Traffic of a training step as synchronized phases of flows.

A :class:`Phase` is a set of flows that start together and must all finish before the step goes
on (the slowest flow decides); ``repeat`` says how many times the same phase runs back to back
(a ring all-reduce is ``2(n-1)`` identical ring steps; under ECMP the same 5-tuples hash to the
same paths every step, so one simulated step times ``repeat`` is the phase's cost).

Patterns (``S`` = the message bytes of one host, ``n`` = hosts, ``g`` = group size):

- ``permutation``: every host sends ``S`` to one other host, a random derangement (the
  pipeline-parallel point-to-point phase; founding paper section 5: "a synchronized permutation
  across all training nodes");
- ``ring``: ring all-reduce over all hosts in host order: ``2(n-1)`` steps of ``S/n`` to the next
  host (Patarasuk and Yuan 2009);
- ``hierarchical``: reduce-scatter inside groups of ``g`` consecutive hosts (``g-1`` ring steps of
  ``S/g``), ring all-reduce across groups between hosts of equal local index (``2(G-1)`` steps of
  ``S/(g*G)``), all-gather inside the group (``g-1`` steps of ``S/g``); the in-group phases may be
  declared to run on the scale-up domain (NVLink) and are then left out of the fabric;
- ``all_to_all``: inside groups of ``g`` hosts every host sends ``S/g`` to each other member (MoE
  dispatch; ``g = n`` for a global all-to-all).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PATTERNS = ("permutation", "ring", "hierarchical", "all_to_all")


@dataclass
class Phase:
    name: str
    src: np.ndarray
    dst: np.ndarray
    size: np.ndarray
    repeat: int = 1

    @property
    def num_flows(self) -> int:
        return int(self.src.size)


def derangement(n: int, rng: np.random.Generator) -> np.ndarray:
    """A uniformly random permutation of ``range(n)`` with no fixed point (rejection sampling)."""
    if n < 2:
        raise ValueError("a permutation with no fixed point needs at least 2 hosts")
    while True:
        p = rng.permutation(n)
        if not np.any(p == np.arange(n)):
            return p


def permutation(n: int, message_bytes: float, rng: np.random.Generator) -> list[Phase]:
    src = np.arange(n, dtype=np.int64)
    return [Phase("permutation", src, derangement(n, rng).astype(np.int64), np.full(n, float(message_bytes)))]


def _ring_step(members: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One step of rings: ``members`` is (rings, ring length); each member sends to the next."""
    return members.ravel(), np.roll(members, -1, axis=1).ravel()


def ring(n: int, message_bytes: float) -> list[Phase]:
    src, dst = _ring_step(np.arange(n, dtype=np.int64)[None, :])
    return [Phase("ring step", src, dst, np.full(n, message_bytes / n), repeat=2 * (n - 1))]


def hierarchical(n: int, message_bytes: float, group: int, in_group_on_fabric: bool) -> list[Phase]:
    if group < 1 or n % group:
        raise ValueError(f"group_size must divide the number of hosts ({n}), got {group}")
    groups = n // group
    grid = np.arange(n, dtype=np.int64).reshape(groups, group)
    phases = []
    if group > 1 and in_group_on_fabric:
        s, d = _ring_step(grid)
        phases.append(Phase("reduce-scatter in group", s, d, np.full(n, message_bytes / group), repeat=group - 1))
    if groups > 1:
        s, d = _ring_step(grid.T.copy())
        shard = message_bytes / (group * groups)
        phases.append(Phase("all-reduce across groups", s, d, np.full(n, shard), repeat=2 * (groups - 1)))
    if group > 1 and in_group_on_fabric:
        s, d = _ring_step(grid)
        phases.append(Phase("all-gather in group", s, d, np.full(n, message_bytes / group), repeat=group - 1))
    return phases


def all_to_all(n: int, message_bytes: float, group: int) -> list[Phase]:
    if group < 2 or n % group:
        raise ValueError(f"group_size must be >= 2 and divide the number of hosts ({n}), got {group}")
    base = (np.arange(n, dtype=np.int64) // group) * group
    local = np.arange(n, dtype=np.int64) % group
    offs = np.arange(1, group, dtype=np.int64)
    src = np.repeat(np.arange(n, dtype=np.int64), group - 1)
    dst = (np.repeat(base, group - 1) + (np.repeat(local, group - 1) + np.tile(offs, n)) % group).astype(np.int64)
    return [Phase("all-to-all", src, dst, np.full(src.size, message_bytes / group))]


def build_phases(
    pattern: str,
    n: int,
    message_bytes: float,
    rng: np.random.Generator,
    group: int | None = None,
    in_group_on_fabric: bool = True,
) -> list[Phase]:
    """The phases of one collective or point-to-point exchange (see module docstring)."""
    if pattern == "permutation":
        return permutation(n, message_bytes, rng)
    if pattern == "ring":
        return ring(n, message_bytes)
    if pattern == "hierarchical":
        return hierarchical(n, message_bytes, group or 1, in_group_on_fabric)
    if pattern == "all_to_all":
        return all_to_all(n, message_bytes, group or n)
    raise ValueError(f"pattern must be one of {', '.join(PATTERNS)} (got {pattern!r})")
