"""How many inner steps each site runs per outer round, from step rates measured in the run.

Sites with slower hardware take longer per inner step. In lock-step DiLoCo every site runs H
steps, so at each round boundary a fast site waits, idle, for the slowest. With
``sync.pace=adaptive`` (Async Local-SGD's "dynamic local updates", Liu et al. 2024,
arXiv:2401.09135, §4) each round gets a **time budget**: the time the fastest site needs for H
steps at its measured rate. Every site steps until its next step would overrun the budget by
more than half a step of the fastest site (ending when less than its own step less half the
fastest's is left: a slow site ends early rather than late, since the round ends when the last
site does and the fastest sites, the least busy, would wait for it), so site s runs about

    H_s = H · rate_s / rate_max

inner steps, but decided step by step against the clock rather than fixed at the round's
start: on a shared machine one round's rate swings by a third with the load of its
neighbours, and a fixed count would let the unluckiest site hold up everyone. A site never runs
more than 1.5 H (``OVERRUN``): the fastest site, stepping faster than its smoothed rate, would
otherwise stop at H and wait out the rest of the budget. Rates are steps per second of compute (forward and backward; waits on the
network excluded), averaged exponentially over rounds (``SMOOTHING`` on the newest).

Agreement: the ranks of one site vote on ending the round after each step (a one-float sum in
the site), so they end it together. At the boundary one small control exchange across sites, in
one hop (:meth:`Collectives.gather_sites`), gives every rank every site's steps, compute and
elapsed time: the steps weight the round's
average by tokens (workers × steps; :meth:`OuterSync.site_weights`), the rates set the next
budget, and the elapsed time ends the run for ``train.max_seconds`` on every site at once.

In elastic mode (``elastic.enabled``) each site is a torch.distributed world of its own and the
rounds meet in the elastic membership: each site claims its smoothed seconds per step in the
round's meeting, next to its step, and every admitted site takes the same budget from the
fastest claim (:attr:`RoundClock.claimed_fastest`); each site's tokens weigh its update
(:meth:`geotrain.elastic.view.Schedule.weight`). The run ends on rounds (the calibration round
and ``ceil(steps / H)`` more): a site claims the rounds it still owes, a site that healed takes
its source's round count, and a site done with its rounds stays in the others' rounds without an
update until no admitted site owes one (:meth:`geotrain.round.engine.DiLoCo.finish`).

Nothing is measured before the first round, so the run opens with a short lock-step
calibration round of ``max(1, H // 20)`` steps (``CALIBRATION``: the fast sites wait for the
slowest in it). The rates come from the run, never from
``topology.sites[].compute_speed`` (which only emulates slower hardware by pacing;
:func:`geotrain.run.loop.train_loop`).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from geotrain.comm.collectives import Collectives

SMOOTHING = 0.5  # weight of the newest round in the moving average of seconds per step
CALIBRATION = 20  # the calibration round runs max(1, H // CALIBRATION) lock-step steps
OVERRUN = 1.5  # a site runs at most ceil(OVERRUN x H) steps in a budgeted round (the budget ends it first, as a rule)


def round_limit(H: int) -> int:
    """The most steps any site runs in a budgeted round."""
    return math.ceil(OVERRUN * H)


def expected_steps(H: int, seconds_per_step: list[float]) -> list[int]:
    """The steps each site is expected to fit in a round budgeted for H steps of the fastest."""
    fastest = min(seconds_per_step)
    return [min(H, max(1, round(H * fastest / t))) for t in seconds_per_step]


class RoundClock:
    """Measures this site's compute, ends its rounds on the step count or the time budget, and
    exchanges steps, compute and elapsed time with the other sites at each boundary.

    Args:
        comm: the collectives (control exchange in the site and across sites).
        H: inner steps per round (adaptive: the most any site runs).
        adaptive: end each site's round on the time budget (else every site runs H).
    """

    def __init__(self, comm: Collectives, H: int, adaptive: bool) -> None:
        self.comm = comm
        self.H = H
        self.adaptive = adaptive
        self.max_rounds = 0  # stop after this many rounds (0: no limit; set with end_after)
        self.max_steps = 0  # stop once a site has run this many steps in all (0: no limit; set with end_after)
        self.rounds_done = 0  # the rounds counted at the last boundary
        self.max_seconds = 0.0  # stop at the first boundary after this much training (0: no limit)
        n = comm.groups.topology.num_sites
        self.first = max(1, H // CALIBRATION) if adaptive else H  # the calibration round
        self.limit = self.first  # the most steps this round
        self.budget_s = 0.0  # adaptive: this round's time budget (0: the step limit only)
        self.steps_run = [self.first] * n  # every site's steps in the round being averaged
        self.history: list[list[int]] = []  # every site's steps in every round that ended
        self.totals = [0] * n  # every site's steps in all those rounds (kept as it goes, not summed again)
        self.seconds_per_step = [0.0] * n  # smoothed, per site
        # elastic mode: the fastest admitted site's seconds per step as claimed in the last round
        # (each site is its own world there, so the control exchange sees this site alone)
        self.claimed_fastest = 0.0
        self.log: list[dict[str, Any]] = []  # per boundary: what was measured, what the next round gets, why
        self.done = False
        self._compute = 0.0
        self._t0: float | None = None  # the first step's start
        self._round_t0: float | None = None  # this round's first step's start
        self._ending = False
        self._elapsed = 0.0
        # the site's vote on ending the round: lane 0's site group, or (Streaming DiLoCo, whose exchange
        # thread uses lane 0 meanwhile) the main site group of the training thread
        self.sum_in_site = comm.sum_in_site

    @property
    def exchanges(self) -> bool:
        """Whether round boundaries need the control exchange (else the clock only counts)."""
        return self.adaptive or self.max_seconds > 0

    def end_after(self, max_rounds: int = 0, max_steps: int = 0) -> None:
        """The run's length: this many rounds, or until one site has run this many steps (0: no
        limit). Set as training starts, which may be after rounds have ended already: an elastic
        site that healed in the run's last round holds the others' count and is done with them."""
        self.max_rounds, self.max_steps = max_rounds, max_steps
        self.done = self.done or self._past_limits()

    def _past_limits(self) -> bool:
        return bool(self.max_rounds and self.rounds_done >= self.max_rounds) or bool(
            self.max_steps and max(self.totals) >= self.max_steps
        )

    def fastest(self) -> float:
        """The fastest site's smoothed seconds per step (elastic mode: as the sites claimed it)."""
        return self.claimed_fastest or min(self.seconds_per_step)

    def add_compute(self, seconds: float) -> None:
        """Account one inner step's compute on this rank (called by the loop after backward)."""
        now = time.perf_counter()
        if self._t0 is None:
            self._t0 = now - seconds
        if self._round_t0 is None:
            self._round_t0 = now - seconds
        self._compute += seconds

    def vote(self, steps_in_round: int) -> None:
        """Before step ``steps_in_round + 1``'s update: decide, with the site's other ranks, whether
        the round ends after it (see :meth:`ends`)."""
        if not self.budget_s:
            return
        me = self.comm.groups.me.site_index
        left = self.budget_s - (time.perf_counter() - (self._round_t0 or time.perf_counter()))
        # end when the next step would overrun by more than half a step of the fastest site
        last = left < self.seconds_per_step[me] - 0.5 * self.fastest()
        want = torch.tensor([1.0 if last else 0.0], dtype=torch.float64)
        if len(self.comm.groups.intra_ranks) > 1:  # the site ends together when any of its ranks is out of time
            self.sum_in_site(want)
        self._ending = bool(want.item() > 0)

    def ends(self, steps_in_round: int) -> bool:
        """Whether the round ends after ``steps_in_round`` steps (the same on every rank of the site)."""
        return steps_in_round >= self.limit or (self._ending and steps_in_round >= 1)

    def exchange(self, steps: int) -> list[int]:
        """At the boundary, before the average: every site's steps this round (control exchange of
        steps, compute and elapsed time when needed). Every rank of every site calls it."""
        n = self.comm.groups.topology.num_sites
        if not self.exchanges:
            self.steps_run = [steps] * n
            return self.steps_run
        g = self.comm.groups
        elapsed = 0.0 if self._t0 is None else time.perf_counter() - self._t0
        mine = torch.tensor([self._compute, elapsed], dtype=torch.float64)
        if len(g.intra_ranks) > 1:  # one value per site: the mean over its ranks
            self.comm.sum_in_site(mine)
            mine.div_(len(g.intra_ranks))
        rows = self.comm.gather_sites(torch.tensor([float(steps), float(mine[0]), float(mine[1])], dtype=torch.float64))
        slots = rows.reshape(-1)
        self.steps_run = [int(v) for v in slots[0::3].tolist()]
        measured = [c / max(1, k) for k, c in zip(self.steps_run, slots[1::3].tolist(), strict=True)]
        self.seconds_per_step = [
            m if o <= 0 else SMOOTHING * m + (1 - SMOOTHING) * o for m, o in zip(measured, self.seconds_per_step, strict=True)
        ]
        self._elapsed = max(slots[2::3].tolist())
        return self.steps_run

    def next_round(self, rounds_done: int) -> None:
        """After the boundary: the next round's budget and whether the run is done (no communication)."""
        self.history.append(list(self.steps_run))
        self.totals = [a + b for a, b in zip(self.totals, self.steps_run, strict=True)]
        if self.exchanges:
            if self.max_seconds and self._elapsed >= self.max_seconds:
                self.done = True
            if self.adaptive:
                self.limit = round_limit(self.H)
                self.budget_s = self.H * self.fastest()
            self.log.append(
                {
                    "round": rounds_done,
                    "steps": list(self.steps_run),
                    "seconds_per_step": [round(t, 4) for t in self.seconds_per_step],
                    "fastest_s": round(self.fastest(), 4),  # (elastic mode: the fastest rate the round's sites claimed)
                    "elapsed_s": round(self._elapsed, 3),
                    "next_budget_s": round(self.budget_s, 3),
                    "next_steps_expected": expected_steps(self.H, self.seconds_per_step)
                    if self.adaptive
                    else [self.H] * len(self.steps_run),
                    "why": "budget = H x fastest site's seconds per step" if self.adaptive else "lock-step",
                }
            )
        self._compute = 0.0
        self._round_t0 = None
        self._ending = False
        self.rounds_done = rounds_done
        if self._past_limits():
            self.done = True

    # what a checkpoint keeps: the next round's limit and budget and the rates behind them
    _STATE = ("limit", "budget_s", "steps_run", "history", "seconds_per_step", "log", "done")

    def state_dict(self) -> dict[str, Any]:
        """The clock at a round boundary (what the next rounds are budgeted from)."""
        return {k: getattr(self, k) for k in self._STATE}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k in self._STATE:
            setattr(self, k, state[k])
        self.totals = [sum(steps) for steps in zip(*self.history, strict=True)] or [0] * len(self.steps_run)

    def world_steps(self, workers: list[int]) -> int:
        """Inner steps all ranks have run in the rounds that ended (rank-steps)."""
        return sum(w * s for steps in self.history for w, s in zip(workers, steps, strict=True))
