"""Network adaptation in asynchronous quorum rounds (``sync.adapt`` with ``sync.quorum``): the
syncer chooses every site's next H and codec from the links the sites measured.

In quorum rounds a site exchanges with the syncer only: it sends its update and gets the model
back, over its own link (a star, not a ring). Each site's leader measures, for each of its rounds:

- a **ping**: one empty message to the syncer and its answer, just before the update;
- the **bytes** its update and the syncer's answer carried;
- the **seconds** from sending the update to receiving the answer, less the time the update
  waited at the syncer for its quorum (the answer says how long: :attr:`Answer.held_s`).

It sends them with its next update. At each merge the syncer chooses from the reports that came
in since its last choice, with the planner's formula for a star (:data:`geotrain.plan.strategies.STAR`:
both ways' bytes on the site's own link and one round trip per round): for the slowest link
reported (the least bandwidth, the longest round trip) and the fastest site's step time as T (the
site whose compute hides its exchange least), the least compression among ``sync.adapt.codecs``
that reaches ``sync.adapt.target`` with H <= ``H_max``, then the smallest such H. Every site gets the
choice with its next answer: its next round's H, and the codec its next update is encoded with and
the syncer's answers to it are. Site 0 talks to the syncer in memory: it measures nothing, and its
link is no constraint. The choice follows the links a few rounds late (a report describes the
site's last round, and reaches the syncer with its next update); every choice is logged with the
reports behind it (the summary's ``adapt`` list).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from geotrain.config import CODEC_BITS, AdaptConfig
from geotrain.plan.strategies import STAR, achieved_bps, choose_round


@dataclass(frozen=True)
class LinkReport:
    """What a site measured in its last round: its exchange's bytes both ways and seconds (the wait
    at the syncer taken out), a ping, and its steps and compute seconds."""

    bytes: float
    seconds: float
    ping_s: float
    steps: int
    compute_s: float


class StarAdapter:
    """The syncer's choice of H and codec from the sites' link reports (see the module docstring).

    Args:
        cfg: the ``sync.adapt`` section; ``params``: values in one update (the formula's P).
        H, codec: the first rounds' settings.
    """

    def __init__(self, cfg: AdaptConfig, params: int, H: int, codec: str) -> None:
        self.cfg, self.params, self.H, self.codec = cfg, params, H, codec
        self.reports: dict[int, LinkReport] = {}  # per site, the latest since the last choice
        self.log: list[dict[str, Any]] = []

    def report(self, site: int, report: LinkReport) -> None:
        """A site's measurements, with its update (none from site 0, or from a round that measured nothing)."""
        if report.seconds > 0 and report.bytes > 0 and report.steps > 0 and report.compute_s > 0:
            self.reports[site] = report

    def choose(self, version: int) -> bool:
        """After the merge that made ``version``: the next settings from the reports since the last
        choice (none: nothing changes); True when H or the codec changed."""
        if not self.reports:
            return False
        sites = sorted(self.reports)
        reps = [self.reports[s] for s in sites]
        self.reports = {}
        links = [achieved_bps(r.bytes, r.seconds, STAR, r.ping_s) for r in reps]
        bps, rtt = min(links), max(r.ping_s for r in reps)
        T = min(r.compute_s / r.steps for r in reps)
        bits: dict[str, float] = {str(c): float(CODEC_BITS[c]) for c in self.cfg.codecs}
        choice = choose_round(bps, self.params, T, STAR, rtt, self.cfg.H_min, self.cfg.H_max, bits, self.cfg.target)
        changed = (choice["H"], choice["codec"]) != (self.H, self.codec)
        self.log.append(
            {
                "version": version,
                "H": self.H,
                "codec": self.codec,
                "sites": sites,
                "bytes": [r.bytes for r in reps],
                "seconds": [r.seconds for r in reps],
                "ping_s": [r.ping_s for r in reps],
                "link_bps": links,
                "rtt_s": rtt,
                "step_s": T,
                "params": self.params,
                "next": choice,
                "changed": changed,
                "why": f"slowest link {bps / 1e6:.2f} Mbit/s, rtt {rtt * 1e3:.0f} ms, fastest {T * 1e3:.0f} ms/step: "
                + (
                    f"{choice['codec']} is the least compression that reaches {self.cfg.target:.0%} within H<={self.cfg.H_max}; "
                    f"the smallest H that does is {choice['H']} ({choice['predicted_utilization']:.1%})"
                    if choice["meets_target"]
                    else f"no codec reaches {self.cfg.target:.0%}; the most is {choice['codec']} at H={choice['H']} "
                    f"({choice['predicted_utilization']:.1%})"
                ),
            }
        )
        self.H, self.codec = int(choice["H"]), str(choice["codec"])
        return changed

    def state_dict(self) -> dict[str, Any]:
        return {"H": self.H, "codec": self.codec, "log": [dict(e) for e in self.log]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.H, self.codec, self.log = int(state["H"]), str(state["codec"]), list(state["log"])
