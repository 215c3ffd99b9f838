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
    outers: list[DelayedNesterov]
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
        the model exactly): the global model, each fragment's outer optimizer with its delayed
        momentum and version, the merge log, the sites' step counts and measured rates."""
        return {
            "theta": [t.clone() for t in self.theta],
            "optimizers": [o.optimizer.state_dict() for o in self.outers],  # (Streaming DiLoCo: one per fragment)
            "pendings": [o.state_dict() for o in self.outers],
            "versions": list(self.versions),
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
        for o, saved, pending in zip(self.outers, state["optimizers"], state["pendings"], strict=True):
            o.optimizer.load_state_dict(saved)
            o.load_state_dict(pending)
        self.versions, self.world_steps = list(state["versions"]), state["world_steps"]
        self.H, self.rates, self.site_steps = list(state["H"]), list(state["rates"]), list(state["site_steps"])
        self.log = list(state["log"])
        if self.adapter is not None and state.get("adapt") is not None:
            self.adapter.load_state_dict(state["adapt"])
            self.codec_name = self.adapter.codec
        flat = torch.cat([t.reshape(-1) for t in self.theta])
        self.held = {s: flat.clone() for s in self.held}  # the barrier's answer was exact
