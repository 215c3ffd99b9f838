"""The world tier of asynchronous quorum rounds in two tiers (``sync.quorum`` with
``sync.region_every`` and ``topology.regions``): synchronous inside a site, asynchronous between
the sites of a region, and rarer merges across regions.

Each region has its own syncer (:class:`geotrain.round.syncer.QuorumSyncer`, beside the local
rank 0 of the region's first site, its **hub**), which merges its sites' updates as quorum rounds
do. After every ``region_every`` merges, a region's syncer runs a **world round** with the other
regions' syncers, over the slow links between regions:

1. it sends every other hub its region's change since the last world model,
   Δ_r = θ_world − θ_r, with the tokens its merges took in since then (rank-steps; its weight
   with ``sync.weight_by_tokens``, else 1), and waits for every other region's contribution to
   the same world round (bounded by ``liveness.hub_timeout_s``);
2. every hub takes the same weighted mean of the regions' Δ in region order, and the world step
   θ_world ← step(θ_world, Δ̄) (``sync.tier_outer``: plain averaging, or the outer optimizer),
   so every hub computes the same world model bit for bit; then θ_r ← θ_world, and the region's
   version moves on by one (an update made from the model before the world round is one merge stale).

A region faster than another waits for it at each world round: the world tier is lock-step, as
the tiers of lock-step DiLoCo are. A region whose sites have all ended sends one last, **final**
contribution; from then on it takes no part in the arithmetic but keeps receiving the others'
contributions and taking the same world steps, so that every site ends on one model: the run's
last world round is the one in which the last region ends. Contributions also carry each
region's lost sites, so every site knows at the end which sites left the run.

Bytes: one model (or its encoding under ``sync.codec``, with error feedback) from each hub to
each other hub per world round.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from geotrain.codecs import Codec, Residual
from geotrain.comm.mailbox import Mailbox, Message
from geotrain.comm.topology import Topology
from geotrain.config import SyncConfig
from geotrain.errors import CorruptPayload, SyncerTimeout
from geotrain.round.outer import outer_step_, weighted_mean

WORLD = 5.0  # a message kind: one region's contribution to a world round
# hub -> hub fields: [WORLD, world round, tokens, final, lost sites, sites ever lost, the region's rank-steps, encoded, 0, 0]


@dataclass
class Contribution:
    """One region's part of one world round."""

    region: int
    round: int
    tokens: float
    final: bool
    lost: int  # site mask: the region's sites lost now
    ever_lost: int  # site mask: the region's sites lost at some point
    steps: int  # rank-steps the region has merged since the start
    delta: torch.Tensor
    arrival: float = 0.0  # when it lands (emulated link)


def region_hubs(topo: Topology) -> list[int]:
    """The first site of each region, in region order, whose local rank 0 holds the region's
    syncer (no regions: the first site)."""
    return [topo.region_of.index(r) for r in range(len(topo.region_names))] if topo.tiered else [0]


def is_world(msg: Message) -> bool:
    """Whether a message is a hub's contribution to a world round."""
    return bool(msg.fields) and msg.fields[0] == WORLD


def last_from_hub(msg: Message) -> bool:
    """Whether a hub's message is its last one (its final contribution)."""
    return is_world(msg) and bool(msg.fields[3])


class WorldTier:
    """A region syncer's side of the world tier (see the module docstring).

    Args:
        region: this region's index; ``hubs``: each region's hub (global rank), in region order.
        theta: the initial model (the world model starts as a copy).
        step: the world step's optimizer over a list of tensors (averaging or the outer optimizer).
        cfg: ``sync.region_every``, ``weight_by_tokens`` and ``sync.codec``
            (from ``codecs``; with error feedback where the codec uses it). ``timeout_s``: how long a
            world round waits for the other regions (``liveness.hub_timeout_s``).
    """

    def __init__(
        self,
        region: int,
        hubs: list[int],
        theta: list[torch.Tensor],
        step: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
        mailbox: Mailbox | None,
        cfg: SyncConfig,
        codecs: Mapping[str, Codec | None],
        timeout_s: float = 600.0,
    ) -> None:
        assert mailbox is not None and cfg.quorum is not None
        self.region, self.hubs, self.every = region, list(hubs), cfg.region_every
        self.anchor = [t.detach().clone() for t in theta]
        self.optimizer = step(self.anchor)
        self.mailbox, self.weight_by_tokens, self.timeout_s = mailbox, cfg.weight_by_tokens, timeout_s
        names = list(codecs)
        self.codec = codecs.get(cfg.codec.name)
        self.encoded = float(1 + names.index(cfg.codec.name)) if cfg.codec.name in names else 0.0
        self.residual = (
            Residual(decay=cfg.codec.error_decay) if self.codec is not None and cfg.codec.uses_error_feedback else None
        )
        self.round = 0
        self.since, self.tokens = 0, 0.0  # this region's merges and tokens since its last world round
        self.ended: set[int] = set()  # regions that sent their final contribution
        self.got: dict[tuple[int, int], Contribution] = {}
        self.steps = [0] * len(hubs)  # each region's rank-steps at the last world round
        self.lost, self.ever_lost = [0] * len(hubs), [0] * len(hubs)  # each region's lost sites then (masks)

    def take(self, msg: Message) -> None:
        """A contribution from another hub (a message :func:`is_world` says is one)."""
        f = msg.fields
        region = self.hubs.index(msg.src)
        n = sum(t.numel() for t in self.anchor)
        try:
            delta = self.codec.decode(msg.payload, n) if f[7] and self.codec is not None else msg.floats().clone()
        except CorruptPayload:  # malformed: weighs nothing, as a contribution of the wrong size
            delta = torch.zeros(0)
        delta = delta.to(self.anchor[0].device)  # (messages arrive on the host; the anchor may live on a GPU)
        # a contribution of the wrong size, or not finite, weighs nothing: it costs its region this world round
        good = delta.numel() == n and bool(torch.isfinite(delta).all()) and f[2] >= 0
        tokens, delta = (f[2], delta) if good else (0.0, torch.zeros(n, device=self.anchor[0].device))
        c = Contribution(region, int(f[1]), tokens, bool(f[3]), int(f[4]), int(f[5]), int(f[6]), delta, msg.arrival)
        self.got[(region, c.round)] = c

    def merged(self, tokens: float) -> bool:
        """This region merged updates worth ``tokens`` rank-steps: whether a world round is due."""
        self.since += 1
        self.tokens += tokens
        return self.since >= self.every

    def _delta(self, theta: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int | None, float]:
        """This region's Δ as every hub will read it (decoded, when encoded), and what is sent."""
        delta = torch.cat([(a - t).reshape(-1) for a, t in zip(self.anchor, theta, strict=True)])
        if self.codec is None or not bool(torch.isfinite(delta).all()):
            return delta, delta, None, 0.0
        if self.residual is not None:
            self.residual.add_to(delta)
        buf = self.codec.encode(delta)
        seen = self.codec.decode(buf, delta.numel())
        if self.residual is not None:
            self.residual.keep(delta - seen)
        return seen, buf, 4 * delta.numel(), self.encoded

    def contribute(self, theta: list[torch.Tensor], final: bool, steps: int, lost: int, ever_lost: int) -> None:
        """Send this region's contribution to the current world round to every other hub."""
        if self.region in self.ended:  # (it ended: the others go on without it)
            return
        mine, payload, raw, encoded = self._delta(theta)
        tokens = self.tokens if self.weight_by_tokens or not self.tokens else 1.0
        self.got[(self.region, self.round)] = Contribution(self.region, self.round, tokens, final, lost, ever_lost, steps, mine)
        fields = [
            WORLD,
            float(self.round),
            tokens,
            float(final),
            float(lost),
            float(ever_lost),
            float(steps),
            encoded,
            0.0,
            0.0,
            0.0,
        ]
        for r, hub in enumerate(self.hubs):
            if r != self.region:
                self.mailbox.send(hub, fields, payload, raw)

    def missing(self) -> list[int]:
        """The regions whose contribution to the current world round has not landed yet."""
        now = time.monotonic()
        return [
            r
            for r in range(len(self.hubs))
            if r not in self.ended and ((c := self.got.get((r, self.round))) is None or c.arrival > now)
        ]

    def next_arrival(self) -> float | None:
        """When the first contribution already in but still on the (emulated) link lands."""
        times = [c.arrival for (_, k), c in self.got.items() if k == self.round and c.arrival > time.monotonic()]
        return min(times) if times else None

    @torch.no_grad()
    def step(self, theta: list[torch.Tensor]) -> tuple[bool, list[int]]:
        """The world round's step on every hub alike; ``theta`` (the region's model) becomes the
        world model. Returns whether every region has ended (the run's last world round), and the
        regions that contributed."""
        parts = [self.got.pop((r, self.round)) for r in range(len(self.hubs)) if r not in self.ended]
        weights = [c.tokens for c in parts]
        if sum(weights) > 0:
            mean = weighted_mean([c.delta for c in parts], weights, float(sum(weights)))
            outer_step_(self.optimizer, self.anchor, mean)
        for c in parts:
            self.steps[c.region], self.lost[c.region], self.ever_lost[c.region] = c.steps, c.lost, c.ever_lost
            if c.final:
                self.ended.add(c.region)
        for t, a in zip(theta, self.anchor, strict=True):
            t.copy_(a)
        self.round += 1
        self.since, self.tokens = 0, 0.0
        return len(self.ended) == len(self.hubs), [c.region for c in parts]

    def others_steps(self) -> int:
        """The other regions' rank-steps at the last world round."""
        return sum(s for r, s in enumerate(self.steps) if r != self.region)

    def timeout(self) -> SyncerTimeout:
        names = ", ".join(str(r) for r in self.missing())
        return SyncerTimeout(
            f"world round {self.round}: no contribution from region(s) {names} within liveness.hub_timeout_s={self.timeout_s:g} s"
        )
