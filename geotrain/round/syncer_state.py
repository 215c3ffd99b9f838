"""What a checkpoint keeps of the quorum syncer (:class:`geotrain.round.syncer.QuorumSyncer`),
taken at a checkpoint's barrier round, and how a resumed syncer takes it back."""

from __future__ import annotations

import threading
from typing import Any

import torch

from geotrain.round.outer import DelayedNesterov
from geotrain.round.star import StarAdapter


class SyncerState:
    """The syncer's checkpoint (a mixin of :class:`~geotrain.round.syncer.QuorumSyncer`)."""

    theta: list[torch.Tensor]
    outer: DelayedNesterov
    versions: list[int]
    world_steps: int
    H: list[int]
    rates: list[float]
    site_steps: list[int]
    log: list[dict[str, Any]]
    adapter: StarAdapter | None
    codec_name: str
    held: dict[int, torch.Tensor]
    _thread: threading.Thread

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps, taken at a barrier (nothing in flight; every live site holds
        the model exactly): the global model, the outer optimizer with its delayed momentum, the
        version and the merge log, the sites' step counts and measured rates."""
        return {
            "theta": [t.clone() for t in self.theta],
            "optimizer": self.outer.optimizer.state_dict(),
            "pending": [p.clone() for p in self.outer.pending],
            "pending_updates": self.outer.pending_updates,
            "version": self.versions[0],
            "world_steps": self.world_steps,
            "H": list(self.H),
            "rates": list(self.rates),
            "site_steps": list(self.site_steps),
            "log": [dict(e) for e in self.log],
            "adapt": None if self.adapter is None else self.adapter.state_dict(),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (before :meth:`start`)."""
        assert not self._thread.is_alive()
        for t, v in zip(self.theta, state["theta"], strict=True):
            t.copy_(v)
        self.outer.optimizer.load_state_dict(state["optimizer"])
        for p, v in zip(self.outer.pending, state["pending"], strict=True):
            p.copy_(v)
        self.outer.pending_updates = state["pending_updates"]
        self.versions[0], self.world_steps = state["version"], state["world_steps"]
        self.H, self.rates, self.site_steps = list(state["H"]), list(state["rates"]), list(state["site_steps"])
        self.log = list(state["log"])
        if self.adapter is not None and state.get("adapt") is not None:
            self.adapter.load_state_dict(state["adapt"])
            self.codec_name = self.adapter.codec
        flat = torch.cat([t.reshape(-1) for t in self.theta])
        self.held = {s: flat.clone() for s in self.held}  # the barrier's answer was exact
