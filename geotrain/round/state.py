"""What a checkpoint (and a heal, which loads the same state) holds of a site's rounds: the
schedule, the global models and their optimizers, the codecs' error feedback, syncs in flight
(waited for: their averages and merge steps), the pace clock, adaptation, the guard, the hub's
counters. A state of an earlier geotrain (before the round engine) is refused in one line.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch

from geotrain.errors import RoundFailed
from geotrain.round.core import EngineCore
from geotrain.round.parts import REGION, WORLD, InFlight, Outcome, done

FORMAT = 2  # the sync state's layout (1: the classes before the round engine)


class EngineState(EngineCore):
    """Checkpoint state, as a part of :class:`~geotrain.round.engine.RoundEngine`."""

    def checkpoint_state(self) -> dict[str, Any]:
        """Everything to continue exactly; exchanges in flight are waited for first (their
        averaged Δ and merge step are kept)."""
        if self.eager:
            raise ValueError("checkpoints of the eager streaming variant are not supported")
        for f in [f for f, x in self.inflight.items() if x.future.done() and x.future.result().answer is not None]:
            self._settle(f)  # (an elastic round running beside compute: taken in now, in the run that checkpoints)
        pending = {}
        for f, x in self.inflight.items():
            try:
                out = self._wait(x.future)
            except RoundFailed as exc:
                out = Outcome(False, str(exc))
            frag = self.schedule.fragments[f]
            avg = None if out.average is None else self.shards_out(out.average, frag) if self.sharded else out.average.clone()
            pending[f] = {"at": x.merge_at, "ok": out.ok, "reason": out.reason, "average": avg, "stepped": out.stepped,
                          "tier": out.tier, "contributors": out.contributors}  # fmt: skip
        reducers = {f"{k[3]}/{k[2]}": self.reducer_out(r, self.schedule.fragments[k[2]]) for k, r in self._reducers.items()
                    if k[0] == (self.codec if k[3] == WORLD or not self.tiers else self.cfg.codec) and k[1] == self.F}  # fmt: skip
        return {
            **super().checkpoint_state(),
            "format": FORMAT,
            "globals": self.globals.state_dict(
                lambda ts: self.shards_out(ts) if self.sharded else [t.clone() for t in ts], self.optim_out
            ),  # fmt: skip
            "schedule": self.schedule.state_dict(),
            "reducers": reducers,
            "pending": pending,
            "since": [list(s) for s in self._since],
            "since_world": [list(s) for s in self._since_world],
            "region_syncs": list(self.region_syncs),
            "region_rounds": self.region_rounds,
            "every": self.every,
            "codec": self.codec,
            "in_slot": self.in_slot,
            "slots": self.slots,
            "clock": self.clock.state_dict(),
            "adapt": None if self.adapter is None else self.adapter.state_dict(),
            "guard": None if self.guard is None else self.guard.state_dict(),
            "region": self.region_name,
            "hub": None if self.hub is None else self.hub.state_dict(),
            # Streaming's adaptation: a choice measured but not yet applied (at its step, as in the uninterrupted run)
            "decision": None if self._decision is None else (self._decision[0], self._wait(self._decision[1])),
        }

    @torch.no_grad()
    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        if state.get("format") != FORMAT:
            raise ValueError("this checkpoint's sync state is of an earlier geotrain (before the round engine); start afresh")
        super().load_checkpoint_state(state)
        sched = state["schedule"]
        if (sched["H"], sched["F"]) != (self.H, self.F):
            self._rebuild(int(sched["H"]), int(sched["F"]), int(sched["base"]))
        self.schedule.load_state_dict(sched)
        self.globals.load_state_dict(state["globals"], self.shards_in, self.optim_in)
        self.codec, self.every = state["codec"], int(state["every"])
        for key, saved in state["reducers"].items():
            tier, f = key.split("/")
            self.reducer(int(f), tier).load_state_dict(self.reducer_in(saved))
        self.inflight = {}
        for f, p in state["pending"].items():
            avg = None if p["average"] is None else self.shards_in(p["average"], flat=True)
            out = Outcome(p["ok"], p["reason"], avg, p["stepped"], p["tier"], p["contributors"])
            self.inflight[int(f)] = InFlight(int(p["at"]), done(out), avg if avg is not None else torch.zeros(0))
        self._since = [list(s) for s in state["since"]]
        self._since_world = [list(s) for s in state["since_world"]]
        self.region_syncs = list(state["region_syncs"])
        self.region_rounds = int(state["region_rounds"])
        self.in_slot, self.slots = int(state["in_slot"]), int(state["slots"])
        self.clock.load_state_dict(state["clock"])
        if self.adapter is not None and state.get("adapt") is not None:
            self.adapter.load_state_dict(state["adapt"])
        if self.guard is not None and state["guard"] is not None:
            self.guard.load_state_dict(state["guard"])
        if state.get("decision") is not None:
            at, changed = state["decision"]
            fut: Future[bool] = Future()
            fut.set_result(bool(changed))
            self._decision = (int(at), fut)
        if self.hub is not None and state.get("hub") is not None:
            self.hub.load_state_dict(state["hub"])
        if self.tiers and state.get("region", self.region_name) != self.region_name:
            # a heal from a site of another region (none of this region was alive): the region
            # restarts from the world model, with fresh momentum and no error feedback
            self.globals.region = [g.clone() for g in self.globals.world]
            self.globals.steps = {}
            self.globals.build(self.schedule.fragments)
            for key, r in self._reducers.items():
                if key[3] == REGION:
                    r.forget_residual()

    def forget_feedback(self) -> None:
        """Drop every codec's error-feedback residual (a healed site's state is its source's)."""
        for r in self._reducers.values():
            r.forget_residual()
