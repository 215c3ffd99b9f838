"""When a round is due and which part of the model it syncs.

DiLoCo syncs the whole model every H inner steps; Streaming DiLoCo (Douillard et al. 2025,
arXiv:2501.18512) splits the parameters into F fragments (strided groups of layers) and syncs
fragment p when the step count is ≡ p·H/F (mod H). Both are one schedule: the cycle of H steps
cut into F *slots*, slot k (k ≥ 1, counted from the schedule's base step) ending with fragment
k mod F's sync. DiLoCo is the schedule with F = 1.

The schedule only says which fragment a slot ends with and how many lock-step steps it holds;
*when* a slot actually ends is the pace's business (:mod:`geotrain.round.pace`: the lock-step
count, a time budget under adaptive pace, the boundary the sites agreed on in elastic rounds,
the syncer's steps in quorum rounds). A change of H or F (``sync.adapt``) rebuilds the schedule
from the step it takes effect at.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from geotrain.config import SyncConfig

_LAYER = re.compile(r"(?:^|\.)(\d+)\.")


def fragment_count(cfg: SyncConfig, tensors: int) -> int:
    """How many fragments sync separately: the configured F for streaming (at most one per tensor), else 1."""
    return min(cfg.fragments, tensors) if cfg.algorithm == "streaming" else 1


def strided_fragments(names: Sequence[str], sizes: Sequence[int], fragments: int) -> list[list[int]]:
    """Parameter indices per fragment: layer i goes to fragment i mod F (strided, as in the paper);
    parameters outside numbered layers (embeddings, final norm, head) go to the smallest fragment."""
    out: list[list[int]] = [[] for _ in range(fragments)]
    load = [0] * fragments
    loose = []
    for i, name in enumerate(names):
        m = _LAYER.search(name)
        if m is None:
            loose.append(i)
            continue
        f = int(m.group(1)) % fragments
        out[f].append(i)
        load[f] += sizes[i]
    for i in sorted(loose, key=lambda i: -sizes[i]):
        f = min(range(fragments), key=lambda f: load[f])
        out[f].append(i)
        load[f] += sizes[i]
    return [sorted(f) for f in out]


class Schedule:
    """F fragments synced in turn over a cycle of H steps (see the module docstring).

    Args:
        names, sizes: the trainable parameters' names and sizes, in order.
        H: steps per cycle; ``F``: fragments.
    """

    def __init__(self, names: Sequence[str], sizes: Sequence[int], H: int, F: int) -> None:
        self.names, self.sizes = list(names), list(sizes)
        self.param_sync = [0] * len(self.sizes)  # each parameter's last sync step (a rebuild keeps it)
        self.build(H, F, 0)

    def build(self, H: int, F: int, base: int) -> None:
        """H and F from step ``base`` on: the fragments, their offsets in the cycle, each one's last sync."""
        self.H, self.F, self.base = H, F, base
        self.fragments = strided_fragments(self.names, self.sizes, F)
        self.offsets = [(f * H) // F for f in range(F)]
        self.slot = 0  # slots ended since ``base``
        self.last_sync = [min(self.param_sync[i] for i in frag) if frag else base for frag in self.fragments]

    def resume_after(self, H: int, f: int, t: int) -> None:
        """A new H from step ``t``, where fragment ``f``'s slot has just ended: the new cycle is laid
        so that the next slot is the next fragment's (every fragment keeps its turn)."""
        self.build(H, self.F, 0)
        self.slot = f if f else self.F
        self.base = t - self.end(self.slot) + self.base

    def fragment(self, k: int) -> int:
        """The fragment slot ``k`` ends with."""
        return k % self.F

    def length(self, k: int) -> int:
        """Slot ``k``'s lock-step steps (k ≥ 1): from the sync before it to fragment k mod F's (0
        when two fragments sync at the same step, H < F)."""
        f = k % self.F
        end = self.offsets[f] if f else self.H
        return end - self.offsets[f - 1 if f else -1] if self.F > 1 else self.H

    @property
    def next_fragment(self) -> int:
        return self.fragment(self.slot + 1)

    def longest(self) -> int:
        return max(self.length(k) for k in range(1, self.F + 1))

    def end(self, k: int) -> int:
        """The step slot ``k`` ends at on the lock-step grid."""
        return self.base + (k // self.F) * self.H + self.offsets[k % self.F]

    def slot_after(self, step: int) -> int:
        """The first slot (counted from ``base``) that ends on the lock-step grid strictly after ``step``."""
        k = max(1, self.F * ((step - self.base) // self.H))
        while self.end(k) <= step:
            k += 1
        return k

    def synced(self, f: int, t: int) -> None:
        """Fragment ``f`` synced at step ``t``."""
        self.last_sync[f] = t
        for i in self.fragments[f]:
            self.param_sync[i] = t

    def unsynced(self, t: int) -> list[int]:
        """The fragments that trained since their last sync, in order (the same on every site)."""
        return [f for f in range(self.F) if self.last_sync[f] < t]

    def state_dict(self) -> dict[str, Any]:
        return {"H": self.H, "F": self.F, "base": self.base, "slot": self.slot, "last_sync": list(self.last_sync)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.build(int(state["H"]), int(state["F"]), int(state["base"]))
        self.slot, self.last_sync = int(state["slot"]), [int(v) for v in state["last_sync"]]
        for f, frag in enumerate(self.fragments):
            for i in frag:
                self.param_sync[i] = self.last_sync[f]
